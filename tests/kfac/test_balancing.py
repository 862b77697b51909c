"""Greedy and round-robin placement: largest first onto the least-loaded rank, or in turn."""

from __future__ import annotations

import pytest

from interlace.kfac.balancing import (
    decomposition_cost,
    greedy_placement,
    rank_loads,
    round_robin_placement,
)
from interlace.kfac.module_helpers import make_helper
from interlace.zoo import build_model


def test_greedy_placement_puts_the_largest_first_on_the_least_loaded_rank() -> None:
    # Hand-worked: 8 -> r0; 7 -> r1; 5 -> r2; 4 -> r2 (5 < 7 < 8); 3 -> r1 (7 < 8 = 9? no: r1 7)
    # then loads r0 8, r1 10, r2 9 and 1 -> r0.
    costs = [3.0, 8.0, 4.0, 7.0, 1.0, 5.0]
    owners = greedy_placement(costs, 3)
    assert owners == [1, 0, 2, 1, 0, 2]
    assert rank_loads(costs, owners, 3) == [9.0, 10.0, 9.0]
    # Ties go to the lowest rank, and one rank takes everything.
    assert greedy_placement([1.0, 1.0], 2) == [0, 1]
    assert greedy_placement([5.0, 2.0], 1) == [0, 0]
    with pytest.raises(ValueError, match="ranks"):
        greedy_placement([1.0], 0)


def test_placement_of_resnet32_on_4_ranks_is_within_1_2x_of_ideal() -> None:
    model = build_model("resnet32", (3, 32, 32), 10)
    costs = []
    for module in model.modules():
        helper, _ = make_helper(module)
        if helper is not None:
            costs.append(decomposition_cost(helper.a_dim, helper.g_dim, helper.diagonal_a))
    # The first convolution, 30 in 15 blocks, 2 projection shortcuts and the classifier.
    assert len(costs) == 34
    loads = rank_loads(costs, greedy_placement(costs, 4), 4)
    ideal = sum(costs) / 4
    assert max(costs) <= ideal  # balance is possible at all
    assert max(loads) / ideal <= 1.2


def test_round_robin_deals_factors_out_in_turn() -> None:
    assert round_robin_placement(5, 2) == [0, 1, 0, 1, 0]
    assert round_robin_placement(0, 3) == []
    with pytest.raises(ValueError, match="ranks"):
        round_robin_placement(3, 0)
