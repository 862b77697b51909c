"""Forward-overlap plans: the most urgent slice first, gates that wait, golden schedules."""

from __future__ import annotations

import pytest

from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import (
    GateDues,
    GateTiming,
    Landing,
    gates_from_timings,
    overlap_candidates,
    per_gate_groups,
    plan_overlap,
)
from interlace.comm.plan import Gate, Plan, ReadyTensor

MS = 1e-3
MB = 1_000_000
#: No start-up, 1 ms per MB: times in the goldens below are easy to follow.
COST = CostModel(a=0.0, b=1e-9)
#: Backward makes a 4 MB tensor ready first (the layer the next forward needs last), then
#: three 1 MB ones; the forward needs them in the reverse order, 0.5 ms of compute each.
TENSORS = [
    ReadyTensor("head", 4 * MB, 0.0),
    ReadyTensor("c", 1 * MB, 1 * MS),
    ReadyTensor("b", 1 * MB, 2 * MS),
    ReadyTensor("a", 1 * MB, 3 * MS),
]
GATES = [
    Gate(name, (index,), 0.5 * MS) for index, name in ((3, "a"), (2, "b"), (1, "c"), (0, "head"))
]


def _order(plan: Plan) -> list[tuple[int, int]]:
    return [(launch.bucket, launch.part) for launch in plan.launches]


def test_whole_buckets_go_most_urgent_first_once_the_wire_is_free() -> None:
    plan = plan_overlap(TENSORS, GATES, COST, groups=[[0], [1], [2], [3]], forward_s=2 * MS)
    # The head goes out alone (0-4 ms); then all three are ready and go as the forward needs
    # them: a (4-5), b (5-6), c (6-7).
    assert _order(plan) == [(0, 0), (3, 0), (2, 0), (1, 0)]
    assert [t / MS for x in plan.launches for t in (x.start_s, x.end_s)] == pytest.approx(
        [0, 4, 4, 5, 5, 6, 6, 7]
    )
    # Forward from 3 ms: a waits to 5, b to 6, c to 7, the head is there: 7 + 2 x 0.5.
    assert plan.forward_end_s == pytest.approx(8 * MS)
    assert plan.predicted_s == plan.iteration_s == pytest.approx(8 * MS)
    assert plan.overlaps_forward


def test_slices_let_urgent_buckets_pass_a_large_one() -> None:
    plan = plan_overlap(
        TENSORS, GATES, COST, groups=[[0], [1], [2], [3]], forward_s=2 * MS, slice_bytes=MB
    )
    # The head's first slice goes at once; each small bucket passes the rest as it is ready.
    assert _order(plan) == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (0, 2), (0, 3)]
    assert all(x.parts == (4 if x.bucket == 0 else 1) for x in plan.launches)
    assert sum(x.nbytes for x in plan.launches if x.bucket == 0) == 4 * MB
    # a arrives at 4, b and c before; the head at 7: 4.5, 5.0, 5.5, then wait to 7, 7.5.
    assert plan.forward_end_s == pytest.approx(7.5 * MS)
    assert plan.buckets[0].start_s == 0 and plan.buckets[0].end_s == pytest.approx(7 * MS)


def _reference_times(plan: Plan, cost: CostModel) -> list[tuple[float, float]]:
    """One channel, the plan's order: each slice starts when its bucket is complete, the one
    before it has gone out and the wire is free."""
    times = []
    free = launched = 0.0
    for launch in plan.launches:
        ready = max(plan.tensors[i].ready_s for i in plan.buckets[launch.bucket].indices)
        launched = max(launched, ready)
        start = max(launched, free)
        free = start + cost.time(launch.nbytes)
        times.append((start, free))
    return times


def _reference_forward_end(plan: Plan) -> float:
    """The next forward, gate by gate, as a user would write it down: a gate waits for the
    buckets of its tensors that have not landed, and every member of those buckets is updated
    there (a bucket's average arrives whole)."""
    done = {number: bucket.end_s for number, bucket in enumerate(plan.buckets)}
    bucket_of = {i: n for n, bucket in enumerate(plan.buckets) for i in bucket.indices}
    total = sum(t.nbytes for t in plan.tensors)
    now = plan.backward_s + plan.forward_s - sum(gate.forward_s for gate in plan.gates)
    landed: set[int] = set()
    for gate in plan.gates:
        due = {bucket_of[i] for i in gate.tensors} - landed
        now = max([now] + [done[n] for n in due])
        members = [i for n in due for i in plan.buckets[n].indices]
        now += plan.step_s * sum(plan.tensors[i].nbytes for i in members) / total + gate.forward_s
        landed |= due
    rest = set(done) - landed
    if rest:
        now = max([now] + [done[n] for n in rest])
        members = [i for n in rest for i in plan.buckets[n].indices]
        now += plan.step_s * sum(plan.tensors[i].nbytes for i in members) / total
    return now


@pytest.mark.parametrize("slice_bytes", [None, 0.3 * MB, 2 * MB])
@pytest.mark.parametrize("groups", [[[0], [1], [2], [3]], [[0, 1], [2, 3]], [[0, 1, 2, 3]]])
def test_predicted_times_match_a_reference_schedule(
    groups: list[list[int]], slice_bytes: float | None
) -> None:
    cost = CostModel(a=0.2 * MS, b=1e-9)
    # Two tensors share the last gate and one tensor no gate waits for.
    gates = [Gate("a", (3,), 0.4 * MS), Gate("bc", (2, 1), 0.7 * MS)]
    plan = plan_overlap(
        TENSORS,
        gates,
        cost,
        groups=groups,
        forward_s=1.5 * MS,
        backward_s=3.5 * MS,
        step_s=0.8 * MS,
        slice_bytes=slice_bytes,
    )
    assert [t for x in plan.launches for t in (x.start_s, x.end_s)] == pytest.approx(
        [t for pair in _reference_times(plan, cost) for t in pair]
    )
    assert plan.forward_end_s == pytest.approx(_reference_forward_end(plan))
    assert plan.backward_s == 3.5 * MS and plan.step_s == 0.8 * MS


def test_the_candidates_come_fastest_first_and_cover_the_bucketings() -> None:
    cost = CostModel(a=0.1 * MS, b=1e-9)
    found = overlap_candidates(TENSORS, GATES, cost, forward_s=2 * MS, step_s=0.1 * MS)
    times = [plan.iteration_s for _, plan in found]
    assert times == sorted(times)
    labels = {label.split(",")[0] for label, _ in found}
    assert {"overlap: merged", "overlap: per gate", "overlap: 10 MB caps"} <= labels
    assert any("1 MB slices" in label for label, _ in found)


def test_per_gate_groups_cut_where_the_first_waiting_gate_changes() -> None:
    gates = [Gate("x", (4, 3), 0.0), Gate("y", (2,), 0.0), Gate("z", (1, 0), 0.0)]
    assert per_gate_groups(5, gates) == [[0, 1], [2], [3, 4]]
    # A tensor no gate waits for stays with its neighbours that no gate waits for.
    assert per_gate_groups(3, [Gate("x", (2,), 0.0)]) == [[0, 1], [2]]


def test_profiled_gates_become_plan_gates_with_stretches_to_the_next_one() -> None:
    timings = [GateTiming("first", (1,), 0.0), GateTiming("second", (0, 2), 3 * MS)]
    # Registration 0, 1, 2 are at ready positions 2, 0, 1.
    gates = gates_from_timings(timings, [2, 0, 1], forward_s=5 * MS)
    assert gates == [Gate("first", (0,), 3 * MS), Gate("second", (1, 2), 2 * MS)]


@pytest.mark.parametrize(
    ("groups", "gates", "slice_bytes", "needle"),
    [
        ([[0], [1]], GATES, None, "cover every tensor"),
        ([[0, 1, 2, 3]], [Gate("g", (7,), 0.0)], None, "does not have"),
        ([[0, 1, 2, 3]], GATES, 0.0, "slice_bytes must be > 0"),
    ],
)
def test_bad_plans_are_refused(
    groups: list[list[int]], gates: list[Gate], slice_bytes: float | None, needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        plan_overlap(TENSORS, gates, COST, groups=groups, forward_s=1 * MS, slice_bytes=slice_bytes)


def test_a_gate_lands_every_member_of_the_buckets_due_there() -> None:
    # Buckets {0, 1}, {2, 3}, {4}; gates wait for 3, then 1 and 2, then 0; tensor 4 for none.
    dues = GateDues.of([[0, 1], [2, 3], [4]], [[3], [1, 2], [0]])
    assert dues.due(1, {0, 1, 2}) == [0, 1]
    assert dues.due(1, {0, 2}) == [0]
    assert dues.landing([1, 0]) == [0, 1, 2, 3]
    # The first gate lands tensor 2 with 3, the second tensor 0 with 1, the third nothing;
    # bucket {4} only at the end.
    assert dues.in_order() == [
        Landing((1,), (2, 3)),
        Landing((0,), (0, 1)),
        Landing((), ()),
        Landing((2,), (4,)),
    ]
    assert dues.first_due() == [1, 0, 3]
