"""The environment each rank starts with: torchrun's env:// contract, the rendezvous port, and
the parent-death signal that ends it with its launcher."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from interlace.launch.netem import EmulatedCluster
from interlace.launch.rank import COLLECTIVE_TIMEOUT_VARIABLE, STATE_DIR_VARIABLE
from interlace.launch.worker import RESULT_DIR_VARIABLE

__all__ = [
    "LINK_VARIABLE",
    "die_with_launcher",
    "free_port",
    "job_envs",
    "rank_env",
    "worker_pythonpath",
]

#: Carries the emulated link's rate into the ranks (absent on plain loopback).
LINK_VARIABLE = "INTERLACE_LINK"


def free_port() -> int:
    """A TCP port free on loopback now (the rendezvous store binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def rank_env(
    rank: int,
    nprocs: int,
    *,
    base: Mapping[str, str],
    master_addr: str,
    master_port: int,
    run_id: str,
    cluster: EmulatedCluster | None,
    link: str | None,
    result_dir: Path | None,
    pythonpath: str | None,
    state_dir: Path | None = None,
    collective_timeout_s: float | None = None,
) -> dict[str, str]:
    """torchrun's env:// contract for one rank, plus what the emulated network needs.

    Args:
        rank: This rank.
        nprocs: The number of ranks.
        base: The environment to start from (the launcher's, with the caller's additions).
        master_addr: Where the rendezvous store listens.
        master_port: Its port.
        run_id: The job's ``TORCHELASTIC_RUN_ID``.
        cluster: The emulated cluster the ranks run on, or None for loopback.
        link: The emulated link's rate name (with ``cluster``).
        result_dir: Where a callable's worker writes its result, or None for a command.
        pythonpath: The worker's ``PYTHONPATH``, or None to keep the inherited one.
        state_dir: Where the rank writes its heartbeat, or None for none.
        collective_timeout_s: The rank's collective timeout, or None to keep the inherited one.
    """
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(nprocs),
        ROLE_NAME="default",
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
    )
    if nprocs > 1:
        # torchrun's default: N ranks each using every core would oversubscribe the machine N-fold.
        env.setdefault("OMP_NUM_THREADS", "1")
    # Ranks write into pipes; unbuffered, their lines reach the terminal as they are printed.
    env.setdefault("PYTHONUNBUFFERED", "1")
    if cluster is not None and link is not None:
        # gloo picks an interface by resolving the hostname; in a namespace that finds nothing
        # reachable and the rendezvous hangs, so name the rank's NIC explicitly.
        env["GLOO_SOCKET_IFNAME"] = cluster.ifname(rank)
        env[LINK_VARIABLE] = link
    else:
        env.pop(LINK_VARIABLE, None)
    if result_dir is not None:
        env[RESULT_DIR_VARIABLE] = str(result_dir)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    if state_dir is not None:
        env[STATE_DIR_VARIABLE] = str(state_dir)
    if collective_timeout_s is not None:
        env[COLLECTIVE_TIMEOUT_VARIABLE] = f"{collective_timeout_s:g}"
    return env


def worker_pythonpath(base: Mapping[str, str]) -> str:
    """The parent's ``sys.path`` for a worker, so it imports the target's module as we did.

    Args:
        base: The environment the worker inherits (its ``PYTHONPATH`` is kept, last).
    """
    entries = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    existing = base.get("PYTHONPATH")
    if existing:
        entries.append(existing)
    return os.pathsep.join(dict.fromkeys(entries))


def job_envs(
    nprocs: int,
    *,
    env: Mapping[str, str] | None,
    cluster: EmulatedCluster | None,
    link: str | None,
    master_port: int | None,
    result_dir: Path | None,
    state_dir: Path | None = None,
    collective_timeout_s: float | None = None,
) -> list[dict[str, str]]:
    """Every rank's environment for one job, sharing one rendezvous address, port and run id.

    Args:
        nprocs: The number of ranks.
        env: Added to (and overriding) the launcher's own environment.
        cluster: The emulated cluster the ranks run on, or None for loopback.
        link: The emulated link's rate name (with ``cluster``).
        master_port: The rendezvous port, or None for a free one.
        result_dir: Where callable workers write their results, or None for a command.
        state_dir: Where every rank writes its heartbeat, or None for none.
        collective_timeout_s: Every rank's collective timeout, or None to keep the inherited one.
    """
    base = dict(os.environ)
    if env is not None:
        base.update(env)
    pythonpath = worker_pythonpath(base) if result_dir is not None else None
    master_addr = cluster.master_addr if cluster is not None else "127.0.0.1"
    # Inside a fresh namespace every port is free; on loopback, ask the kernel for one.
    port = master_port if master_port is not None else free_port()
    run_id = f"interlace-{uuid.uuid4().hex[:12]}"
    return [
        rank_env(
            rank,
            nprocs,
            base=base,
            master_addr=master_addr,
            master_port=port,
            run_id=run_id,
            cluster=cluster,
            link=link,
            result_dir=result_dir,
            pythonpath=pythonpath,
            state_dir=state_dir,
            collective_timeout_s=collective_timeout_s,
        )
        for rank in range(nprocs)
    ]


#: ``prctl(PR_SET_PDEATHSIG, ...)``: the signal a process receives when its parent dies.
_PR_SET_PDEATHSIG = 1


def die_with_launcher() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the rank receive SIGKILL when the launcher dies (Linux only).

    ``prctl`` is looked up here, before the fork: the child only makes the call. The signal
    fires when the thread that started the rank ends, which is no earlier than the launcher:
    :func:`interlace.launch.run` waits for its ranks in the thread that started them.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    launcher = os.getpid()

    def set_parent_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before the call: it would never fire
            os._exit(1)

    return set_parent_death_signal
