"""DistributedDataParallel's constructor arguments, checked and mapped onto DataParallel.

Each argument of the installed torch's DDP is taken with DDP's meaning or refused with a line
saying why and what to use instead (the table: docs/data-parallel.md, "Coming from DDP").
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from interlace.errors import UsageError

__all__ = ["DEFAULT_BUCKET_CAP_MB", "DdpSettings", "ddp_settings", "move_inputs"]

#: DDP's bucket cap when ``bucket_cap_mb`` is None.
DEFAULT_BUCKET_CAP_MB = 25.0

DeviceLike = int | str | torch.device


@dataclass(frozen=True)
class DdpSettings:
    """DDP's arguments as DataParallel acts on them.

    Args:
        process_group: The group to average over (``device_mesh``'s group if one was given;
            None for the default group).
        input_device: Where forward moves the inputs (``device_ids`` on a GPU), or None.
        forward_sync_buffers: Whether every training forward starts from one rank's buffers.
        init_sync: Whether parameters are broadcast from rank 0 at wrap time.
        init_sync_buffers: Whether buffers are, too.
        gradient_as_bucket_view: Whether ``param.grad`` is a view into its bucket.
        batched_grad_copy: Whether a bucket's gradients are copied into it in one batched copy.
    """

    process_group: dist.ProcessGroup | None
    input_device: torch.device | None
    forward_sync_buffers: bool
    init_sync: bool
    init_sync_buffers: bool
    gradient_as_bucket_view: bool
    batched_grad_copy: bool


def ddp_settings(
    device: torch.device,
    *,
    forward_overlap: bool,
    device_ids: Sequence[DeviceLike] | None,
    output_device: DeviceLike | None,
    dim: int,
    broadcast_buffers: bool | None,
    init_sync: bool,
    process_group: dist.ProcessGroup | None,
    find_unused_parameters: bool,
    check_reduction: bool,
    gradient_as_bucket_view: bool,
    static_graph: bool,
    delay_all_reduce_named_params: Any,
    param_to_hook_all_reduce: Any,
    mixed_precision: Any,
    device_mesh: Any,
    skip_all_reduce_unused_params: bool,
    bucket_cap_mb_list: Sequence[float] | None,
    batched_grad_copy: bool,
    forward_sync_buffers: bool | None,
) -> DdpSettings:
    """DDP's constructor arguments (but ``module`` and ``bucket_cap_mb``, which DataParallel's
    plan request checks), as DataParallel uses them.

    Args:
        device: The device of the wrapped module's parameters.
        forward_overlap: Whether DataParallel runs with ``overlap="forward"``.
        device_ids: DDP's ``device_ids``.
        output_device: DDP's ``output_device``.
        dim: DDP's ``dim``.
        broadcast_buffers: DDP's ``broadcast_buffers``.
        init_sync: DDP's ``init_sync``.
        process_group: DDP's ``process_group``.
        find_unused_parameters: DDP's ``find_unused_parameters``.
        check_reduction: DDP's ``check_reduction``.
        gradient_as_bucket_view: DDP's ``gradient_as_bucket_view``.
        static_graph: DDP's ``static_graph``.
        delay_all_reduce_named_params: DDP's ``delay_all_reduce_named_params``.
        param_to_hook_all_reduce: DDP's ``param_to_hook_all_reduce``.
        mixed_precision: DDP's ``mixed_precision``.
        device_mesh: DDP's ``device_mesh``.
        skip_all_reduce_unused_params: DDP's ``skip_all_reduce_unused_params``.
        bucket_cap_mb_list: DDP's ``bucket_cap_mb_list``.
        batched_grad_copy: DDP's ``batched_grad_copy``.
        forward_sync_buffers: DDP's ``forward_sync_buffers``.

    Raises:
        UsageError: For a value of the wrong kind, or an argument DataParallel cannot honour,
            naming it and what to use instead.
    """
    flags = {
        "init_sync": init_sync,
        "find_unused_parameters": find_unused_parameters,
        "check_reduction": check_reduction,
        "gradient_as_bucket_view": gradient_as_bucket_view,
        "static_graph": static_graph,
        "skip_all_reduce_unused_params": skip_all_reduce_unused_params,
        "batched_grad_copy": batched_grad_copy,
    }
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise UsageError(f"{name} must be True or False, got {value!r}")
    for name, maybe in (
        ("broadcast_buffers", broadcast_buffers),
        ("forward_sync_buffers", forward_sync_buffers),
    ):
        if maybe is not None and not isinstance(maybe, bool):
            raise UsageError(
                f"{name} must be True or False (or None, DDP's default), got {maybe!r}"
            )
    _refuse_unsupported(
        dim=dim,
        delay_all_reduce_named_params=delay_all_reduce_named_params,
        param_to_hook_all_reduce=param_to_hook_all_reduce,
        mixed_precision=mixed_precision,
        bucket_cap_mb_list=bucket_cap_mb_list,
    )
    if gradient_as_bucket_view and forward_overlap:
        raise UsageError(
            "gradient_as_bucket_view cannot be combined with overlap='forward', whose gradients "
            "are still in flight when backward returns; drop one of them"
        )
    if check_reduction:
        # As DDP does: the argument has done nothing there for years.
        warnings.warn(
            "The `check_reduction` argument is deprecated in DistributedDataParallel and does "
            "nothing there or in interlace.DataParallel; please avoid using it.",
            FutureWarning,
            stacklevel=3,
        )
    # DDP: forward_sync_buffers replaces broadcast_buffers and never affects the sync at wrap
    # time; the deprecated broadcast_buffers=False also leaves buffers out of that sync.
    if forward_sync_buffers is not None:
        forward_sync, init_buffers = forward_sync_buffers, True
    else:
        forward_sync = True if broadcast_buffers is None else broadcast_buffers
        init_buffers = forward_sync
    return DdpSettings(
        process_group=_group_of(process_group, device_mesh),
        input_device=_input_device(device, device_ids, output_device),
        forward_sync_buffers=forward_sync,
        init_sync=init_sync,
        init_sync_buffers=init_buffers,
        gradient_as_bucket_view=gradient_as_bucket_view,
        batched_grad_copy=batched_grad_copy,
    )


def move_inputs(
    inputs: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Every tensor in ``inputs`` and ``kwargs`` on ``device``, as DDP's forward does with
    ``device_ids``.

    Args:
        inputs: The forward's positional arguments.
        kwargs: Its keyword arguments.
        device: Where the module lives.
    """

    def move(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device, non_blocking=True)

    moved: tuple[tuple[Any, ...], dict[str, Any]] = tree_map_only(
        torch.Tensor, move, (inputs, kwargs)
    )
    return moved


def _refuse_unsupported(
    *,
    dim: int,
    delay_all_reduce_named_params: Any,
    param_to_hook_all_reduce: Any,
    mixed_precision: Any,
    bucket_cap_mb_list: Sequence[float] | None,
) -> None:
    """The arguments DataParallel cannot honour: one line each on why, and what to use."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise UsageError(f"dim must be an integer, got {dim!r}")
    if dim != 0:
        raise UsageError(
            f"dim={dim}: DDP's dim is the dimension along which inputs are scattered over "
            "several devices of one process, which neither DDP's forward nor DataParallel's "
            "does (one device per rank); leave dim=0 and give each rank its own batch"
        )
    if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
        raise UsageError(
            "delay_all_reduce_named_params and param_to_hook_all_reduce schedule some "
            "all-reduces by hand; DataParallel plans when every bucket goes out from measured "
            "ready times: drop both (bucketing='single' sends everything after backward)"
        )
    if mixed_precision is not None:
        raise UsageError(
            "mixed_precision (DDP's experimental _MixedPrecision) is not supported: run the "
            "forward under torch.autocast, and pass compression='bf16' or 'fp16' to send the "
            "gradients in 16 bits"
        )
    if bucket_cap_mb_list:
        raise UsageError(
            "bucket_cap_mb_list sets a cap per bucket; DataParallel sizes buckets from measured "
            "times: drop it (or use bucketing='fixed' with one bucket_cap_mb)"
        )


def _group_of(
    process_group: dist.ProcessGroup | None, device_mesh: Any
) -> dist.ProcessGroup | None:
    """The process group to average over: ``process_group``, or a 1-D ``device_mesh``'s."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise UsageError(
            "pass process_group or device_mesh, not both (as DDP requires); the mesh's group "
            "is the one averaged over"
        )
    ndim = getattr(device_mesh, "ndim", None)
    if ndim != 1:
        raise UsageError(
            f"device_mesh must be a 1-D DeviceMesh (its group is averaged over), got "
            f"{device_mesh!r}; pass the data-parallel dimension's mesh"
        )
    if device_mesh._get_root_mesh() != device_mesh:
        raise UsageError(
            "device_mesh is sliced from a larger mesh (DDP with tensor parallelism), which "
            "DataParallel does not support; pass a mesh of the data-parallel ranks alone"
        )
    group: dist.ProcessGroup = device_mesh.get_group(0)
    return group


def _input_device(
    device: torch.device,
    device_ids: Sequence[DeviceLike] | None,
    output_device: DeviceLike | None,
) -> torch.device | None:
    """Where forward moves the inputs: the one CUDA device named by ``device_ids``, which must be
    the module's; None when ``device_ids`` is None or empty."""
    ids = [] if device_ids is None else list(device_ids)
    if device.type != "cuda":
        if ids or output_device is not None:
            raise UsageError(
                f"device_ids and output_device name the GPU of a single-device CUDA module; "
                f"this model is on {device}, where DDP too needs device_ids=None and "
                f"output_device=None: drop them (got device_ids={device_ids!r}, "
                f"output_device={output_device!r})"
            )
        return None
    if len(ids) > 1:
        raise UsageError(
            f"device_ids can hold one device (one device per rank, as DDP), got {device_ids!r}"
        )
    named = [_cuda(value, "device_ids") for value in ids]
    if output_device is not None:
        named.append(_cuda(output_device, "output_device"))
    for where in named:
        if where != device:
            raise UsageError(
                f"device_ids and output_device must name the module's device {device}, got "
                f"{where}; move the model there first (model.to({str(device)!r}))"
            )
    return device if ids else None


def _cuda(value: DeviceLike, name: str) -> torch.device:
    """``value`` as DDP reads a device id: an int is a CUDA index."""
    if isinstance(value, bool):
        raise UsageError(
            f"{name} must name a CUDA device (an index or a torch.device), got {value!r}"
        )
    if isinstance(value, int):
        return torch.device("cuda", value)
    try:
        where = torch.device(value)
    except (RuntimeError, TypeError):
        raise UsageError(
            f"{name} must name a CUDA device (an index or a torch.device), got {value!r}"
        ) from None
    if where.type == "cuda" and where.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return where
