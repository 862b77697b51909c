"""Bucket planners: pure functions from (tensors in ready order, cost model) to buckets.

A planner decides which gradients travel together. Its input is what a profiled backward pass
shows: tensors in the order they become ready, each with its size and the time (from the start of
backward) at which it is ready. Four rules, from the literature:

- ``per-tensor`` (WFBP): every tensor all-reduced alone as soon as it is ready;
- ``fixed`` (PyTorch DDP, Horovod): tensors packed in ready order until a byte cap is reached;
- ``single`` (SyncEASGD): one all-reduce of everything after backward;
- ``merged`` (MG-WFBP, Shi et al., TPDS 2021, Theorem 1): merge a tensor into the next one
  exactly when the next is ready before this one's all-reduce could start plus one start-up
  ``a``: merging then saves a start-up for at most as much waiting.

:func:`schedule` prices a bucketing on one communication channel (all-reduces run one after
another, each as soon as its bucket is full and the channel is free). The runtime, the simulator
and the K-FAC factor fusion all use these same functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from interlace.comm.cost import CostModel

STRATEGIES = ("per-tensor", "fixed", "single", "merged", "optimal")


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


@dataclass(frozen=True)
class Plan:
    """A bucketing with its predicted timeline on one channel.

    Times are seconds from the start of backward; ``predicted_s`` adds the forward pass, so it
    is the predicted iteration time (excluding the optimizer step).
    """

    strategy: str
    buckets: tuple[Bucket, ...]
    backward_s: float
    forward_s: float
    cost: CostModel
    tensors: tuple[ReadyTensor, ...] = ()

    @property
    def comm_end_s(self) -> float:
        """When the last all-reduce ends (0 with nothing to send)."""
        return max((bucket.end_s for bucket in self.buckets), default=0.0)

    @property
    def predicted_s(self) -> float:
        """Forward + the later of the end of backward and the end of the last all-reduce."""
        return self.forward_s + max(self.backward_s, self.comm_end_s)

    @property
    def groups(self) -> list[list[int]]:
        return [list(bucket.indices) for bucket in self.buckets]

    def describe(self) -> str:
        """A readable table of the buckets and the predicted time."""
        lines = [
            f"{self.strategy} plan: {len(self.buckets)} bucket(s), predicted iteration "
            f"{self.predicted_s * 1e3:.2f} ms (forward {self.forward_s * 1e3:.2f} ms, backward "
            f"{self.backward_s * 1e3:.2f} ms, last all-reduce ends {self.comm_end_s * 1e3:.2f} ms "
            f"into backward; cost a={self.cost.a * 1e6:.1f} us, "
            f"b={self.cost.b * 1e9:.3f} ns/byte)",
            f"{'bucket':>6}  {'tensors':>7}  {'MB':>9}  {'ready ms':>9}  {'start ms':>9}  "
            f"{'end ms':>9}  first..last",
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
                f"{bucket.end_s * 1e3:>9.2f}  {span}"
            )
        return "\n".join(lines)


def schedule(
    groups: Sequence[Sequence[int]],
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    *,
    backward_s: float | None = None,
    forward_s: float = 0.0,
    strategy: str = "custom",
) -> Plan:
    """Price a bucketing on one channel: each all-reduce starts when its last tensor is ready and
    the previous all-reduce has ended."""
    _check_tensors(tensors)
    _check_groups(groups, len(tensors))
    end_of_backward = max((t.ready_s for t in tensors), default=0.0)
    if backward_s is None:
        backward_s = end_of_backward
    elif backward_s < end_of_backward:
        raise ValueError(
            f"backward_s={backward_s} is before the last tensor is ready ({end_of_backward})"
        )
    buckets: list[Bucket] = []
    channel_free = 0.0
    for group in groups:
        nbytes = sum(tensors[i].nbytes for i in group)
        ready = max(tensors[i].ready_s for i in group)
        start = max(channel_free, ready)
        end = start + cost.time(nbytes)
        buckets.append(Bucket(tuple(group), nbytes, ready, start, end))
        channel_free = end
    return Plan(strategy, tuple(buckets), backward_s, forward_s, cost, tuple(tensors))


def plan_per_tensor(
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    backward_s: float | None = None,
    forward_s: float = 0.0,
) -> Plan:
    """WFBP: one all-reduce per tensor, launched as soon as it is ready."""
    groups = [[i] for i in range(len(tensors))]
    return schedule(
        groups, tensors, cost, backward_s=backward_s, forward_s=forward_s, strategy="per-tensor"
    )


def plan_single(
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    backward_s: float | None = None,
    forward_s: float = 0.0,
) -> Plan:
    """SyncEASGD: everything in one all-reduce after the whole backward pass."""
    groups = [list(range(len(tensors)))] if tensors else []
    return schedule(
        groups, tensors, cost, backward_s=backward_s, forward_s=forward_s, strategy="single"
    )


def plan_fixed(
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    cap_bytes: float,
    first_cap_bytes: float | None = None,
    *,
    backward_s: float | None = None,
    forward_s: float = 0.0,
) -> Plan:
    """DDP/Horovod: fill a bucket in ready order and close it once it holds ``cap_bytes``.

    ``first_cap_bytes`` caps the first bucket alone (DDP uses 1 MB there so communication starts
    early).
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {cap_bytes}")
    groups: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, tensor in enumerate(tensors):
        current.append(index)
        filled += tensor.nbytes
        limit = first_cap_bytes if (first_cap_bytes is not None and not groups) else cap_bytes
        if filled >= limit:
            groups.append(current)
            current, filled = [], 0
    if current:
        groups.append(current)
    return schedule(
        groups, tensors, cost, backward_s=backward_s, forward_s=forward_s, strategy="fixed"
    )


def plan_merged(
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    backward_s: float | None = None,
    forward_s: float = 0.0,
) -> Plan:
    """MG-WFBP's optimal merge (Theorem 1), in one pass over the ready order.

    Walking from the first-ready tensor: with the current group closed at tensor ``i``, its
    all-reduce would start at ``tau_c = max(channel free, ready[i])``. The next tensor joins the
    group exactly when ``ready[i+1] < tau_c + a``: it is ready before that all-reduce could even
    pay its start-up, so merging saves ``a`` while delaying the group by less than ``a``.
    Otherwise the group is sent and the next tensor starts a new one.
    """
    _check_tensors(tensors)
    groups: list[list[int]] = []
    if tensors:
        channel_free = 0.0
        current = [0]
        current_bytes = tensors[0].nbytes
        for index in range(len(tensors) - 1):
            start = max(channel_free, tensors[index].ready_s)
            following = tensors[index + 1]
            if following.ready_s < start + cost.a:
                current.append(index + 1)
                current_bytes += following.nbytes
            else:
                channel_free = start + cost.time(current_bytes)
                groups.append(current)
                current, current_bytes = [index + 1], following.nbytes
        groups.append(current)
    return schedule(
        groups, tensors, cost, backward_s=backward_s, forward_s=forward_s, strategy="merged"
    )


def plan_optimal(
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    *,
    backward_s: float | None = None,
    forward_s: float = 0.0,
) -> Plan:
    """The bucketing into contiguous groups that :func:`schedule` prices fastest, exactly.

    On one channel the end of a group's all-reduce depends on the earlier groups only through
    when the channel became free, and ends later whenever that is later; so the best way to send
    the first ``j`` tensors extends the best way to send some shorter prefix. Dynamic programming
    over prefixes then finds the minimum in ``O(L^2)``. MG-WFBP's greedy rule is optimal under
    the paper's assumptions; this is the reference it can be checked against, and it is never
    slower under the model than any other planner here.
    """
    _check_tensors(tensors)
    count = len(tensors)
    prefix_bytes = [0]
    for tensor in tensors:
        prefix_bytes.append(prefix_bytes[-1] + tensor.nbytes)
    best_end = [0.0] + [float("inf")] * count
    best_cut = [0] * (count + 1)
    for end in range(1, count + 1):
        ready = tensors[end - 1].ready_s
        for begin in range(end):
            finish = max(best_end[begin], ready) + cost.time(
                prefix_bytes[end] - prefix_bytes[begin]
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
        groups, tensors, cost, backward_s=backward_s, forward_s=forward_s, strategy="optimal"
    )


def make_plan(
    strategy: str,
    tensors: Sequence[ReadyTensor],
    cost: CostModel,
    *,
    cap_bytes: float = 25e6,
    first_cap_bytes: float | None = None,
    backward_s: float | None = None,
    forward_s: float = 0.0,
) -> Plan:
    """Dispatch to the planner named ``strategy`` (one of :data:`STRATEGIES`)."""
    if strategy == "per-tensor":
        return plan_per_tensor(tensors, cost, backward_s=backward_s, forward_s=forward_s)
    if strategy == "single":
        return plan_single(tensors, cost, backward_s=backward_s, forward_s=forward_s)
    if strategy == "fixed":
        return plan_fixed(
            tensors, cost, cap_bytes, first_cap_bytes, backward_s=backward_s, forward_s=forward_s
        )
    if strategy == "merged":
        return plan_merged(tensors, cost, backward_s=backward_s, forward_s=forward_s)
    if strategy == "optimal":
        return plan_optimal(tensors, cost, backward_s=backward_s, forward_s=forward_s)
    raise ValueError(f"unknown bucketing strategy '{strategy}'; choose one of {STRATEGIES}")


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
