"""``interlace bench kfac``'s rank side: the ablation's modes and when a contender's plans
are final."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from interlace import KFAC
from interlace.bench.kfac_rank import (
    ABLATION_MODES,
    DEFAULT_MODE,
    KfacContender,
    factor_bucket_names,
    mode_policies,
)
from interlace.emulate.kfac import EmulatedKFACModel
from interlace.kfac.factor_modes import Bulk, Pipelined, factor_comm_from
from interlace.kfac.placements import placement_from

MODES = ("dkfac", "pipelined", "lbp", "spd")


def test_the_ablation_modes_are_spd_kfacs() -> None:
    assert tuple(ABLATION_MODES) == MODES
    assert ABLATION_MODES["dkfac"] == ("bulk", "none", "greedy")
    assert ABLATION_MODES["pipelined"] == ("pipelined", "merged", "greedy")
    assert ABLATION_MODES["lbp"] == ("bulk", "none", "lbp")
    assert ABLATION_MODES["spd"] == ("pipelined", "merged", "lbp")


def test_the_default_mode_is_what_kfacs_defaults_select() -> None:
    defaults = inspect.signature(KFAC).parameters
    factor_comm, placement = mode_policies(*ABLATION_MODES[DEFAULT_MODE], {})
    assert factor_comm == factor_comm_from(defaults["factor_comm"].default)
    # The ablation's 4 ranks under COMM-OPT.
    assert placement == placement_from(defaults["placement"].default, ranks=4, comm_opt=True)


def _contender(planning_done: bool, factor_comm: str, plan_settled: bool) -> KfacContender:
    mode = Pipelined(profile_steps=3) if factor_comm == "pipelined" else Bulk()
    precond = SimpleNamespace(factor_comm=mode, factor_plan_settled=plan_settled)
    return KfacContender("m", SimpleNamespace(planning_done=planning_done), None, precond=precond)


def test_warm_up_waits_for_every_plan() -> None:
    assert not _contender(False, "bulk", True).settled()
    assert _contender(True, "bulk", False).settled()  # bulk has no factor buckets to plan
    # Pipelined: until the merged buckets are profiled and their trials are over.
    assert not _contender(True, "pipelined", False).settled()
    assert _contender(True, "pipelined", True).settled()
    assert not _contender(False, "pipelined", True).settled()


def test_a_wrapper_without_a_plan_is_settled_at_once() -> None:
    # torch's DDP (kfac-pytorch's contender) plans nothing the warm-up must wait for.
    precond = SimpleNamespace(factor_comm="kfac-pytorch")
    assert KfacContender("peer", SimpleNamespace(), None, precond=precond).settled()


def test_factor_buckets_are_named_as_the_simulators_trace_names_them() -> None:
    model = EmulatedKFACModel("resnet20-h200", 1.0)
    # layers.0 and layers.2 are the trace's stem.0 and stages.0.0.conv1.
    order = [("layers.0", "A"), ("module.layers.2", "G"), ("layers.0", "G"), ("head", "A")]
    precond = SimpleNamespace(factor_plan=[[1, 0], [2, 3]], factor_order=order)
    assert factor_bucket_names(precond, model) == [  # type: ignore[arg-type]
        ["stages.0.0.conv1.G", "stem.0.A"],
        ["stem.0.G", "head.A"],  # a module that is no emulated layer keeps its path
    ]
    unplanned = SimpleNamespace(factor_plan=None, factor_order=[])
    assert factor_bucket_names(unplanned, model) is None  # type: ignore[arg-type]
