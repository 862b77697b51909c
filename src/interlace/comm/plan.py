"""What a bucket plan is: the tensors to all-reduce, the planners' names, and a :class:`Plan`'s
buckets, launches and gates with its predicted timeline.

The planners are in :mod:`interlace.comm.planners`, the pricing of a bucketing on channels in
:mod:`interlace.comm.pricing` (docs/notes/dp.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from interlace.comm.cost import CostModel

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


def check_tensors(tensors: Sequence[ReadyTensor]) -> None:
    """Check a planner's input: every tensor of size >= 1, in ready order.

    Args:
        tensors: the tensors in ready order.

    Raises:
        ValueError: naming the first tensor that is empty or out of order.
    """
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
