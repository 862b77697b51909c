"""Wrapping a model for data-parallel training by strategy name, as the command line spells it.

``ddp`` is PyTorch's own DistributedDataParallel (the peer every claim is measured against),
``ddp-50mb`` and ``ddp-100mb`` the same with larger buckets and ``fsdp2`` torch's FSDP2; the
others are :class:`interlace.DataParallel` with the planner the strategy table
(:mod:`interlace.comm.strategies`) gives them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from interlace.comm.engine import COMPRESSIONS
from interlace.comm.plan import MIB
from interlace.comm.strategies import BENCH_STRATEGIES
from interlace.comm.strategies import STRATEGIES as TABLE
from interlace.dp import DataParallel
from interlace.errors import UsageError


def parse_channels(text: str | int) -> int | str:
    """``--channels`` as DataParallel takes it.

    Args:
        text: ``"auto"``, an integer or its string.

    Returns:
        ``"auto"`` or an integer >= 1.

    Raises:
        UsageError: for anything else.
    """
    if isinstance(text, int) or text == "auto":
        channels: int | str = text
    else:
        try:
            channels = int(text)
        except ValueError:
            channels = 0
    if channels != "auto" and not (isinstance(channels, int) and channels >= 1):
        raise UsageError(f"--channels must be 'auto' or an integer >= 1, got {text!r}")
    return channels


def wrap_model(
    model: nn.Module,
    strategy: str,
    *,
    device: torch.device | None = None,
    bucket_cap_mb: float | None = None,
    profile_steps: int | None = None,
    channels: int | str = 1,
    compression: str | None = None,
    find_unused_parameters: bool = False,
) -> nn.Module:
    """Wrap ``model`` (already on its device) for data-parallel training with ``strategy``.

    Args:
        model: the model to wrap.
        strategy: one of :data:`~interlace.comm.strategies.BENCH_STRATEGIES`.
        device: the rank's device (DDP's ``device_ids`` on a GPU).
        bucket_cap_mb: None keeps each implementation's default (25 MiB, first bucket 1 MiB). For
            ``ddp`` a cap is passed on only when given: torch then applies it to the first
            bucket too, so passing the default explicitly would drop DDP's small first bucket.
        profile_steps: DataParallel's ``profile_steps``.
        channels: DataParallel's ``channels``; ``ddp`` has one channel.
        compression: ``None``, ``"fp16"`` or ``"bf16"``; for ``ddp`` torch's own communication
            hook of that type (``bf16`` off NCCL: :func:`bf16_hook_any_backend`).
        find_unused_parameters: DDP's flag, for a model with parameters its forward does not
            use (DataParallel handles them either way).

    Raises:
        UsageError: for an unknown strategy or a setting the strategy cannot take.
    """
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise UsageError(f"--bucket-cap-mb must be > 0, got {bucket_cap_mb}")
    if compression is not None and compression not in COMPRESSIONS:
        raise UsageError(
            f"unknown --compression '{compression}'; choose one of {', '.join(COMPRESSIONS)}"
        )
    chosen = TABLE.get(strategy)
    if chosen is None or strategy not in BENCH_STRATEGIES:
        raise UsageError(
            f"unknown strategy '{strategy}'; choose one of {', '.join(BENCH_STRATEGIES)}"
        )
    if chosen.torch_wrapper == "ddp":
        if bucket_cap_mb is None and strategy != "ddp":
            bucket_cap_mb = chosen.cap_bytes / MIB
        return _wrap_ddp(
            model, device, bucket_cap_mb, channels, compression, find_unused_parameters
        )
    if chosen.torch_wrapper == "fsdp2":
        return _wrap_fsdp2(model, channels, compression)
    assert chosen.bucketing is not None
    return DataParallel(
        model,
        bucketing=chosen.bucketing,
        bucket_cap_mb=25.0 if bucket_cap_mb is None else bucket_cap_mb,
        profile_steps=profile_steps,
        channels=channels,
        compression=compression,
        overlap=chosen.overlap,
    )


def _wrap_fsdp2(model: nn.Module, channels: int | str, compression: str | None) -> nn.Module:
    """torch's FSDP2 as one would use it for data parallelism on few ranks: every module that
    holds parameters sharded, parameters kept gathered after forward (no all-gather in
    backward), then the root."""
    if channels != 1 or compression is not None:
        raise UsageError("fsdp2 runs as torch configures it: one channel, no --compression")
    for child in list(model.modules())[1:]:
        if any(True for _ in child.parameters(recurse=False)):
            fully_shard(child, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    return model


def _wrap_ddp(
    model: nn.Module,
    device: torch.device | None,
    bucket_cap_mb: float | None,
    channels: int | str,
    compression: str | None,
    find_unused_parameters: bool = False,
) -> DistributedDataParallel:
    if channels != 1:
        raise UsageError(
            "torch DDP sends on one channel; --channels needs an interlace strategy "
            "(mgwfbp, wfbp, fixed or single)"
        )
    device_ids = [device.index] if device is not None and device.type == "cuda" else None
    if bucket_cap_mb is None:
        ddp = DistributedDataParallel(
            model, device_ids=device_ids, find_unused_parameters=find_unused_parameters
        )
    else:
        ddp = DistributedDataParallel(
            model,
            device_ids=device_ids,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
        )
    if compression == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif compression == "bf16":
        on_nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        ddp.register_comm_hook(
            None, default_hooks.bf16_compress_hook if on_nccl else bf16_hook_any_backend
        )
    return ddp


def bf16_hook_any_backend(state, bucket):  # type: ignore[no-untyped-def]
    """torch's ``bf16_compress_hook`` under another name: DDP refuses that name without CUDA
    and NCCL, while gloo on CPUs sums bfloat16 as well; the same function runs.

    (Not annotated: DDP compares a hook's annotations with its own classes, and this module's
    annotations are strings.)

    Args:
        state: The process group, or None for the default one.
        bucket: DDP's ``GradBucket``.
    """
    future: Any = default_hooks.bf16_compress_hook(state, bucket)
    return future
