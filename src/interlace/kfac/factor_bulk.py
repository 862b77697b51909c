"""Averaging K-FAC factors across ranks in bulk: the step's all-reduce, in the buckets of
:func:`~interlace.kfac.fusion.bulk_groups` (the rule the simulator prices)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from interlace.comm.engine import BucketEngine
from interlace.kfac.fusion import bulk_groups

__all__ = ["all_reduce_mean"]


def all_reduce_mean(
    tensors: list[torch.Tensor],
    world_size: int,
    group: dist.ProcessGroup | None,
    bucket_bytes: int,
) -> list[torch.Tensor]:
    """Average ``tensors`` across ranks in the buckets of
    :func:`~interlace.kfac.fusion.bulk_groups`, on the communication core's bucket engine: every
    bucket is launched before the first is waited for.

    Args:
        tensors: The same shapes and dtypes on every rank.
        world_size: The ranks of ``group`` (1: nothing to do).
        group: The process group.
        bucket_bytes: The cap of a bucket (0: one all-reduce per tensor).

    Returns:
        The averages, shaped like ``tensors`` (views of the engine's buffers).
    """
    if world_size == 1 or not tensors:
        return tensors
    groups = bulk_groups([t.numel() * t.element_size() for t in tensors], bucket_bytes)
    engine = BucketEngine(tensors, groups, group)
    for index, tensor in enumerate(tensors):
        engine.add(index, tensor)
    averaged = engine.finish()
    return [
        mean if mean is not None else tensor for mean, tensor in zip(averaged, tensors, strict=True)
    ]
