"""Which factors share a pipelined all-reduce bucket (SPD-KFAC's tensor fusion).

Pure functions of the factors' ready order, packed sizes and (``"merged"``) profiled ready times,
and :class:`BucketLauncher`, which launches buckets in plan order as the hooks fire.
"""

from __future__ import annotations

from collections.abc import Sequence

from interlace.comm.cost import CostModel
from interlace.comm.plan import ReadyTensor, plan_merged

__all__ = ["FUSIONS", "BucketLauncher", "fixed_groups", "make_groups", "merged_groups"]

#: Values of ``KFAC(fusion=...)``.
FUSIONS = ("none", "fixed", "merged")


def fixed_groups(sizes: Sequence[int], cap_bytes: float) -> list[list[int]]:
    """Consecutive factors (indices into the ready order) in buckets of at most ``cap_bytes``.

    A factor that would overflow a non-empty bucket starts the next one, the same rule as the
    bulk all-reduce, so a factor above the cap travels alone.

    Args:
        sizes: Each factor's bytes, in ready order.
        cap_bytes: The most bytes per bucket.
    """
    if not cap_bytes > 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {cap_bytes}")
    groups: list[list[int]] = []
    filled = 0.0
    for index, size in enumerate(sizes):
        if not groups or (filled + size > cap_bytes and groups[-1]):
            groups.append([])
            filled = 0.0
        groups[-1].append(index)
        filled += size
    return groups


def merged_groups(
    sizes: Sequence[int], ready_s: Sequence[float], cost: CostModel
) -> list[list[int]]:
    """MG-WFBP's merged buckets for factors of ``sizes`` bytes ready at ``ready_s`` seconds.

    Ready times must be in ready order (non-decreasing); they are made so (a running maximum)
    because averaged profiles can be off by rounding, and the planner insists.

    Args:
        sizes: Each factor's bytes, in ready order.
        ready_s: Each factor's ready time, seconds.
        cost: The all-reduce cost model.
    """
    if len(sizes) != len(ready_s):
        raise ValueError(f"{len(sizes)} sizes but {len(ready_s)} ready times")
    tensors = []
    latest = 0.0
    for index, (size, ready) in enumerate(zip(sizes, ready_s, strict=True)):
        latest = max(latest, float(ready))
        tensors.append(ReadyTensor(f"factor {index}", max(int(size), 1), latest))
    return plan_merged(tensors, cost).groups


def make_groups(
    fusion: str,
    sizes: Sequence[int],
    *,
    cap_bytes: float = 25 * 1024 * 1024,
    ready_s: Sequence[float] | None = None,
    cost: CostModel | None = None,
) -> list[list[int]]:
    """The buckets for ``fusion`` (one of :data:`FUSIONS`); ``"merged"`` needs times and cost.

    Args:
        fusion: One of :data:`FUSIONS`.
        sizes: Each factor's bytes, in ready order.
        cap_bytes: The bucket cap (``"fixed"``).
        ready_s: Ready times (``"merged"``).
        cost: The all-reduce cost model (``"merged"``).
    """
    if fusion == "none":
        return [[index] for index in range(len(sizes))]
    if fusion == "fixed":
        return fixed_groups(sizes, cap_bytes)
    if fusion == "merged":
        if ready_s is None or cost is None:
            raise ValueError("merged fusion needs the factors' ready times and a cost model")
        return merged_groups(sizes, ready_s, cost)
    raise ValueError(f"fusion must be one of {', '.join(FUSIONS)}, got {fusion!r}")


class BucketLauncher:
    """Decides, as factors arrive, which buckets to launch, always in plan order.

    ``groups`` partition ``range(n)`` (indices into the ready order). :meth:`add` marks one factor
    as arrived and returns the buckets (indices into ``groups``) that may now be launched: the
    next unlaunched bucket once all its factors are in, then the one after it, and so on. A factor
    added twice counts once. :meth:`rest` returns the buckets still unlaunched, for the flush.

    Args:
        groups: The buckets, as lists of indices into the ready order.
    """

    def __init__(self, groups: Sequence[Sequence[int]]) -> None:
        flat = sorted(index for group in groups for index in group)
        if flat != list(range(len(flat))) or any(not group for group in groups):
            raise ValueError("buckets must be non-empty and cover every factor exactly once")
        self.groups = [list(group) for group in groups]
        self._missing = [len(group) for group in self.groups]
        self._bucket_of = {index: number for number, group in enumerate(groups) for index in group}
        self._arrived: set[int] = set()
        self._next = 0

    @property
    def launched(self) -> int:
        """How many buckets have been launched (they are always the first ones)."""
        return self._next

    def add(self, index: int) -> list[int]:
        """Factor ``index`` is ready; the buckets to launch now, in order.

        Args:
            index: The factor's position in the ready order.
        """
        if index not in self._bucket_of:
            raise ValueError(f"factor {index} is in no bucket")
        if index in self._arrived:
            return []
        self._arrived.add(index)
        self._missing[self._bucket_of[index]] -= 1
        launch: list[int] = []
        while self._next < len(self.groups) and self._missing[self._next] == 0:
            launch.append(self._next)
            self._next += 1
        return launch

    def rest(self) -> list[int]:
        """Every bucket not launched yet (launching them all, in order, is the flush)."""
        launch = list(range(self._next, len(self.groups)))
        self._next = len(self.groups)
        return launch
