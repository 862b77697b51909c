"""DataParallel's options checked: the plan request, the trainable parameters, the cost model,
a communication hook."""

from __future__ import annotations

import math

import torch.distributed as dist
from torch import nn

from interlace.checks import is_int, is_real
from interlace.comm.channels import MAX_AUTO_CHANNELS
from interlace.comm.choose import PlanRequest
from interlace.comm.cost import CostModel
from interlace.comm.engine import COMPRESSIONS
from interlace.comm.forward_plan import Overlap
from interlace.comm.plan import MIB, Bucketing
from interlace.comm.strategies import bucketing_named
from interlace.errors import UsageError


def plan_request(
    *,
    bucketing: Bucketing | str,
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    channels: int | str,
    partition_mb: float | str | None,
    compression: str | None,
    tune_steps: int,
    profile_steps: int | None,
    overlap: Overlap | str = Overlap.BACKWARD,
) -> PlanRequest:
    """DataParallel's settings, checked, as the plan choice takes them.

    Args:
        bucketing: The bucketing rule or its name.
        bucket_cap_mb: The largest bucket, MiB (as torch DDP).
        first_bucket_cap_mb: The first bucket's cap, MiB.
        channels: Concurrent channels, or ``"auto"``.
        partition_mb: Split tensors above this size (MiB), ``"auto"`` or None.
        compression: A name of :data:`~interlace.comm.engine.COMPRESSIONS`, or None.
        tune_steps: Iterations spent measuring candidate plans.
        profile_steps: Profiling iterations, or None for the default.
        overlap: What the all-reduces may overlap, or its name.

    Raises:
        UsageError: Naming the setting that is wrong and what it accepts.
    """
    chosen = bucketing_named(bucketing)
    caps = {"bucket_cap_mb": bucket_cap_mb, "first_bucket_cap_mb": first_bucket_cap_mb}
    for name, cap in caps.items():
        if not is_real(cap) or not 0 < cap < math.inf:
            raise UsageError(f"bucket caps must be > 0 MiB and finite, got {name}={cap!r}")
    if channels != "auto" and not (is_int(channels) and channels >= 1):
        raise UsageError(f"channels must be an integer >= 1 or 'auto', got {channels!r}")
    if partition_mb not in ("auto", None) and not (
        is_real(partition_mb) and 0 < partition_mb < math.inf
    ):
        raise UsageError(
            f"partition_mb must be > 0 and finite, None (never split) or 'auto', "
            f"got {partition_mb!r}"
        )
    if compression is not None and compression not in COMPRESSIONS:
        raise UsageError(
            f"unknown compression {compression!r}; choose one of "
            f"{', '.join(COMPRESSIONS)} (or None)"
        )
    if chosen is Bucketing.OPTIMAL and channels != 1:
        raise UsageError(
            "bucketing='optimal' is exact on one channel only; use bucketing='merged' with "
            f"channels={channels!r}"
        )
    if not (is_int(tune_steps) and tune_steps >= 0):
        raise UsageError(
            f"tune_steps must be an integer >= 0 (0: keep the cost model's plan), "
            f"got {tune_steps!r}"
        )
    try:
        overlapping = Overlap(overlap)
    except ValueError:
        raise UsageError(
            f"unknown overlap {overlap!r}; choose one of "
            f"{', '.join(member.value for member in Overlap)}"
        ) from None
    if profile_steps is not None and not (is_int(profile_steps) and profile_steps >= 1):
        raise UsageError(f"profile_steps must be an integer >= 1 or None, got {profile_steps!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise UsageError(
            "torch.distributed is not initialised: call "
            "torch.distributed.init_process_group() before wrapping the model "
            "(torchrun and `interlace launch` provide the environment it needs)"
        )
    return PlanRequest(
        chosen,
        cap_bytes=bucket_cap_mb * MIB,
        first_cap_bytes=first_bucket_cap_mb * MIB,
        channels=channels,
        channel_groups=MAX_AUTO_CHANNELS if channels == "auto" else int(channels),
        partition_mb=partition_mb,
        compression=compression,
        tune_steps=tune_steps,
        overlap=overlapping,
    )


def cost_model_kind(cost_model: CostModel | None) -> str:
    """What decides the collectives a cost model leads to (rank 0's plans for everyone): whether
    one is given (else it is fitted, collectively) and how many concurrency terms it has (else
    they are measured, collectively).

    Args:
        cost_model: The cost model given to DataParallel, if any.
    """
    if cost_model is None:
        return "fitted on the group"
    return f"given, with {len(cost_model.concurrency)} concurrency term(s)"


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module``'s parameters that need gradients, all on one device.

    Args:
        module: The wrapped model.

    Raises:
        UsageError: Without trainable parameters, or with them on several devices.
    """
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise UsageError(
            "the model has no trainable parameters (none with requires_grad=True); "
            "there is nothing to average across ranks"
        )
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise UsageError(
            f"DataParallel needs every parameter on one device, found {sorted(map(str, devices))}"
        )
    return named


def check_comm_hook(
    hook: object,
    *,
    registered: bool,
    fresh: bool,
    compression: str | None,
    channels: int | str,
    overlap: Overlap,
) -> None:
    """Raise where a DataParallel cannot take a communication hook now.

    Args:
        hook: the hook to register.
        registered: whether one is registered already.
        fresh: whether no backward pass has run yet.
        compression: the wrapper's ``compression``.
        channels: the wrapper's ``channels``.
        overlap: the wrapper's overlap.

    Raises:
        UsageError: naming what stands in the way and what to do.
    """
    if registered:
        raise UsageError(
            "register_comm_hook can only be called once; build a new DataParallel to "
            "use another hook"
        )
    if not fresh:
        raise UsageError(
            "register_comm_hook must be called before the first backward pass; register "
            "the hook right after wrapping the model"
        )
    if compression is not None:
        raise UsageError(
            f"compression={compression!r} cannot be combined with a communication "
            "hook; wrap with compression=None and use fp16_compress_hook or "
            "bf16_compress_hook instead"
        )
    if channels != 1:
        raise UsageError(
            f"channels={channels!r} cannot be combined with a communication "
            "hook, which sends each bucket itself; wrap with channels=1"
        )
    if overlap is Overlap.FORWARD:
        raise UsageError(
            "a communication hook's future is waited for at the end of backward, so it "
            "cannot run on into the next forward; wrap with overlap='backward' to use one"
        )
    if not callable(hook):
        raise UsageError(f"hook must be callable as hook(state, bucket), got {hook!r}")
