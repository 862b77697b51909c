"""Fusion of factors into pipelined all-reduce buckets, against hand-worked groupings."""

from __future__ import annotations

import pytest

from interlace.comm.cost import CostModel
from interlace.comm.plan import Bucketing
from interlace.errors import OptionError
from interlace.kfac.fusion import (
    bulk_groups,
    fusion_from,
    make_groups,
    merged_candidates,
    merged_groups,
)

#: Start-up free, a second per byte: after the first factor's all-reduce the channel stays busy
#: past any real ready time, so MG-WFBP merges every later factor into one bucket.
MERGING_COST = CostModel(0.0, 1.0)


def test_a_fusion_is_the_bucketing_of_the_same_meaning_by_member_or_string() -> None:
    assert fusion_from("none") is Bucketing.PER_TENSOR
    assert fusion_from("per-tensor") is Bucketing.PER_TENSOR
    assert fusion_from(" Fixed ") is Bucketing.FIXED
    assert fusion_from(Bucketing.MERGED) is Bucketing.MERGED
    for other in (Bucketing.SINGLE, "optimal", 3):
        with pytest.raises(OptionError, match="fusion must be one of none, fixed, merged"):
            fusion_from(other)


def test_none_gives_one_bucket_per_factor() -> None:
    assert make_groups("none", [8, 16, 4]) == [[0], [1], [2]]
    assert make_groups(Bucketing.PER_TENSOR, [8, 16, 4]) == [[0], [1], [2]]


def test_bulk_buckets_close_at_the_cap_and_a_cap_of_zero_keeps_factors_apart() -> None:
    # 60 + 50 reaches 100 and closes; 120 alone; 10 left over.
    assert bulk_groups([60, 50, 120, 10], 100) == [[0, 1], [2], [3]]
    assert bulk_groups([60, 50], 0) == [[0], [1]]
    with pytest.raises(ValueError, match="cap must be >= 0"):
        bulk_groups([1], -1)


def test_fixed_closes_a_bucket_once_it_holds_the_cap_as_ddp_does() -> None:
    sizes = [40, 50, 20, 100, 30, 30, 30]
    # 40+50 is below 100, +20 reaches it; 100 alone reaches it; the last three stay below.
    assert make_groups("fixed", sizes, cap_bytes=100) == [[0, 1, 2], [3], [4, 5, 6]]
    assert make_groups("fixed", [250, 10], cap_bytes=100) == [[0], [1]]
    with pytest.raises(ValueError, match="cap"):
        make_groups("fixed", sizes, cap_bytes=0)


def test_merged_follows_mg_wfbp() -> None:
    cost = CostModel(a=1.0, b=0.01)
    # Factor 0 ready at 0 starts at 0; factor 1 (ready 0.5 < 0 + a) joins it. Factor 2 ready at
    # 5 is after 0.5 + a, so [0, 1] goes (0.5 .. 0.5 + 1 + 2 = 3.5); factor 3 at 5.5 < 5 + a
    # joins 2; factor 4 at 20 is alone.
    ready = [0.0, 0.5, 5.0, 5.5, 20.0]
    sizes = [100, 100, 100, 100, 100]
    assert merged_groups(sizes, ready, cost) == [[0, 1], [2, 3], [4]]
    # The channel busy after factor 0 makes everything after it wait, so it all merges.
    assert merged_groups([10, 10, 10, 10], [0.0, 1.0, 2.0, 3.0], MERGING_COST) == [
        [0],
        [1, 2, 3],
    ]
    # Slightly unsorted (averaged) times are taken as a running maximum, not refused.
    assert merged_groups([1, 1], [0.2, 0.1], CostModel(0.0, 0.0)) == [[0], [1]]
    with pytest.raises(ValueError, match="ready times"):
        make_groups("merged", [1, 2])
    with pytest.raises(ValueError, match="fusion"):
        make_groups("smart", [1])


def test_merged_candidates_are_the_cost_models_plan_then_larger_start_ups() -> None:
    cost = CostModel(a=1.0, b=0.01)
    # Ready 5 apart: a start-up of 1 merges nothing; x4 (4) still nothing; x16 (16) merges
    # while the next factor is ready before the first bucket could start plus 16: all of them.
    ready = [0.0, 5.0, 10.0, 15.0]
    sizes = [100, 100, 100, 100]
    assert merged_candidates(sizes, ready, cost) == [
        ("the cost model's plan", [[0], [1], [2], [3]]),
        ("start-up x16", [[0, 1, 2, 3]]),
    ]
    # Each candidate is the merge rule itself under its start-up, and none repeats another.
    close = [0.0, 2.0, 4.0, 60.0, 62.0, 200.0]
    found = merged_candidates([10] * 6, close, CostModel(a=1.0, b=0.0))
    assert [label for label, _ in found] == [
        "the cost model's plan",
        "start-up x4",
        "start-up x64",
    ]
    assert found[0][1] == merged_groups([10] * 6, close, CostModel(a=1.0, b=0.0))
    assert found[1][1] == [[0, 1, 2], [3, 4], [5]]
    assert found[2][1] == [[0, 1, 2, 3, 4], [5]]
