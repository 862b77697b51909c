"""Pricing a bucketing: :func:`schedule` places each bucket's all-reduce (or its slices) on the
channels free first with a :class:`ChannelClock`, and returns the :class:`~interlace.comm.plan.Plan`
with its predicted timeline (docs/notes/dp.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from interlace.comm.cost import CostModel
from interlace.comm.plan import (
    Bucket,
    Launch,
    Plan,
    ReadyTensor,
    check_tensors,
    slice_count,
    slice_sizes,
)


def schedule(
    groups: Sequence[Sequence[int]],
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    *,
    backward_s: float | None = None,
    forward_s: float = 0.0,
    strategy: str = "custom",
    channels: int = 1,
    partition_bytes: float | None = None,
) -> Plan:
    """Price a bucketing: buckets are launched in order, each when its last tensor is ready, on
    the channel(s) free first; one channel runs its all-reduces one after another.

    Args:
        groups: the buckets, as indices into ``tensors``, in launch order; together they cover
            every tensor once.
        tensors: the tensors in ready order.
        cost: the price of an all-reduce.
        backward_s: when backward ends (default: when the last tensor is ready).
        forward_s: the forward pass, added to the predicted iteration time.
        strategy: the name the plan carries.
        channels: channels the buckets are priced on.
        partition_bytes: buckets above this are split across channels (None: never).

    Raises:
        ValueError: for tensors out of ready order or of size 0, groups that do not cover them, or
            ``backward_s`` before the last tensor is ready.
    """
    check_tensors(tensors)
    _check_groups(groups, len(tensors))
    end_of_backward = max((t.ready_s for t in tensors), default=0.0)
    if backward_s is None:
        backward_s = end_of_backward
    elif backward_s < end_of_backward:
        raise ValueError(
            f"backward_s={backward_s} is before the last tensor is ready ({end_of_backward})"
        )
    clock = ChannelClock(cost, channels, partition_bytes)
    buckets: list[Bucket] = []
    launches: list[Launch] = []
    for number, group in enumerate(groups):
        nbytes = sum(tensors[i].nbytes for i in group)
        pieces = clock.place_slices(nbytes, max(tensors[i].ready_s for i in group))
        launches += [
            Launch(
                number, part, len(pieces), piece.nbytes, piece.channel, piece.start_s, piece.end_s
            )
            for part, piece in enumerate(pieces)
        ]
        buckets.append(
            bucket_of(tuple(group), nbytes, max(tensors[i].ready_s for i in group), pieces)
        )
    return Plan(
        strategy,
        tuple(buckets),
        backward_s,
        forward_s,
        cost,
        tuple(tensors),
        channels,
        partition_bytes,
        launches=tuple(launches),
    )


#: Times closer than this are one instant: sums of float seconds differ in the last bits.
_SAME_INSTANT_S = 1e-12


class ChannelClock:
    """The communication timeline of ``channels`` channels, built one bucket at a time.

    Launch order is plan order: a bucket goes out once it is ready and every earlier bucket has
    gone out. Its slices take the channels predicted to be free first (ties: the lowest index,
    so every rank computes the same assignment); a slice starts when its channel is free and
    lasts ``a_j + c_j * b * m`` for ``j`` all-reduces in flight at its start (itself and any
    starting at the same instant included). Earlier ones are not
    slowed after the fact: the newcomer pays for the sharing, so the total stays right for a
    shared link while start-ups still overlap.

    Args:
        cost: the price of an all-reduce, alone and concurrent.
        channels: how many channels.
        partition_bytes: buckets above this are split across channels (None: never).

    Raises:
        ValueError: for ``channels < 1`` or a threshold that is not positive.
    """

    def __init__(self, cost: CostModel, channels: int = 1, partition_bytes: float | None = None):
        if channels < 1:
            raise ValueError(f"channels must be >= 1, got {channels}")
        if partition_bytes is not None and not partition_bytes > 0:
            raise ValueError(f"partition_bytes must be > 0 (or None), got {partition_bytes}")
        self.cost = cost
        self.channels = channels
        self.partition_bytes = partition_bytes
        self.free = [0.0] * channels
        self.launched = 0.0
        self._flights: list[tuple[float, float]] = []

    def earliest_start(self, ready_s: float) -> float:
        """When a bucket ready at ``ready_s`` could start if it were sent next.

        Args:
            ready_s: when the bucket's last tensor is ready.
        """
        return max(self.launched, ready_s, min(self.free))

    def place(self, indices: tuple[int, ...], nbytes: int, ready_s: float) -> Bucket:
        """Send the next bucket; returns it with its predicted start, end and channels.

        Args:
            indices: the bucket's tensors, as indices into the ready order.
            nbytes: its size.
            ready_s: when its last tensor is ready.
        """
        return bucket_of(indices, nbytes, ready_s, self.place_slices(nbytes, ready_s))

    def place_slices(
        self, nbytes: int, ready_s: float, count: int | None = None
    ) -> list[PlacedSlice]:
        """Send the next bucket's slices at once; returns each with its channel and times.

        Args:
            nbytes: the bucket's size.
            ready_s: when its last tensor is ready.
            count: how many slices (default: :func:`slice_count` of the partition threshold).
        """
        self.launched = max(self.launched, ready_s)
        if count is None:
            count = slice_count(nbytes, self.channels, self.partition_bytes)
        if self.channels == 1 and count == 1:
            # One channel runs one all-reduce at a time: nothing else is ever in flight.
            start = max(self.launched, self.free[0])
            end = start + self.cost.time(nbytes)
            self.free[0] = end
            self._flights = [(start, end)] if end > self.launched else []
            return [PlacedSlice(0, nbytes, start, end)]
        chosen = sorted(range(self.channels), key=lambda c: (self.free[c], c))[:count]
        sizes = slice_sizes(nbytes, count)
        starts = [max(self.launched, self.free[c]) for c in chosen]
        ends = [0.0] * count
        placed: set[int] = set()
        # Slices in order of start; each counts what is in flight when it starts: earlier
        # buckets' all-reduces, siblings already running, and siblings starting at that instant.
        for k in sorted(range(count), key=lambda k: (starts[k], k)):
            start = starts[k]
            # Up to rounding, one ending at this very instant is no longer in flight and one
            # starting at this instant is.
            in_flight = sum(
                1
                for begin, end in self._flights
                if begin <= start + _SAME_INSTANT_S and start < end - _SAME_INSTANT_S
            )
            starting = sum(
                1
                for other in range(count)
                if other != k
                and other not in placed
                and abs(starts[other] - start) <= _SAME_INSTANT_S
            )
            ends[k] = start + self.cost.time(sizes[k], 1 + in_flight + starting)
            self._flights.append((start, ends[k]))
            placed.add(k)
        for channel, end in zip(chosen, ends, strict=True):
            self.free[channel] = end
        # Later slices start at or after this launch: what ended before it can no longer overlap.
        self._flights = [flight for flight in self._flights if flight[1] > self.launched]
        return [
            PlacedSlice(channel, size, start, end)
            for channel, size, start, end in zip(chosen, sizes, starts, ends, strict=True)
        ]


@dataclass(frozen=True)
class PlacedSlice:
    """A slice :class:`ChannelClock` placed: its channel, bytes, start and end."""

    channel: int
    nbytes: int
    start_s: float
    end_s: float


def bucket_of(
    indices: tuple[int, ...], nbytes: int, ready_s: float, pieces: Sequence[PlacedSlice]
) -> Bucket:
    """The bucket whose slices were placed as ``pieces``: from the first start to the last end.

    Args:
        indices: its tensors, as indices into the ready order.
        nbytes: its size.
        ready_s: when its last tensor is ready.
        pieces: its slices.
    """
    return Bucket(
        indices,
        nbytes,
        ready_s,
        min(piece.start_s for piece in pieces),
        max(piece.end_s for piece in pieces),
        tuple(piece.channel for piece in pieces),
    )


def _check_groups(groups: Sequence[Sequence[int]], count: int) -> None:
    flat = [index for group in groups for index in group]
    if sorted(flat) != list(range(count)) or any(not group for group in groups):
        raise ValueError("buckets must be non-empty and cover every tensor exactly once")
