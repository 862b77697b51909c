"""Joining a torch.distributed job from torchrun's environment (or running alone without one)."""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from interlace.errors import UsageError
from interlace.launch.env import free_port
from interlace.launch.rank import (
    COLLECTIVE_TIMEOUT_VARIABLE,
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    collective_timeout_s,
    report_phase,
)

__all__ = [
    "BACKEND_VARIABLE",
    "COLLECTIVE_TIMEOUT_VARIABLE",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "DistContext",
    "collective_device",
    "collective_timeout_s",
    "default_backend",
    "finish_distributed",
    "in_launched_job",
    "init_distributed",
    "report_phase",
    "set_collective_timeout",
]


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in the job: its rank, the job's size, and its device.

    Args:
        rank: This process's rank in the job.
        world_size: The number of ranks.
        local_rank: Its rank on this machine (its GPU index under NCCL).
        device: Where its model and data live.
        backend: The process group's backend (``gloo`` or ``nccl``).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0."""
        return self.rank == 0


def in_launched_job() -> bool:
    """True when torchrun (or ``interlace launch``) started this process as one rank of a job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


#: Names the backend outright (``gloo`` or ``nccl``), e.g. to keep a job on CPU on a GPU node.
BACKEND_VARIABLE = "INTERLACE_BACKEND"


def default_backend(local_rank: int | None = None) -> str:
    """NCCL when this rank has a GPU of its own, gloo otherwise; ``$INTERLACE_BACKEND`` overrides.

    NCCL needs one GPU per rank on a node. With more local ranks than GPUs (``interlace train
    -n 4`` on a one-GPU workstation) every rank runs on CPU over gloo instead, rather than a
    mix of devices or a failure inside NCCL.

    Args:
        local_rank: This rank on its machine (``$LOCAL_RANK`` when None).

    Raises:
        ValueError: When ``$INTERLACE_BACKEND`` names neither gloo nor nccl.
    """
    chosen = os.environ.get(BACKEND_VARIABLE, "").strip().lower()
    if chosen:
        if chosen not in ("gloo", "nccl"):
            raise ValueError(f"${BACKEND_VARIABLE} must be gloo or nccl, got {chosen!r}")
        return chosen
    if not torch.cuda.is_available():
        return "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    return "nccl" if max(local_rank + 1, local_world) <= torch.cuda.device_count() else "gloo"


def set_collective_timeout(seconds: float | None) -> None:
    """Make ``seconds`` this process's collective timeout, and that of the ranks it launches.

    Entry points call this with their ``--collective-timeout`` flag; :func:`init_distributed`
    and :func:`interlace.launch.run` then read it from ``$INTERLACE_COLLECTIVE_TIMEOUT``.

    Args:
        seconds: The timeout, or None to keep the inherited one (300 s if none).

    Raises:
        UsageError: When ``seconds`` is not a positive, finite number.
    """
    if seconds is None:
        return
    if not 0 < seconds < float("inf"):
        raise UsageError(f"--collective-timeout must be > 0 seconds, got {seconds:g}")
    os.environ[COLLECTIVE_TIMEOUT_VARIABLE] = f"{seconds:g}"


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> DistContext:
    """Join the job described by the env:// variables, or make a one-rank group when there is none.

    A one-rank group lets the same training code (which always wraps its model for data
    parallelism) run as a plain single process.

    Args:
        backend: ``gloo`` or ``nccl``; :func:`default_backend` chooses when None.
        timeout_s: Bounds every collective, so a peer that vanished or stopped ends this rank
            with an error instead of a hang; when None, :func:`collective_timeout_s` (the
            launcher's ``--collective-timeout``, ``$INTERLACE_COLLECTIVE_TIMEOUT``, else 300 s).

    Raises:
        UsageError: When ``$INTERLACE_COLLECTIVE_TIMEOUT`` is not a positive number.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = backend or default_backend(local_rank)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=collective_timeout_s() if timeout_s is None else timeout_s)
    if not dist.is_initialized():
        if in_launched_job():
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
                timeout=timeout,
            )
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=backend,
    )


def finish_distributed() -> None:
    """Leave the job: wait for every rank (a barrier), then destroy the process group.

    A rank that destroys its group while a peer still finishes the last collective can make
    that peer fail, or abort in gloo's teardown, after a run that succeeded. Meant for a
    ``finally`` block: while an exception propagates the barrier is skipped (a peer may be gone,
    and waiting for it would hold this rank for the whole collective timeout), and the group is
    only destroyed. Does nothing without a process group.
    """
    if not dist.is_initialized():
        return
    failing = sys.exc_info()[1] is not None
    try:
        if not failing and dist.get_world_size() > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor sent through ``group`` must live: this rank's GPU for NCCL, else the CPU.

    Small control messages (timings, flags, chosen plans) are built on the host; NCCL accepts
    only CUDA tensors, so they are placed here before they travel.

    Args:
        group: The process group (the default group when None).
    """
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
