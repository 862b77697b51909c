"""Bucket planners: pure functions from (tensors in ready order, cost model) to a priced plan.

WFBP, DDP/Horovod's fixed caps, SyncEASGD, MG-WFBP's merge (Theorem 1's, and its authors'
simulator's pairwise one) and the exact optimum, each priced by
:func:`~interlace.comm.pricing.schedule`; :func:`make_plan` picks one by its
:class:`~interlace.comm.plan.Bucketing` (docs/notes/dp.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from interlace.comm.cost import CostModel
from interlace.comm.pairwise import pairwise_groups
from interlace.comm.plan import Bucketing, Plan, ReadyTensor, check_tensors
from interlace.comm.pricing import ChannelClock, schedule


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
    check_tensors(tensors)
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
    check_tensors(tensors)
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
    check_tensors(tensors)
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
