"""Supervising a job's ranks: start them, wait, stop them all when one fails, clean up on signals.

:func:`run` is the launcher; everything a killed launcher would leave behind (ranks, namespaces,
job files) is undone on every way out of it, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from interlace.comm.links import parse_link
from interlace.errors import UsageError
from interlace.launch import netem
from interlace.launch.diagnose import (
    explain_timeout,
    failure_text,
    finished_before_exit,
    is_collective_timeout,
)
from interlace.launch.env import die_with_launcher, job_envs
from interlace.launch.output import Output, pump
from interlace.launch.rank import collective_timeout_s
from interlace.launch.result import TIMEOUT_STATUS, LaunchResult
from interlace.launch.worker import (
    WORKDIR_PREFIX,
    check_executable,
    collect_results,
    command_for,
    earliest_error,
    read_result,
    remove_stale_workdirs,
)

__all__ = ["CAUSE_WINDOW_S", "GRACE_S", "describe_exit", "run"]

#: Seconds between SIGTERM and SIGKILL when stopping ranks: long enough for a rank to flush its
#: output and run its ``finally`` blocks, short enough that a failed job is over in seconds.
GRACE_S = 3.0
#: After a rank that raised exits, how long to wait for a peer that died without raising (whose
#: death would be the cause) before reporting the raising rank.
CAUSE_WINDOW_S = 2.0

#: Lines of a failing rank's stderr kept for the error message when no result file says more.
_STDERR_TAIL = 60

_Exits = queue.Queue[tuple[int, int]]


# -- process bookkeeping --------------------------------------------------------------------------


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    threads: list[threading.Thread]
    stderr_tail: deque[str] | None


def _signal_group(proc: subprocess.Popen[bytes], signo: int) -> None:
    """Send ``signo`` to the process group the rank leads (it started its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signo)


def _stop_ranks(ranks: Sequence[_Rank], grace_s: float = GRACE_S) -> None:
    """SIGTERM every rank's process group, then SIGKILL whatever is left after ``grace_s``."""
    for r in ranks:
        if r.proc.poll() is None:
            _signal_group(r.proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for r in ranks:
        remaining = deadline - time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.proc.wait(timeout=max(remaining, 0.0))
    for r in ranks:
        # Also for ranks that exited: children they left in their group (data loader workers,
        # a shell's children) would otherwise outlive the job and hold its output pipes open.
        _signal_group(r.proc, signal.SIGKILL)
    for r in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.proc.wait(timeout=5.0)


class _Job:
    """What must be undone if the launcher dies: live ranks and an emulated cluster."""

    def __init__(self) -> None:
        self.ranks: list[_Rank] = []
        self.cluster: netem.EmulatedCluster | None = None
        self.workdir: Path | None = None
        self._cleaned = False

    def cleanup(self, grace_s: float = GRACE_S) -> None:
        """Stop every rank and remove the emulated network; safe to call again."""
        if self._cleaned:
            return
        try:
            _stop_ranks(self.ranks, grace_s)
        finally:
            if self.cluster is not None:
                self.cluster.close()
        # Only now: a cleanup cut short (by an exception) is redone by the next call.
        self._cleaned = True

    def remove_workdir(self) -> None:
        """Delete the job file and the ranks' result files (after the results were read)."""
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


_active_jobs: set[_Job] = set()


@atexit.register
def _cleanup_at_exit() -> None:
    # Reached when the interpreter exits while a job is still running (e.g. SystemExit raised in
    # another thread's callback); the normal paths clean up in run()'s finally.
    for job in list(_active_jobs):
        job.cleanup(grace_s=1.0)
        job.remove_workdir()


# -- signals --------------------------------------------------------------------------------------


class _Terminated(BaseException):
    """Raised in the main thread by a SIGTERM/SIGHUP handler so ``finally`` blocks run."""

    def __init__(self, signo: int) -> None:
        super().__init__(signo)
        self.signo = signo


def _raise_terminated(signo: int, frame: FrameType | None) -> None:
    raise _Terminated(signo)


@contextlib.contextmanager
def _termination_raises() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into an exception while a job runs (main thread only), and make
    Ctrl-C raise KeyboardInterrupt even if the launcher started with SIGINT ignored.

    Their default action kills the launcher on the spot, leaving ranks running and namespaces
    behind; as an exception they unwind through the cleanup like Ctrl-C does. A shell starts
    background commands with SIGINT ignored, where ``kill -INT`` would otherwise do nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise_terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for signo, handler in previous.items():
            signal.signal(signo, handler)


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Ignore Ctrl-C and SIGTERM while cleaning up, so a second one cannot leave a mess."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        yield
    finally:
        for signo, handler in previous.items():
            signal.signal(signo, handler)


# -- exits ----------------------------------------------------------------------------------------


def describe_exit(returncode: int) -> tuple[str, int]:
    """How a rank ended, in words, and the job status it implies (128 + signal for a signal).

    Args:
        returncode: The rank's :attr:`subprocess.Popen.returncode` (negative for a signal).
    """
    if returncode < 0:
        signo = -returncode
        try:
            name = signal.Signals(signo).name
        except ValueError:
            name = f"signal {signo}"
        return f"was killed by {name}", 128 + signo
    return f"exited with status {returncode}", returncode


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _wait_for(rank: int, proc: subprocess.Popen[bytes], exits: _Exits) -> None:
    """Report ``(rank, status)`` on ``exits`` when the rank's process ends."""
    exits.put((rank, proc.wait()))


def _abrupt_exit_soon(
    exits: _Exits, running: set[int], workdir: Path, window_s: float
) -> tuple[int, int] | None:
    """The first rank to exit non-zero without an exception record within ``window_s``, if
    any (the exits of ranks that raised are taken off the queue meanwhile)."""
    deadline = time.monotonic() + window_s
    while running:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        try:
            rank, status = exits.get(timeout=remaining)
        except queue.Empty:
            return None
        running.discard(rank)
        if status != 0 and read_result(workdir, rank) is None:
            return rank, status
    return None


# -- the launcher ---------------------------------------------------------------------------------


def run(
    target: Callable[..., Any] | str | Sequence[str],
    nprocs: int,
    link: str | None = None,
    *,
    args: Sequence[Any] = (),
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    prefix_rank0: bool = False,
    output: TextIO | None = None,
    master_port: int | None = None,
    collective_timeout: float | None = None,
) -> LaunchResult:
    """Run ``target`` on ``nprocs`` local ranks and wait for all of them.

    Each rank gets torchrun's environment. Output lines are prefixed ``[rank K] ``, rank 0's
    only with ``prefix_rank0`` (otherwise rank 0 writes straight to this process's streams).
    When a rank fails the others are stopped (SIGTERM, then SIGKILL after :data:`GRACE_S`) and
    the result names the first failing rank and its status. The result is returned, not raised:
    call :meth:`LaunchResult.check` to raise on failure.

    Args:
        target: A module-level callable (each rank runs ``target(*args)`` and its return value
            lands in :attr:`LaunchResult.values`), a ``.py`` script path (run with this
            interpreter and ``args`` as its arguments), or a command line.
        nprocs: The number of ranks.
        link: A link rate (see :func:`~interlace.comm.links.parse_link`): the ranks then run on
            an :class:`~interlace.launch.netem.EmulatedCluster`, removed on every way out.
        args: The callable's arguments, or extra command-line arguments.
        timeout: Stop every rank this many seconds after the start.
        env: Added to (and overriding) the inherited environment.
        prefix_rank0: Prefix rank 0's lines too.
        output: Receives every line instead of sys.stdout/sys.stderr.
        master_port: The rendezvous port (a free one by default).
        collective_timeout: Seconds any one collective may wait for its peers in every rank
            whose process group is made without an explicit timeout (``$INTERLACE_COLLECTIVE_
            TIMEOUT`` or 300 s by default). When one times out, the launcher names the rank
            that stopped making progress, from the ranks' heartbeats.

    Raises:
        UsageError: For bad arguments, or when the emulated network cannot be built here.
        KeyboardInterrupt: On Ctrl-C, after cleanup.
        SystemExit: ``128 + signal`` on SIGTERM or SIGHUP, after cleanup.
    """
    if nprocs < 1:
        raise UsageError(f"the number of ranks must be >= 1, got {nprocs}")
    link_name: str | None = None
    if link is not None:
        parse_link(link)
        link_name = link.strip().lower()
        netem.check_available()
    if timeout is not None and timeout <= 0:
        raise UsageError(f"timeout must be > 0 seconds, got {timeout}")
    if collective_timeout is None:
        collective_timeout = collective_timeout_s({**os.environ, **(env or {})})
    elif not 0 < collective_timeout < float("inf"):
        raise UsageError(f"collective timeout must be > 0 seconds, got {collective_timeout}")

    sink = Output(output)
    job = _Job()
    remove_stale_workdirs()
    _sweep_stale_networks(sink)
    job.workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))
    start = time.monotonic()
    _active_jobs.add(job)
    try:
        with _termination_raises():
            try:
                return _run_job(
                    job,
                    target,
                    nprocs,
                    link=link_name,
                    args=args,
                    timeout=timeout,
                    env=env,
                    prefix_rank0=prefix_rank0,
                    sink=sink,
                    master_port=master_port,
                    start=start,
                    collective_timeout=collective_timeout,
                )
            except _Terminated as exc:
                sink.message(f"received {signal.Signals(exc.signo).name}; stopping all ranks")
                with _interrupts_deferred():
                    job.cleanup()
                raise SystemExit(128 + exc.signo) from None
            except KeyboardInterrupt:
                sink.message("interrupted; stopping all ranks")
                with _interrupts_deferred():
                    job.cleanup()
                raise
    finally:
        with _interrupts_deferred():
            job.cleanup()
            job.remove_workdir()
        _active_jobs.discard(job)


def _sweep_stale_networks(sink: Output) -> None:
    """Remove namespaces and veths of launchers that were killed (SIGKILL leaves them behind).

    Only names this module's own pattern makes, whose launcher PID is no longer alive; needs
    root, and without root there is nothing of ours to remove.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return
    removed = netem.cleanup_stale()
    if removed:
        sink.message(
            f"removed the network left by a launcher that was killed: {', '.join(removed)}"
        )


@dataclass
class _Watch:
    """What waiting for a job's ranks needs: their exits as they happen, and their results."""

    exits: _Exits
    nprocs: int
    workdir: Path
    is_worker: bool
    collective_timeout: float
    stderr_tails: list[deque[str] | None] = field(default_factory=list)


@dataclass
class _Ending:
    """How the wait for the ranks ended: the rank blamed and its status, or a timeout."""

    failed_rank: int | None = None
    returncode: int = 0
    timed_out: bool = False
    hung: list[int] = field(default_factory=list)
    stuck: list[int] = field(default_factory=list)
    reason: str = ""


def _run_job(
    job: _Job,
    target: Callable[..., Any] | str | Sequence[str],
    nprocs: int,
    *,
    link: str | None,
    args: Sequence[Any],
    timeout: float | None,
    env: Mapping[str, str] | None,
    prefix_rank0: bool,
    sink: Output,
    master_port: int | None,
    start: float,
    collective_timeout: float,
) -> LaunchResult:
    """Start the ranks, wait for the first failure (or the end), stop them, read the results."""
    assert job.workdir is not None
    workdir = job.workdir
    argv, is_worker = command_for(target, args, workdir)
    if link is not None:
        job.cluster = netem.EmulatedCluster(nprocs, link)
    envs = job_envs(
        nprocs,
        env=env,
        cluster=job.cluster,
        link=link,
        master_port=master_port,
        result_dir=workdir if is_worker else None,
        state_dir=workdir,
        collective_timeout_s=collective_timeout,
    )
    if not is_worker:
        check_executable(argv[0], envs[0].get("PATH"))
    watch = _Watch(queue.Queue(), nprocs, workdir, is_worker, collective_timeout)
    for rank, rank_env in enumerate(envs):
        _start_rank(job, rank, argv, rank_env, watch.exits, sink=sink, prefix_rank0=prefix_rank0)
        watch.stderr_tails.append(job.ranks[-1].stderr_tail)

    deadline = None if timeout is None else start + timeout
    ending = _wait_for_ranks(watch, sink, deadline=deadline, timeout=timeout)

    with _interrupts_deferred():
        job.cleanup()
    for r in job.ranks:
        for thread in r.threads:
            thread.join(timeout=2.0)

    values, tracebacks = collect_results(workdir, nprocs, is_worker)
    failed_rank = ending.failed_rank
    if failed_rank is not None and failed_rank not in tracebacks:
        tail = job.ranks[failed_rank].stderr_tail
        if tail:
            tracebacks[failed_rank] = "".join(tail)
    return LaunchResult(
        returncode=TIMEOUT_STATUS if ending.timed_out else ending.returncode,
        failed_rank=failed_rank,
        values=values,
        tracebacks=tracebacks,
        elapsed_s=time.monotonic() - start,
        timed_out=ending.timed_out,
        hung_ranks=ending.hung,
        stuck_ranks=ending.stuck,
        reason=ending.reason,
    )


def _start_rank(
    job: _Job,
    rank: int,
    argv: list[str],
    env: dict[str, str],
    exits: _Exits,
    *,
    sink: Output,
    prefix_rank0: bool,
) -> None:
    """Start one rank, the threads that copy its output, and the one that reports its exit."""
    cluster = job.cluster
    rank_argv = cluster.wrap(rank, argv) if cluster is not None else argv
    piped = rank != 0 or prefix_rank0 or sink.captured
    try:
        proc = subprocess.Popen(
            rank_argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if piped else None,
            stderr=subprocess.PIPE if piped else None,
            # Its own session and process group: stopping a rank reaches its children too, and
            # a Ctrl-C at the terminal reaches only the launcher, which then stops ranks in order.
            start_new_session=True,
            # Dies with the launcher, even one killed by SIGKILL, which gets no chance to stop it.
            preexec_fn=die_with_launcher(),  # noqa: PLW1509 - one prctl call, resolved pre-fork
        )
    except OSError as exc:  # checked before the start, so only a race or an odd file gets here
        raise UsageError(f"cannot start rank {rank}: {argv[0]}: {exc.strerror or exc}") from None
    tail: deque[str] | None = deque(maxlen=_STDERR_TAIL) if piped else None
    threads: list[threading.Thread] = []
    if piped:
        prefix = f"[rank {rank}] " if rank != 0 or prefix_rank0 else ""
        assert proc.stdout is not None and proc.stderr is not None
        for pipe, is_err in ((proc.stdout, False), (proc.stderr, True)):
            thread = threading.Thread(
                target=pump,
                args=(pipe, prefix, sink, is_err, tail if is_err else None),
                name=f"interlace-rank{rank}-{'err' if is_err else 'out'}",
                daemon=True,
            )
            thread.start()
            threads.append(thread)
    job.ranks.append(_Rank(rank, proc, threads, tail))
    waiter = threading.Thread(
        target=_wait_for,
        args=(rank, proc, exits),
        name=f"interlace-rank{rank}-wait",
        daemon=True,
    )
    waiter.start()


def _wait_for_ranks(
    watch: _Watch, sink: Output, *, deadline: float | None, timeout: float | None
) -> _Ending:
    """Wait until every rank exited 0, one failed, or the deadline passed; say which it was.

    Exits are taken in the order they happen, so the failure reported is the one that came first
    (a rank that dies makes its peers fail in their collectives a moment later).
    """
    exits = watch.exits
    running = set(range(watch.nprocs))
    while running:
        wait_s = None if deadline is None else deadline - time.monotonic()
        if wait_s is not None and wait_s <= 0:
            hung = sorted(running)
            sink.message(
                f"timed out after {timeout:g} s; stopping {_plural(len(hung), 'rank')} still "
                f"running: {', '.join(map(str, hung))}"
            )
            return _Ending(timed_out=True, hung=hung)
        try:
            # Bounded waits keep the main thread responsive to Ctrl-C on every platform.
            rank, status = exits.get(timeout=0.5 if wait_s is None else min(wait_s, 0.5))
        except queue.Empty:
            continue
        running.discard(rank)
        if status == 0:
            continue
        if finished_before_exit(watch.workdir, rank):
            how, _ = describe_exit(status)
            sink.message(
                f"warning: rank {rank} had finished (its code returned) but then {how} while "
                "the interpreter shut down; counting it as finished"
            )
            continue
        failed_rank, returncode, how = _blame(watch, rank, status, running)
        text = failure_text(watch.workdir, failed_rank, watch.stderr_tails[failed_rank])
        if is_collective_timeout(text):
            stuck, reason = explain_timeout(
                watch.workdir, failed_rank, running, watch.collective_timeout, watch.nprocs
            )
            alive = len(running)
            stopping = f"stopping {_plural(alive, 'rank')} still running" if alive else "none left"
            sink.message(f"{reason}; {stopping}")
            blamed = stuck[0] if stuck else failed_rank
            return _Ending(failed_rank=blamed, returncode=returncode, stuck=stuck, reason=reason)
        others = len(running - {failed_rank})
        stopping = f"stopping the other {_plural(others, 'rank')}" if others else "none left"
        sink.message(f"rank {failed_rank} {how}; {stopping}")
        return _Ending(failed_rank=failed_rank, returncode=returncode)
    return _Ending()


def _blame(watch: _Watch, rank: int, status: int, running: set[int]) -> tuple[int, int, str]:
    """The rank whose failure caused the job's, its job status, and how it ended in words.

    ``rank`` is the first rank seen to exit non-zero, with ``status``; ``running`` loses the
    ranks whose exits are taken off the queue meanwhile.
    """
    workdir, is_worker = watch.workdir, watch.is_worker
    if is_worker and read_result(workdir, rank) is not None:
        # This rank raised. If a peer died without raising (killed, os._exit), its death
        # broke this rank's collective and is the cause, though the peer's exit may reach
        # us a moment later on a loaded machine: wait briefly for one.
        abrupt = _abrupt_exit_soon(watch.exits, running, workdir, CAUSE_WINDOW_S)
        if abrupt is not None:
            rank, status = abrupt
            running.discard(rank)
    how, returncode = describe_exit(status)
    failed_rank = rank
    # A rank that died without raising is the cause: a peer's exception cannot kill it, it
    # can only make it raise too. Its exit may be seen late on a loaded machine, after the
    # exceptions its death caused were caught, so their times must not outrank it.
    raised = is_worker and read_result(workdir, rank) is not None
    first = earliest_error(workdir, watch.nprocs) if raised else None
    if first is not None and first[0] != rank:
        # A rank that raises makes its peers fail in their collectives a moment later, and
        # a peer can exit first; the exception caught earliest is the cause to report.
        failed_rank, returncode = first
        how = f"failed with status {returncode} (rank {rank} {how} after it)"
    return failed_rank, returncode, how
