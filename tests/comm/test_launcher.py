"""The launch order: slices go out strictly in plan order, each once its bucket is complete."""

from __future__ import annotations

import pytest

from interlace.comm.launcher import LaunchOrder


def test_buckets_go_out_in_order_whatever_order_members_arrive_in() -> None:
    order = LaunchOrder([[0, 1], [2], [3, 4]])
    assert order.add(3) == []
    assert order.add(4) == []  # bucket 2 is complete but waits behind buckets 0 and 1
    assert order.add(2) == []
    assert order.add(1) == []
    assert order.add(0) == [0, 1, 2]
    assert order.launched == 3


def test_slices_of_one_bucket_can_be_interleaved_with_other_buckets() -> None:
    # Bucket 0 in two slices, with bucket 1 sent between them: the plan's order.
    order = LaunchOrder([[0], [1]], order=[0, 1, 0])
    assert order.add(0) == [0]
    assert order.add(0) == []  # a member added twice counts once
    assert order.add(1) == [1, 2]
    assert order.rest() == []


def test_rest_sends_everything_left_as_if_every_member_had_arrived() -> None:
    order = LaunchOrder([[0], [1, 2], [3]])
    assert order.add(3) == []
    assert order.rest() == [0, 1, 2]
    assert all(order.arrived(member) for member in range(4))
    order.reset()
    assert order.launched == 0 and not order.arrived(3)
    assert order.bucket_of(2) == 1


@pytest.mark.parametrize(
    ("groups", "launches", "needle"),
    [
        ([[0], [0]], None, "cover every member exactly once"),
        ([[0], []], None, "cover every member exactly once"),
        ([[0], [1]], [0], "name every bucket"),
        ([[0], [1]], [0, 1, 2], "name every bucket"),
    ],
)
def test_bad_plans_are_refused(
    groups: list[list[int]], launches: list[int] | None, needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        LaunchOrder(groups, launches)


def test_an_unknown_member_is_refused() -> None:
    with pytest.raises(ValueError, match="member 5 is in no bucket"):
        LaunchOrder([[0]]).add(5)
