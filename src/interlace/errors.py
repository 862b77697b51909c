"""Errors that interlace raises for a user to act on.

The command line turns a :class:`UsageError` into one line on stderr and exit status 2, the
convention of argparse and of torchrun.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class UsageError(ValueError):
    """Bad input from the user (a bad flag, an unknown model, a missing file).

    The message says what is wrong and how to fix it.
    """


@dataclass(frozen=True)
class Named:
    """Another option's name inside an :class:`OptionError`'s message.

    Args:
        option: The option's name as the Python API spells it.
    """

    option: str


class OptionError(UsageError):
    """A bad value of one named option: the option, then what is wrong and what to do.

    The message is kept in parts, so that a command line names each option by its flag
    (:meth:`spelt`) rather than rewriting the text.

    Args:
        option: The option's name as the Python API spells it.
        problem: The rest of the message; other options in it as :class:`Named`.
    """

    def __init__(self, option: str, *problem: str | Named) -> None:
        self.option = option
        self.problem = problem
        super().__init__(self.spelt(str))

    def spelt(self, spell: Callable[[str], str]) -> str:
        """The message with every option named as ``spell`` names it (e.g. by its flag).

        Args:
            spell: An option's Python name -> how to write it.
        """
        parts = [spell(p.option) if isinstance(p, Named) else p for p in self.problem]
        return f"{spell(self.option)} {''.join(parts)}"

    def __reduce__(self) -> tuple[type[OptionError], tuple[str | Named, ...]]:
        return (type(self), (self.option, *self.problem))


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
