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


@dataclass(frozen=True)
class Setting:
    """An option with a value inside an :class:`OptionError`'s message: ``name=value`` in
    Python, ``--flag value`` on a command line.

    Args:
        option: The option's name as the Python API spells it.
        value: The value.
    """

    option: str
    value: object


def _python_setting(option: str, value: object) -> str:
    return f"{option}={value!r}"


class OptionError(UsageError):
    """A bad value of one named option, and what to do.

    The message is kept in parts, so that a command line names each option by its flag
    (:meth:`spelt`) rather than rewriting the text. It starts with the option's name unless its
    first part is a :class:`Named` or :class:`Setting` of its own.

    Args:
        option: The option to blame, as the Python API spells it.
        problem: The message; other options in it as :class:`Named` or :class:`Setting`.
    """

    def __init__(self, option: str, *problem: str | Named | Setting) -> None:
        self.option = option
        self.problem = problem
        super().__init__(self.spelt())

    def spelt(
        self,
        name: Callable[[str], str] = str,
        setting: Callable[[str, object], str] = _python_setting,
    ) -> str:
        """The message with every option written as a reader knows it.

        Args:
            name: An option's Python name -> how to write it (its flag, on a command line).
            setting: An option and a value -> how to write them (``--flag value``).
        """
        parts = list(self.problem)
        if not parts or not isinstance(parts[0], Named | Setting):
            parts = [Named(self.option), " ", *parts]
        return "".join(
            name(part.option)
            if isinstance(part, Named)
            else setting(part.option, part.value)
            if isinstance(part, Setting)
            else part
            for part in parts
        )

    def __reduce__(self) -> tuple[type[OptionError], tuple[str | Named | Setting, ...]]:
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
