"""Pipeline validation, rank side: host costs timed around the device time, and the
point-to-point fit on live ranks."""

from __future__ import annotations

import math

import pytest
import torch

from interlace.bench.validate_pipeline_rank import (
    StageOps,
    fit_p2p_cost,
    measure_host_cost,
    measure_slowdown,
    slowdowns,
)
from interlace.emulate import device
from interlace.emulate.pipeline import EmulatedPipelineModel
from interlace.pipeline.partition import pipeline_blocks
from interlace.sim.pipeline import HostCost
from interlace.testing import run_ranks


def _last_stage(dilation: float) -> tuple[EmulatedPipelineModel, torch.nn.Module, torch.Tensor]:
    model = EmulatedPipelineModel("vgg11-h200", dilation=dilation, classes=10)
    stage = pipeline_blocks(model)[15:19]
    x = torch.full((8, *model.emulated_blocks()[14].output_shape), 0.5)
    return model, stage, x


def test_host_costs_of_an_emulated_stage_are_timed() -> None:
    model, stage, x = _last_stage(2)
    ops = StageOps(stage, x, torch.zeros(8, dtype=torch.long), 4, first=False)
    host = measure_host_cost(ops, clock=model.clock, cycles=2)
    values = [getattr(host, name) for name in HostCost.__dataclass_fields__ if name != "send_s"]
    assert all(math.isfinite(v) and v > 0 for v in values), host
    assert host.send_s == 0.0  # timed with the messages, not here


def test_the_device_time_spent_is_not_host_work(monkeypatch: pytest.MonkeyPatch) -> None:
    # Sleeps skipped, the clock still counts a million-fold dilated device time: what is left of
    # a forward or backward after taking it out is nothing; the update spends none.
    monkeypatch.setattr(device.time, "sleep", lambda seconds: None)
    model, stage, x = _last_stage(1e6)
    ops = StageOps(stage, x, torch.zeros(8, dtype=torch.long), 4, first=False)
    host = measure_host_cost(ops, clock=model.clock, cycles=2)
    assert host.forward_s == 0.0 and host.backward_s == 0.0
    assert host.update_s > 0.0


def _fit_on_rank() -> tuple[float, float, float]:
    cost, send_s = fit_p2p_cost((4096, 65536), repeats=2)
    return cost.a, cost.b, send_s


def test_the_point_to_point_fit_is_the_same_on_every_rank() -> None:
    values = run_ranks(_fit_on_rank, 3, timeout=120)
    assert values[0] == values[1] == values[2]
    assert all(math.isfinite(v) and v >= 0 for v in values[0])
    assert values[0][2] > 0  # a send call takes some time


def test_slowdowns_are_each_group_median_time_together_over_alone() -> None:
    times = [
        [1.0, 0.0, 1.5, 2.0],  # rank 0: alone, -, with 2 ranks, with 3
        [2.0, 0.0, 2.2, 5.0],
        [4.0, 0.0, 0.0, 4.4],
    ]
    # k = 2: ranks 0 and 1, ratios 1.5 and 1.1; k = 3: ratios 2.0, 2.5 and 1.1.
    assert slowdowns(times) == pytest.approx([1.0, 1.3, 2.0])
    assert slowdowns([[1.0, 0.0, 0.9], [1.0, 0.0, 0.8]]) == [1.0, 1.0]  # never a speed-up


def _slowdown_on_rank() -> list[float]:
    _, stage, x = _last_stage(2)
    ops = StageOps(stage, x, torch.zeros(8, dtype=torch.long), 2, first=False)
    return measure_slowdown(ops, 1)


def test_every_rank_gets_the_same_slowdowns_one_per_count() -> None:
    values = run_ranks(_slowdown_on_rank, 2, timeout=120)
    assert values[0] == values[1]
    slowdown = values[0]
    assert len(slowdown) == 2 and slowdown[0] == 1.0
    assert math.isfinite(slowdown[1]) and slowdown[1] >= 1.0
