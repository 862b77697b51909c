"""Joining a torch.distributed job from torchrun's environment (or running alone without one)."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in the job: its rank, the job's size, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def in_launched_job() -> bool:
    """True when torchrun (or ``interlace launch``) started this process as one rank of a job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_backend() -> str:
    """NCCL when this process has a GPU, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str | None = None, timeout_s: float = 300.0) -> DistContext:
    """Join the job described by the env:// variables, or make a one-rank group when there is none.

    A one-rank group lets the same training code (which always wraps its model for data
    parallelism) run as a plain single process. ``timeout_s`` bounds every collective, so a peer
    that vanished ends this rank with an error instead of a hang.
    """
    backend = backend or default_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if in_launched_job():
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{_free_port()}",
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
