"""Spreading work over ranks: greedy (largest first, onto the least-loaded rank) and round-robin,
with what a layer weighs (``n^3`` decomposition work, or ``n^2`` memory).

Functions of sizes and the world size, so every rank derives the same answer without talking.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "decomposition_cost",
    "greedy_placement",
    "memory_cost",
    "rank_loads",
    "round_robin_placement",
]


def decomposition_cost(a_dim: int, g_dim: int, a_diagonal: bool = False) -> float:
    """Relative cost of decomposing a layer's factors: ``n^3`` each (a diagonal costs ``n``).

    Args:
        a_dim: Side of ``A``.
        g_dim: Side of ``G``.
        a_diagonal: Whether ``A`` is a diagonal.
    """
    return float(a_dim if a_diagonal else a_dim**3) + float(g_dim**3)


def memory_cost(a_dim: int, g_dim: int, a_diagonal: bool = False) -> float:
    """Relative memory of a layer's decompositions: ``n^2`` each (a diagonal takes ``n``).

    Args:
        a_dim: Side of ``A``.
        g_dim: Side of ``G``.
        a_diagonal: Whether ``A`` is a diagonal.
    """
    return float(a_dim if a_diagonal else a_dim**2) + float(g_dim**2)


def largest_first(costs: Sequence[float]) -> list[int]:
    """Item indices by cost, largest first; equal costs keep their order, so the answer depends
    only on the inputs.

    Args:
        costs: Each item's cost.
    """
    return sorted(range(len(costs)), key=lambda i: -costs[i])


def greedy_placement(costs: Sequence[float], ranks: int) -> list[int]:
    """The rank of each item: largest cost first, onto the least-loaded rank (lowest on ties).

    Args:
        costs: Each item's cost.
        ranks: The number of ranks.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    loads = [0.0] * ranks
    owner = [0] * len(costs)
    for index in largest_first(costs):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owner[index] = rank
        loads[rank] += costs[index]
    return owner


def rank_loads(costs: Sequence[float], owners: Sequence[int], ranks: int) -> list[float]:
    """Total cost placed on each rank.

    Args:
        costs: Each item's cost.
        owners: Each item's rank.
        ranks: The number of ranks.
    """
    loads = [0.0] * ranks
    for cost, rank in zip(costs, owners, strict=True):
        loads[rank] += cost
    return loads


def round_robin_placement(count: int, ranks: int) -> list[int]:
    """Item ``i`` on rank ``i % ranks``: the size-blind baseline.

    Args:
        count: The number of items.
        ranks: The number of ranks.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return [index % ranks for index in range(count)]
