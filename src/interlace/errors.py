"""Errors that interlace raises for a user to act on.

A :class:`UsageError` means the input was wrong (a bad flag, an unknown model, a missing file):
the message names what is wrong and what to do instead, and the command line turns it into a
single line on stderr with exit status 2, the convention of argparse and of torchrun.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input from the user; the message says what is wrong and how to fix it."""


class RankFailedError(RuntimeError):
    """A rank of a multi-process job failed; carries the rank and, when known, its traceback."""

    def __init__(self, rank: int, returncode: int, detail: str = "") -> None:
        self.rank = rank
        self.returncode = returncode
        self.detail = detail
        message = f"rank {rank} failed with exit status {returncode}"
        if detail:
            message += f"\n--- rank {rank} traceback ---\n{detail.rstrip()}"
        super().__init__(message)
