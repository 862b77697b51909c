"""KAISA's gradient workers: which ranks precondition each layer, and who sends whom its result.

Pure functions of the world size and ``grad_worker_fraction``, the same on every rank, and what
``KFAC(grad_worker_fraction=)`` accepts (kfac-pytorch's meanings).
"""

from __future__ import annotations

import enum
import math
import warnings
from dataclasses import dataclass

from interlace.checks import is_real
from interlace.errors import OptionError
from interlace.kfac.enums import DistributedStrategy, coerce_choice

__all__ = [
    "WorkerGroups",
    "asks_for_comm_opt",
    "check_grad_worker_fraction",
    "resolve_grad_worker_fraction",
    "worker_count",
]


def check_grad_worker_fraction(value: object) -> None:
    """Refuse a ``grad_worker_fraction`` that is no fraction or strategy at any world size.

    Args:
        value: What the caller passed.

    Raises:
        OptionError: Out of [0, 1], not a number, or an unknown strategy.
    """
    if value is None:
        return
    if isinstance(value, str | enum.Enum):
        coerce_choice(DistributedStrategy, value, "grad_worker_fraction")
        return
    if not (is_real(value) and math.isfinite(value) and 0 <= value <= 1):
        raise OptionError(
            "grad_worker_fraction",
            f"must be a number in [0, 1] (0: MEM-OPT) or a DistributedStrategy, got {value!r}",
        )


def resolve_grad_worker_fraction(value: object, world_size: int, stacklevel: int = 2) -> float:
    """``grad_worker_fraction`` as a fraction that gives whole, equal worker groups.

    kfac-pytorch's meanings: a :class:`DistributedStrategy` (COMM-OPT 1, HYBRID-OPT 1/2,
    MEM-OPT 1/world_size) or its string; a number in [0, 1], 0 meaning MEM-OPT, rounded to a
    whole number of workers per layer (with a warning when rounding changes it); None is 1.

    Args:
        value: What the caller passed.
        world_size: The ranks K-FAC runs on.
        stacklevel: Where a rounding warning points, counted as :func:`warnings.warn` counts
            from the caller of this function.

    Raises:
        OptionError: Out of [0, 1], not a number, or workers that do not divide the ranks.
    """
    check_grad_worker_fraction(value)
    if value is None:
        return 1.0
    if isinstance(value, str | enum.Enum):
        strategy = coerce_choice(DistributedStrategy, value, "grad_worker_fraction")
        workers = {
            DistributedStrategy.COMM_OPT: world_size,
            DistributedStrategy.HYBRID_OPT: max(1, round(world_size / 2)),
            DistributedStrategy.MEM_OPT: 1,
        }[strategy]
        if world_size % workers:
            raise OptionError(
                "grad_worker_fraction",
                f"{strategy.value} gives {workers} gradient workers, which does not divide the "
                f"{world_size} ranks; use comm-opt or mem-opt",
            )
        return workers / world_size
    assert is_real(value)
    if value == 0:
        return 1.0 / world_size
    workers = max(1, round(value * world_size))
    if world_size % workers:
        raise OptionError(
            "grad_worker_fraction",
            f"{value} gives {workers} gradient workers, which does not divide the {world_size} "
            f"ranks into equal groups; pick k/{world_size} with k dividing {world_size}",
        )
    fraction = workers / world_size
    if not math.isclose(fraction, value, rel_tol=1e-6):
        warnings.warn(
            f"grad_worker_fraction {value} of {world_size} ranks is rounded to {workers} "
            f"gradient worker(s) per layer ({fraction:g})",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
    return fraction


def asks_for_comm_opt(value: object) -> bool:
    """Whether ``grad_worker_fraction`` asks for every rank as a gradient worker (COMM-OPT).

    Args:
        value: What the caller passed (see :func:`resolve_grad_worker_fraction`).
    """
    if value is None:
        return True
    if isinstance(value, str | enum.Enum):
        return coerce_choice(DistributedStrategy, value, "grad_worker_fraction") is (
            DistributedStrategy.COMM_OPT
        )
    return value == 1


def worker_count(grad_worker_fraction: float, world_size: int) -> int:
    """Gradient workers per layer for a fraction of the world; must divide the world size.

    Args:
        grad_worker_fraction: Gradient workers per layer as a fraction of the world.
        world_size: The number of ranks.
    """
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
    """KAISA's gradient-worker blocks and receiver groups for one world size.

    With ``workers`` k on W ranks, the ranks form W / k blocks of k consecutive ranks. A layer's
    *gradient workers* are the block that holds its owner: they receive its decomposition and
    precondition its gradient. Every other rank receives the preconditioned gradient from the
    worker in the same position of that block (its *receiver group* is the ranks of that
    position in every block). k = W is COMM-OPT, k = 1 MEM-OPT, anything between HYBRID.

    Args:
        world_size: The number of ranks.
        workers: Gradient workers per layer; divides ``world_size``.
    """

    world_size: int
    workers: int

    @classmethod
    def for_fraction(cls, grad_worker_fraction: float, world_size: int) -> WorkerGroups:
        """The groups for a fraction of the world (see :func:`worker_count`).

        Args:
            grad_worker_fraction: Gradient workers per layer as a fraction of the world.
            world_size: The number of ranks.
        """
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
        """The gradient-worker block that holds ``rank``.

        Args:
            rank: A rank.
        """
        start = rank - rank % self.workers
        return tuple(range(start, start + self.workers))

    def gradient_source(self, owner: int, rank: int) -> int:
        """The gradient worker of ``owner``'s block that sends ``rank`` the gradient.

        Args:
            owner: The layer's owner.
            rank: The receiving rank.
        """
        return owner - owner % self.workers + rank % self.workers
