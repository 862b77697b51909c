"""The simulator's engine and network models against schedule(), the paper's formulas and
hand-worked timelines; MG-WFBP's properties across worker counts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlace.comm.cost import CostModel
from interlace.comm.plan import ReadyTensor, make_plan, schedule
from interlace.errors import UsageError
from interlace.sim.engine import STRATEGIES, simulate, strategy_named
from interlace.sim.experiments import check_claims, parse_workers, scaling_rows, simulate_scaling
from interlace.sim.network import (
    Fitted,
    HierarchicalRing,
    Link,
    Ring,
    Tree,
    fit_ring_link,
    parse_network,
)
from interlace.sim.replay import Contention, replay
from interlace.sim.trace import Trace, from_ready, load_trace

MS = 1e-3
TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
GOOGLENET = TRACES / "googlenet_k80_8workers.log"
needs_traces = pytest.mark.skipif(not GOOGLENET.exists(), reason=f"{GOOGLENET} not present")
WORKERS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


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


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=25),
    sizes=st.lists(st.integers(1, 4_000_000), min_size=25, max_size=25),
    a_ms=st.floats(0.0, 3.0),
    b_ns=st.floats(0.0, 3.0),
    tail_ms=st.floats(0.0, 4.0),
)
def test_replay_without_contention_is_schedule(
    gaps: list[float], sizes: list[int], a_ms: float, b_ns: float, tail_ms: float
) -> None:
    ready = [sum(gaps[: i + 1]) * MS for i in range(len(gaps))]
    tensors = [ReadyTensor(f"t{i}", sizes[i], t) for i, t in enumerate(ready)]
    cost = CostModel(a_ms * MS, b_ns * 1e-9)
    for name in ("per-tensor", "fixed", "single", "merged", "optimal"):
        plan = make_plan(
            name,
            tensors,
            cost,
            cap_bytes=5e6,
            backward_s=ready[-1] + tail_ms * MS,
            forward_s=1 * MS,
        )
        replayed = replay(plan)
        assert replayed.iteration_s == pytest.approx(plan.predicted_s, rel=1e-9, abs=1e-12)
        assert [t for c in replayed.comms for t in (c.start_s, c.end_s)] == pytest.approx(
            [t for b in plan.buckets for t in (b.start_s, b.end_s)], abs=1e-12
        )


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=20),
    sizes=st.lists(st.integers(1, 4_000_000), min_size=20, max_size=20),
    channels=st.integers(2, 4),
    partition=st.sampled_from([None, 1e6]),
    c2=st.floats(1.0, 2.0),
)
def test_replay_on_several_channels_without_contention_is_the_plans_timeline(
    gaps: list[float], sizes: list[int], channels: int, partition: float | None, c2: float
) -> None:
    ready = [sum(gaps[: i + 1]) * MS for i in range(len(gaps))]
    tensors = [ReadyTensor(f"t{i}", sizes[i], t) for i, t in enumerate(ready)]
    cost = CostModel(1 * MS, 1e-9, concurrency=((1.2 * MS, c2), (1.5 * MS, 2.5)))
    for name in ("per-tensor", "fixed", "merged"):
        plan = make_plan(
            name,
            tensors,
            cost,
            cap_bytes=5e6,
            backward_s=ready[-1],
            forward_s=1 * MS,
            channels=channels,
            partition_bytes=partition,
        )
        replayed = replay(plan)
        assert replayed.iteration_s == pytest.approx(plan.predicted_s, rel=1e-9, abs=1e-12)
        assert [t for c in replayed.comms for t in (c.start_s, c.end_s)] == pytest.approx(
            [t for b in plan.buckets for t in (b.start_s, b.end_s)], abs=1e-12
        )


def test_channel_strategies_are_named_with_a_k_suffix() -> None:
    assert strategy_named("mgwfbp/k=2").channels == 2
    three = strategy_named("wfbp/k=3")
    assert (three.name, three.bucketing, three.channels) == ("wfbp/k=3", "per-tensor", 3)
    with pytest.raises(UsageError, match="one channel"):
        strategy_named("optimal/k=2")
    with pytest.raises(UsageError, match="/k=K"):
        strategy_named("mgwfbp/k=zero")


def test_contention_slows_compute_only_while_communication_is_in_flight() -> None:
    # One 1 MB tensor ready at 1 ms, all-reduce 1..3 ms (a = 1 ms, b = 1 ms/MB); backward runs
    # on to 5 ms. With compute at half speed while the all-reduce runs, 2 ms of it yield 1 ms of
    # compute: backward ends at 5 + 1 = 6 ms.
    tensors = [ReadyTensor("t0", 1_000_000, 1 * MS), ReadyTensor("t1", 1, 5 * MS)]
    plan = schedule([[0], [1]], tensors, CostModel(1 * MS, 1e-9))
    slowed = replay(plan, Contention(compute_slowdown=2.0, startup_compute_slowdown=2.0))
    assert slowed.ready_s == pytest.approx((1 * MS, 6 * MS))
    assert slowed.comms[0].end_s == pytest.approx(3 * MS)
    # t1's all-reduce: 6..7 ms (1 byte).
    assert slowed.comms[1].end_s == pytest.approx(7 * MS, rel=1e-6)


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


def test_ring_and_tree_follow_the_papers_formulas() -> None:
    link = Link(alpha=10e-6, beta=1e-9, gamma=0.5e-9)
    ring = Ring(link).cost(8)
    assert ring.a == pytest.approx(2 * 7 * 10e-6)
    assert ring.b == pytest.approx(2 * 7 / 8 * 1e-9 + 7 / 8 * 0.5e-9)
    tree = Tree(link).cost(8)
    assert tree.a == pytest.approx(2 * 3 * 10e-6)
    assert tree.b == pytest.approx(2e-9 + 0.5e-9)


def test_hierarchical_ring_is_rings_inside_and_across_nodes() -> None:
    inter, intra = Link(50e-6, 1e-9), Link(5e-6, 0.1e-9)
    model = HierarchicalRing(8, inter, intra).cost(64)
    inside, across = CostModel.ring(8, 5e-6, 0.1e-9), CostModel.ring(8, 50e-6, 1e-9)
    assert model.a == pytest.approx(inside.a + across.a)
    assert model.b == pytest.approx(inside.b + across.b / 8)
    # Fewer workers than a node: one node, the intra-node ring only.
    assert HierarchicalRing(8, inter, intra).cost(4) == CostModel.ring(4, 5e-6, 0.1e-9)


def test_ring_link_recovered_from_fits_at_several_sizes() -> None:
    link = Link(40e-6, 2e-9)
    fits = {n: CostModel.ring(n, link.alpha, link.beta) for n in (2, 4, 8)}
    found = fit_ring_link(fits)
    assert found.alpha == pytest.approx(link.alpha)
    assert found.beta == pytest.approx(link.beta)


def test_fitted_models_are_fixed_or_extrapolated() -> None:
    model = CostModel(9.72e-4, 1.97e-9)
    assert Fitted(model).cost(1024) == model
    assert Fitted(model, 8).cost(8).a == pytest.approx(model.a)
    assert Fitted(model, 8).cost(64).a == pytest.approx(model.a / 14 * 126)


def test_network_specs() -> None:
    ring = parse_network("ring:10gbit:50us")
    assert isinstance(ring, Ring)
    assert ring.link.alpha == pytest.approx(50e-6)
    assert ring.link.beta == pytest.approx(8 / 10e9)
    assert isinstance(parse_network("tree:1gbit"), Tree)
    hier = parse_network("hier:8:10gbit")
    assert isinstance(hier, HierarchicalRing)
    assert hier.gpus_per_node == 8
    fitted = parse_network("fitted:1e-3,2e-9@8")
    assert isinstance(fitted, Fitted)
    assert fitted.fitted_on == 8
    for bad in ("ring", "ring:fast", "hier:x:1gbit", "fitted:1", "mesh:1gbit", "osu:/no/such"):
        with pytest.raises(UsageError, match="--network"):
            parse_network(bad)


@needs_traces
def test_osu_logs_give_a_ring_close_to_each_fit() -> None:
    network = parse_network(f"osu:{TRACES}")
    assert isinstance(network, Ring)
    # The paper's fit for 8 workers: a = 0.97 ms, b = 1.97 ns/byte; our OSU fit is the same order.
    eight = network.cost(8)
    assert 0.3e-3 < eight.a < 1.5e-3
    assert 1e-9 < eight.b < 5e-9


def test_parse_workers() -> None:
    assert parse_workers("4..2048") == WORKERS
    assert parse_workers("4,8, 8,16") == (4, 8, 16)
    for bad in ("4,x", "0", "8..4"):
        with pytest.raises(UsageError, match="--workers"):
            parse_workers(bad)


# ---------------------------------------------------------------------- MG-WFBP's properties


@needs_traces
@pytest.mark.parametrize("spec", [f"osu:{TRACES}", "ring:10gbit", "tree:10gbit", "hier:8:10gbit"])
def test_mgwfbp_never_loses_to_wfbp_or_syncesgd_and_its_buckets_shrink(spec: str) -> None:
    trace = load_trace(GOOGLENET)
    network = parse_network(spec)
    results = simulate_scaling(trace, network, WORKERS, ("single", "wfbp", "mgwfbp"))
    by_key = {(r.workers, r.strategy): r for r in results}
    counts = []
    for workers in WORKERS:
        mg = by_key[(workers, "mgwfbp")].iteration_s
        assert mg <= min(by_key[(workers, s)].iteration_s for s in ("single", "wfbp")) * (1 + 1e-9)
        counts.append(by_key[(workers, "mgwfbp")].buckets)
    assert counts == sorted(counts, reverse=True)
    notes = check_claims(scaling_rows(trace, results))
    assert all(note.startswith("ok") for note in notes[:1])


@needs_traces
def test_on_the_osu_ring_mgwfbp_becomes_syncesgd_at_large_scale() -> None:
    trace = load_trace(GOOGLENET)
    results = simulate_scaling(trace, parse_network(f"osu:{TRACES}"), (2048,), ("mgwfbp",))
    assert results[0].buckets == 1


@needs_traces
def test_every_strategy_has_a_timeline_with_its_buckets() -> None:
    trace = load_trace(GOOGLENET)
    cost = parse_network("ring:10gbit").cost(64)
    for name in STRATEGIES:
        result = simulate(trace, name, cost, workers=64)
        timeline = result.timeline()
        comms = [e for e in timeline.events if e.category == "comm"]
        assert len(comms) == result.buckets
        assert math.isclose(timeline.span_s(), result.iteration_s, rel_tol=1e-9)


def test_unknown_strategy_is_named() -> None:
    with pytest.raises(UsageError, match="unknown strategy 'nope'"):
        simulate(toy_trace([1], [4]), "nope", CostModel(0, 0))


@pytest.mark.parametrize(
    ("gaps", "sizes", "channels", "c2"),
    [
        # A later bucket's slice takes a channel before an earlier bucket's second slice starts.
        ([0.0, 1.0, 0.0, 0.0], [1, 500_003, 1_000_001, 1], 2, 1.0),
        # Two slices of one bucket start at the same instant up to float rounding.
        (
            [
                0.0,
                2.0,
                0.0,
                0.0,
                0.0,
                1.0,
                0.0,
                3.237983874070707,
                1.0,
                1.0,
                1.0,
                1.0,
                1.0,
                0.0,
                1.172972290138925,
            ],
            [
                1000001,
                1000001,
                3631001,
                3322207,
                1000001,
                1000001,
                1000001,
                3622413,
                3962933,
                1,
                500003,
                500003,
                2758168,
                1000001,
                500003,
            ],
            4,
            2.0,
        ),
    ],
)
def test_replay_equals_the_plan_in_cases_found_by_search(
    gaps: list[float], sizes: list[int], channels: int, c2: float
) -> None:
    ready = [sum(gaps[: i + 1]) * MS for i in range(len(gaps))]
    tensors = [ReadyTensor(f"t{i}", sizes[i], t) for i, t in enumerate(ready)]
    cost = CostModel(1 * MS, 1e-9, concurrency=((1.2 * MS, c2), (1.5 * MS, 2.5)))
    plan = make_plan(
        "per-tensor",
        tensors,
        cost,
        backward_s=ready[-1],
        forward_s=1 * MS,
        channels=channels,
        partition_bytes=1e6,
    )
    assert replay(plan).iteration_s == pytest.approx(plan.predicted_s, rel=1e-9)
