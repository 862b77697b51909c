"""Where each layer's decomposition is computed, and which ranks precondition its gradient.

Pure functions of sizes and the world size, so every rank derives the same answer without
talking, and the tests and the simulator can call them directly.

* :func:`greedy_placement`: each layer's cost (``n^3`` per factor for a decomposition or an
  inverse), largest first, goes to the least-loaded rank (ties to the lowest rank). This is the
  SC20 / KAISA rule; a layer's two factors stay on one rank, which MEM-OPT and HYBRID need.
* :class:`WorkerGroups`: KAISA's gradient workers. With ``grad_worker_fraction`` f on W ranks,
  the ranks form W / (f W) blocks of f W consecutive ranks. A layer's *gradient workers* are the
  block that holds its owner: they receive its decomposition and precondition its gradient.
  Every other rank receives the preconditioned gradient from the worker in the same position of
  that block (its *receiver group* is the ranks of that position in every block).
  f = 1 is COMM-OPT (decompositions to everyone, no gradient broadcast), f = 1/W is MEM-OPT (only
  the owner preconditions, then broadcasts the gradient), anything between is HYBRID.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["WorkerGroups", "decomposition_cost", "greedy_placement", "worker_count"]


def decomposition_cost(a_dim: int, g_dim: int, a_diagonal: bool = False) -> float:
    """Relative cost of decomposing a layer's factors: ``n^3`` each (a diagonal costs ``n``)."""
    return float(a_dim if a_diagonal else a_dim**3) + float(g_dim**3)


def greedy_placement(costs: Sequence[float], ranks: int) -> list[int]:
    """The rank of each item: largest cost first, onto the least-loaded rank (lowest on ties)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    loads = [0.0] * ranks
    owner = [0] * len(costs)
    # Stable on equal costs (earlier item first), so the answer depends only on the inputs.
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owner[index] = rank
        loads[rank] += costs[index]
    return owner


def rank_loads(costs: Sequence[float], owners: Sequence[int], ranks: int) -> list[float]:
    """Total cost placed on each rank."""
    loads = [0.0] * ranks
    for cost, rank in zip(costs, owners, strict=True):
        loads[rank] += cost
    return loads


def worker_count(grad_worker_fraction: float, world_size: int) -> int:
    """Gradient workers per layer for a fraction of the world; must divide the world size."""
    if not 0 < grad_worker_fraction <= 1:
        raise ValueError(
            f"grad_worker_fraction must be in (0, 1], got {grad_worker_fraction}; use 1 for "
            f"COMM-OPT, 1/world_size for MEM-OPT, or a fraction in between for HYBRID"
        )
    workers = max(1, round(grad_worker_fraction * world_size))
    if not math.isclose(workers, grad_worker_fraction * world_size, rel_tol=1e-6, abs_tol=1e-6):
        raise ValueError(
            f"grad_worker_fraction {grad_worker_fraction} of {world_size} ranks is not a whole "
            f"number of ranks; pick a fraction k/{world_size} with k dividing {world_size}"
        )
    if world_size % workers:
        raise ValueError(
            f"grad_worker_fraction {grad_worker_fraction} gives {workers} gradient workers, "
            f"which does not divide the {world_size} ranks into equal groups"
        )
    return workers


@dataclass(frozen=True)
class WorkerGroups:
    """KAISA's gradient-worker blocks and receiver groups for one world size (see module doc)."""

    world_size: int
    workers: int

    @classmethod
    def for_fraction(cls, grad_worker_fraction: float, world_size: int) -> WorkerGroups:
        return cls(world_size, worker_count(grad_worker_fraction, world_size))

    @property
    def broadcasts_decompositions(self) -> bool:
        """Decompositions travel when a layer has more than one gradient worker."""
        return self.workers > 1

    @property
    def broadcasts_gradients(self) -> bool:
        """Preconditioned gradients travel when not every rank is a gradient worker."""
        return self.workers < self.world_size

    def blocks(self) -> list[tuple[int, ...]]:
        """The gradient-worker blocks, in rank order."""
        return [
            tuple(range(start, start + self.workers))
            for start in range(0, self.world_size, self.workers)
        ]

    def receiver_groups(self) -> list[tuple[int, ...]]:
        """Ranks at the same position of every block, one group per position."""
        return [
            tuple(range(position, self.world_size, self.workers))
            for position in range(self.workers)
        ]

    def block_of(self, rank: int) -> tuple[int, ...]:
        start = rank - rank % self.workers
        return tuple(range(start, start + self.workers))

    def gradient_source(self, owner: int, rank: int) -> int:
        """The gradient worker of ``owner``'s block that sends ``rank`` the gradient."""
        return owner - owner % self.workers + rank % self.workers
