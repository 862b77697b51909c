"""The ``interlace launch`` command: its parser, its checks, and ``python -m interlace.launch``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from interlace.cliutil import OneLineArgumentParser, add_collective_timeout_argument
from interlace.comm.links import LINK_RATES, parse_link
from interlace.errors import UsageError
from interlace.launch.rank import SCRIPT_FLAG, run_script
from interlace.launch.supervise import run
from interlace.launch.worker import WORKER_FLAG, worker_main

__all__ = ["PROG", "build_parser", "entry", "main"]

PROG = "interlace launch"

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
        help=f"emulate a NIC of this rate per rank ({', '.join(LINK_RATES)}); needs root",
    )
    parser.add_argument(
        "--prefix-rank0", action="store_true", help="prefix rank 0's output with [rank 0] too"
    )
    parser.add_argument("--master-port", type=int, metavar="P", help="rendezvous port")
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="stop every rank after S seconds of the whole job (default: no limit)",
    )
    add_collective_timeout_argument(parser)
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="the command each rank runs, after --"
    )
    return parser


def _checked_command(ns: argparse.Namespace) -> list[str]:
    """The command to launch, once every option was checked; raises UsageError otherwise."""
    command: list[str] = list(ns.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if ns.nprocs < 1:
        raise UsageError(f"-n must be >= 1, got {ns.nprocs}")
    if ns.link is not None:
        parse_link(ns.link)
    if ns.timeout is not None and ns.timeout <= 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {ns.timeout:g}")
    if ns.collective_timeout is not None and not 0 < ns.collective_timeout < float("inf"):
        raise UsageError(f"--collective-timeout must be > 0 seconds, got {ns.collective_timeout:g}")
    if ns.master_port is not None and not 0 < ns.master_port < 65536:
        raise UsageError(f"--master-port must be 1-65535, got {ns.master_port}")
    if not command:
        raise UsageError(
            "no command to launch; put it after --, e.g. 'interlace launch -n 2 -- python train.py'"
        )
    script = _script_of(command)
    if script is not None and not Path(script).is_file():
        raise UsageError(f"script not found: {script}")
    if command[0].startswith("-"):
        raise UsageError(f"unknown option {command[0]!r} before the command")
    return _normalise_command(command)


def main(argv: list[str] | None = None) -> int:
    """``interlace launch``: parse the command line, launch, return the job's exit status.

    Args:
        argv: The arguments after ``launch`` (``sys.argv[1:]`` when None).

    Returns:
        The job's exit status; 2 for bad input (reported in one line on stderr), 130 after
        Ctrl-C.
    """
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a bad flag (already reported on one line)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        result = run(
            _checked_command(ns),
            ns.nprocs,
            ns.link,
            timeout=ns.timeout,
            prefix_rank0=ns.prefix_rank0,
            master_port=ns.master_port,
            collective_timeout=ns.collective_timeout,
        )
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:  # SIGTERM/SIGHUP, after cleanup
        return exc.code if isinstance(exc.code, int) else 1
    return result.returncode


def entry(argv: list[str]) -> int:
    """``python -m interlace.launch``: a rank's worker (``--worker JOB``), a rank's script
    (``--run X.py ARGS``), or else the CLI.

    Args:
        argv: The arguments after ``-m interlace.launch``.

    Returns:
        The command's exit status (a worker leaves through :func:`os._exit` instead).
    """
    if len(argv) >= 2 and argv[0] == SCRIPT_FLAG:
        return run_script(argv[1:])
    if len(argv) == 2 and argv[0] == WORKER_FLAG:
        status = worker_main(argv[1])
        # The result is on disk; leave without interpreter teardown. Tearing down a process that
        # still holds a process group's C++ threads (a target that never destroyed its group)
        # can abort in their destructors ("terminate called without an active exception") and
        # turn a finished rank into a failed one.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return main(argv)
