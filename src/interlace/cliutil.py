"""Command-line plumbing shared by every ``interlace`` subcommand.

Errors are one line (``interlace train: error: ...``) with exit status 2, so a mistyped flag is
answered with what was wrong rather than a screen of usage text.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from interlace.errors import UsageError


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a single line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def fail(prog: str, message: str, status: int = 2) -> NoReturn:
    """Print ``prog: error: message`` on stderr and exit with ``status``."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(status)


def standalone_main(
    prog: str,
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: list[str] | None = None,
) -> int:
    """A subcommand run on its own (``python benchmarks/X.py``): parse, run, and answer a
    usage error or Ctrl-C with one line and the exit status ``interlace`` itself would give."""
    parser = OneLineArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UsageError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def add_channel_arguments(parser: argparse.ArgumentParser) -> None:
    """``--channels`` and ``--compression``, spelled the same by every command that takes them."""
    parser.add_argument(
        "--channels",
        default="1",
        help="communication channels (process groups used at once): an integer >= 1, or auto "
        "to choose 1..4 and the partition threshold from measurements (default 1)",
    )
    parser.add_argument(
        "--compression",
        choices=["fp16", "bf16"],
        help="send float32 gradient buckets as fp16 or bf16 (averaged in fp32; default: none)",
    )
