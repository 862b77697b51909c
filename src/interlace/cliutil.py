"""Command-line plumbing shared by every ``interlace`` subcommand.

Errors are one line (``interlace train: error: ...``) with exit status 2, so a mistyped flag is
answered with what was wrong rather than a screen of usage text.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn, Protocol, TypeVar, overload

from interlace.errors import UsageError

_N = TypeVar("_N")


class JobOutcome(Protocol):
    """What :func:`report_failure` reads of a launched job (``interlace.launch.LaunchResult``)."""

    @property
    def returncode(self) -> int:
        """The job's exit status."""

    @property
    def timed_out(self) -> bool:
        """True when the job ran out of its timeout."""

    @property
    def failed_rank(self) -> int | None:
        """The first rank that failed, if any."""

    @property
    def tracebacks(self) -> Mapping[int, str]:
        """Each failed rank's traceback."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a single line on stderr and exit status 2.

    Args:
        *args: :class:`argparse.ArgumentParser`'s.
        populate: adds the parser's arguments the first time it parses or prints help, so a
            subcommand's (heavy) module is imported only when that subcommand is used.
        **kwargs: :class:`argparse.ArgumentParser`'s.
    """

    def __init__(
        self,
        *args: Any,
        populate: Callable[[argparse.ArgumentParser], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._populate = populate

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line on stderr and exit with status 2.

        Args:
            message: what was wrong.
        """
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    @overload
    def parse_known_args(
        self, args: Iterable[str] | None = None, namespace: None = None
    ) -> tuple[argparse.Namespace, list[str]]: ...
    @overload
    def parse_known_args(
        self, args: Iterable[str] | None, namespace: _N
    ) -> tuple[_N, list[str]]: ...
    @overload
    def parse_known_args(self, *, namespace: _N) -> tuple[_N, list[str]]: ...
    def parse_known_args(
        self, args: Iterable[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        """Add the arguments (``populate``) if not yet done, then parse as argparse does.

        Args:
            args: the arguments (default: ``sys.argv[1:]``).
            namespace: the namespace to fill (default: a new one).
        """
        self._add_arguments_once()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self._add_arguments_once()
        return super().format_usage()

    def format_help(self) -> str:
        self._add_arguments_once()
        return super().format_help()

    def _add_arguments_once(self) -> None:
        if self._populate is not None:
            populate, self._populate = self._populate, None
            populate(self)


def fail(prog: str, message: str, status: int = 2) -> NoReturn:
    """Print ``prog: error: message`` on stderr and exit with ``status``.

    Args:
        prog: the command, e.g. interlace train.
        message: what was wrong.
        status: the exit status.
    """
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
    usage error or Ctrl-C with one line and the exit status ``interlace`` itself would give.

    Args:
        prog: the program's name in messages.
        description: the parser's description.
        add_arguments: adds the subcommand's flags to a parser.
        run: runs the parsed subcommand, returning its exit status.
        argv: the arguments (default: sys.argv[1:]).
    """
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
    """``--channels`` and ``--compression``, spelled the same by every command that takes them.

    Args:
        parser: the subcommand's parser.
    """
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


def parse_shape(text: str) -> tuple[int, ...]:
    """An argparse ``type`` for shapes written ``3,32,32`` (or ``3x32x32``).

    Args:
        text: the sizes, separated by commas or ``x``.

    Raises:
        argparse.ArgumentTypeError: for anything but positive integer sizes.
    """
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a shape; write it as comma-separated sizes, e.g. 3,32,32"
        ) from None
    if not shape or any(size < 1 for size in shape):
        raise argparse.ArgumentTypeError(f"'{text}' is not a shape of positive sizes")
    return shape


def report_failure(prog: str, result: JobOutcome, timeout: float | None) -> int:
    """A launched job's exit status; on failure, print why: the timeout, or the rank's traceback.

    Args:
        prog: the command as the user typed it, e.g. ``interlace train``.
        result: what the launcher reported.
        timeout: the job's ``--timeout``, named when the job ran out of it.
    """
    if result.returncode != 0:
        if result.timed_out:
            print(f"{prog}: stopped after --timeout {timeout} s", file=sys.stderr)
        elif result.failed_rank is not None and result.failed_rank in result.tracebacks:
            print(result.tracebacks[result.failed_rank].rstrip(), file=sys.stderr)
    return result.returncode
