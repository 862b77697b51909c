"""Which all-reduces may go out now: a plan's launches, strictly in order, each once its bucket is
complete.

Every rank then issues the same collectives in the same order, whatever order its hooks fire in
(the condition for never deadlocking). DataParallel's bucket engine and K-FAC's factor pipeline
both launch through :class:`LaunchOrder`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["LaunchOrder"]


class LaunchOrder:
    """The launches of a plan as members of its buckets arrive.

    Args:
        groups: Each bucket's members; together they are ``0..n-1``, each in one bucket.
        order: The bucket of each launch, in launch order; a bucket may be launched in several
            pieces (slices), and every bucket at least once. Default: each bucket once, in order.

    Raises:
        ValueError: For buckets that do not partition ``0..n-1``, or an order that names an
            unknown bucket or leaves one out.
    """

    def __init__(self, groups: Sequence[Sequence[int]], order: Sequence[int] | None = None):
        flat = sorted(member for group in groups for member in group)
        if flat != list(range(len(flat))) or any(not group for group in groups):
            raise ValueError("buckets must be non-empty and cover every member exactly once")
        order = list(range(len(groups))) if order is None else list(order)
        if any(not 0 <= bucket < len(groups) for bucket in order) or set(order) != set(
            range(len(groups))
        ):
            raise ValueError("the launch order must name every bucket, and only those")
        self.groups = [list(group) for group in groups]
        self.order = order
        self._bucket_of = [0] * len(flat)
        for number, group in enumerate(groups):
            for member in group:
                self._bucket_of[member] = number
        self._sizes = [len(group) for group in groups]
        self.reset()

    def reset(self) -> None:
        """Start afresh: no member arrived, nothing launched."""
        self._missing = list(self._sizes)
        self._arrived = [False] * len(self._bucket_of)
        self._next = 0

    @property
    def launched(self) -> int:
        """How many launches went out (always the first ones of the order)."""
        return self._next

    def bucket_of(self, member: int) -> int:
        """The bucket ``member`` belongs to.

        Args:
            member: A member's index.
        """
        return self._bucket_of[member]

    def arrived(self, member: int) -> bool:
        """Whether ``member`` has arrived.

        Args:
            member: A member's index.
        """
        return self._arrived[member]

    def add(self, member: int) -> list[int]:
        """``member`` arrived; the launches (positions in the order) that may go out now.

        A member added twice counts once.

        Args:
            member: A member's index.

        Raises:
            ValueError: For a member outside ``0..n-1``.
        """
        if not 0 <= member < len(self._bucket_of):
            raise ValueError(f"member {member} is in no bucket")
        if self._arrived[member]:
            return []
        self._arrived[member] = True
        bucket = self._bucket_of[member]
        left = self._missing[bucket] = self._missing[bucket] - 1
        # Only a bucket just completed can let launches go (its members arrive once per step).
        return [] if left else self._due()

    def missing(self) -> list[int]:
        """The members that have not arrived, in index order."""
        return [member for member, arrived in enumerate(self._arrived) if not arrived]

    def rest(self) -> list[int]:
        """Every launch not out yet, as if every member had arrived (the flush)."""
        for member, arrived in enumerate(self._arrived):
            if not arrived:
                self._arrived[member] = True
                self._missing[self._bucket_of[member]] -= 1
        return self._due()

    def _due(self) -> list[int]:
        due: list[int] = []
        while self._next < len(self.order) and self._missing[self.order[self._next]] == 0:
            due.append(self._next)
            self._next += 1
        return due
