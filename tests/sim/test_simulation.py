"""The simulation: hand-worked iterations, strategy names, a run's own buckets and timelines."""

from __future__ import annotations

import math

import pytest

from interlace.comm.cost import CostModel
from interlace.comm.strategies import PLANNED_STRATEGIES
from interlace.errors import UsageError
from interlace.sim.network import (
    parse_network,
)
from interlace.sim.profiled import from_ready
from interlace.sim.simulation import simulate, strategy_named, wire_tensors
from interlace.sim.trace import Trace, load_trace
from interlace.sim.traces import data_path

MS = 1e-3
#: The shipped GoogLeNet K80 trace, and the folder that holds it beside the 10 GbE OSU logs.
GOOGLENET = data_path("googlenet_k80_8workers.log")
TRACES = GOOGLENET.parent


def toy_trace(ready_ms: list[float], sizes: list[int], backward_ms: float | None = None) -> Trace:
    count = len(sizes)
    return from_ready(
        "toy",
        names=[f"t{i}" for i in range(count)],
        layers=[f"l{i}" for i in range(count)],
        numels=[size // 4 for size in sizes],
        element_bytes=[4] * count,
        ready_s=[ms * MS for ms in ready_ms],
        forward_s=2 * MS,
        backward_s=(backward_ms if backward_ms is not None else ready_ms[-1]) * MS,
        step_s=1 * MS,
    )


def test_hand_worked_iteration() -> None:
    # a = 1 ms, b = 1 ms/MB. Tensors of 1 MB ready at 1, 2, 3 ms; backward ends at 3 ms.
    trace = toy_trace([1, 2, 3], [1_000_000] * 3)
    cost = CostModel(1 * MS, 1e-9)
    wfbp = simulate(trace, "wfbp", cost)
    # All-reduces 1..3, 3..5, 5..7 ms; iteration = 2 (forward) + 7 + 1 (step).
    assert [t for c in wfbp.replay.comms for t in (c.start_s, c.end_s)] == pytest.approx(
        [1 * MS, 3 * MS, 3 * MS, 5 * MS, 5 * MS, 7 * MS]
    )
    assert wfbp.iteration_s == pytest.approx(10 * MS)
    single = simulate(trace, "single", cost)
    # One 3 MB all-reduce from 3 ms: 3 + 1 + 3 = 7 ms.
    assert single.iteration_s == pytest.approx(10 * MS)
    assert single.buckets == 1


def test_channel_strategies_are_named_with_a_k_suffix() -> None:
    assert strategy_named("mgwfbp/k=2").channels == 2
    three = strategy_named("wfbp/k=3")
    assert (three.name, three.bucketing, three.channels) == ("wfbp/k=3", "per-tensor", 3)
    with pytest.raises(UsageError, match="one channel"):
        strategy_named("optimal/k=2")
    with pytest.raises(UsageError, match="/k=K"):
        strategy_named("mgwfbp/k=zero")


def test_planning_and_timing_costs_can_differ() -> None:
    trace = toy_trace([1, 2, 3], [1_000_000] * 3)
    believed = CostModel(0.1 * MS, 1e-9)
    actual = CostModel(2 * MS, 1e-9)
    result = simulate(trace, "wfbp", believed, timing_cost=actual)
    # Three all-reduces of 3 ms each from 1 ms: 1..4, 4..7, 7..10.
    assert result.replay.comm_end_s == pytest.approx(10 * MS)
    assert result.plan.cost == believed


def test_a_run_s_own_buckets_are_replayed_instead_of_planned() -> None:
    trace = toy_trace([1, 2, 3], [1_000_000] * 3)
    cost = CostModel(1 * MS, 1e-9)
    # The run kept t0 alone and t1 with t2: 1..3 ms, then 2 MB from 3 ms to 6 ms.
    result = simulate(trace, "mgwfbp", cost, buckets=[["t0"], ["t1", "t2"]])
    assert [t for c in result.replay.comms for t in (c.start_s, c.end_s)] == pytest.approx(
        [1 * MS, 3 * MS, 3 * MS, 6 * MS]
    )
    assert result.buckets == 2 and result.iteration_s == pytest.approx(9 * MS)
    with pytest.raises(ValueError, match="does not have: t9"):
        simulate(trace, "mgwfbp", cost, buckets=[["t0", "t1", "t2", "t9"]])


# ---------------------------------------------------------------------- network models


def test_every_strategy_has_a_timeline_with_its_buckets() -> None:
    trace = load_trace(GOOGLENET)
    cost = parse_network("ring:10gbit").cost(64)
    for name in PLANNED_STRATEGIES:
        result = simulate(trace, name, cost, workers=64)
        timeline = result.timeline()
        comms = [e for e in timeline.events if e.category == "comm"]
        assert len(comms) == result.buckets
        assert math.isclose(timeline.span_s(), result.iteration_s, rel_tol=1e-9)


def test_unknown_strategy_is_named() -> None:
    with pytest.raises(UsageError, match="unknown strategy 'nope'"):
        simulate(toy_trace([1], [4]), "nope", CostModel(0, 0))


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compression_halves_the_bytes_on_the_wire(compression: str) -> None:
    # a = 1 ms, b = 1 ms/MB; three 1 MB tensors in one bucket after backward (3 ms): the
    # all-reduce sends 1.5 MB instead of 3, so it takes 1 + 1.5 ms instead of 1 + 3 ms.
    trace = toy_trace([1, 2, 3], [1_000_000] * 3)
    cost = CostModel(1 * MS, 1e-9)
    plain = simulate(trace, "single", cost)
    halved = simulate(trace, "single", cost, compression=compression)
    assert plain.iteration_s == pytest.approx((2 + 3 + 4 + 1) * MS)
    assert halved.iteration_s == pytest.approx((2 + 3 + 2.5 + 1) * MS)
    assert [t.nbytes for t in halved.plan.tensors] == [500_000] * 3


def test_compressed_plans_are_the_plans_of_half_the_bytes() -> None:
    # The planner sees the wire bytes, as DataParallel(compression=...) plans: the same plan
    # as on a trace whose tensors are half as large.
    trace = load_trace("resnet50-h200")
    cost = CostModel(0.1 * MS, 0.5e-9)
    for strategy in ("mgwfbp", "overlap", "fixed"):
        compressed = simulate(trace, strategy, cost, compression="bf16")
        tensors = trace.ready_tensors()
        halves = wire_tensors(tensors, "bf16")
        assert [t.nbytes for t in halves] == [max(t.nbytes // 2, 1) for t in tensors]
        assert [t.nbytes for t in compressed.plan.tensors] == [t.nbytes for t in halves]
        assert compressed.iteration_s < simulate(trace, strategy, cost).iteration_s, strategy


def test_an_unknown_compression_is_named() -> None:
    with pytest.raises(UsageError, match="unknown compression 'fp8'; choose one of fp16, bf16"):
        simulate(toy_trace([1], [4]), "single", CostModel(MS, 1e-9), compression="fp8")


def test_an_overlap_run_s_buckets_run_on_into_the_next_forward() -> None:
    trace = toy_trace([1, 2, 3], [1_000_000] * 3)
    cost = CostModel(1 * MS, 1e-9)
    buckets = [["t0"], ["t1", "t2"]]
    overlapped = simulate(trace, "overlap", cost, buckets=buckets)
    behind = simulate(trace, "mgwfbp", cost, buckets=buckets)
    assert overlapped.plan.overlaps_forward and not behind.plan.overlaps_forward
    assert [sorted(b.indices) for b in overlapped.plan.buckets] == [[0], [1, 2]]
    # Backward-only: all-reduces 1..3 and 3..6 ms, then the step, then the forward: 2 + 6 + 1.
    assert behind.iteration_s == pytest.approx(9 * MS)
    # Overlapped, the period from one backward's start to the next: the forward (three gates
    # of 2/3 ms) starts as backward ends (3 ms); its first gate (l2) waits for the [t1, t2]
    # bucket (6 ms) and applies its 2/3 of the step (1 ms, by bytes): 6 + 2/3 + 2/3 = 7.33;
    # l1's bucket is in: + 2/3 = 8; l0 applies t0's 1/3 and computes: + 1/3 + 2/3 = 9 ms.
    assert overlapped.replay.forward_end_s == pytest.approx(9 * MS)
    assert overlapped.iteration_s == pytest.approx(9 * MS)
    # Cut into 1 MB slices, as the run cut them: the 2 MB bucket goes in two launches.
    sliced = simulate(trace, "overlap", cost, buckets=buckets, slice_bytes=1e6)
    assert [launch.bucket for launch in sliced.plan.launches] == [0, 1, 1]
