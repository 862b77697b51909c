"""The strategy table: names, planners and caps, the bucketing names and their aliases."""

from __future__ import annotations

import pytest

from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import Overlap, overlap_candidates
from interlace.comm.plan import Bucketing, Gate, ReadyTensor
from interlace.comm.planners import make_plan, plan_fixed
from interlace.comm.strategies import (
    BENCH_STRATEGIES,
    PLANNED_STRATEGIES,
    RUNTIME_STRATEGIES,
    STRATEGIES,
    Strategy,
    bucketing_named,
    planned_strategy,
)
from interlace.errors import UsageError

MS = 1e-3
COST = CostModel(a=1 * MS, b=1e-9)
#: Twelve 0.4 MB tensors ready 1 ms apart: caps of 1 MB and 25 MB give different buckets.
TENSORS = [ReadyTensor(f"t{i}", 400_000, i * MS) for i in range(12)]


def test_the_command_line_and_the_simulator_keep_their_names() -> None:
    assert set(RUNTIME_STRATEGIES) == {
        "ddp",
        "ddp-50mb",
        "ddp-100mb",
        "wfbp",
        "fixed",
        "single",
        "mgwfbp",
        "optimal",
        "overlap",
    }
    assert set(BENCH_STRATEGIES) == {*RUNTIME_STRATEGIES, "fsdp2"}
    assert list(PLANNED_STRATEGIES) == [
        "single",
        "wfbp",
        "fixed",
        "horovod",
        "mgwfbp",
        "optimal",
        "pairwise",
        "overlap",
        "mgwfbp/k=2",
        "wfbp/k=4",
    ]
    for peer in ("ddp", "ddp-50mb", "ddp-100mb", "fsdp2"):
        assert STRATEGIES[peer].bucketing is None and peer not in PLANNED_STRATEGIES
    # MiB, as torch DDP counts bucket_cap_mb.
    assert STRATEGIES["ddp-100mb"].cap_bytes == 100 * 2**20
    assert STRATEGIES["ddp-50mb"].cap_bytes == 50 * 2**20


@pytest.mark.parametrize(
    ("name", "bucketing"),
    [
        ("mgwfbp", "merged"),
        ("wfbp", "per-tensor"),
        ("fixed", "fixed"),
        ("single", "single"),
        ("optimal", "optimal"),
    ],
)
def test_a_strategy_name_and_its_bucketing_name_are_the_same_planner(
    name: str, bucketing: str
) -> None:
    assert STRATEGIES[name].bucketing == bucketing
    if name in ("mgwfbp", "wfbp"):
        assert bucketing_named(name) is Bucketing(bucketing)


def test_fixed_is_ddps_rule_and_horovod_its_fusion_buffer() -> None:
    fixed = STRATEGIES["fixed"].plan(TENSORS, COST, backward_s=12 * MS, forward_s=0.0)
    assert fixed.groups == plan_fixed(TENSORS, COST, 25e6, 1e6).groups
    assert [len(group) for group in fixed.groups] == [3, 9]  # 1.2 MB closes the first bucket
    horovod = STRATEGIES["horovod"].plan(TENSORS, COST, backward_s=12 * MS, forward_s=0.0)
    assert [len(group) for group in horovod.groups] == [12]


def test_every_planned_strategy_plans_as_make_plan_does_with_its_arguments() -> None:
    for strategy in PLANNED_STRATEGIES.values():
        if strategy.overlap is Overlap.FORWARD:
            continue
        plan = strategy.plan(TENSORS, COST, backward_s=12 * MS, forward_s=2 * MS)
        assert strategy.bucketing is not None
        expected = make_plan(
            strategy.bucketing.value,
            TENSORS,
            COST,
            cap_bytes=strategy.cap_bytes,
            first_cap_bytes=strategy.first_cap_bytes,
            backward_s=12 * MS,
            forward_s=2 * MS,
            channels=strategy.channels,
            partition_bytes=strategy.partition_bytes,
        )
        assert plan == expected, strategy.name


def test_the_overlap_strategy_plans_as_dataparallels_overlap_planner_does() -> None:
    gates = [Gate(f"g{i}", (11 - i,), 0.5 * MS) for i in range(12)]
    strategy = STRATEGIES["overlap"]
    with pytest.raises(ValueError, match="needs its gates"):
        strategy.plan(TENSORS, COST, backward_s=12 * MS, forward_s=6 * MS)
    plan = strategy.plan(
        TENSORS, COST, backward_s=12 * MS, forward_s=6 * MS, gates=gates, step_s=1 * MS
    )
    label, expected = overlap_candidates(
        TENSORS, gates, COST, forward_s=6 * MS, backward_s=12 * MS, step_s=1 * MS
    )[0]
    assert plan == expected and plan.overlaps_forward, label


def test_bucketings_are_named_by_member_string_or_alias() -> None:
    assert bucketing_named(Bucketing.FIXED) is Bucketing.FIXED
    assert bucketing_named("per-tensor") is Bucketing.PER_TENSOR
    assert bucketing_named("synceasgd") is Bucketing.SINGLE
    assert f"{Bucketing.PER_TENSOR}" == "per-tensor" and Bucketing.MERGED == "merged"
    with pytest.raises(UsageError, match=r"unknown bucketing 'fastest'; choose one of merged, "):
        bucketing_named("fastest")
    assert make_plan(Bucketing.MERGED, TENSORS, COST) == make_plan("merged", TENSORS, COST)


def test_a_strategy_takes_a_planners_string() -> None:
    assert Strategy("mine", "fixed", "a test").bucketing is Bucketing.FIXED
    with pytest.raises(ValueError, match="buckets by itself"):
        STRATEGIES["ddp"].plan(TENSORS, COST, backward_s=0.0, forward_s=0.0)


def test_a_channel_suffix_names_a_strategy_on_that_many_channels() -> None:
    three = planned_strategy("mgwfbp/k=3")
    assert three is not None
    assert (three.name, three.bucketing, three.channels) == ("mgwfbp/k=3", "merged", 3)
    assert three.description.endswith("on 3 channels")
    assert planned_strategy("ddp") is None
    assert planned_strategy("ddp/k=2") is None
    assert planned_strategy("mgwfbp/k=0") is None
    with pytest.raises(UsageError, match="exact on one channel only"):
        planned_strategy("optimal/k=2")
