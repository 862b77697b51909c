"""Fusion of factors into pipelined all-reduce buckets, against hand-worked groupings."""

from __future__ import annotations

import pytest

from interlace.comm.cost import CostModel
from interlace.kfac.fusion import BucketLauncher, fixed_groups, make_groups, merged_groups

#: Start-up free, a second per byte: after the first factor's all-reduce the channel stays busy
#: past any real ready time, so MG-WFBP merges every later factor into one bucket.
MERGING_COST = CostModel(0.0, 1.0)


def test_none_gives_one_bucket_per_factor() -> None:
    assert make_groups("none", [8, 16, 4]) == [[0], [1], [2]]


def test_fixed_fills_buckets_up_to_the_cap_in_ready_order() -> None:
    sizes = [40, 50, 20, 100, 30, 30, 30]
    # 40+50 fits 100, +20 does not; 20 alone then +100 overflows; 100 is a bucket by itself.
    assert fixed_groups(sizes, 100) == [[0, 1], [2], [3], [4, 5, 6]]
    assert make_groups("fixed", [250, 10], cap_bytes=100) == [[0], [1]]
    with pytest.raises(ValueError, match="cap"):
        fixed_groups(sizes, 0)


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


def test_launcher_launches_complete_buckets_in_plan_order() -> None:
    launcher = BucketLauncher([[0, 1], [2], [3, 4]])
    assert launcher.add(2) == []  # bucket 1 is complete but bucket 0 is not out yet
    assert launcher.add(0) == []
    assert launcher.add(0) == []  # a repeat counts once
    assert launcher.add(1) == [0, 1]
    assert launcher.add(3) == []
    assert launcher.launched == 2
    assert launcher.rest() == [2]  # the flush
    assert launcher.rest() == []
    with pytest.raises(ValueError, match="no bucket"):
        launcher.add(7)
    with pytest.raises(ValueError, match="cover"):
        BucketLauncher([[0], [2]])
