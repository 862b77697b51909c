"""DataParallel's plan as plain data: saved once planned, loaded without profiling or trials."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import plan_overlap
from interlace.comm.plan import Gate, ReadyTensor
from interlace.comm.planners import plan_fixed
from interlace.dp import DataParallel
from interlace.dp.plan_state import plan_from_dict, plan_to_dict
from interlace.errors import UsageError
from interlace.testing import run_ranks


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def _step(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    inputs = torch.randn(6, 8, generator=generator)
    model.zero_grad()
    model(inputs).square().mean().backward()


def _plan_travels() -> dict[str, Any]:
    cost = CostModel(1e-4, 1e-9)
    # Caps of a few hundred bytes: several buckets, so the layout is worth carrying.
    first = DataParallel(
        _net(), bucketing="fixed", bucket_cap_mb=5e-4, first_bucket_cap_mb=2e-4, cost_model=cost
    )
    before = first.plan_state()
    no_plan_before = first.plan is None
    for seed in range(4):
        _step(first, seed)
    state = first.plan_state()
    assert state is not None

    second = DataParallel(_net(), bucketing="merged", cost_model=cost)
    second.load_plan_state(state)
    loaded_at_once = second.planning_done
    plan_in_use = second.plan == plan_from_dict(state["plan"])
    _step(second, 10)
    _step(first, 10)
    same_grads = all(
        torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
        for a, b in zip(first.module.parameters(), second.module.parameters(), strict=True)
    )
    for seed in range(11, 19):
        _step(second, seed)

    refused = ""
    other = DataParallel(nn.Sequential(nn.Linear(8, 4)), cost_model=cost)
    try:
        other.load_plan_state(state)
    except UsageError as error:
        refused = str(error)
    return {
        "before": before,
        "state": state,
        "loaded_at_once": loaded_at_once,
        "no_plan_before": no_plan_before,
        "plan_in_use": plan_in_use,
        "same_buckets": second.buckets == first.buckets,
        "same_grads": same_grads,
        "kept": second.plan_state() == state,
        "refused": refused,
    }


def test_a_saved_plan_is_loaded_without_profiling() -> None:
    for report in run_ranks(_plan_travels, 2, timeout=120):
        assert report["before"] is None  # nothing to save before the plan is made
        assert len(report["state"]["plan"]["buckets"]) > 1
        assert report["loaded_at_once"]
        # DataParallel.plan: None while profiling, then the plan in use, loaded or planned.
        assert report["no_plan_before"] and report["plan_in_use"]
        assert report["same_buckets"] and report["same_grads"]
        # Eight more steps: no profiling, no trials, the loaded plan stays.
        assert report["kept"]
        assert "other parameters" in report["refused"]


def test_an_overlap_plan_keeps_its_launch_order_and_gates_as_plain_data() -> None:
    tensors = [ReadyTensor("late", 4_000, 0.0), ReadyTensor("early", 1_000, 1e-3)]
    gates = [Gate("early", (1,), 1e-3), Gate("late", (0,), 2e-3)]
    plan = plan_overlap(
        tensors,
        gates,
        CostModel(1e-4, 1e-9),
        groups=[[0], [1]],
        forward_s=3e-3,
        step_s=1e-3,
        slice_bytes=1_500,
    )
    data = plan_to_dict(plan)
    assert json.loads(json.dumps(data)) == data  # plain data
    assert plan_from_dict(data) == plan
    # A plan saved before launches were listed: each bucket at once, in order.
    old = plan_to_dict(plan_fixed(tensors, CostModel(0, 0), 1))
    for key in ("launches", "gates", "step_s", "forward_end_s"):
        del old[key]
    loaded = plan_from_dict(old)
    assert [(x.bucket, x.part, x.parts) for x in loaded.launches] == [(0, 0, 1), (1, 0, 1)]
    assert not loaded.overlaps_forward
