"""Command-line plumbing shared by every ``interlace`` subcommand.

Errors are one line (``interlace train: error: ...``) with exit status 2, so a mistyped flag is
answered with what was wrong rather than a screen of usage text.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a single line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def fail(prog: str, message: str, status: int = 2) -> NoReturn:
    """Print ``prog: error: message`` on stderr and exit with ``status``."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(status)


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
