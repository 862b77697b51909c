"""Bucket planners against hand-worked timelines and the properties MG-WFBP guarantees."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlace.comm.cost import CostModel
from interlace.comm.plan import ReadyTensor
from interlace.comm.planners import (
    make_plan,
    plan_fixed,
    plan_merged,
    plan_optimal,
    plan_per_tensor,
    plan_single,
)
from interlace.comm.pricing import schedule

MS = 1e-3


def tensors(*pairs: tuple[int, float]) -> list[ReadyTensor]:
    """(bytes, ready ms) pairs in ready order."""
    return [ReadyTensor(f"t{i}", nbytes, ms * MS) for i, (nbytes, ms) in enumerate(pairs)]


# a = 1 ms start-up, b = 1 ms per MB.
COST = CostModel(a=1 * MS, b=1e-9)


def test_hidden_communication_stays_separate() -> None:
    # t0 ready at 0 starts at once (0..2 ms); t1 is ready at 5 ms, well after 0 + a = 1 ms:
    # t0's all-reduce is fully hidden, merging would only delay it.
    items = tensors((1_000_000, 0.0), (1_000_000, 5.0))
    plan = plan_merged(items, COST)
    assert plan.groups == [[0], [1]]
    # t1: 5..7 ms.
    assert plan.predicted_s == pytest.approx(7 * MS)


def test_queued_communication_is_merged() -> None:
    # t0 (4 MB) occupies the channel 0..5 ms. t1 ready at 1 ms: could start at 0 + a? No, t1 is
    # considered against t0's own start (0): 1 ms is not < 0 + 1 ms, so t0 goes alone. Then t1
    # would start at 5 ms (queued behind t0); t2 is ready at 5.5 ms < 5 + a: merged into t1.
    items = tensors((4_000_000, 0.0), (1_000_000, 1.0), (1_000_000, 5.5))
    plan = plan_merged(items, COST)
    assert plan.groups == [[0], [1, 2]]
    # t0: 0..5; {t1,t2}: ready 5.5, start 5.5, 2 MB -> ends 8.5 ms.
    assert plan.predicted_s == pytest.approx(8.5 * MS)
    # Per tensor it is t0 0..5, t1 5..7, t2 7..9: the merge saved 0.5 ms.
    assert plan_per_tensor(items, COST).predicted_s == pytest.approx(9 * MS)


def test_partly_hidden_merges_only_when_the_wait_is_shorter_than_a() -> None:
    # t1 ready 0.6 ms after t0: waiting 0.6 ms < a = 1 ms saves a start-up -> merge.
    close = plan_merged(tensors((1_000_000, 0.0), (1_000_000, 0.6)), COST)
    assert close.groups == [[0, 1]]
    assert close.predicted_s == pytest.approx((0.6 + 1 + 2) * MS)
    # 1.4 ms later: not merged.
    far = plan_merged(tensors((1_000_000, 0.0), (1_000_000, 1.4)), COST)
    assert far.groups == [[0], [1]]


def test_a_tie_is_not_merged() -> None:
    plan = plan_merged(tensors((1_000, 0.0), (1_000, 1.0)), CostModel(a=1 * MS, b=0.0))
    assert plan.groups == [[0], [1]]


def test_merging_chains_through_a_burst_of_small_tensors() -> None:
    # Ten 1 kB tensors 0.1 ms apart: every one is ready before the group could pay a start-up.
    items = tensors(*[(1_000, 0.1 * i) for i in range(10)])
    assert plan_merged(items, COST).groups == [list(range(10))]


def test_single_and_per_tensor_timelines() -> None:
    items = tensors((1_000_000, 0.0), (2_000_000, 1.0), (1_000_000, 2.0))
    single = plan_single(items, COST, backward_s=3 * MS, forward_s=1 * MS)
    assert single.groups == [[0, 1, 2]]
    # Starts at the last ready time (2 ms), 1 + 4 ms -> ends 7 ms, plus 1 ms forward.
    assert single.predicted_s == pytest.approx(8 * MS)
    wfbp = plan_per_tensor(items, COST, backward_s=3 * MS, forward_s=1 * MS)
    # 0..2, 2..5 (ready 1, queued), 5..7: ends at 7 ms, plus forward.
    timeline = [value / MS for bucket in wfbp.buckets for value in (bucket.start_s, bucket.end_s)]
    assert timeline == pytest.approx([0, 2, 2, 5, 5, 7])
    assert wfbp.predicted_s == pytest.approx(8 * MS)


def test_fixed_caps_like_ddp() -> None:
    items = tensors((600, 0.0), (600, 0.1), (600, 0.2), (100, 0.3), (2000, 0.4), (10, 0.5))
    # Close a bucket once it holds >= 1000 bytes; the first bucket is capped at 500.
    plan = plan_fixed(items, COST, cap_bytes=1000, first_cap_bytes=500)
    assert plan.groups == [[0], [1, 2], [3, 4], [5]]
    assert [b.nbytes for b in plan.buckets] == [600, 1200, 2100, 10]
    with pytest.raises(ValueError, match="cap"):
        plan_fixed(items, COST, cap_bytes=0)


def test_backward_longer_than_communication_bounds_the_prediction() -> None:
    items = tensors((10, 0.0))
    plan = plan_merged(items, COST, backward_s=50 * MS, forward_s=5 * MS)
    assert plan.predicted_s == pytest.approx(55 * MS)


def test_inputs_out_of_order_or_empty_are_rejected() -> None:
    with pytest.raises(ValueError, match="ready order"):
        plan_merged(tensors((10, 2.0), (10, 1.0)), COST)
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        plan_merged(tensors((0, 0.0)), COST)
    with pytest.raises(ValueError, match="cover every tensor"):
        schedule([[0]], tensors((1, 0.0), (1, 0.0)), COST)
    with pytest.raises(ValueError, match="unknown bucketing"):
        make_plan("fastest", tensors((1, 0.0)), COST)
    assert plan_merged([], COST).predicted_s == 0.0


def from_gaps(steps: list[tuple[int, float]]) -> list[ReadyTensor]:
    """(bytes, seconds since the previous tensor) pairs as tensors in ready order."""
    ready = 0.0
    items = []
    for index, (nbytes, gap) in enumerate(steps):
        ready += gap
        items.append(ReadyTensor(f"t{index}", nbytes, ready))
    return items


_backward = st.lists(
    st.tuples(st.integers(1, 50_000_000), st.floats(0.0, 20 * MS)), min_size=1, max_size=40
)


@settings(max_examples=400, deadline=None)
@given(_backward, st.floats(0.0, 5 * MS), st.floats(0.0, 5e-9))
def test_merged_never_predicts_longer_than_wfbp_or_single(
    steps: list[tuple[int, float]], a: float, b: float
) -> None:
    items = from_gaps(steps)
    cost = CostModel(a, b)
    merged = plan_merged(items, cost).predicted_s
    assert merged <= plan_per_tensor(items, cost).predicted_s + 1e-12
    assert merged <= plan_single(items, cost).predicted_s + 1e-12


def _all_contiguous_groupings(count: int) -> list[list[list[int]]]:
    """Every split of 0..count-1 into contiguous groups (2^(count-1) of them)."""
    result = []
    for mask in range(1 << max(count - 1, 0)):
        groups, current = [], [0]
        for index in range(1, count):
            if mask >> (index - 1) & 1:
                groups.append(current)
                current = []
            current.append(index)
        groups.append(current)
        result.append(groups)
    return result


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 5_000_000), st.floats(0.0, 5 * MS)), min_size=1, max_size=8),
    st.floats(0.0, 3 * MS),
    st.floats(0.0, 3e-9),
)
def test_optimal_equals_brute_force_and_bounds_every_planner(
    steps: list[tuple[int, float]], a: float, b: float
) -> None:
    items = from_gaps(steps)
    cost = CostModel(a, b)
    best = plan_optimal(items, cost)
    brute = min(
        schedule(groups, items, cost).comm_end_s for groups in _all_contiguous_groupings(len(items))
    )
    assert best.comm_end_s == pytest.approx(brute, rel=1e-12, abs=1e-15)
    for other in (plan_merged, plan_per_tensor, plan_single):
        assert best.predicted_s <= other(items, cost).predicted_s + 1e-12
    assert best.predicted_s <= plan_fixed(items, cost, cap_bytes=4e6).predicted_s + 1e-12


def test_optimal_splits_where_the_greedy_rule_chains_a_dense_run() -> None:
    # Eight 1 MB tensors 0.5 ms apart with a = 1 ms, b = 1 ms/MB: each is ready before the
    # group could pay a start-up, so MG-WFBP's rule chains all eight into one 8 MB bucket sent
    # at 3.5 ms (ends 12.5 ms). Splitting lets the first part travel during backward.
    items = tensors(*[(1_000_000, 0.5 * i) for i in range(8)])
    merged = plan_merged(items, COST)
    optimal = plan_optimal(items, COST)
    assert merged.groups == [list(range(8))]
    assert merged.comm_end_s == pytest.approx(12.5 * MS)
    assert len(optimal.groups) > 1
    assert optimal.comm_end_s < merged.comm_end_s
