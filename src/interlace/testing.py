"""The multi-rank harness: run a function on N spawned gloo ranks and get their return values.

Tests and benchmarks of distributed code share one way of starting ranks (:func:`run_ranks`), one
hard timeout and one failure report. Torch is imported only inside the ranks, so importing this
module (e.g. from a conftest) is cheap.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

from interlace import launch
from interlace.launch import netem

__all__ = ["average_gradients", "netns_available", "raised_message", "run_ranks", "run_scenarios"]

_T = TypeVar("_T")

#: Upper bound on how long one collective may block inside the harness. A broken collective (a
#: peer that died or never joined) then raises in the surviving ranks instead of waiting out
#: gloo's 30-minute default; the harness's own hard timeout catches anything that still hangs.
COLLECTIVE_TIMEOUT_S = 30.0


def _rank_main(
    fn: Callable[..., Any], args: tuple[Any, ...], backend: str, collective_timeout_s: float
) -> Any:
    """One rank: join the process group from torchrun's environment, run ``fn``, leave."""
    # Imported here, in the spawned rank, so that importing the harness stays cheap.
    import torch  # noqa: PLC0415 - a spawned rank's entry point
    import torch.distributed as dist  # noqa: PLC0415 - a spawned rank's entry point

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

    The ranks start through :func:`interlace.launch.run`, in fresh processes with torchrun's
    environment, and each joins a process group before calling ``fn``.

    Args:
        fn: A module-level function (it is pickled by name into fresh processes) whose return
            value is picklable.
        nprocs: The number of ranks.
        *args: Passed to ``fn`` on every rank.
        timeout: Stop the whole job after this many seconds.
        link: Run the ranks on an emulated network of this rate (see
            :mod:`interlace.launch.netem`; needs root).
        backend: The process group's backend (``gloo`` or ``nccl``).

    Returns:
        Each rank's return value, by rank.

    Raises:
        RankFailedError: Naming the first rank that failed, its traceback in the message.
        TimeoutError: Naming the ranks that were still running.
    """
    collective_timeout = min(COLLECTIVE_TIMEOUT_S, max(timeout, 1.0))
    result = launch.run(
        _rank_main,
        nprocs,
        link,
        args=(fn, tuple(args), backend, collective_timeout),
        timeout=timeout,
        prefix_rank0=True,
        collective_timeout=collective_timeout,
    ).check()
    return result.values


def run_scenarios(scenarios: Mapping[str, Callable[[], _T]]) -> dict[str, _T]:
    """Each scenario's result on this rank, run in order; one that raises is named in the error.

    For several scenarios sharing one launch of ranks (starting ranks costs more than most
    scenarios do), so that a failure still says which scenario it was.

    Args:
        scenarios: Each scenario's name and its function of no arguments.

    Raises:
        RuntimeError: Naming the scenario that raised, with its error chained.
    """
    results: dict[str, _T] = {}
    for name, scenario in scenarios.items():
        try:
            results[name] = scenario()
        except Exception as error:
            raise RuntimeError(f"scenario {name!r} failed") from error
    return results


def average_gradients(model: Any) -> None:
    """Average every parameter's gradient across the default group in place, as DDP leaves
    them after backward: what a test without a data-parallel wrapper does before K-FAC's step.
    A parameter with no gradient on this rank counts as zeros, so every rank issues the same
    all-reduces; on one process (or none initialised) nothing changes.

    Args:
        model: The ``torch.nn.Module`` whose gradients to average.
    """
    import torch  # noqa: PLC0415 - run on a rank; importing this module stays torch-free
    import torch.distributed as dist  # noqa: PLC0415 - as above

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    for param in model.parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad)
        param.grad /= world


def raised_message(call: Callable[[], Any]) -> str:
    """The message of the error ``call`` raises, or ``"no error"``: for checking, on every rank
    of a shared launch, what a refusal tells the user.

    Args:
        call: A function of no arguments expected to raise.
    """
    try:
        call()
    except Exception as error:  # what a user would see, whatever its class
        return str(error)
    return "no error"


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
