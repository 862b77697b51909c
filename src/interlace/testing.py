"""The multi-rank harness: run a function on N spawned gloo ranks and get their return values.

Tests and benchmarks of distributed code all go through :func:`run_ranks`, so they share one
way of starting ranks (fresh processes via :func:`interlace.launch.run`, torchrun's environment),
one hard timeout (no test can hang CI on a collective that never completes), and one failure
report (the failing rank's traceback inside the raised error).

This module imports torch only inside the ranks, so importing it (e.g. from a conftest) is cheap.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from interlace import launch, netem

__all__ = ["netns_available", "run_ranks"]

#: Upper bound on how long one collective may block inside the harness. A broken collective (a
#: peer that died or never joined) then raises in the surviving ranks instead of waiting out
#: gloo's 30-minute default; the harness's own hard timeout catches anything that still hangs.
COLLECTIVE_TIMEOUT_S = 30.0


def _rank_main(
    fn: Callable[..., Any], args: tuple[Any, ...], backend: str, collective_timeout_s: float
) -> Any:
    """One rank: join the process group from torchrun's environment, run ``fn``, leave."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=collective_timeout_s))
    # No try/finally: when fn raises, the group dies with the process. Destroying it first would
    # tell the peers, whose own errors could then be reported before this rank's, the cause.
    value = fn(*args)
    dist.destroy_process_group()
    return value


def run_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    timeout: float = 60.0,
    link: str | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` ranks inside a process group; return each rank's value.

    ``fn`` must be a module-level function (it is pickled by name into fresh processes) and its
    return value picklable. With ``link`` the ranks run on an emulated network of that rate (see
    :mod:`interlace.netem`; needs root). The whole job is stopped after ``timeout`` seconds.

    Raises :class:`~interlace.errors.RankFailedError` naming the first rank that failed, with its
    traceback in the message, or :class:`TimeoutError` naming the ranks that were still running.
    """
    collective_timeout = min(COLLECTIVE_TIMEOUT_S, max(timeout, 1.0))
    result = launch.run(
        _rank_main,
        nprocs,
        link,
        args=(fn, tuple(args), backend, collective_timeout),
        timeout=timeout,
        prefix_rank0=True,
    ).check()
    return result.values


@functools.lru_cache(maxsize=1)
def netns_available() -> tuple[bool, str]:
    """Whether an emulated cluster can be built here, and if not, why (a skip reason).

    True needs root, ``ip`` and ``tc``, and a namespace with a tbf-shaped veth that can actually
    be created and removed (containers may forbid it even to root). Cached per process.
    """
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "iproute2 (ip, tc) not installed"
    try:
        netem.check_available()
    except netem.NetemUnavailableError as exc:
        return False, str(exc)
    return True, "network namespaces available"
