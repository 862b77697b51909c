"""The replay against schedule() and hand-worked timelines, with and without contention."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import overlap_candidates
from interlace.comm.plan import Gate, ReadyTensor
from interlace.comm.planners import make_plan
from interlace.comm.pricing import schedule
from interlace.sim.replay import Contention, replay

MS = 1e-3


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
            [t for b in plan.buckets for t in (b.start_s, b.end_s)], rel=1e-9, abs=1e-12
        )


@settings(max_examples=40, deadline=None)
@given(
    gaps=st.lists(st.floats(0.0, 5.0), min_size=2, max_size=15),
    sizes=st.lists(st.integers(1, 6_000_000), min_size=15, max_size=15),
    forward_ms=st.lists(st.floats(0.0, 3.0), min_size=15, max_size=15),
    costs_ms=st.tuples(st.floats(0.0, 2.0), st.floats(0.0, 2.0)),
    channels=st.integers(1, 2),
)
# Equal only to rounding: the planner and the replay add the same times in different orders.
@example(
    gaps=[0.0, 1e-09, 0.0, 0.0],
    sizes=[1] * 15,
    forward_ms=[0.0] * 15,
    costs_ms=(1.0, 0.0),
    channels=2,
)
def test_replaying_an_overlap_plan_without_contention_gives_the_planners_times(
    gaps: list[float],
    sizes: list[int],
    forward_ms: list[float],
    costs_ms: tuple[float, float],
    channels: int,
) -> None:
    a_ms, step_ms = costs_ms
    ready = [sum(gaps[: i + 1]) * MS for i in range(len(gaps))]
    tensors = [ReadyTensor(f"t{i}", sizes[i], t) for i, t in enumerate(ready)]
    # One gate per tensor but the first, in reverse ready order (the layers of a network).
    gates = [Gate(f"g{i}", (i,), forward_ms[i] * MS) for i in reversed(range(1, len(tensors)))]
    cost = CostModel(a_ms * MS, 1e-9)
    for _, plan in overlap_candidates(
        tensors,
        gates,
        cost,
        forward_s=sum(forward_ms) * MS,
        step_s=step_ms * MS,
        channels=channels,
    ):
        replayed = replay(plan, step_s=step_ms * MS)
        assert replayed.iteration_s == pytest.approx(plan.iteration_s, rel=1e-9, abs=1e-12)
        assert [t for c in replayed.comms for t in (c.start_s, c.end_s)] == pytest.approx(
            [t for b in plan.buckets for t in (b.start_s, b.end_s)], rel=1e-9, abs=1e-12
        )


def test_contention_slows_an_overlap_plans_gated_forward_too() -> None:
    tensors = [ReadyTensor("head", 4_000_000, 1 * MS), ReadyTensor("tail", 1_000_000, 2 * MS)]
    gates = [Gate("tail", (1,), 1 * MS), Gate("head", (0,), 1 * MS)]
    _, plan = overlap_candidates(tensors, gates, CostModel(0.0, 1e-9), forward_s=2 * MS)[0]
    free = replay(plan)
    slowed = replay(plan, Contention(compute_slowdown=2.0, transfer_rate=0.5))
    assert free.forward_end_s == pytest.approx(plan.forward_end_s)
    assert slowed.forward_end_s > free.forward_end_s
    assert slowed.iteration_s > free.iteration_s


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
            [t for b in plan.buckets for t in (b.start_s, b.end_s)], rel=1e-9, abs=1e-12
        )


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


def test_bytes_progress_at_their_rate_while_backward_computes() -> None:
    # One 1 MB tensor ready at 0; a = 2 ms, b = 4 ms/MB; backward lasts 10 ms.
    # The start-up is priced as paid beside backward: 0..2 ms. Bytes at 1/4 from 2 to 10 ms:
    # 2 of 4 ms done; the other 2 ms at full speed after backward: ends at 12 ms.
    tensors = [ReadyTensor("t0", 1_000_000, 0.0)]
    plan = schedule([[0]], tensors, CostModel(2 * MS, 4e-9), backward_s=10 * MS)
    played = replay(plan, Contention(transfer_rate=0.25))
    assert played.backward_end_s == pytest.approx(10 * MS)
    assert played.comms[0].end_s == pytest.approx(12 * MS)
    # With no contention it is the plan's own time: 0..6 ms.
    assert replay(plan).comms[0].end_s == pytest.approx(6 * MS)


def test_compute_slows_by_the_phase_in_flight() -> None:
    # A start-up (a = 2 ms, no bytes) slows the 10 ms backward to 1/2 while it runs, 0..2 ms:
    # 1 ms of compute done, the other 9 ms at full speed, so backward ends at 11 ms.
    tensors = [ReadyTensor("t0", 4, 0.0)]
    plan = schedule([[0]], tensors, CostModel(2 * MS, 0.0), backward_s=10 * MS)
    played = replay(plan, Contention(startup_compute_slowdown=2.0))
    assert played.backward_end_s == pytest.approx(11 * MS)
    assert played.comms[0].end_s == pytest.approx(2 * MS)
    # A slowdown while bytes are in flight does not apply to a start-up.
    only_bytes = replay(plan, Contention(compute_slowdown=3.0))
    assert only_bytes.backward_end_s == pytest.approx(10 * MS)
    # Bytes (b = 4 ms/MB, 1 MB, at full speed) slow compute by 3 from 2 to 6 ms: 4/3 ms of
    # compute there, 2 ms before; the remaining 8 - 4/3 ms after, so backward ends at 12 2/3 ms.
    big = [ReadyTensor("t0", 1_000_000, 0.0)]
    plan_big = schedule([[0]], big, CostModel(2 * MS, 4e-9), backward_s=10 * MS)
    slowed = replay(plan_big, Contention(compute_slowdown=3.0))
    assert slowed.comms[0].end_s == pytest.approx(6 * MS)
    assert slowed.backward_end_s == pytest.approx((6 + 10 - 2 - 4 / 3) * MS)


def test_a_startup_can_run_behind_the_previous_transfer() -> None:
    # Bucket 0: 1 MB (a = 1 ms, bytes 10 ms), bucket 1: 4 bytes, both ready at 0, backward 0.
    # One at a time: 0..11, 11..12 ms. With a start-up fully behind a transfer, bucket 1's
    # start-up runs 1..2 ms while bucket 0's bytes are on the wire, and its 4 bytes (0.04 us)
    # then share the wire with them: it ends at 2 ms and bucket 0 at 11 ms (each + 0.04 us).
    tensors = [ReadyTensor("big", 1_000_000, 0.0), ReadyTensor("tiny", 4, 0.0)]
    plan = schedule([[0], [1]], tensors, CostModel(1 * MS, 1e-8), backward_s=0.0)
    serial = replay(plan)
    assert [c.end_s for c in serial.comms] == pytest.approx([11 * MS, 12 * MS], abs=1e-7)
    behind = replay(plan, Contention(startup_overlap=1.0))
    assert [c.start_s for c in behind.comms] == pytest.approx([0.0, 1 * MS])
    assert [c.end_s for c in behind.comms] == pytest.approx([11 * MS, 2 * MS], abs=1e-7)
    # Two start-ups never overlap, and no more than two all-reduces are in flight: a third
    # bucket starts when the second has ended, at 2 ms, and ends at 3 ms.
    three = [*tensors, ReadyTensor("tiny2", 4, 0.0)]
    plan3 = schedule([[0], [1], [2]], three, CostModel(1 * MS, 1e-8), backward_s=0.0)
    played = replay(plan3, Contention(startup_overlap=1.0)).comms
    assert [c.start_s for c in played] == pytest.approx([0.0, 1 * MS, 2 * MS], abs=1e-7)
    assert [c.end_s for c in played] == pytest.approx([11 * MS, 2 * MS, 3 * MS], abs=1e-6)


def test_bytes_in_flight_together_share_the_wire() -> None:
    # Two 100 kB all-reduces (a = 1 ms, 1 ms of bytes each), both ready at 0, full overlap:
    # bucket 0's bytes go 1..2 ms while bucket 1's start-up runs behind them; bucket 1's bytes
    # begin as bucket 0's end, so they never share: 2..3 ms.
    tensors = [ReadyTensor("a", 100_000, 0.0), ReadyTensor("b", 100_000, 0.0)]
    plan = schedule([[0], [1]], tensors, CostModel(1 * MS, 1e-8), backward_s=0.0)
    ends = [c.end_s for c in replay(plan, Contention(startup_overlap=1.0)).comms]
    assert ends == pytest.approx([2 * MS, 3 * MS], abs=1e-9)
    # With a start-up at half speed behind the bytes, bucket 1 has 0.5 ms of its start-up left
    # at 2 ms (runs alone 2..2.5), then its bytes: ends at 3.5 ms.
    half = [c.end_s for c in replay(plan, Contention(startup_overlap=0.5)).comms]
    assert half == pytest.approx([2 * MS, 3.5 * MS], abs=1e-9)
    # A 3 ms transfer in front: bucket 1's bytes (from 2 ms) and bucket 0's remaining 2 ms share
    # the wire at half speed each until bucket 1's are done at 4 ms; bucket 0's last 1 ms
    # goes alone, 4..5 ms.
    long_first = [ReadyTensor("a", 300_000, 0.0), ReadyTensor("b", 100_000, 0.0)]
    plan_long = schedule([[0], [1]], long_first, CostModel(1 * MS, 1e-8), backward_s=0.0)
    shared = [c.end_s for c in replay(plan_long, Contention(startup_overlap=1.0)).comms]
    assert shared == pytest.approx([5 * MS, 4 * MS], abs=1e-9)


def test_a_startup_behind_a_transfer_goes_at_the_overlap() -> None:
    # As above, but bucket 0's bytes take only 0.2 ms (20 kB): bucket 1 starts behind them at
    # 1 ms at a quarter of its speed, does 0.05 ms of its 1 ms start-up by 1.2 ms, and the
    # remaining 0.95 ms at full speed once the wire is its own: it ends at 2.15 ms.
    tensors = [ReadyTensor("mid", 20_000, 0.0), ReadyTensor("tiny", 4, 0.0)]
    plan = schedule([[0], [1]], tensors, CostModel(1 * MS, 1e-8), backward_s=0.0)
    played = replay(plan, Contention(startup_overlap=0.25))
    # (The tiny one's 4 bytes add 0.04 us.)
    assert [c.end_s for c in played.comms] == pytest.approx([1.2 * MS, 2.15 * MS], abs=1e-7)
    # No overlap is one at a time; full overlap ends the second's start-up at 2 ms.
    serial = [c.end_s for c in replay(plan, Contention(startup_overlap=0.0)).comms]
    full = [c.end_s for c in replay(plan, Contention(startup_overlap=1.0)).comms]
    assert serial == pytest.approx([1.2 * MS, 2.2 * MS], abs=1e-7)
    assert full == pytest.approx([1.2 * MS, 2.0 * MS], abs=1e-7)


def test_a_startup_behind_bytes_slows_compute_by_its_share() -> None:
    # 1 MB then 4 bytes, both ready as a 10 ms backward starts; a = 1 ms, 10 ms of bytes; a
    # start-up slows compute 2x, bytes not at all; start-ups behind bytes go at half speed.
    # 0..1 ms: the first start-up, compute at 1/2 (0.5 ms done). 1..3 ms: the second start-up
    # behind the bytes at half speed takes half a start-up's cycles, compute at 1/1.5 (4/3 ms
    # more). From 3 ms compute is alone with bytes: the other 10 - 11/6 ms end at 11 1/6 ms.
    tensors = [ReadyTensor("big", 1_000_000, 0.0), ReadyTensor("tiny", 4, 0.0)]
    plan = schedule([[0], [1]], tensors, CostModel(1 * MS, 1e-8), backward_s=10 * MS)
    played = replay(plan, Contention(startup_compute_slowdown=2.0, startup_overlap=0.5))
    assert played.backward_end_s == pytest.approx((10 + 1 - 0.5 - 4 / 3 + 2) * MS)
    assert [c.end_s for c in played.comms] == pytest.approx([11 * MS, 3 * MS], abs=1e-6)


def test_contention_rejects_impossible_numbers() -> None:
    with pytest.raises(ValueError, match="transfer_rate"):
        Contention(transfer_rate=1.5)
    with pytest.raises(ValueError, match="transfer_rate"):
        Contention(transfer_rate=-0.1)
    with pytest.raises(ValueError, match="startup_compute_slowdown"):
        Contention(startup_compute_slowdown=0.5)
    with pytest.raises(ValueError, match="compute_slowdown"):
        Contention(compute_slowdown=math.inf)
    with pytest.raises(ValueError, match="startup_overlap"):
        Contention(startup_overlap=1.01)


def test_host_work_runs_on_the_compute_lane_before_each_bucket_goes_out() -> None:
    # Three 1 MB tensors ready at 1, 2, 3 ms; a = 1 ms, b = 1 ms/MB; buckets [t0], [t1, t2];
    # the runtime's host work 0.5 ms/MB, done as a bucket goes out, on backward's thread.
    tensors = [ReadyTensor(f"t{i}", 1_000_000, (i + 1) * MS) for i in range(3)]
    cost = CostModel(1 * MS, 1e-9)
    plan = schedule([[0], [1, 2]], tensors, cost, forward_s=2 * MS)
    replayed = replay(plan, step_s=1 * MS, host_s_per_byte=0.5e-9)
    # t0 ready at 1 + 0.5 = 1.5 ms, its all-reduce 1.5..3.5; t1 at 2.5; t2 at 3.5 plus 1 ms of
    # host work for the 2 MB bucket = 4.5 ms, when backward ends; that all-reduce 4.5..7.5.
    assert replayed.ready_s == pytest.approx((1.5 * MS, 2.5 * MS, 4.5 * MS))
    assert [t for c in replayed.comms for t in (c.start_s, c.end_s)] == pytest.approx(
        [1.5 * MS, 3.5 * MS, 4.5 * MS, 7.5 * MS]
    )
    assert replayed.backward_end_s == pytest.approx(4.5 * MS)
    # forward 2 + 7.5 + step 1.
    assert replayed.iteration_s == pytest.approx(10.5 * MS)
    assert replay(plan, step_s=1 * MS).iteration_s == pytest.approx(plan.predicted_s + 1 * MS)
    with pytest.raises(ValueError, match="host_s_per_byte"):
        replay(plan, host_s_per_byte=-1.0)
