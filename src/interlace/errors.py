"""Errors that interlace raises for a user to act on.

The command line turns a :class:`UsageError` into one line on stderr and exit status 2, the
convention of argparse and of torchrun.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input from the user (a bad flag, an unknown model, a missing file).

    The message says what is wrong and how to fix it.
    """


class RankFailedError(RuntimeError):
    """A rank of a multi-process job failed; carries the rank and, when known, its traceback.

    Args:
        rank: The failing rank (-1 when unknown).
        returncode: Its exit status.
        detail: Its formatted traceback (or the tail of its stderr), if known.
        reason: Why the rank is blamed, when it is not simply that it failed (e.g. it stopped
            making progress and a peer timed out waiting for it); replaces the first line.
    """

    def __init__(self, rank: int, returncode: int, detail: str = "", reason: str = "") -> None:
        self.rank = rank
        self.returncode = returncode
        self.detail = detail
        self.reason = reason
        message = reason or f"rank {rank} failed with exit status {returncode}"
        if detail:
            heading = "traceback" if reason else f"rank {rank} traceback"
            message += f"\n--- {heading} ---\n{detail.rstrip()}"
        super().__init__(message)
