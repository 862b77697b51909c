"""What runs inside every rank the launcher starts: a heartbeat, the collective timeout, scripts.

A heartbeat thread writes ``state-<RANK>.json`` beside the job once a second: where the main
thread is (function, file, line, and the collective it waits in, if any), since when, the phase
interlace last reported, and finally whether the rank's code returned or raised. The launcher
reads these files to tell a rank that stopped making progress from one that gave up waiting.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.abc
import importlib.machinery
import json
import linecache
import os
import re
import runpy
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from interlace.errors import UsageError

__all__ = [
    "COLLECTIVE_TIMEOUT_VARIABLE",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "HEARTBEAT_S",
    "SCRIPT_FLAG",
    "STATE_DIR_VARIABLE",
    "UNREADABLE_WHERE",
    "Heartbeat",
    "RankState",
    "collective_timeout_s",
    "limit_default_timeout",
    "read_state",
    "report_phase",
    "run_script",
    "start_heartbeat",
]

#: Names the folder each rank writes its ``state-<RANK>.json`` into (the launcher's job folder).
STATE_DIR_VARIABLE = "INTERLACE_STATE_DIR"
#: Seconds any one collective may wait for its peers (``interlace launch --collective-timeout``).
COLLECTIVE_TIMEOUT_VARIABLE = "INTERLACE_COLLECTIVE_TIMEOUT"
#: The default collective timeout: long enough for a slow first step or a checkpoint on one rank,
#: short enough that a hang ends in minutes rather than gloo's 30.
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
#: Seconds between two heartbeats.
HEARTBEAT_S = 1.0
#: A heartbeat older than this says the rank's process no longer runs Python at all (frozen, or
#: in a native call that holds Python's lock).
STALE_AFTER_S = 3 * HEARTBEAT_S
#: ``python -m interlace.launch --run script.py ARGS`` (or ``--run -m module ARGS``) runs a
#: user's script as ``python script.py ARGS`` would, with a heartbeat.
SCRIPT_FLAG = "--run"

_TORCH_DISTRIBUTED = f"torch{os.sep}distributed{os.sep}"
# A line that waits on a collective started earlier (``handle.wait()``, ``work.wait()``).
_WAIT_CALL = re.compile(r"\.wait\(")

# The phase last reported and when: one slot, replaced whole (the heartbeat thread reads it).
_phase: list[tuple[str, float]] = []


def report_phase(text: str) -> None:
    """Note what this rank is doing now (e.g. ``"step 12: backward"``) for its heartbeat.

    Costs one assignment; without a heartbeat (not started by the launcher) it is never read.

    Args:
        text: A few words; the launcher quotes them if the rank stops making progress.
    """
    _phase[:] = [(text, time.time())]


def collective_timeout_s(environ: dict[str, str] | None = None) -> float:
    """The collective timeout: ``$INTERLACE_COLLECTIVE_TIMEOUT`` seconds, else the default.

    Args:
        environ: Where to look (``os.environ`` when None).

    Raises:
        UsageError: When the variable is not a positive number of seconds.
    """
    value = (os.environ if environ is None else environ).get(COLLECTIVE_TIMEOUT_VARIABLE, "")
    if not value.strip():
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise UsageError(
            f"${COLLECTIVE_TIMEOUT_VARIABLE} must be a positive number of seconds, got {value!r}"
        )
    return seconds


# -- the heartbeat --------------------------------------------------------------------------------


@dataclass
class RankState:
    """What a rank's heartbeat file says.

    Args:
        pid: The rank's process ID.
        beat: When the file was written (``time.time()``).
        state: ``running``, ``returned`` (its code finished) or ``raised``.
        where: Where the main thread was: ``function (file:line)``.
        since: Since when it has been there.
        collective: The collective the main thread waits in (``all_reduce``, ``wait``...), if any.
        phase: The phase interlace last reported (see :func:`report_phase`), if any.
        phase_since: When that phase was reported.
        error: The exception's last line, when ``state`` is ``raised``.
    """

    pid: int
    beat: float
    state: str = "running"
    where: str = ""
    since: float = 0.0
    collective: str | None = None
    phase: str | None = None
    phase_since: float | None = None
    error: str | None = None

    def describe(self, now: float) -> str:
        """Where the rank is and for how long, e.g. ``in step (job.py:12) for 38 s``.

        Args:
            now: The current ``time.time()``.
        """
        parts = []
        if self.phase is not None and self.phase_since is not None:
            parts.append(f"last phase {self.phase!r}, {now - self.phase_since:.0f} s ago")
        if self.collective is not None:
            parts.append(
                f"waiting in {self.collective} at {self.where} for {now - self.since:.0f} s"
            )
        elif self.where:
            parts.append(f"in {self.where} for {now - self.since:.0f} s")
        age = now - self.beat
        if age > STALE_AFTER_S:
            parts.append(f"last heartbeat {age:.0f} s ago")
        return "; ".join(parts) or f"last heartbeat {age:.0f} s ago"


def _state_path(directory: Path, rank: int) -> Path:
    return directory / f"state-{rank}.json"


def read_state(directory: Path, rank: int) -> RankState | None:
    """Rank ``rank``'s last heartbeat, or None if it wrote none (or it cannot be read).

    Args:
        directory: The job's folder.
        rank: Whose heartbeat to read.
    """
    try:
        data = json.loads(_state_path(directory, rank).read_text())
        return RankState(**data)
    except (OSError, ValueError, TypeError):
        return None


#: What a heartbeat says when the main thread's frames could not be read: the rank is alive (it
#: beat), but where it is stays unknown.
UNREADABLE_WHERE = "unknown (its frames could not be read)"


def _where(frame: types.FrameType) -> tuple[str, str | None]:
    """``function (file:line)`` of the innermost frame and the collective it waits in, if any.

    A frame without a line number (Python 3.11 gives None while it runs an instruction that has
    none) is shown as ``file:?``.
    """
    innermost = frame
    collective = None
    stack = []
    current: types.FrameType | None = frame
    while current is not None:
        stack.append(current)
        current = current.f_back
    for outer in reversed(stack):  # the first public torch.distributed function called
        name = outer.f_code.co_name
        if _TORCH_DISTRIBUTED in outer.f_code.co_filename and not (
            name.startswith("_") or name == "wrapper"
        ):
            collective = name
            break
    outside = next((f for f in stack if _TORCH_DISTRIBUTED not in f.f_code.co_filename), innermost)
    code = outside.f_code
    lineno = outside.f_lineno
    if isinstance(lineno, int):
        line = linecache.getline(code.co_filename, lineno)
        if collective is None and _WAIT_CALL.search(line):
            collective = "wait"
    shown = lineno if isinstance(lineno, int) else "?"
    return f"{code.co_name} ({os.path.basename(code.co_filename)}:{shown})", collective


class Heartbeat:
    """A daemon thread that writes this rank's :class:`RankState` every :data:`HEARTBEAT_S`.

    Args:
        path: The state file to write (atomically, by rename).
        interval_s: Seconds between two writes.
    """

    def __init__(self, path: Path, interval_s: float = HEARTBEAT_S) -> None:
        self._path = path
        self._interval_s = interval_s
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._state = RankState(pid=os.getpid(), beat=time.time(), since=time.time())
        self._thread = threading.Thread(target=self._run, name="interlace-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        """Write the first heartbeat and start the thread; returns ``self``."""
        self._beat()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            # A rank whose heartbeat thread died would read as stuck for the rest of the job, so
            # no failure of one beat may end the loop; the next beat tries again.
            with contextlib.suppress(Exception):
                self._beat()

    def _beat(self) -> None:
        now = time.time()
        located: tuple[str, str | None] | None = None
        try:
            frame = sys._current_frames().get(self._main) if self._main is not None else None
            if frame is not None:
                located = _where(frame)
        except Exception:  # a frame torn down while read, or anything odd in it: still beat
            located = (UNREADABLE_WHERE, None)
        with self._lock:
            state = self._state
            if state.state != "running":
                return
            if located is not None:
                where, collective = located
                if where != state.where or collective != state.collective:
                    state.where, state.collective, state.since = where, collective, now
            if _phase:
                state.phase, state.phase_since = _phase[-1]
            state.beat = now
            self._write(state)

    def _write(self, state: RankState) -> None:
        tmp = self._path.with_suffix(".tmp")
        with contextlib.suppress(OSError):  # a vanished job folder must not kill the rank
            tmp.write_text(json.dumps(asdict(state)))
            tmp.replace(self._path)

    def finish(self, state: str, error: str | None = None) -> None:
        """Record that the rank's code ``returned`` or ``raised``, and stop beating.

        Args:
            state: ``returned`` or ``raised``.
            error: The exception's last line, for ``raised``.
        """
        self._stop.set()
        with self._lock:
            self._state.state, self._state.error = state, error
            self._state.beat = time.time()
            self._write(self._state)


def start_heartbeat(environ: dict[str, str] | None = None) -> Heartbeat | None:
    """Start this rank's heartbeat when the launcher asked for one (``$INTERLACE_STATE_DIR``).

    Args:
        environ: Where to look (``os.environ`` when None).
    """
    env = os.environ if environ is None else environ
    directory = env.get(STATE_DIR_VARIABLE)
    if not directory:
        return None
    return Heartbeat(_state_path(Path(directory), int(env.get("RANK", "0")))).start()


# -- the default collective timeout ---------------------------------------------------------------

_C10D = "torch.distributed.distributed_c10d"


def _set_default_timeout(module: types.ModuleType, seconds: float) -> None:
    timeout = datetime.timedelta(seconds=seconds)
    # What init_process_group and new_group use when the caller passes no timeout.
    setattr(module, "default_pg_timeout", timeout)  # noqa: B010 - a module, not a class
    if isinstance(getattr(module, "default_pg_nccl_timeout", None), datetime.timedelta):
        setattr(module, "default_pg_nccl_timeout", timeout)  # noqa: B010 - as above


class _TimeoutOnImport(importlib.abc.MetaPathFinder):
    """Sets torch's default process-group timeout as soon as torch.distributed is imported.

    Installed before the rank's code runs, so even ``init_process_group("gloo")`` without a
    timeout is bounded, without importing torch (a second or more) in ranks that never use it.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _C10D:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader = spec.loader
        exec_module: Callable[[types.ModuleType], None] = loader.exec_module
        seconds = self.seconds

        def exec_then_limit(module: types.ModuleType) -> None:
            exec_module(module)
            _set_default_timeout(module, seconds)

        loader.exec_module = exec_then_limit  # type: ignore[method-assign]
        return spec


def limit_default_timeout(seconds: float) -> None:
    """Make ``seconds`` torch's default process-group timeout in this process.

    Args:
        seconds: The bound on any one collective of a group made without an explicit timeout.
    """
    module = sys.modules.get(_C10D)
    if module is not None:
        _set_default_timeout(module, seconds)
        return
    sys.meta_path.insert(0, _TimeoutOnImport(seconds))


def prepare_rank() -> Heartbeat | None:
    """Set up this rank as the launcher asked: its collective timeout, then its heartbeat."""
    if COLLECTIVE_TIMEOUT_VARIABLE in os.environ:
        limit_default_timeout(collective_timeout_s())
    return start_heartbeat()


# -- a user's script ------------------------------------------------------------------------------


def _error_line(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return lines[-1].strip() if lines else type(exc).__name__


def run_script(argv: list[str]) -> int:
    """Run ``script.py ARGS`` (or ``-m module ARGS``) as ``python`` would, with a heartbeat.

    The heartbeat records ``returned`` once the script's code is done and before the interpreter
    tears down, so the launcher can tell a crash at shutdown from a failure of the script.

    Args:
        argv: ``[script, *args]`` or ``["-m", module, *args]``.

    Returns:
        The script's exit status (a traceback is printed for an exception, as Python does).
    """
    heartbeat = prepare_rank()
    status = 0
    try:
        if argv[:1] == ["-m"]:
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code: Any = exc.code
        if code is None or code == 0:
            status = 0
        elif isinstance(code, int):
            status = code
        else:  # sys.exit("message") prints it and exits 1
            print(code, file=sys.stderr)
            status = 1
        if heartbeat is not None:
            heartbeat.finish("returned" if status == 0 else "raised", f"SystemExit: {code}")
        return status
    except BaseException as exc:
        if heartbeat is not None:
            heartbeat.finish("raised", _error_line(exc))
        tb = exc.__traceback__
        # Start at the script's own frames, as `python script.py` would print them.
        ours = (__file__, runpy.__file__, "<frozen runpy>")
        while tb is not None and tb.tb_frame.f_code.co_filename in ours:
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        return 130 if isinstance(exc, KeyboardInterrupt) else 1
    if heartbeat is not None:
        heartbeat.finish("returned")
    return status
