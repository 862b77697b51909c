"""Data-parallel strategies by name, as the command line and the benchmarks spell them.

``ddp`` is PyTorch's own DistributedDataParallel (the peer every claim is measured against); the
others are :class:`interlace.DataParallel` with one of the bucket planners.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from interlace.comm.engine import COMPRESSIONS
from interlace.dp import DataParallel
from interlace.errors import UsageError

STRATEGIES = ("ddp", "wfbp", "fixed", "single", "mgwfbp", "optimal")
BUCKETING = {
    "wfbp": "per-tensor",
    "fixed": "fixed",
    "single": "single",
    "mgwfbp": "merged",
    "optimal": "optimal",
}
DESCRIPTIONS = {
    "ddp": "torch DistributedDataParallel, 25 MB buckets (1 MB first)",
    "wfbp": "interlace, one all-reduce per tensor as soon as it is ready (WFBP)",
    "fixed": "interlace, DDP-style fixed buckets in measured ready order",
    "single": "interlace, one all-reduce after backward (SyncEASGD)",
    "mgwfbp": "interlace, MG-WFBP optimal merge from measured times and a fitted cost model",
    "optimal": "interlace, the exact best contiguous bucketing under the same cost model",
}


def parse_channels(text: str | int) -> int | str:
    """``--channels`` as DataParallel takes it: ``"auto"`` or an integer >= 1."""
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
) -> nn.Module:
    """Wrap ``model`` (already on its device) for data-parallel training with ``strategy``.

    ``bucket_cap_mb=None`` keeps each implementation's default (25 MB, first bucket 1 MB). For
    ``ddp`` a cap is passed on only when given: torch then applies it to the first bucket too,
    so passing the default explicitly would silently drop DDP's small first bucket. ``ddp`` has
    one channel; its compression is torch's own fp16/bf16 communication hook.
    """
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise UsageError(f"--bucket-cap-mb must be > 0, got {bucket_cap_mb}")
    if compression is not None and compression not in COMPRESSIONS:
        raise UsageError(
            f"unknown --compression '{compression}'; choose one of {', '.join(COMPRESSIONS)}"
        )
    if strategy == "ddp":
        if channels != 1:
            raise UsageError(
                "torch DDP sends on one channel; --channels needs an interlace strategy "
                "(mgwfbp, wfbp, fixed or single)"
            )
        device_ids = [device.index] if device is not None and device.type == "cuda" else None
        if bucket_cap_mb is None:
            ddp = DistributedDataParallel(model, device_ids=device_ids)
        else:
            ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)
        if compression is not None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = (
                default_hooks.fp16_compress_hook
                if compression == "fp16"
                else default_hooks.bf16_compress_hook
            )
            ddp.register_comm_hook(None, hook)
        return ddp
    if strategy not in BUCKETING:
        raise UsageError(f"unknown strategy '{strategy}'; choose one of {', '.join(STRATEGIES)}")
    return DataParallel(
        model,
        bucketing=BUCKETING[strategy],
        bucket_cap_mb=25.0 if bucket_cap_mb is None else bucket_cap_mb,
        profile_steps=profile_steps,
        channels=channels,
        compression=compression,
    )
