"""The worker side of a callable job: the job file the launcher writes, the result files it reads.

A callable runs in a fresh ``python -m interlace.launch --worker JOB`` process per rank, which
writes the return value, or the formatted exception, to ``result-<RANK>.pkl`` beside the job.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import runpy
import shutil
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from interlace.errors import UsageError
from interlace.launch.netem import pid_alive
from interlace.launch.rank import SCRIPT_FLAG, prepare_rank

__all__ = [
    "RESULT_DIR_VARIABLE",
    "WORKDIR_PREFIX",
    "WORKER_FLAG",
    "check_executable",
    "collect_results",
    "command_for",
    "earliest_error",
    "load_job",
    "read_result",
    "remove_stale_workdirs",
    "with_heartbeat",
    "worker_main",
    "write_job",
]

#: ``python -m interlace.launch --worker JOB`` runs one rank of a callable job.
WORKER_FLAG = "--worker"

#: Job folders are ``<tmp>/interlace-launch-<launcher PID>-<random>``.
WORKDIR_PREFIX = "interlace-launch-"

#: Names the folder a worker writes its result file into (the job file's folder by default).
RESULT_DIR_VARIABLE = "INTERLACE_RESULT_DIR"


def remove_stale_workdirs() -> None:
    """Delete job folders of launchers that died without cleaning up (their PID is in the name)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*-*"):
        pid = folder.name[len(WORKDIR_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


# -- the launcher writes the job ------------------------------------------------------------------


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


def write_job(workdir: Path, target: Callable[..., Any], args: Sequence[Any]) -> Path:
    """Pickle ``(target, args)`` for the workers into ``workdir/job.pkl``.

    Args:
        workdir: The job's folder.
        target: A module-level callable (pickled by name).
        args: Its positional arguments (pickled by value).

    Returns:
        The job file's path.

    Raises:
        UsageError: When the target or its arguments cannot be sent to the ranks, saying why.
    """
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


# Interpreter options without a value that keep PYTHONPATH working (not -I, -E), so the rank can
# still import interlace to run the script for us.
_PASSED_FLAGS = {"-u", "-O", "-OO", "-B", "-s", "-S", "-q", "-b", "-bb", "-d", "-v"}


def with_heartbeat(command: Sequence[str]) -> list[str]:
    """``python [flags] X.py ARGS`` or ``... -m M ARGS`` run through interlace, with a heartbeat.

    Only commands of this interpreter are rewritten (``python -m interlace.launch --run X.py
    ARGS`` behaves as ``python X.py ARGS``); any other command is returned unchanged.

    Args:
        command: The rank's command line.
    """
    if not command or command[0] != sys.executable:
        return list(command)
    flags: list[str] = []
    index = 1
    while index < len(command):
        arg = command[index]
        if arg in ("-W", "-X") and index + 1 < len(command):
            flags += command[index : index + 2]
            index += 2
        elif arg in _PASSED_FLAGS:
            flags.append(arg)
            index += 1
        else:
            break
    rest = list(command[index:])
    runner = [sys.executable, *flags, "-m", "interlace.launch", SCRIPT_FLAG]
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return [*runner, *rest]
    if not rest or rest[0].startswith("-"):  # -c CODE, an interactive interpreter, -I...
        return list(command)
    return [*runner, *rest]


def command_for(
    target: Callable[..., Any] | str | Sequence[str], args: Sequence[Any], workdir: Path
) -> tuple[list[str], bool]:
    """The command each rank runs, and whether it is the callable worker.

    Args:
        target: A callable (written to a job file in ``workdir``), a ``.py`` script, or a
            command line.
        args: The callable's arguments, or extra command-line arguments.
        workdir: The job's folder.

    Raises:
        UsageError: For a script that is not a ``.py`` file, or an empty command.
    """
    if isinstance(target, str):
        if not target.endswith(".py"):
            raise UsageError(f"a script target must end in .py, got {target!r}")
        return with_heartbeat([sys.executable, target, *map(str, args)]), False
    if callable(target):
        job = write_job(workdir, target, args)
        return [sys.executable, "-m", "interlace.launch", WORKER_FLAG, str(job)], True
    command = [str(part) for part in target]
    if not command:
        raise UsageError("no command to launch")
    return with_heartbeat([*command, *map(str, args)]), False


def check_executable(program: str, path: str | None) -> None:
    """Make sure ``program`` names something a rank can run, before any rank starts.

    Args:
        program: The command's first word (a name looked up on ``path``, or a file path).
        path: The ranks' ``PATH`` (this process's when None).

    Raises:
        UsageError: Naming the program and what to do, when it is not found or not executable.
    """
    if os.sep in program:
        if not os.path.isfile(program):
            raise UsageError(f"command not found: {program} (no such file)")
        if not os.access(program, os.X_OK):
            raise UsageError(
                f"command not executable: {program} (chmod +x it, or run it with its interpreter)"
            )
        return
    if shutil.which(program, path=path) is None:
        raise UsageError(
            f"command not found: {program} (not on PATH); check the spelling, or give its path"
        )


# -- the launcher reads the results ---------------------------------------------------------------


def read_result(workdir: Path, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s result record, or None if it wrote none (or it cannot be read).

    Args:
        workdir: The job's folder.
        rank: Whose record to read.
    """
    try:
        record = pickle.loads((workdir / f"result-{rank}.pkl").read_bytes())
    except FileNotFoundError:
        return None
    except Exception as exc:  # e.g. the value's class cannot be imported in the launcher
        return {"ok": False, "traceback": f"could not read rank {rank}'s result: {exc!r}"}
    return record if isinstance(record, dict) else None


def earliest_error(workdir: Path, nprocs: int) -> tuple[int, int] | None:
    """``(rank, status)`` of the callable rank whose exception was caught first, if any.

    Args:
        workdir: The job's folder.
        nprocs: The number of ranks.
    """
    errors = []
    for rank in range(nprocs):
        record = read_result(workdir, rank)
        if record is not None and not record.get("ok") and "time" in record:
            errors.append((float(record["time"]), rank, int(record.get("status", 1))))
    if not errors:
        return None
    _, rank, status = min(errors)
    return rank, status


def collect_results(
    workdir: Path, nprocs: int, is_worker: bool
) -> tuple[list[Any], dict[int, str]]:
    """Each rank's return value (None where it has none) and the failed ranks' tracebacks.

    Args:
        workdir: The job's folder.
        nprocs: The number of ranks.
        is_worker: Whether the ranks ran a callable (a command leaves no result files).
    """
    values: list[Any] = []
    tracebacks: dict[int, str] = {}
    if not is_worker:
        return values, tracebacks
    for rank in range(nprocs):
        record = read_result(workdir, rank)
        if record is not None and record.get("ok"):
            values.append(record.get("value"))
            continue
        values.append(None)
        if record is not None:
            tracebacks[rank] = str(record.get("traceback", ""))
    return values, tracebacks


# -- the worker -----------------------------------------------------------------------------------


def load_job(path: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Unpickle a job, first re-creating the launcher's ``__main__`` if the job refers to it.

    Args:
        path: The job file.
    """
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
    printed to stderr, as an uncaught exception would be.

    Args:
        job_path: The job file :func:`write_job` wrote.

    Returns:
        The rank's exit status.
    """
    rank = int(os.environ.get("RANK", "0"))
    result_dir = Path(os.environ.get(RESULT_DIR_VARIABLE, str(Path(job_path).parent)))
    result_path = result_dir / f"result-{rank}.pkl"
    heartbeat = prepare_rank()
    try:
        target, args = load_job(job_path)
        try:
            value = target(*args)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
            value = None  # sys.exit(0) in the target is a success without a value
        record: dict[str, Any] = {"ok": True, "value": value}
        _write_result(result_path, record)
        if heartbeat is not None:
            heartbeat.finish("returned")
    except BaseException as exc:
        failed_at = time.time()
        text = traceback.format_exc()
        status = 1
        if isinstance(exc, SystemExit) and isinstance(exc.code, int) and exc.code != 0:
            status = exc.code
        with contextlib.suppress(Exception):
            record = {"ok": False, "traceback": text, "time": failed_at, "status": status}
            _write_result(result_path, record)
        if heartbeat is not None:
            heartbeat.finish("raised", text.strip().splitlines()[-1] if text.strip() else None)
        sys.stderr.write(text)
        sys.stderr.flush()
        return status
    return 0
