"""The link of a simulated K-FAC iteration: the bulk factor messages, the gradient buckets a run
used, and the gradient and factor all-reduces played on one queue or two."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from interlace.comm.cost import CostModel
from interlace.comm.plan import Plan, ReadyTensor
from interlace.comm.pricing import schedule
from interlace.kfac.fusion import bulk_groups
from interlace.kfac.sizes import factor_numel
from interlace.sim.replay import Replay, replay

__all__ = ["bulk_messages", "named_groups", "play_link"]


def named_groups(
    buckets: Sequence[Sequence[str]], tensors: Sequence[ReadyTensor], what: str = "gradient"
) -> list[list[int]]:
    """``buckets`` of tensor names as indices into ``tensors``, each bucket in ready order.

    Args:
        buckets: Tensor names per bucket, in launch order.
        tensors: The tensors, in ready order.
        what: What the buckets hold, for the error (``"gradient"``, ``"factor"``).

    Raises:
        ValueError: For a name ``tensors`` lacks.
    """
    position = {tensor.name: index for index, tensor in enumerate(tensors)}
    missing = sorted({name for bucket in buckets for name in bucket} - set(position))
    if missing:
        raise ValueError(
            f"the {what} buckets name tensors the trace does not have: {', '.join(missing[:5])}"
        )
    return [sorted(position[name] for name in bucket) for bucket in buckets]


def play_link(
    groups: list[list[int]],
    messages: list[ReadyTensor],
    *,
    kinds: tuple[str, ...],
    cost: CostModel,
    compute_end: float,
    name: str,
    factor_queue: bool,
) -> tuple[Plan, Replay]:
    """The gradient and factor buckets played on the link: one serial queue, or with
    ``factor_queue`` two (gradients on channel 0, factors on channel 1: a process group of
    their own), whose start-ups overlap while their bytes share the wire (the cost model's
    default concurrency, ``(a, j)``: the newcomer's bytes take ``j`` times as long).

    Args:
        groups: The buckets, as indices into ``messages``, in launch order.
        messages: Gradients and factors, in ready order.
        kinds: Each bucket's ``"gradient"`` or ``"factor"``.
        cost: Prices each all-reduce.
        compute_end: When the compute stream ends.
        name: The plan's strategy name.
        factor_queue: Factors on a queue of their own.
    """
    link = schedule(
        groups,
        messages,
        cost,
        backward_s=compute_end,
        forward_s=0.0,
        strategy=name,
        channels=2 if factor_queue else 1,
    )
    if not factor_queue:
        return link, replay(link)
    queued = tuple(
        replace(bucket, channels=(1 if kind == "factor" else 0,))
        for bucket, kind in zip(link.buckets, kinds, strict=True)
    )
    replayed = replay(replace(link, buckets=queued))
    # The plan's times as the two queues play them.
    timed = tuple(
        replace(bucket, start_s=comm.start_s, end_s=comm.end_s)
        for bucket, comm in zip(queued, replayed.comms, strict=True)
    )
    return replace(link, buckets=timed), replayed


def bulk_messages(
    dims: Sequence[tuple[int, int]],
    element_bytes: int,
    ready_s: float,
    *,
    packed: bool,
    cap_bytes: int | None,
    a_diagonal: Sequence[bool] = (),
) -> tuple[list[ReadyTensor], list[list[int]]]:
    """The bulk factor all-reduce(s), all ready at ``ready_s``, each its own bucket: one message,
    or the runtime's own buckets (:func:`~interlace.kfac.fusion.bulk_groups`, the factors in
    layer order, each layer's ``A`` then ``G``).

    Args:
        dims: Each layer's ``(a_dim, g_dim)``.
        element_bytes: Bytes per number.
        ready_s: When the factors are all ready.
        packed: Packed upper triangles; otherwise whole ``n x n`` factors.
        cap_bytes: The runtime's bucket cap (0: a bucket per factor); None: one message.
        a_diagonal: Per layer, whether ``A`` is kept as a diagonal (sent as its ``n`` values
            either way); none given: no layer's is.
    """
    diagonal = list(a_diagonal) or [False] * len(dims)
    if len(diagonal) != len(dims):
        raise ValueError(f"a_diagonal has {len(diagonal)} flags for {len(dims)} layers")
    sizes = [
        factor_numel(dim, diagonal=which == 0 and flag, packed=packed) * element_bytes
        for (a_dim, g_dim), flag in zip(dims, diagonal, strict=True)
        for which, dim in enumerate((a_dim, g_dim))
    ]
    if cap_bytes is None:
        return [ReadyTensor("factors (all layers)", sum(sizes), ready_s)], [[0]]
    messages = [
        ReadyTensor(f"factors (bucket {number})", sum(sizes[i] for i in group), ready_s)
        for number, group in enumerate(bulk_groups(sizes, cap_bytes))
    ]
    return messages, [[number] for number in range(len(messages))]
