"""The benchmark harness: launching, rounds, batches, contenders, parsing and quartiles."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from interlace.bench.harness import round_order, split_blocks


def test_timed_iterations_are_split_into_even_rounds() -> None:
    assert split_blocks(12, 3) == [4, 4, 4]
    assert split_blocks(8, 3) == [3, 3, 2]
    assert split_blocks(2, 5) == [1, 1]


@pytest.mark.parametrize("slots", [1, 2, 3, 4, 5, 6, 7])
def test_round_orders_balance_positions_and_predecessors(slots: int) -> None:
    # A balanced Latin square: over `slots` rounds (2x for an odd count) each slot takes every
    # position equally often and follows every other slot equally often.
    rounds = slots if slots % 2 == 0 else 2 * slots
    orders = [round_order(slots, index) for index in range(rounds)]
    for order in orders:
        assert sorted(order) == list(range(slots))
    per_round = rounds // slots
    for position in range(slots):
        assert Counter(order[position] for order in orders) == dict.fromkeys(
            range(slots), per_round
        )
    follows = Counter((a, b) for order in orders for a, b in itertools.pairwise(order))
    expected = {(a, b): per_round for a in range(slots) for b in range(slots) if a != b}
    assert follows == expected


def test_the_old_rotation_would_have_kept_predecessors() -> None:
    # The reason for the design: with 6 slots, 5 rounds already put every slot behind at
    # least 3 different ones (a rotation gives each exactly one).
    orders = [round_order(6, index) for index in range(5)]
    for slot in range(6):
        before = {order[order.index(slot) - 1] for order in orders if order.index(slot) > 0}
        assert len(before) >= 3
