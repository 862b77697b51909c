"""Why a job failed, read from its ranks' heartbeats: who stopped, who gave up waiting for it.

When a collective times out, the rank that reports the error is the one that waited; the cause
is a peer that never arrived. The heartbeats (see :mod:`interlace.launch.rank`) say where every
rank still running is, so the launcher can name the one that is not in a collective.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from pathlib import Path

from interlace.launch.rank import (
    COLLECTIVE_TIMEOUT_VARIABLE,
    STALE_AFTER_S,
    RankState,
    read_state,
)
from interlace.launch.worker import read_result

__all__ = ["explain_timeout", "failure_text", "finished_before_exit", "is_collective_timeout"]

# gloo: "Timed out waiting 5000ms for recv operation"; the store: "Socket Timeout"; NCCL's
# watchdog: "collective operation timeout".
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)


def failure_text(workdir: Path, rank: int, stderr_tail: Iterable[str] | None) -> str:
    """Everything known about how ``rank`` failed: its heartbeat's error, traceback, stderr.

    Args:
        workdir: The job's folder.
        rank: The failed rank.
        stderr_tail: The last lines of its stderr, if they were kept.
    """
    parts = []
    state = read_state(workdir, rank)
    if state is not None and state.error:
        parts.append(state.error)
    record = read_result(workdir, rank)
    if record is not None and not record.get("ok"):
        parts.append(str(record.get("traceback", "")))
    if stderr_tail is not None:
        parts.append("".join(stderr_tail))
    return "\n".join(parts)


def is_collective_timeout(text: str) -> bool:
    """Whether a rank's error says it gave up waiting (a collective or store timeout).

    Args:
        text: The rank's error, traceback or stderr (see :func:`failure_text`).
    """
    return _TIMEOUT.search(text) is not None


def finished_before_exit(workdir: Path, rank: int) -> bool:
    """Whether ``rank``'s code had returned before its process ended (so a crash came after).

    Args:
        workdir: The job's folder.
        rank: The rank whose process ended.
    """
    state = read_state(workdir, rank)
    if state is not None and state.state == "returned":
        return True
    record = read_result(workdir, rank)
    return record is not None and bool(record.get("ok"))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def explain_timeout(
    workdir: Path, waiter: int, running: Iterable[int], timeout_s: float, nprocs: int
) -> tuple[list[int], str]:
    """The ranks that stopped making progress, and one line that names them and the waiter.

    A rank still running whose heartbeat shows it outside any collective, or whose heartbeat
    went silent, is stuck: its peers wait for it. Ranks also waiting in a collective, or that
    timed out too, are only described; when they waited in different collectives, the line
    says so (the ranks disagree on what to run).

    Args:
        workdir: The job's folder.
        waiter: The rank whose collective timed out.
        running: The ranks still running.
        timeout_s: The collective timeout the ranks ran with.
        nprocs: The number of ranks.

    Returns:
        The stuck ranks (possibly none) and the launcher's message.
    """
    now = time.time()
    states: dict[int, RankState] = {}
    for rank in sorted(running):
        state = read_state(workdir, rank)
        if state is not None and state.state == "running":
            states[rank] = state
    # Outside any collective, or silent (a frozen process, or one stuck in a native call that
    # holds Python's lock): either way its peers are waiting for it.
    stuck = [
        rank
        for rank, state in states.items()
        if state.collective is None or now - state.beat > STALE_AFTER_S
    ]
    how_to_change = f"--collective-timeout or ${COLLECTIVE_TIMEOUT_VARIABLE} changes it"
    if stuck:
        if len(stuck) == 1:
            where = states[stuck[0]].describe(now)
        else:
            where = "; ".join(f"rank {rank} {states[rank].describe(now)}" for rank in stuck)
        return stuck, (
            f"{_ranks(stuck)} stopped making progress ({where}); rank {waiter} timed out "
            f"waiting for {'it' if len(stuck) == 1 else 'them'} after the {timeout_s:g} s "
            f"collective timeout ({how_to_change})"
        )
    own = read_state(workdir, waiter)
    waited_in = [own.collective] if own is not None and own.collective else []
    message = (
        f"rank {waiter} timed out waiting in "
        f"{_in(own) if own is not None and own.collective else 'a collective'} after the "
        f"{timeout_s:g} s collective timeout ({how_to_change})"
    )
    notes = [f"rank {rank} {state.describe(now)}" for rank, state in states.items()]
    for rank in range(nprocs):
        other = read_state(workdir, rank) if rank != waiter and rank not in states else None
        if (
            other is not None
            and other.state == "raised"
            and is_collective_timeout(other.error or "")
        ):
            notes.append(f"rank {rank} timed out too, waiting in {_in(other)}")
            waited_in += [other.collective] if other.collective else []
    if len(set(waited_in) - {"wait"}) > 1:
        notes.append("the ranks called different collectives")
    return [], "; ".join([message, *notes])


def _in(state: RankState) -> str:
    """``all_reduce at step (job.py:12)``: the collective a state waits in, and where."""
    return f"{state.collective or 'a collective'} at {state.where}"
