"""balance_table: the bisection on monotone stage costs cuts as the full search does."""

from __future__ import annotations

import itertools
import math
import random

from interlace.pipeline.balance import balance_table


def _table(times: list[float], start_up: float) -> list[list[float]]:
    prefix = list(itertools.accumulate(times, initial=0.0))
    n = len(times)
    return [
        [math.inf] * (i + 1) + [prefix[j] - prefix[i] + start_up for j in range(i + 1, n + 1)]
        for i in range(n)
    ]


def _brute_bottleneck(table: list[list[float]], stages: int) -> float:
    n = len(table)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = (0, *cuts, n)
        best = min(best, max(table[a][b] for a, b in itertools.pairwise(edges)))
    return best


def test_monotone_bisection_cuts_as_the_full_search() -> None:
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        times = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(n)]
        table = _table(times, rng.choice([0.0, 0.5]))
        fast = balance_table(table, stages, monotone=True)
        assert fast == balance_table(table, stages)
        assert len(fast) == stages
        assert fast[0][0] == 0
        assert fast[-1][1] == n
        assert max(table[a][b] for a, b in fast) == _brute_bottleneck(table, stages)
