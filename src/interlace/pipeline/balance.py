"""Cutting a sequence of block costs into contiguous stages that minimise the largest stage.

Pure arithmetic, shared by :mod:`interlace.pipeline.partition` and the simulator (no torch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["balance_spans", "balance_stages", "balance_table", "check_num_stages"]


def check_num_stages(num_stages: int, num_blocks: int) -> None:
    """Raise unless ``num_blocks`` blocks can be cut into ``num_stages`` non-empty stages.

    Args:
        num_stages: The stages asked for.
        num_blocks: The blocks there are.

    Raises:
        ValueError: For fewer than one stage, or more stages than blocks.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > num_blocks:
        raise ValueError(
            f"cannot cut {num_blocks} block(s) into {num_stages} non-empty stages; use at most "
            f"{num_blocks} stages or split the model into finer blocks"
        )


def balance_stages(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Cut ``costs`` into ``num_stages`` contiguous non-empty ``[start, end)`` ranges.

    The cut minimises the largest stage sum exactly. Among cuts that reach that minimum, each stage
    in turn takes as many blocks as it can (the one whose end positions are lexicographically
    largest). The rule is deterministic, and it leaves the last stage, which also computes the loss
    that no block cost includes, no heavier than it needs to be.

    Dynamic programming over suffixes, ``O(num_stages * len(costs) ** 2)``: instant for the tens to
    hundreds of blocks a model is cut into. Stage sums are always differences of the same prefix
    sums, so the optimum and the tie-breaking compare identical floating-point values.

    Args:
        costs: the cost of each block, in order (finite, >= 0).
        num_stages: how many stages to cut into (1 to len(costs)).

    Raises :class:`ValueError` when ``num_stages < 1``, ``num_stages > len(costs)``, or a cost is
    negative or not finite.
    """
    n = len(costs)
    check_num_stages(num_stages, n)
    values = [float(c) for c in costs]
    for index, value in enumerate(values):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"block costs must be finite and >= 0, got {value} at index {index}")
    prefix = [0.0]
    for value in values:
        prefix.append(prefix[-1] + value)

    def span(start: int, end: int) -> float:
        return prefix[end] - prefix[start]

    return balance_spans(span, n, num_stages)


def balance_spans(
    stage_cost: Callable[[int, int], float], num_blocks: int, num_stages: int
) -> list[tuple[int, int]]:
    """Cut ``num_blocks`` blocks into ``num_stages`` stages minimising the largest stage cost.

    :func:`balance_stages` for a stage cost that need not be a sum of block costs (a stage's
    all-reduce pays one start-up however many blocks it holds). ``stage_cost(start, end)`` must
    be deterministic; the minimum is exact and the tie-breaking that of :func:`balance_stages`.

    Args:
        stage_cost: The cost of the stage holding blocks ``[start, end)``.
        num_blocks: The blocks there are.
        num_stages: How many stages to cut into (1 to num_blocks).

    Raises:
        ValueError: When ``num_stages`` is not in 1..num_blocks.
    """
    n = num_blocks
    check_num_stages(num_stages, n)
    inf = math.inf
    table = [[inf] * (i + 1) + [stage_cost(i, j) for j in range(i + 1, n + 1)] for i in range(n)]
    return balance_table(table, num_stages)


def balance_table(
    table: Sequence[Sequence[float]], num_stages: int, *, monotone: bool = False
) -> list[tuple[int, int]]:
    """:func:`balance_spans` on its stage costs priced already (for a caller that prices a
    whole row at once).

    Args:
        table: ``table[i][j]``, for ``0 <= i < j <= n``, the cost of the stage holding blocks
            ``[i, j)``; entries with ``j <= i`` are never read (``math.inf`` by convention).
        num_stages: How many stages to cut into (1 to ``n``, the rows).
        monotone: The costs never fall as a stage gains blocks at either end (``table[i][j]``
            non-decreasing in ``j`` and non-increasing in ``i``, as for sums of non-negative
            block costs): each minimum is then found by bisection, to the same value.

    Raises:
        ValueError: When ``num_stages`` is not in 1..n.
    """
    n = len(table)
    check_num_stages(num_stages, n)
    inf = math.inf
    # best[m][i]: the smallest possible largest stage cost when [i, n) is cut into m stages
    # (inf where fewer than m blocks remain).
    best: list[list[float]] = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    for i in range(n):
        best[1][i] = table[i][n]
    for m in range(2, num_stages + 1):
        rest = best[m - 1]
        for i in range(n - m + 1):
            if monotone:
                best[m][i] = _least_max(table[i], rest, i + 1, n - m + 2)
            else:
                best[m][i] = min(map(max, table[i][i + 1 : n - m + 2], rest[i + 1 : n - m + 2]))
    bottleneck = best[num_stages][0]

    bounds: list[tuple[int, int]] = []
    start = 0
    for stage in range(num_stages - 1):
        remaining = num_stages - stage - 1
        end = max(
            j
            for j in range(start + 1, n - remaining + 1)
            if table[start][j] <= bottleneck and best[remaining][j] <= bottleneck
        )
        bounds.append((start, end))
        start = end
    bounds.append((start, n))
    return bounds


def _least_max(rising: Sequence[float], falling: Sequence[float], low: int, high: int) -> float:
    """``min(max(rising[j], falling[j]) for j in range(low, high))`` where ``rising`` never
    falls and ``falling`` never rises over the range: the least is at the first ``j`` where
    ``rising`` reaches ``falling``, or just before it."""
    first, last = low, high
    while first < last:
        middle = (first + last) // 2
        if rising[middle] >= falling[middle]:
            last = middle
        else:
            first = middle + 1
    found = [rising[first]] if first < high else []  # max there: rising
    if first > low:
        found.append(falling[first - 1])  # max just before: falling
    return min(found)
