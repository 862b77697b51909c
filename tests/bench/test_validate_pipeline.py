"""Pipeline validation on emulated compute: its checks, the undilated sample and its rows, the
point-to-point fit and the host costs on live ranks, and a tiny run on the emulated cluster."""

from __future__ import annotations

import math
import statistics

import pytest

from interlace.bench.pipeline_rank import SCHEDULES
from interlace.bench.session import LaunchOptions
from interlace.bench.validate_pipeline import PipelineSample, pipeline_validation_rows
from interlace.comm.cost import CostModel
from interlace.emulate import Compute
from interlace.emulate.compute import ComputeKind, parse_compute
from interlace.errors import UsageError
from interlace.sim.pipeline import (
    PIPELINE_SCHEDULES,
    HostCost,
    simulate_pipeline,
    stage_costs,
    with_measured_compute,
)
from interlace.sim.trace import load_trace

EMULATED = parse_compute("emulated:vgg11-h200", 32)


def test_the_simulator_names_the_benchmarks_pipeline_contenders() -> None:
    assert set(PIPELINE_SCHEDULES) == set(SCHEDULES) - {"dp"}


@pytest.mark.parametrize(
    ("compute", "schedules", "stages", "iters", "needle"),
    [
        (Compute(ComputeKind.REAL), ["gpipe"], 4, 20, "emulated compute"),
        (EMULATED, ["dp"], 4, 20, "unknown pipeline schedule"),
        (EMULATED, [], 4, 20, "none given"),
        (EMULATED, ["gpipe"], 1, 20, "at least 2 stages"),
        (EMULATED, ["gpipe"], 4, 0, "--iters"),
        (parse_compute("emulated:googlenet-k80", 4), ["gpipe"], 4, 20, "activation size"),
    ],
)
def test_bad_requests_are_refused_before_any_launch(
    compute: Compute, schedules: list[str], stages: int, iters: int, needle: str
) -> None:
    with pytest.raises(UsageError, match=needle):
        pipeline_validation_rows(
            "vgg11-h200",
            compute,
            stages,
            "10gbit",
            schedules,
            options=LaunchOptions(
                iters=iters, warmup=1, rounds=10, timeout_s=60, collective_timeout_s=60
            ),
        )


def _launch_result() -> dict[str, object]:
    """A launch's value as :func:`validate_pipeline_rank` returns it, at dilation 10."""
    host = HostCost(
        forward_s=1e-4,
        backward_s=2e-4,
        update_s=3e-4,
        predict_s=4e-4,
        copy_s=5e-4,
        scale_s=6e-5,
        send_s=1e-5,
    )
    return {
        "value": {
            "bounds": [[0, 5], [5, 10], [10, 15], [15, 19]],
            "block_s": {"gpipe": [0.4, 0.8, 0.6], "spectrain": [0.2, 0.3, 0.25]},
            "stage_stats": {"gpipe": {"compute_s": [0.2, 0.4, 0.4, 0.2], "comm_s": [0.1] * 4}},
        },
        "cost": CostModel(1e-3, 1e-8),
        "host": [host] * 4,
        "slowdown": [1.0, 1.1, 1.2, 1.3],
        "microbatches": 4,
    }


def test_a_launch_becomes_an_undilated_sample() -> None:
    sample = PipelineSample.from_launch(_launch_result(), dilation=10, block=4)
    assert sample.bounds == ((0, 5), (5, 10), (10, 15), (15, 19))
    assert (sample.cost.a, sample.cost.b) == pytest.approx((1e-4, 1e-9))
    assert sample.host[0].update_s == pytest.approx(3e-5)
    assert sample.host[0].scale_s == pytest.approx(6e-6)
    assert sample.host[0].send_s == pytest.approx(1e-6)
    assert sample.measured_s["gpipe"] == pytest.approx([0.01, 0.02, 0.015])
    assert sample.microbatches == 4
    assert sample.stage_compute_s == {"gpipe": pytest.approx([0.005, 0.01, 0.01, 0.005])}
    assert sample.slowdown == (1.0, 1.1, 1.2, 1.3)  # a ratio: not undilated


def test_the_comparison_names_every_schedule_and_the_stages_compute() -> None:
    sample = PipelineSample.from_launch(_launch_result(), dilation=10, block=4)
    lines = sample.compare(load_trace("vgg11-h200"), 32)
    assert [line.split()[0] for line in lines] == ["gpipe", "spectrain"]
    assert "stage compute per mini-batch measured/replayed 5.000/" in lines[0]
    assert "stage compute" not in lines[1]


def test_each_row_is_the_replayed_block_against_the_median_block() -> None:
    sample = PipelineSample.from_launch(
        _launch_result(), dilation=10, block=4, link="10gbit (emulated at 312mbit)"
    )
    trace = load_trace("vgg11-h200")
    rows = sample.rows(trace, "vgg11-h200", 32)
    costs = stage_costs(trace, sample.bounds, 32, sample.host)
    assert [r.strategy for r in rows] == ["gpipe", "spectrain"]
    # Each stage's compute as the run measured it: gpipe, the one schedule that timed its
    # stages, computed 5, 10, 10 and 5 ms per mini-batch; the replay from the trace (stages
    # slowing each other included) keeps each busy for its forwards, backwards, division and
    # update. Every schedule's stages take those factors. Uncontended: the trace's device
    # time, nothing slowed (the model without the launch's compute measurements).
    traced = simulate_pipeline(
        costs, "gpipe", sample.cost, microbatches=4, block=4, slowdown=sample.slowdown
    )
    busy = [
        sum(s.end_s - s.start_s for s in traced.replay.computations if s.stage == k) / 4
        for k in range(4)
    ]
    factors = [m / b for m, b in zip([0.005, 0.01, 0.01, 0.005], busy, strict=True)]
    assert sample.compute_factors(trace, 32) == pytest.approx(factors)
    measured = with_measured_compute(
        costs,
        [
            f * (c.forward_s + c.backward_s + c.host_s(4))
            for c, f in zip(costs, factors, strict=True)
        ],
        4,
    )
    for row in rows:
        expected = simulate_pipeline(
            measured, row.strategy, sample.cost, microbatches=4, block=4, slowdown=sample.slowdown
        )
        alone = simulate_pipeline(costs, row.strategy, sample.cost, microbatches=4, block=4)
        assert row.predicted_s == pytest.approx(expected.iteration_s)
        assert row.predicted_uncontended_s == pytest.approx(alone.iteration_s)
        assert row.compute_slowdown == 1.3
        assert row.measured_s == pytest.approx(statistics.median(sample.measured_s[row.strategy]))
        assert (row.family, row.ranks, row.link) == (
            "pipeline",
            4,
            "10gbit (emulated at 312mbit)",
        )
    # The launch's stages computed about 2-3x the trace's: the calibrated prediction is slower.
    assert all(f > 1.5 for f in factors)
    assert rows[0].predicted_s > rows[0].predicted_uncontended_s


@pytest.mark.netns
def test_a_tiny_validation_on_the_emulated_cluster_gives_finite_rows() -> None:
    notes: list[str] = []
    rows = pipeline_validation_rows(
        "resnet20-h200",
        parse_compute("emulated:resnet20-h200", 4),
        2,
        "1gbit",
        ["gpipe", "spectrain", "torch-1f1b"],
        options=LaunchOptions(
            iters=1, warmup=1, rounds=2, timeout_s=240, collective_timeout_s=120, note=notes.append
        ),
    )
    assert [r.strategy for r in rows] == ["gpipe", "spectrain", "torch-1f1b"]
    for row in rows:
        assert row.family == "pipeline" and row.ranks == 2
        assert row.link == "1gbit (emulated at 250mbit)"
        assert math.isfinite(row.predicted_s) and row.predicted_s > 0
        assert math.isfinite(row.measured_s) and row.measured_s > 0
    assert any(line.startswith("stages (blocks): ") for line in notes)
