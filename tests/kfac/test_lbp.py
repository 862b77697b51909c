"""SPD-KFAC's LBP with its makespan model.

LBP's golden cases use integer seconds, so every sum is exact and the hand-worked answers are
the answers; the properties compare LBP with the factor-level greedy and the paper's own rule.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from interlace.kfac.lbp import (
    FactorItem,
    factor_greedy_placement,
    lbp_placement,
    predicted_makespan,
    schedule_order,
)


def _dim(n: int) -> float:
    return float(n)


def _constant(seconds: float) -> Callable[[int], float]:
    return lambda n: seconds


def test_factor_greedy_is_greedy_by_n_cubed_per_factor() -> None:
    # 1000 -> r0, 1000 -> r1, 8 -> r0 (tie), a diagonal of 5 costs 5 -> r1.
    factors = [FactorItem(10), FactorItem(2), FactorItem(10), FactorItem(5, diagonal=True)]
    assert factor_greedy_placement(factors, 2) == [0, 0, 1, 1]


def test_small_factors_go_local_and_large_ones_spread() -> None:
    # Decomposing n costs n seconds, any broadcast 3. Dims 1 and 2 are cheaper to decompose than
    # to send: local (3 s on every rank). The 10s go to ranks 0 and 1: 10 + max(3 local, 3
    # sent) = 13 each, which is optimal (any rank that decomposes a 10 and also either sends
    # it or does another 10 needs 13 or more). Greedy by n^3 puts dim 2 beside a 10: 15.
    factors = [1, 2, 10, 10]
    owners = lbp_placement(factors, 2, _dim, _constant(3.0))
    assert owners == [None, None, 0, 1]
    assert predicted_makespan(factors, owners, 2, _dim, _constant(3.0)) == 13.0
    greedy = factor_greedy_placement(factors, 2)
    assert greedy == [1, 0, 0, 1]
    assert predicted_makespan(factors, greedy, 2, _dim, _constant(3.0)) == 15.0


def test_ties_go_to_the_lowest_rank_and_search_beats_the_paper_rule() -> None:
    # Four equal factors (4 s to decompose, 1 s to send) on 3 ranks. The paper's rule keeps
    # none local and deals them 0, 1, 2, then 0 again (all three ranks tie at 9 s): rank 0
    # finishes at 9. Keeping the first factor local instead costs every rank 4 s and leaves one
    # factor per rank: 4 + 4 = 8.
    factors = [4, 4, 4, 4]
    paper = lbp_placement(factors, 3, _dim, _constant(1.0), search=False)
    assert paper == [0, 1, 2, 0]
    assert predicted_makespan(factors, paper, 3, _dim, _constant(1.0)) == 9.0
    owners = lbp_placement(factors, 3, _dim, _constant(1.0))
    assert owners == [None, 0, 1, 2]
    assert predicted_makespan(factors, owners, 3, _dim, _constant(1.0)) == 8.0


def test_the_rank_that_finishes_last_gives_up_or_swaps_factors() -> None:
    # Longest first puts 3 and 3 apart, then the 2s where least loaded: 3+2+2 = 7 against
    # 3+2 = 5. Swapping a 3 for a 2 gives 6 and 6, the optimum, which no move alone reaches.
    sizes = [3, 3, 2, 2, 2]
    owners = lbp_placement(sizes, 2, _dim, _constant(0.0))
    assert owners == [1, 1, 0, 0, 0]
    assert predicted_makespan(sizes, owners, 2, _dim, _constant(0.0)) == 6.0
    # Three ranks: longest first gives 4+2+2, 4+2, 3+3 = 8, 6, 6; 20 seconds of integer work
    # cannot finish before 7 on three ranks, and the refinement gets there.
    sizes = [4, 4, 3, 3, 2, 2, 2]
    owners = lbp_placement(sizes, 3, _dim, _constant(0.0))
    assert predicted_makespan(sizes, owners, 3, _dim, _constant(0.0)) == 7.0


def test_many_factors_just_below_the_threshold_are_better_mostly_spread() -> None:
    # Ten factors that take 9 s to decompose and 10 s to send, on 2 ranks. The paper keeps all
    # of them local: 90 s on each rank. Greedy spreads them 5 and 5; sends overlap the next
    # decompositions, so each rank's last send ends at 9 + 5 * 10 = 59. LBP keeps two local
    # (18 s everywhere) and spreads eight: 4 * 9 + 18 = 54 of work, sends done at 9 + 40 = 49.
    factors = [5] * 10
    nine, ten = _constant(9.0), _constant(10.0)
    paper = lbp_placement(factors, 2, nine, ten, search=False)
    assert paper == [None] * 10
    assert predicted_makespan(factors, paper, 2, nine, ten) == 90.0
    greedy = factor_greedy_placement(factors, 2)
    assert predicted_makespan(factors, greedy, 2, nine, ten) == 59.0
    owners = lbp_placement(factors, 2, nine, ten)
    assert owners == [None, None, 0, 1, 0, 1, 0, 1, 0, 1]
    assert predicted_makespan(factors, owners, 2, nine, ten) == 54.0


def test_every_rank_computes_everything_when_broadcasts_are_very_expensive() -> None:
    factors = [FactorItem(n) for n in (64, 576, 128, 1152, 256, 2304, 512, 4608, 10)]
    owners = lbp_placement(factors, 8, lambda n: 1e-11 * n**3, _constant(1e3))
    assert owners == [None] * len(factors)


def test_one_rank_and_diagonal_factors_are_always_local() -> None:
    assert lbp_placement([10, 20], 1, _dim, _constant(0.0)) == [None, None]
    factors = [FactorItem(1000, diagonal=True), FactorItem(50), FactorItem(60)]
    owners = lbp_placement(factors, 2, _dim, _constant(1.0))
    assert owners == [None, 1, 0]
    # A diagonal costs nothing wherever it is put, and on one rank nothing is sent.
    assert predicted_makespan(factors, [0, 1, 0], 2, _dim, _constant(1.0)) == 61.0
    assert predicted_makespan(factors, [0, 0, 0], 1, _dim, _constant(1.0)) == 110.0


def test_the_schedule_follows_johnsons_rule_then_the_local_factors() -> None:
    # d < b (sending dominates): shortest decomposition first; then the longest sends first.
    seconds = {1: 3.0, 2: 1.0, 3: 5.0, 4: 4.0, 5: 2.0}
    sends = {1: 4.0, 2: 2.0, 3: 1.0, 4: 3.0, 5: 9.0}
    owners: list[int | None] = [0, 0, 0, 0, None]
    order = schedule_order([1, 2, 3, 4, 5], owners, 2, seconds.__getitem__, sends.__getitem__)
    assert order == [1, 0, 3, 2, 4]
    # Rank 0: decompositions end 1, 4, 8, 13; sends 1-3, 4-8, 8-11, 13-14; plus 2 s local.
    span = predicted_makespan([1, 2, 3, 4, 5], owners, 2, seconds.__getitem__, sends.__getitem__)
    assert span == 15.0


def test_bad_placements_and_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="2 owners for 3 factors"):
        predicted_makespan([1, 2, 3], [0, 1], 2, _dim, _dim)
    with pytest.raises(ValueError, match="owner 2 is not a rank of 2"):
        predicted_makespan([1, 2], [0, 2], 2, _dim, _dim)
    with pytest.raises(ValueError, match="ranks"):
        lbp_placement([1], 0, _dim, _dim)
    with pytest.raises(ValueError, match="finite and >= 0"):
        lbp_placement([1], 2, _dim, _constant(-1.0))
    with pytest.raises(ValueError, match="dimension"):
        FactorItem(-1)


def _flow_shop_brute_force(seconds: Sequence[float], sends: Sequence[float]) -> float:
    """The best single-rank makespan over every decomposition order."""
    best = float("inf")
    for order in itertools.permutations(range(len(seconds))):
        computed = sent = 0.0
        for index in order:
            computed += seconds[index]
            sent = max(sent, computed) + sends[index]
        best = min(best, max(computed, sent))
    return best


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=6))
def test_the_predicted_makespan_uses_the_best_order_on_each_rank(
    costs: list[tuple[int, int]],
) -> None:
    factors = list(range(len(costs)))
    span = predicted_makespan(
        factors, [0] * len(costs), 2, lambda i: costs[i][0], lambda i: costs[i][1]
    )
    assert span == _flow_shop_brute_force([c[0] for c in costs], [c[1] for c in costs])


_factors = st.lists(
    st.builds(FactorItem, st.integers(1, 96), st.sampled_from([False, False, False, True])),
    min_size=0,
    max_size=24,
)


_coefficients = st.tuples(
    st.floats(1e-6, 1e-3),  # decomposition start-up, s
    st.floats(1e-10, 1e-6),  # decomposition seconds per n^3
    st.floats(0.0, 1e-3),  # broadcast start-up, s
    st.floats(0.0, 1e-7),  # broadcast seconds per number sent
)


@settings(max_examples=300, deadline=None)
@given(_factors, st.integers(1, 8), _coefficients)
def test_lbp_is_never_worse_than_greedy_or_the_paper_rule(
    factors: list[FactorItem], ranks: int, coefficients: tuple[float, float, float, float]
) -> None:
    c0, c3, a, b = coefficients

    def decompose(n: int) -> float:
        return c0 + c3 * n**3

    def broadcast(n: int) -> float:
        return a + b * (n * n + n)

    owners = lbp_placement(factors, ranks, decompose, broadcast)
    assert len(owners) == len(factors)
    assert all(owner is None or 0 <= owner < ranks for owner in owners)
    assert all(owner is None for owner, f in zip(owners, factors, strict=True) if f.diagonal)
    assert owners == lbp_placement(factors, ranks, decompose, broadcast)  # deterministic
    span = predicted_makespan(factors, owners, ranks, decompose, broadcast)
    greedy = factor_greedy_placement(factors, ranks)
    assert span <= predicted_makespan(factors, greedy, ranks, decompose, broadcast)
    paper = lbp_placement(factors, ranks, decompose, broadcast, search=False)
    assert span <= predicted_makespan(factors, paper, ranks, decompose, broadcast)
    # The paper's rule: local exactly when decomposing is cheaper than sending.
    if ranks > 1:
        for owner, factor in zip(paper, factors, strict=True):
            cheaper = decompose(factor.dim) < broadcast(factor.dim)
            assert (owner is None) == (factor.diagonal or cheaper)
