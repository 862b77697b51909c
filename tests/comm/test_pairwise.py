"""The greedy pairwise merge of MG-WFBP's published simulator, on a hand-worked example."""

from __future__ import annotations

import pytest

from interlace.comm.cost import CostModel
from interlace.comm.pairwise import pairwise_groups
from interlace.comm.plan import Bucketing, ReadyTensor
from interlace.comm.planners import make_plan, plan_merged

#: T(m) = 1 + m / 8 (seconds, bytes): every number below is exact in binary.
COST = CostModel(a=1.0, b=0.125)
SIZES = [8, 8, 16, 80, 8, 8]
READY = [1.0, 1.5, 6.0, 7.5, 8.0, 20.0]


def test_the_pairwise_merge_on_a_hand_worked_example() -> None:
    # Message 0 starts at 1 and would end at 3, after message 1 is ready (1.5): partly hidden.
    #   Merged: 1.5 + T(16) = 4.5 < 1 + T(8) + T(8) = 5, so merge.
    # Messages 0+1 start at 1.5, end at 4.5, before message 2 is ready (6): hidden, sent.
    # Message 2 starts at 6, ends at 9 > 7.5: merged would end 7.5 + T(96) = 20.5, apart
    #   6 + T(16) + T(80) = 20: not faster, sent alone; the channel is busy until 9.
    # Message 3 starts at 9, after message 4 is ready (8): one all-reduce T(88) = 12 is shorter
    #   than T(80) + T(8) = 13, so merge.
    # Messages 3+4 start at 9, end at 21 > 20: merged 20 + T(96) = 33 against 9 + 12 + 2 = 23,
    #   sent; message 5 goes alone.
    assert pairwise_groups(SIZES, READY, COST) == [[0, 1], [2], [3, 4], [5]]


def test_the_planner_prices_the_groups_one_after_another() -> None:
    tensors = [
        ReadyTensor(f"t{i}", size, ready)
        for i, (size, ready) in enumerate(zip(SIZES, READY, strict=True))
    ]
    plan = make_plan("pairwise", tensors, COST, forward_s=2.0)
    assert plan.strategy == Bucketing.PAIRWISE.value
    assert [(b.start_s, b.end_s) for b in plan.buckets] == [
        (1.5, 4.5),
        (6.0, 9.0),
        (9.0, 21.0),
        (21.0, 23.0),
    ]
    assert plan.predicted_s == pytest.approx(2.0 + 23.0)


def test_with_an_affine_cost_it_merges_exactly_as_theorem_1() -> None:
    # Partly hidden: merge iff next_ready + a + b(m1 + m2) < start + 2a + b(m1 + m2), i.e.
    # next_ready < start + a, Theorem 1's test; queued: merge iff a > 0, which Theorem 1's test
    # also says then. So on one channel the two rules group alike (docs/simulate.md).
    tensors = [
        ReadyTensor(f"t{i}", size, ready)
        for i, (size, ready) in enumerate(zip(SIZES, READY, strict=True))
    ]
    assert plan_merged(tensors, COST).groups == pairwise_groups(SIZES, READY, COST)


def test_no_messages_and_mismatched_inputs() -> None:
    assert pairwise_groups([], [], COST) == []
    assert pairwise_groups([8], [0.0], COST) == [[0]]
    with pytest.raises(ValueError, match="2 sizes but 1 ready times"):
        pairwise_groups([8, 8], [0.0], COST)
