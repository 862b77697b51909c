"""A torchrun-compatible local launcher, optionally on an emulated network.

``interlace launch -n 4 --link 1gbit -- python train.py`` starts four ranks of ``train.py`` with
the environment torchrun gives (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), so any script
written for torchrun runs unchanged. What it adds:

* ``--link RATE`` runs each rank in its own network namespace behind a NIC shaped to RATE (see
  :mod:`interlace.netem`), so communication costs what it would on a real cluster;
* every rank's output is prefixed ``[rank K]`` (rank 0's is left alone, so its progress bars draw
  in place);
* when one rank fails, the others are stopped within seconds instead of waiting forever in a
  collective, and the job exits with the failing rank's status;
* the same machinery runs a Python callable on every rank (:func:`run`), which is how the test
  harness in :mod:`interlace.testing` spawns its ranks.

A callable runs in a fresh ``python -m interlace.launch --worker JOB`` process per rank; the
worker writes the return value, or the formatted exception, to a per-rank result file.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import os
import pickle
import queue
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any, TextIO

from interlace import netem
from interlace.cliutil import OneLineArgumentParser
from interlace.errors import RankFailedError, UsageError

__all__ = ["LaunchResult", "main", "run", "worker_main"]

PROG = "interlace launch"

#: Seconds between SIGTERM and SIGKILL when stopping ranks: long enough for a rank to flush its
#: output and run its ``finally`` blocks, short enough that a failed job is over in seconds.
GRACE_S = 3.0
#: After a rank that raised exits, how long to wait for a peer that died without raising (whose
#: death would be the cause) before reporting the raising rank.
CAUSE_WINDOW_S = 2.0

#: Exit status of a job stopped by ``timeout`` (the convention of coreutils ``timeout``).
TIMEOUT_STATUS = 124

#: Lines of a failing rank's stderr kept for the error message when no result file says more.
_STDERR_TAIL = 60

_WORKER_FLAG = "--worker"


@dataclass
class LaunchResult:
    """How a launched job ended.

    ``returncode`` is 0 on success, else the first failing rank's exit status (``128 + signal``
    when a signal killed it) or :data:`TIMEOUT_STATUS`. ``values`` holds each rank's return value
    for a callable target (``None`` for ranks that returned none) and is empty for a command;
    ``tracebacks`` maps a failing rank to its formatted exception (or the tail of its stderr).
    """

    returncode: int
    failed_rank: int | None
    values: list[Any]
    tracebacks: dict[int, str]
    elapsed_s: float
    timed_out: bool
    #: The ranks still running when ``timeout`` expired.
    hung_ranks: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every rank exited with status 0."""
        return self.returncode == 0 and not self.timed_out

    def check(self) -> LaunchResult:
        """Return ``self`` if the job succeeded; otherwise raise what went wrong.

        Raises :class:`TimeoutError` naming the ranks that were still running, or
        :class:`~interlace.errors.RankFailedError` carrying the failing rank's traceback.
        """
        if self.timed_out:
            raise TimeoutError(
                f"job timed out after {self.elapsed_s:.1f} s; ranks still running: "
                f"{', '.join(map(str, self.hung_ranks)) or 'none'}"
            )
        if self.returncode != 0:
            rank = -1 if self.failed_rank is None else self.failed_rank
            raise RankFailedError(rank, self.returncode, self.tracebacks.get(rank, ""))
        return self


# -- output ---------------------------------------------------------------------------------------


class _Output:
    """Serialises prefixed lines from many reader threads onto the launcher's streams."""

    def __init__(self, output: TextIO | None) -> None:
        self._output = output
        self._lock = threading.Lock()

    def write(self, text: str, *, stderr: bool) -> None:
        stream = self._output or (sys.stderr if stderr else sys.stdout)
        with self._lock:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):
                pass  # a closed or broken launcher stream must not take the job down with it

    @property
    def captured(self) -> bool:
        """Whether output goes to a caller's stream (then rank 0 must be piped into it too)."""
        return self._output is not None

    def message(self, text: str) -> None:
        """One line from the launcher itself (always to stderr, or to ``output`` if given)."""
        self.write(f"interlace launch: {text}\n", stderr=True)


def _pump(
    pipe: IO[bytes], prefix: str, sink: _Output, stderr: bool, tail: deque[str] | None
) -> None:
    """Copy ``pipe`` to ``sink`` line by line, each line prefixed; keep a tail if asked."""
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            if not line.endswith("\n"):
                line += "\n"
            sink.write(prefix + line, stderr=stderr)
            if tail is not None:
                tail.append(line)


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


class _Terminated(BaseException):
    """Raised in the main thread by a SIGTERM/SIGHUP handler so ``finally`` blocks run."""

    def __init__(self, signo: int) -> None:
        super().__init__(signo)
        self.signo = signo


def _raise_terminated(signo: int, frame: FrameType | None) -> None:
    raise _Terminated(signo)


@contextlib.contextmanager
def _termination_raises() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into an exception while a job runs (main thread only).

    Their default action kills the launcher on the spot, leaving ranks running and namespaces
    behind; as an exception they unwind through the cleanup like Ctrl-C does.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise_terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
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


# -- targets --------------------------------------------------------------------------------------


_WORKDIR_PREFIX = "interlace-launch-"


def _remove_stale_workdirs() -> None:
    """Delete job folders of launchers that died without cleaning up (their PID is in the name)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{_WORKDIR_PREFIX}*-*"):
        pid = folder.name[len(_WORKDIR_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not netem.pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _free_port() -> int:
    """A TCP port free on loopback now (the rendezvous store binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class _MainFinder(pickle.Pickler):
    """A pickler that notes whether anything pickled by name lives in ``__main__``."""

    uses_main = False

    def persistent_id(self, obj: Any) -> None:
        if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
            self.uses_main = True


def _main_source() -> dict[str, str]:
    """How a worker can re-create ``__main__``: the module it was run as (-m), or its file."""
    main_module = sys.modules.get("__main__")
    spec = getattr(main_module, "__spec__", None)
    if spec is not None and getattr(spec, "name", None):
        return {"module": spec.name}
    path = getattr(main_module, "__file__", None)
    if isinstance(path, str):
        return {"path": os.path.abspath(path)}
    return {}


def _write_job(workdir: Path, target: Callable[..., Any], args: Sequence[Any]) -> Path:
    """Pickle ``(target, args)`` for the workers; say clearly when that is impossible."""
    buffer = io.BytesIO()
    finder = _MainFinder(buffer)
    try:
        finder.dump((target, tuple(args)))
    except Exception as exc:
        raise UsageError(
            f"cannot send {target!r} and its arguments to the ranks ({exc}); the target must be a "
            "module-level function and its arguments picklable"
        ) from exc
    main: dict[str, str] = {}
    if finder.uses_main:
        # Like multiprocessing's spawn: the workers re-create the launching script as
        # __mp_main__ so that functions and classes defined in it can be found by name.
        main = _main_source()
        if not main:
            raise UsageError(
                f"cannot run {target!r} on the ranks: it uses code defined in an interactive "
                "session; define it in a module or script file"
            )
    path = workdir / "job.pkl"
    path.write_bytes(pickle.dumps({"main": main, "payload": buffer.getvalue()}))
    return path


def _command_for(
    target: Callable[..., Any] | str | Sequence[str], args: Sequence[Any], workdir: Path
) -> tuple[list[str], bool]:
    """The command each rank runs, and whether it is the callable worker."""
    if isinstance(target, str):
        if not target.endswith(".py"):
            raise UsageError(f"a script target must end in .py, got {target!r}")
        return [sys.executable, target, *map(str, args)], False
    if callable(target):
        job = _write_job(workdir, target, args)
        return [sys.executable, "-m", "interlace.launch", _WORKER_FLAG, str(job)], True
    command = [str(part) for part in target]
    if not command:
        raise UsageError("no command to launch")
    return [*command, *map(str, args)], False


def _rank_env(
    rank: int,
    nprocs: int,
    *,
    base: Mapping[str, str],
    master_addr: str,
    master_port: int,
    run_id: str,
    cluster: netem.EmulatedCluster | None,
    link: str | None,
    result_dir: Path | None,
    pythonpath: str | None,
) -> dict[str, str]:
    """torchrun's env:// contract for one rank, plus what the emulated network needs."""
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
        env["INTERLACE_LINK"] = link
    else:
        env.pop("INTERLACE_LINK", None)
    if result_dir is not None:
        env["INTERLACE_RESULT_DIR"] = str(result_dir)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return env


def _pythonpath(base: Mapping[str, str]) -> str:
    """The parent's ``sys.path`` for a worker, so it imports the target's module as we did."""
    entries = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    existing = base.get("PYTHONPATH")
    if existing:
        entries.append(existing)
    return os.pathsep.join(dict.fromkeys(entries))


def _wait_for(
    rank: int, proc: subprocess.Popen[bytes], exits: queue.Queue[tuple[int, int]]
) -> None:
    """Report ``(rank, status)`` on ``exits`` when the rank's process ends."""
    exits.put((rank, proc.wait()))


def _describe_exit(returncode: int) -> tuple[str, int]:
    """How a rank ended, in words, and the job status it implies (128 + signal for a signal)."""
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
) -> LaunchResult:
    """Run ``target`` on ``nprocs`` local ranks and wait for all of them.

    ``target`` is a module-level callable (each rank runs ``target(*args)`` and its return value
    lands in :attr:`LaunchResult.values`), a ``.py`` script path (run with this interpreter and
    ``args`` as its arguments), or a command line. Each rank gets torchrun's environment; ``env``
    adds to (and overrides) the inherited one. With ``link`` (a :data:`netem.LINK_RATES` name)
    the ranks run on an :class:`~interlace.netem.EmulatedCluster`, which is removed on every
    way out of this function.

    Output lines are prefixed ``[rank K] ``; rank 0's only with ``prefix_rank0``, and otherwise
    rank 0 writes straight to this process's stdout/stderr (unless ``output`` is given, which
    receives every line instead of sys.stdout/sys.stderr). When a rank fails the others are
    stopped (SIGTERM, then SIGKILL after :data:`GRACE_S`) and the result carries the first
    failing rank and its status; ``timeout`` seconds after the start every rank is stopped.
    The result is returned, not raised: call :meth:`LaunchResult.check` to raise on failure.
    Ctrl-C propagates as KeyboardInterrupt and SIGTERM as ``SystemExit(143)``, after cleanup.
    """
    if nprocs < 1:
        raise UsageError(f"the number of ranks must be >= 1, got {nprocs}")
    link_name: str | None = None
    if link is not None:
        netem.parse_link(link)
        link_name = link.strip().lower()
        netem.check_available()
    if timeout is not None and timeout <= 0:
        raise UsageError(f"timeout must be > 0 seconds, got {timeout}")

    sink = _Output(output)
    job = _Job()
    _remove_stale_workdirs()
    job.workdir = Path(tempfile.mkdtemp(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-"))
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
    sink: _Output,
    master_port: int | None,
    start: float,
) -> LaunchResult:
    assert job.workdir is not None
    workdir = job.workdir
    argv, is_worker = _command_for(target, args, workdir)
    base = dict(os.environ)
    if env is not None:
        base.update(env)
    pythonpath = _pythonpath(base) if is_worker else None

    if link is not None:
        job.cluster = netem.EmulatedCluster(nprocs, link)
    cluster = job.cluster
    master_addr = cluster.master_addr if cluster is not None else "127.0.0.1"
    # Inside a fresh namespace every port is free; on loopback, ask the kernel for one.
    port = master_port if master_port is not None else _free_port()
    run_id = f"interlace-{uuid.uuid4().hex[:12]}"

    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    for rank in range(nprocs):
        rank_env = _rank_env(
            rank,
            nprocs,
            base=base,
            master_addr=master_addr,
            master_port=port,
            run_id=run_id,
            cluster=cluster,
            link=link,
            result_dir=workdir if is_worker else None,
            pythonpath=pythonpath,
        )
        rank_argv = cluster.wrap(rank, argv) if cluster is not None else argv
        piped = rank != 0 or prefix_rank0 or sink.captured
        proc = subprocess.Popen(
            rank_argv,
            env=rank_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if piped else None,
            stderr=subprocess.PIPE if piped else None,
            # Its own session and process group: stopping a rank reaches its children too, and a
            # Ctrl-C at the terminal reaches only the launcher, which then stops ranks in order.
            start_new_session=True,
        )
        tail: deque[str] | None = deque(maxlen=_STDERR_TAIL) if piped else None
        threads: list[threading.Thread] = []
        if piped:
            prefix = f"[rank {rank}] " if rank != 0 or prefix_rank0 else ""
            assert proc.stdout is not None and proc.stderr is not None
            for pipe, is_err in ((proc.stdout, False), (proc.stderr, True)):
                thread = threading.Thread(
                    target=_pump,
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

    # Wait for exits in the order they happen, so the failure reported is the one that came first
    # (a rank that dies makes its peers fail in their collectives a moment later).
    deadline = None if timeout is None else start + timeout
    running = set(range(nprocs))
    failed_rank: int | None = None
    returncode = 0
    timed_out = False
    hung: list[int] = []
    while running:
        wait_s = None if deadline is None else deadline - time.monotonic()
        if wait_s is not None and wait_s <= 0:
            timed_out = True
            hung = sorted(running)
            sink.message(
                f"timed out after {timeout:g} s; stopping {_plural(len(hung), 'rank')} still "
                f"running: {', '.join(map(str, hung))}"
            )
            break
        try:
            # Bounded waits keep the main thread responsive to Ctrl-C on every platform.
            rank, status = exits.get(timeout=0.5 if wait_s is None else min(wait_s, 0.5))
        except queue.Empty:
            continue
        running.discard(rank)
        if status == 0:
            continue
        if is_worker and _read_result(workdir, rank) is not None:
            # This rank raised. If a peer died without raising (killed, os._exit), its death
            # broke this rank's collective and is the cause, though the peer's exit may reach
            # us a moment later on a loaded machine: wait briefly for one.
            abrupt = _abrupt_exit_soon(exits, running, workdir, CAUSE_WINDOW_S)
            if abrupt is not None:
                rank, status = abrupt
                running.discard(rank)
        how, returncode = _describe_exit(status)
        failed_rank = rank
        # A rank that died without raising is the cause: a peer's exception cannot kill it, it
        # can only make it raise too. Its exit may be seen late on a loaded machine, after the
        # exceptions its death caused were caught, so their times must not outrank it.
        raised = is_worker and _read_result(workdir, rank) is not None
        first = _earliest_error(workdir, nprocs) if raised else None
        if first is not None and first[0] != rank:
            # A rank that raises makes its peers fail in their collectives a moment later, and
            # a peer can exit first; the exception caught earliest is the cause to report.
            failed_rank, returncode = first
            how = f"failed with status {returncode} (rank {rank} {how} after it)"
        others = len(running - {failed_rank})
        stopping = f"stopping the other {_plural(others, 'rank')}" if others else "none left"
        sink.message(f"rank {failed_rank} {how}; {stopping}")
        break

    with _interrupts_deferred():
        job.cleanup()
    for r in job.ranks:
        for thread in r.threads:
            thread.join(timeout=2.0)

    values, tracebacks = _collect_results(workdir, nprocs, is_worker)
    if failed_rank is not None and failed_rank not in tracebacks:
        tail = job.ranks[failed_rank].stderr_tail
        if tail:
            tracebacks[failed_rank] = "".join(tail)
    return LaunchResult(
        returncode=TIMEOUT_STATUS if timed_out else returncode,
        failed_rank=failed_rank,
        values=values,
        tracebacks=tracebacks,
        elapsed_s=time.monotonic() - start,
        timed_out=timed_out,
        hung_ranks=hung,
    )


def _read_result(workdir: Path, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s result record, or None if it wrote none (or it cannot be read)."""
    try:
        record = pickle.loads((workdir / f"result-{rank}.pkl").read_bytes())
    except FileNotFoundError:
        return None
    except Exception as exc:  # e.g. the value's class cannot be imported in the launcher
        return {"ok": False, "traceback": f"could not read rank {rank}'s result: {exc!r}"}
    return record if isinstance(record, dict) else None


def _abrupt_exit_soon(
    exits: queue.Queue[tuple[int, int]],
    running: set[int],
    workdir: Path,
    window_s: float,
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
        if status != 0 and _read_result(workdir, rank) is None:
            return rank, status
    return None


def _earliest_error(workdir: Path, nprocs: int) -> tuple[int, int] | None:
    """``(rank, status)`` of the callable rank whose exception was caught first, if any."""
    errors = []
    for rank in range(nprocs):
        record = _read_result(workdir, rank)
        if record is not None and not record.get("ok") and "time" in record:
            errors.append((float(record["time"]), rank, int(record.get("status", 1))))
    if not errors:
        return None
    _, rank, status = min(errors)
    return rank, status


def _collect_results(
    workdir: Path, nprocs: int, is_worker: bool
) -> tuple[list[Any], dict[int, str]]:
    """Each rank's return value (None where it has none) and the failed ranks' tracebacks."""
    values: list[Any] = []
    tracebacks: dict[int, str] = {}
    if not is_worker:
        return values, tracebacks
    for rank in range(nprocs):
        record = _read_result(workdir, rank)
        if record is not None and record.get("ok"):
            values.append(record.get("value"))
            continue
        values.append(None)
        if record is not None:
            tracebacks[rank] = str(record.get("traceback", ""))
    return values, tracebacks


# -- the worker -----------------------------------------------------------------------------------


def _load_job(path: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Unpickle a job, first re-creating the launcher's ``__main__`` if the job refers to it."""
    envelope = pickle.loads(Path(path).read_bytes())
    main = envelope["main"]
    if main:
        # Without running its `if __name__ == "__main__":` block, as multiprocessing does.
        if "module" in main:
            namespace = runpy.run_module(main["module"], run_name="__mp_main__")
        else:
            namespace = runpy.run_path(main["path"], run_name="__mp_main__")
        module = types.ModuleType("__mp_main__")
        module.__dict__.update(namespace)
        sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    target, args = pickle.loads(envelope["payload"])
    return target, tuple(args)


def _write_result(path: Path, record: dict[str, Any]) -> None:
    """Write a rank's result atomically, so the launcher never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(record))
    tmp.replace(path)


def worker_main(job_path: str) -> int:
    """Run one rank of a callable job: load it, call it, write ``result-<RANK>.pkl``.

    The result file holds the return value, or the formatted traceback together with the time
    the exception was caught and the exit status the rank will have; the traceback is also
    printed to stderr, as an uncaught exception would be. Returns the exit status.
    """
    rank = int(os.environ.get("RANK", "0"))
    result_dir = Path(os.environ.get("INTERLACE_RESULT_DIR", str(Path(job_path).parent)))
    result_path = result_dir / f"result-{rank}.pkl"
    try:
        target, args = _load_job(job_path)
        try:
            value = target(*args)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
            value = None  # sys.exit(0) in the target is a success without a value
        record: dict[str, Any] = {"ok": True, "value": value}
        _write_result(result_path, record)
    except BaseException as exc:
        failed_at = time.time()
        text = traceback.format_exc()
        status = 1
        if isinstance(exc, SystemExit) and isinstance(exc.code, int) and exc.code != 0:
            status = exc.code
        with contextlib.suppress(Exception):
            record = {"ok": False, "traceback": text, "time": failed_at, "status": status}
            _write_result(result_path, record)
        sys.stderr.write(text)
        sys.stderr.flush()
        return status
    return 0


# -- the command line -----------------------------------------------------------------------------

# Interpreter options that take no argument, skipped when looking for the script in the command.
_PYTHON_FLAGS = {"-u", "-O", "-OO", "-B", "-E", "-s", "-S", "-I", "-q", "-b", "-bb", "-d", "-v"}


def _script_of(command: Sequence[str]) -> str | None:
    """The ``.py`` file a command would run (``X.py ...`` or ``python [flags] X.py ...``)."""
    if not command:
        return None
    if command[0].endswith(".py"):
        return command[0]
    if not Path(command[0]).name.startswith("python"):
        return None
    takes_value = False
    for arg in command[1:]:
        if takes_value:  # the value of -W or -X
            takes_value = False
            continue
        if arg in ("-W", "-X"):
            takes_value = True
            continue
        if arg in _PYTHON_FLAGS:
            continue
        if arg.startswith("-"):
            return None  # -m module, -c code, or an option we do not know: nothing to check
        return arg if arg.endswith(".py") else None
    return None


def _normalise_command(command: Sequence[str]) -> list[str]:
    """Run ``X.py`` and a bare ``python``/``python3`` with this interpreter, as torchrun does."""
    if command[0].endswith(".py"):
        return [sys.executable, *command]
    if command[0] in ("python", "python3"):
        # The `python` on PATH may not be this environment's (e.g. an unactivated venv's
        # launcher script was called by path): use the interpreter that has interlace installed.
        return [sys.executable, *command[1:]]
    return list(command)


def build_parser() -> OneLineArgumentParser:
    """The ``interlace launch`` argument parser."""
    parser = OneLineArgumentParser(
        prog=PROG,
        description=(
            "Run a torchrun-style script on N local ranks, optionally on an emulated network "
            "where each rank has a NIC of the given rate."
        ),
        epilog="example: interlace launch -n 4 --link 1gbit -- python train.py --epochs 2",
    )
    parser.add_argument(
        "-n",
        "--nproc-per-node",
        "--nprocs",
        dest="nprocs",
        type=int,
        required=True,
        metavar="N",
        help="number of ranks",
    )
    parser.add_argument(
        "--link",
        metavar="RATE",
        help=f"emulate a NIC of this rate per rank ({', '.join(netem.LINK_RATES)}); needs root",
    )
    parser.add_argument(
        "--prefix-rank0", action="store_true", help="prefix rank 0's output with [rank 0] too"
    )
    parser.add_argument("--master-port", type=int, metavar="P", help="rendezvous port")
    parser.add_argument(
        "--timeout", type=float, metavar="S", help="stop every rank after S seconds"
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="the command each rank runs, after --"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """``interlace launch``: parse the command line, launch, return the job's exit status."""
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a bad flag (already reported on one line)
        return exc.code if isinstance(exc.code, int) else 2
    command: list[str] = list(ns.command)
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        if ns.nprocs < 1:
            raise UsageError(f"-n must be >= 1, got {ns.nprocs}")
        if ns.link is not None:
            netem.parse_link(ns.link)
        if ns.timeout is not None and ns.timeout <= 0:
            raise UsageError(f"--timeout must be > 0 seconds, got {ns.timeout:g}")
        if ns.master_port is not None and not 0 < ns.master_port < 65536:
            raise UsageError(f"--master-port must be 1-65535, got {ns.master_port}")
        if not command:
            raise UsageError(
                "no command to launch; put it after --, e.g. "
                "'interlace launch -n 2 -- python train.py'"
            )
        script = _script_of(command)
        if script is not None and not Path(script).is_file():
            raise UsageError(f"script not found: {script}")
        if command[0].startswith("-"):
            raise UsageError(f"unknown option {command[0]!r} before the command")
        result = run(
            _normalise_command(command),
            ns.nprocs,
            ns.link,
            timeout=ns.timeout,
            prefix_rank0=ns.prefix_rank0,
            master_port=ns.master_port,
        )
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:  # SIGTERM/SIGHUP, after cleanup
        return exc.code if isinstance(exc.code, int) else 1
    return result.returncode


def _entry(argv: list[str]) -> int:
    """``python -m interlace.launch``: the worker when given ``--worker JOB``, else the CLI."""
    if len(argv) == 2 and argv[0] == _WORKER_FLAG:
        status = worker_main(argv[1])
        # The result is on disk; leave without interpreter teardown. Tearing down a process that
        # still holds a process group's C++ threads (a target that never destroyed its group)
        # can abort in their destructors ("terminate called without an active exception") and
        # turn a finished rank into a failed one.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return main(argv)


if __name__ == "__main__":
    sys.exit(_entry(sys.argv[1:]))
