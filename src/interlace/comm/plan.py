"""Bucket planners: pure functions from (tensors in ready order, cost model) to buckets.

WFBP, DDP/Horovod's fixed caps, SyncEASGD, MG-WFBP's merge (Theorem 1's, and its authors'
simulator's pairwise one) and the exact optimum, and
:func:`schedule`, which prices any bucketing on one or several channels (docs/notes/dp.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from interlace.comm.cost import CostModel
from interlace.comm.pairwise import pairwise_groups

#: The unit of every bucket cap given in "MB" (``bucket_cap_mb`` and its kin): a MiB, as torch
#: DDP counts its ``bucket_cap_mb``.
MIB = 1024 * 1024


class Bucketing(str, Enum):
    """The bucket planners by name; wherever a bucketing is named, a member or its string works."""

    #: MG-WFBP's optimal merge (Theorem 1).
    MERGED = "merged"
    #: WFBP: one all-reduce per tensor as soon as it is ready.
    PER_TENSOR = "per-tensor"
    #: DDP and Horovod: tensors packed in ready order up to a byte cap.
    FIXED = "fixed"
    #: SyncEASGD: one all-reduce of everything after backward.
    SINGLE = "single"
    #: The exact best contiguous bucketing under the cost model (dynamic programming).
    OPTIMAL = "optimal"
    #: The greedy pairwise merge of MG-WFBP's published simulator (:mod:`interlace.comm.pairwise`).
    PAIRWISE = "pairwise"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ReadyTensor:
    """A tensor to all-reduce: its name, size in bytes, and when backward makes it ready."""

    name: str
    nbytes: int
    ready_s: float


@dataclass(frozen=True)
class Bucket:
    """Tensors (indices into the ready order) sent in one all-reduce, and when it runs."""

    indices: tuple[int, ...]
    nbytes: int
    ready_s: float
    start_s: float
    end_s: float
    channels: tuple[int, ...] = (0,)
    """The channel of each slice: one entry unless the bucket is partitioned."""


@dataclass(frozen=True)
class Launch:
    """One all-reduce the runtime issues: part ``part`` of ``parts`` equal slices of a bucket.

    Args:
        bucket: The bucket's index in :attr:`Plan.buckets`.
        part: Which slice (from 0).
        parts: How many slices the bucket is cut into.
        nbytes: The slice's bytes.
        channel: The channel it travels on.
        start_s: When it is predicted to start.
        end_s: When it is predicted to end.
    """

    bucket: int
    part: int
    parts: int
    nbytes: int
    channel: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Gate:
    """A point of the next forward that waits for parameters: a layer about to run.

    Args:
        name: What the gate stands for (a module's name).
        tensors: The tensors it waits for, as indices into the plan's ready order.
        forward_s: Compute from this gate to the next one (the last: to the end of forward).
    """

    name: str
    tensors: tuple[int, ...]
    forward_s: float


@dataclass(frozen=True)
class Plan:
    """A bucketing with its predicted timeline on ``channels`` channels.

    Times are seconds from the start of backward. A plan without gates finishes its
    all-reduces inside the iteration: ``predicted_s`` is forward + backward and the last
    all-reduce (excluding the optimizer step). A plan with ``gates`` lets them run on into the
    next forward, which waits at each gate for its tensors' buckets and applies their update
    there (``step_s`` spread by bytes): ``predicted_s`` is then the whole period from one
    backward's start to the next, updates included.
    """

    strategy: str
    buckets: tuple[Bucket, ...]
    backward_s: float
    forward_s: float
    cost: CostModel
    tensors: tuple[ReadyTensor, ...] = ()
    channels: int = 1
    partition_bytes: float | None = None
    launches: tuple[Launch, ...] = ()
    """Every all-reduce in the order the runtime issues them."""
    gates: tuple[Gate, ...] = ()
    """The next forward's gates, in forward order (none: the all-reduces end in backward)."""
    step_s: float = 0.0
    """The optimizer step (the updates applied at the gates, in a plan that has them)."""
    forward_end_s: float = 0.0
    """With gates: when the next forward is predicted to end, seconds from backward's start."""

    def __post_init__(self) -> None:
        if self.buckets and not self.launches:
            # Each bucket's slices at once, bucket after bucket: how a plan without a launch
            # order of its own is sent.
            launches = tuple(
                Launch(
                    number, part, len(bucket.channels), size, channel, bucket.start_s, bucket.end_s
                )
                for number, bucket in enumerate(self.buckets)
                for part, (channel, size) in enumerate(
                    zip(
                        bucket.channels,
                        slice_sizes(bucket.nbytes, len(bucket.channels)),
                        strict=True,
                    )
                )
            )
            object.__setattr__(self, "launches", launches)

    @property
    def overlaps_forward(self) -> bool:
        """Whether the all-reduces run on into the next forward (the plan has gates)."""
        return bool(self.gates)

    @property
    def comm_end_s(self) -> float:
        """When the last all-reduce ends (0 with nothing to send)."""
        return max((bucket.end_s for bucket in self.buckets), default=0.0)

    @property
    def predicted_s(self) -> float:
        """Without gates: forward + the later of the end of backward and the end of the last
        all-reduce. With gates: the period from one backward's start to the next."""
        if self.overlaps_forward:
            return self.forward_end_s
        return self.forward_s + max(self.backward_s, self.comm_end_s)

    @property
    def iteration_s(self) -> float:
        """The predicted iteration with its optimizer step, comparable across both kinds."""
        return self.predicted_s if self.overlaps_forward else self.predicted_s + self.step_s

    @property
    def groups(self) -> list[list[int]]:
        return [list(bucket.indices) for bucket in self.buckets]

    def describe(self) -> str:
        """A readable table of the buckets and the predicted time."""
        cost = f"cost a={self.cost.a * 1e6:.1f} us, b={self.cost.b * 1e9:.3f} ns/byte"
        if self.overlaps_forward:
            head = (
                f"{self.strategy} plan: {len(self.buckets)} bucket(s) in {len(self.launches)} "
                f"all-reduce(s) that run on into the next forward ({len(self.gates)} gates), "
                f"predicted iteration {self.predicted_s * 1e3:.2f} ms (backward "
                f"{self.backward_s * 1e3:.2f} ms, next forward ends "
                f"{self.forward_end_s * 1e3:.2f} ms after backward's start, updates included; "
                f"{cost})"
            )
        else:
            head = (
                f"{self.strategy} plan: {len(self.buckets)} bucket(s), predicted iteration "
                f"{self.predicted_s * 1e3:.2f} ms (forward {self.forward_s * 1e3:.2f} ms, backward "
                f"{self.backward_s * 1e3:.2f} ms, last all-reduce ends "
                f"{self.comm_end_s * 1e3:.2f} ms into backward; {cost})"
            )
        split = (
            "off" if self.partition_bytes is None else f"above {self.partition_bytes / 1e6:g} MB"
        )
        lines = [
            head,
            f"{self.channels} channel(s), partition {split}",
            f"{'bucket':>6}  {'tensors':>7}  {'MB':>9}  {'ready ms':>9}  {'start ms':>9}  "
            f"{'end ms':>9}  {'channels':>8}  first..last",
        ]
        for number, bucket in enumerate(self.buckets):
            first, last = bucket.indices[0], bucket.indices[-1]
            span = (
                f"{self.tensors[first].name}..{self.tensors[last].name}"
                if self.tensors
                else f"{first}..{last}"
            )
            lines.append(
                f"{number:>6}  {len(bucket.indices):>7}  {bucket.nbytes / 1e6:>9.3f}  "
                f"{bucket.ready_s * 1e3:>9.2f}  {bucket.start_s * 1e3:>9.2f}  "
                f"{bucket.end_s * 1e3:>9.2f}  {','.join(map(str, bucket.channels)):>8}  {span}"
            )
        if self.overlaps_forward:
            order = " ".join(
                f"{launch.bucket}" + (f".{launch.part}" if launch.parts > 1 else "")
                for launch in self.launches
            )
            lines.append(f"launch order (bucket.slice): {order}")
        return "\n".join(lines)


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
    _check_tensors(tensors)
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


def slice_count(nbytes: int, channels: int, partition_bytes: float | None) -> int:
    """How many slices a bucket of ``nbytes`` is cut into: one per started ``partition_bytes``,
    at most one per channel; the runtime cuts the same way.

    Args:
        nbytes: the bucket's size.
        channels: channels available.
        partition_bytes: the partition threshold (None: never split).
    """
    if partition_bytes is None or channels == 1 or nbytes <= partition_bytes:
        return 1
    return min(channels, math.ceil(nbytes / partition_bytes))


def slice_sizes(nbytes: int, count: int) -> list[int]:
    """Bytes of each of ``count`` slices of a bucket (the first ``nbytes % count`` one more).

    Args:
        nbytes: the bucket's size.
        count: how many slices.
    """
    return [nbytes // count + (1 if k < nbytes % count else 0) for k in range(count)]


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


def plan_per_tensor(
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    backward_s: float | None = None,
    forward_s: float = 0.0,
    *,
    channels: int = 1,
    partition_bytes: float | None = None,
) -> Plan:
    """WFBP: one all-reduce per tensor, launched as soon as it is ready.

    Args:
        tensors: the tensors in ready order.
        cost: the price of an all-reduce.
        backward_s: when backward ends (default: when the last tensor is ready).
        forward_s: the forward pass, added to the predicted iteration time.
        channels: channels the buckets are priced on.
        partition_bytes: buckets above this are split across channels (None: never).
    """
    groups = [[i] for i in range(len(tensors))]
    return schedule(
        groups,
        tensors,
        cost,
        backward_s=backward_s,
        forward_s=forward_s,
        strategy=Bucketing.PER_TENSOR.value,
        channels=channels,
        partition_bytes=partition_bytes,
    )


def plan_single(
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    backward_s: float | None = None,
    forward_s: float = 0.0,
    *,
    channels: int = 1,
    partition_bytes: float | None = None,
) -> Plan:
    """SyncEASGD: everything in one all-reduce after the whole backward pass.

    Args:
        tensors: the tensors in ready order.
        cost: the price of an all-reduce.
        backward_s: when backward ends (default: when the last tensor is ready).
        forward_s: the forward pass, added to the predicted iteration time.
        channels: channels the buckets are priced on.
        partition_bytes: buckets above this are split across channels (None: never).
    """
    groups = [list(range(len(tensors)))] if tensors else []
    return schedule(
        groups,
        tensors,
        cost,
        backward_s=backward_s,
        forward_s=forward_s,
        strategy=Bucketing.SINGLE.value,
        channels=channels,
        partition_bytes=partition_bytes,
    )


def pack_by_cap(
    sizes: Sequence[int], cap_bytes: float, first_cap_bytes: float | None = None
) -> list[list[int]]:
    """Consecutive items packed into buckets: a bucket is closed once it holds ``cap_bytes``.

    DDP's rule (and Horovod's): the item that reaches the cap still joins the bucket, so one
    item larger than the cap travels alone or with the small ones before it. Every bucket
    packer of interlace (DataParallel's ``fixed`` buckets, K-FAC's factor buckets) uses it.

    Args:
        sizes: each item's bytes, in order.
        cap_bytes: a bucket is closed once it holds this many bytes.
        first_cap_bytes: the first bucket's cap (None: ``cap_bytes``); DDP starts with 1 MB so
            communication begins early.

    Raises:
        ValueError: for a cap that is not positive.
    """
    for cap in (cap_bytes, first_cap_bytes):
        if cap is not None and not cap > 0:
            raise ValueError(f"bucket cap must be > 0 bytes, got {cap}")
    groups: list[list[int]] = []
    current: list[int] = []
    filled = 0.0
    for index, size in enumerate(sizes):
        current.append(index)
        filled += size
        limit = first_cap_bytes if (first_cap_bytes is not None and not groups) else cap_bytes
        if filled >= limit:
            groups.append(current)
            current, filled = [], 0.0
    if current:
        groups.append(current)
    return groups


def plan_fixed(
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    cap_bytes: float,
    first_cap_bytes: float | None = None,
    *,
    backward_s: float | None = None,
    forward_s: float = 0.0,
    channels: int = 1,
    partition_bytes: float | None = None,
) -> Plan:
    """DDP/Horovod: fill a bucket in ready order and close it once it holds ``cap_bytes``.

    ``first_cap_bytes`` caps the first bucket alone (DDP uses 1 MB there so communication starts
    early).

    Args:
        tensors: the tensors in ready order.
        cost: the price of an all-reduce.
        cap_bytes: a bucket is closed once it holds this many bytes.
        first_cap_bytes: the first bucket's cap (None: ``cap_bytes``).
        backward_s: when backward ends (default: when the last tensor is ready).
        forward_s: the forward pass, added to the predicted iteration time.
        channels: channels the buckets are priced on.
        partition_bytes: buckets above this are split across channels (None: never).

    Raises:
        ValueError: for a cap that is not positive.
    """
    return schedule(
        pack_by_cap([tensor.nbytes for tensor in tensors], cap_bytes, first_cap_bytes),
        tensors,
        cost,
        backward_s=backward_s,
        forward_s=forward_s,
        strategy=Bucketing.FIXED.value,
        channels=channels,
        partition_bytes=partition_bytes,
    )


def plan_merged(
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    backward_s: float | None = None,
    forward_s: float = 0.0,
    *,
    channels: int = 1,
    partition_bytes: float | None = None,
) -> Plan:
    """MG-WFBP's optimal merge (Theorem 1), in one pass over the ready order.

    Walking from the first-ready tensor: with the current group closed at tensor ``i``, its
    all-reduce would start at ``tau_c = max(channel free, ready[i])``. The next tensor joins the
    group exactly when ``ready[i+1] < tau_c + a``: it is ready before that all-reduce could even
    pay its start-up, so merging saves ``a`` while delaying the group by less than ``a``.
    Otherwise the group is sent and the next tensor starts a new one.

    With several channels, "could start" is when the first channel frees up (the same
    :class:`ChannelClock` that prices the plan): start-ups on idle channels overlap, so fewer
    merges pay. The greedy rule was derived for one channel, so the result is also compared with
    the one-channel bucketing, per-tensor buckets and a single bucket, all priced on the same
    channels, and the fastest is kept.

    Args:
        tensors: the tensors in ready order.
        cost: the price of an all-reduce.
        backward_s: when backward ends (default: when the last tensor is ready).
        forward_s: the forward pass, added to the predicted iteration time.
        channels: channels the buckets are priced on.
        partition_bytes: buckets above this are split across channels (None: never).
    """
    _check_tensors(tensors)
    groups = _merge_greedily(tensors, cost, channels, partition_bytes)
    candidates = [groups]
    if channels > 1:
        candidates.append(_merge_greedily(tensors, cost, 1, None))
        candidates.append([[i] for i in range(len(tensors))])
        candidates.append([list(range(len(tensors)))] if tensors else [])
    plans = [
        schedule(
            candidate,
            tensors,
            cost,
            backward_s=backward_s,
            forward_s=forward_s,
            strategy=Bucketing.MERGED.value,
            channels=channels,
            partition_bytes=partition_bytes,
        )
        for candidate in candidates
    ]
    # min keeps the first of equals: the greedy rule's own plan unless another is faster.
    return min(plans, key=lambda plan: plan.predicted_s)


def _merge_greedily(
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    channels: int,
    partition_bytes: float | None,
) -> list[list[int]]:
    groups: list[list[int]] = []
    if not tensors:
        return groups
    clock = ChannelClock(cost, channels, partition_bytes)
    current = [0]
    current_bytes = tensors[0].nbytes
    for index in range(len(tensors) - 1):
        start = clock.earliest_start(tensors[index].ready_s)
        following = tensors[index + 1]
        if following.ready_s < start + cost.a:
            current.append(index + 1)
            current_bytes += following.nbytes
        else:
            clock.place(tuple(current), current_bytes, tensors[index].ready_s)
            groups.append(current)
            current, current_bytes = [index + 1], following.nbytes
    groups.append(current)
    return groups


def plan_pairwise(
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    backward_s: float | None = None,
    forward_s: float = 0.0,
    *,
    channels: int = 1,
    partition_bytes: float | None = None,
) -> Plan:
    """The MG-WFBP authors' simulator's greedy pairwise merge
    (:func:`~interlace.comm.pairwise.pairwise_groups`), priced by :func:`schedule`.

    The rule decides on one channel's timeline; on several, its groups are priced there as
    they are.

    Args:
        tensors: the tensors in ready order.
        cost: the price of an all-reduce.
        backward_s: when backward ends (default: when the last tensor is ready).
        forward_s: the forward pass, added to the predicted iteration time.
        channels: channels the buckets are priced on.
        partition_bytes: buckets above this are split across channels (None: never).
    """
    _check_tensors(tensors)
    groups = pairwise_groups([t.nbytes for t in tensors], [t.ready_s for t in tensors], cost)
    return schedule(
        groups,
        tensors,
        cost,
        backward_s=backward_s,
        forward_s=forward_s,
        strategy=Bucketing.PAIRWISE.value,
        channels=channels,
        partition_bytes=partition_bytes,
    )


def plan_optimal(
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    *,
    backward_s: float | None = None,
    forward_s: float = 0.0,
    channels: int = 1,
) -> Plan:
    """The bucketing into contiguous groups that :func:`schedule` prices fastest, exactly.

    On one channel the end of a group's all-reduce depends on the earlier groups only through
    when the channel became free, and ends later whenever that is later; so the best way to send
    the first ``j`` tensors extends the best way to send some shorter prefix. Dynamic programming
    over prefixes then finds the minimum in ``O(L^2)``. MG-WFBP's greedy rule is optimal under
    the paper's assumptions; this is the reference it can be checked against, and it is never
    slower under the model than any other planner here.

    That argument holds on one channel only (with several, a later bucket can overtake on another
    channel), so ``channels > 1`` is refused rather than answered inexactly.

    Args:
        tensors: the tensors in ready order.
        cost: the price of an all-reduce.
        backward_s: when backward ends (default: when the last tensor is ready).
        forward_s: the forward pass, added to the predicted iteration time.
        channels: must be 1.

    Raises:
        ValueError: for more than one channel.
    """
    if channels != 1:
        raise ValueError(
            "the optimal planner is exact on one channel only; use the merged planner with "
            f"channels={channels}"
        )
    _check_tensors(tensors)
    count = len(tensors)
    prefix_bytes = [0]
    for tensor in tensors:
        prefix_bytes.append(prefix_bytes[-1] + tensor.nbytes)
    best_end = [0.0] + [float("inf")] * count
    best_cut = [0] * (count + 1)
    # cost.time(m) of one all-reduce of m >= 1 bytes, inlined: this loop is O(L^2).
    a, b = cost.a, cost.b
    for end in range(1, count + 1):
        ready = tensors[end - 1].ready_s
        total = prefix_bytes[end]
        for begin in range(end):
            previous = best_end[begin]
            finish = (
                (previous if previous > ready else ready) + a + b * (total - prefix_bytes[begin])
            )
            if finish < best_end[end]:
                best_end[end], best_cut[end] = finish, begin
    groups: list[list[int]] = []
    end = count
    while end > 0:
        groups.append(list(range(best_cut[end], end)))
        end = best_cut[end]
    groups.reverse()
    return schedule(
        groups,
        tensors,
        cost,
        backward_s=backward_s,
        forward_s=forward_s,
        strategy=Bucketing.OPTIMAL.value,
    )


def make_plan(
    strategy: Bucketing | str,
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    *,
    cap_bytes: float = 25e6,
    first_cap_bytes: float | None = None,
    backward_s: float | None = None,
    forward_s: float = 0.0,
    channels: int = 1,
    partition_bytes: float | None = None,
) -> Plan:
    """Plan with the planner named ``strategy``.

    Args:
        strategy: a :class:`Bucketing` or its string.
        tensors: the tensors in ready order.
        cost: the price of an all-reduce.
        cap_bytes: the cap of ``fixed`` buckets.
        first_cap_bytes: the first ``fixed`` bucket's cap (None: ``cap_bytes``).
        backward_s: when backward ends (default: when the last tensor is ready).
        forward_s: the forward pass, added to the predicted iteration time.
        channels: channels the buckets are priced on.
        partition_bytes: buckets above this are split across channels (None: never).

    Raises:
        ValueError: for an unknown planner name.
    """
    try:
        bucketing = Bucketing(strategy)
    except ValueError:
        raise ValueError(
            f"unknown bucketing strategy '{strategy}'; choose one of "
            f"{', '.join(member.value for member in Bucketing)}"
        ) from None
    if bucketing is Bucketing.OPTIMAL:
        return plan_optimal(
            tensors, cost, backward_s=backward_s, forward_s=forward_s, channels=channels
        )
    if bucketing is Bucketing.FIXED:
        return plan_fixed(
            tensors,
            cost,
            cap_bytes,
            first_cap_bytes,
            backward_s=backward_s,
            forward_s=forward_s,
            channels=channels,
            partition_bytes=partition_bytes,
        )
    planners = {
        Bucketing.PER_TENSOR: plan_per_tensor,
        Bucketing.SINGLE: plan_single,
        Bucketing.MERGED: plan_merged,
        Bucketing.PAIRWISE: plan_pairwise,
    }
    return planners[bucketing](
        tensors,
        cost,
        backward_s=backward_s,
        forward_s=forward_s,
        channels=channels,
        partition_bytes=partition_bytes,
    )


def _check_tensors(tensors: Sequence[ReadyTensor]) -> None:
    previous = 0.0
    for tensor in tensors:
        if tensor.nbytes < 1:
            # Every all-reduce pays its start-up; an empty tensor is never sent, so never planned.
            raise ValueError(f"tensor {tensor.name} has size {tensor.nbytes}; sizes must be >= 1")
        if tensor.ready_s < previous:
            raise ValueError(
                f"tensors must come in ready order; {tensor.name} is ready at "
                f"{tensor.ready_s} s, before its predecessor ({previous} s)"
            )
        previous = tensor.ready_s


def _check_groups(groups: Sequence[Sequence[int]], count: int) -> None:
    flat = [index for group in groups for index in group]
    if sorted(flat) != list(range(count)) or any(not group for group in groups):
        raise ValueError("buckets must be non-empty and cover every tensor exactly once")
