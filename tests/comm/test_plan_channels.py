"""Planning on several channels: hand-worked timelines, partitioning, the concurrency terms."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlace.comm.cost import CostModel
from interlace.comm.plan import ReadyTensor, slice_count
from interlace.comm.planners import (
    make_plan,
    plan_merged,
    plan_optimal,
    plan_per_tensor,
    plan_single,
)
from interlace.comm.pricing import ChannelClock, schedule

MS = 1e-3
MB = 1_000_000
# a = 1 ms start-up, b = 1 ms per MB; two concurrent all-reduces: start-ups overlap fully and
# each gets 1/1.5 of the link (AIACC's regime: one stream leaves bandwidth idle).
SHARED = CostModel(a=1 * MS, b=1e-9, concurrency=((1 * MS, 1.5), (1 * MS, 2.0)))


def tensors(*pairs: tuple[int, float]) -> list[ReadyTensor]:
    return [ReadyTensor(f"t{i}", nbytes, ms * MS) for i, (nbytes, ms) in enumerate(pairs)]


def test_concurrent_terms_default_measured_and_extrapolated() -> None:
    plain = CostModel(a=1 * MS, b=1e-9)
    assert plain.concurrent_terms(1) == (1 * MS, 1.0)
    assert plain.concurrent_terms(3) == (1 * MS, 3.0)  # unmeasured: the link is just shared
    assert SHARED.concurrent_terms(2) == (1 * MS, 1.5)
    assert SHARED.concurrent_terms(3) == (1 * MS, 2.0)
    # Past the last measured count (3): c_3 * j / 3.
    assert SHARED.concurrent_terms(6) == pytest.approx((1 * MS, 4.0))
    assert SHARED.time(1 * MB, concurrent=2) == pytest.approx(2.5 * MS)
    assert SHARED.time(0, concurrent=2) == 0.0
    with pytest.raises(ValueError, match="c_j > 0"):
        CostModel(1.0, 1.0, concurrency=((1.0, 0.0),))
    with pytest.raises(ValueError, match=">= 1"):
        plain.concurrent_terms(0)


def test_two_channels_overlap_two_all_reduces() -> None:
    # Two 1 MB tensors ready at 0. One channel: 2 ms, then 2 ms more. Two channels: the first
    # alone on channel 0 (2 ms), the second on channel 1 sharing the link (1 + 1.5 = 2.5 ms).
    ready = tensors((MB, 0), (MB, 0))
    one = plan_per_tensor(ready, SHARED)
    two = plan_per_tensor(ready, SHARED, channels=2)
    assert [t for b in one.buckets for t in (b.start_s, b.end_s)] == pytest.approx(
        [0, 2 * MS, 2 * MS, 4 * MS]
    )
    assert [b.channels for b in two.buckets] == [(0,), (1,)]
    assert [t for b in two.buckets for t in (b.start_s, b.end_s)] == pytest.approx(
        [0, 2 * MS, 0, 2.5 * MS]
    )
    assert two.predicted_s == pytest.approx(2.5 * MS)


def test_a_bucket_goes_to_the_channel_free_first() -> None:
    # 3 MB on channel 0 (ends 4 ms), 1 MB at 0 on channel 1 (ends 1 + 1.5 = 2.5 ms); the third,
    # ready at 3 ms, finds channel 1 free first although round-robin would say channel 0.
    ready = tensors((3 * MB, 0), (MB, 0), (MB, 3))
    plan = plan_per_tensor(ready, SHARED, channels=2)
    assert [b.channels for b in plan.buckets] == [(0,), (1,), (1,)]
    # At 3 ms bucket 0 is still running: two in flight, 1 + 1.5 * 1 ms.
    assert plan.buckets[2].start_s == pytest.approx(3 * MS)
    assert plan.buckets[2].end_s == pytest.approx(5.5 * MS)


def test_partitioned_bucket_is_split_across_channels() -> None:
    assert slice_count(4 * MB, 2, 1 * MB) == 2  # at most one slice per channel
    assert slice_count(3 * MB, 4, 1 * MB) == 3
    assert slice_count(MB, 4, 1 * MB) == 1  # not above the threshold
    assert slice_count(4 * MB, 4, None) == 1
    # One 4 MB bucket: one channel 5 ms; two 2 MB slices at once, each 1 + 1.5 * 2 = 4 ms.
    single = plan_single(tensors((4 * MB, 0)), SHARED, channels=2, partition_bytes=MB)
    assert single.buckets[0].channels == (0, 1)
    assert single.buckets[0].end_s == pytest.approx(4 * MS)
    # Where the link is merely shared (c_j = j) partitioning cannot win: 1 + 2 * 2 = 5 ms.
    plain = CostModel(a=1 * MS, b=1e-9)
    shared_only = plan_single(tensors((4 * MB, 0)), plain, channels=2, partition_bytes=MB)
    assert shared_only.buckets[0].end_s == pytest.approx(5 * MS)


def test_one_channel_matches_the_serial_timeline() -> None:
    ready = tensors((MB, 0), (2 * MB, 0.5), (MB, 4), (MB, 4.2))
    groups = [[0], [1, 2], [3]]
    serial = schedule(groups, ready, SHARED)
    ends, free = [], 0.0
    for group in groups:
        start = max(free, *(ready[i].ready_s for i in group))
        free = start + SHARED.a + SHARED.b * sum(ready[i].nbytes for i in group)
        ends.append(free)
    assert [b.end_s for b in serial.buckets] == pytest.approx(ends)
    assert all(b.channels == (0,) for b in serial.buckets)


def test_merged_on_channels_merges_less_where_start_ups_overlap() -> None:
    # Ten 10 KB tensors 0.5 ms apart: on one channel each waits behind the previous one's 1 ms
    # start-up, so the rule chains them; with two channels a tensor usually finds a channel free.
    ready = tensors(*[(10_000, 0.5 * i) for i in range(10)])
    one = plan_merged(ready, SHARED)
    two = plan_merged(ready, SHARED, channels=2)
    assert len(two.buckets) > len(one.buckets)
    assert two.predicted_s < one.predicted_s


def test_optimal_refuses_several_channels() -> None:
    with pytest.raises(ValueError, match="one channel"):
        plan_optimal(tensors((MB, 0)), SHARED, channels=2)
    with pytest.raises(ValueError, match="channels must be >= 1"):
        ChannelClock(SHARED, 0)
    with pytest.raises(ValueError, match="partition_bytes"):
        make_plan("merged", tensors((MB, 0)), SHARED, channels=2, partition_bytes=0)


ready_lists = st.lists(
    st.tuples(st.integers(1, 4 * MB), st.floats(0, 5, allow_nan=False)), min_size=1, max_size=12
).map(lambda pairs: tensors(*[(size, ms) for size, ms in sorted(pairs, key=lambda p: p[1])]))


@settings(max_examples=150, deadline=None)
@given(
    ready=ready_lists,
    channels=st.integers(1, 4),
    partition=st.sampled_from([None, 0.5 * MB, 2 * MB]),
    c2=st.floats(1.0, 2.0),
)
def test_merged_on_k_channels_never_predicts_longer_than_wfbp_or_single(
    ready: list[ReadyTensor], channels: int, partition: float | None, c2: float
) -> None:
    cost = CostModel(a=1 * MS, b=1e-9, concurrency=((0.8 * MS, c2),))
    merged = plan_merged(ready, cost, channels=channels, partition_bytes=partition)
    for planner in (plan_per_tensor, plan_single):
        other = planner(ready, cost, channels=channels, partition_bytes=partition)
        assert merged.predicted_s <= other.predicted_s + 1e-12
    # Every slice is on a real channel, never two slices of a bucket on the same one.
    for bucket in merged.buckets:
        assert all(0 <= c < channels for c in bucket.channels)
        assert len(set(bucket.channels)) == len(bucket.channels)
