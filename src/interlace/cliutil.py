"""Command-line plumbing shared by every ``interlace`` subcommand.

Errors are one line (``interlace train: error: ...``) with exit status 2, so a mistyped flag is
answered with what was wrong rather than a screen of usage text. Options that several commands
take (``--input-shape``/``--classes``, ``-n``, ``--collective-timeout``) are defined here once, so
they read the same everywhere.
"""

from __future__ import annotations

import argparse
import os
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


#: Where a parser records itself in the namespace it fills, so that arguments nobody
#: recognised are reported by the innermost (sub)command's parser, pointing to its own help.
_PARSER_ATTR = "_interlace_parser"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows every option's default: ``(default X)`` is appended to an option's help
    unless the text already names its default or the option has none worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or "%(default)" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return action.help
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else "%(default)s"
        return f"{text} (default {shown})" if text else text


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a single line on stderr and exit status 2, naming the
    (sub)command's own ``--help``, and whose help shows every option's default.

    Args:
        *args: :class:`argparse.ArgumentParser`'s.
        populate: adds the parser's arguments the first time it parses or prints help, so a
            subcommand's (heavy) module is imported only when that subcommand is used.
        **kwargs: :class:`argparse.ArgumentParser`'s (``formatter_class`` defaults to
            :class:`DefaultsHelpFormatter`).
    """

    def __init__(
        self,
        *args: Any,
        populate: Callable[[argparse.ArgumentParser], None] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
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
        parsed, extras = super().parse_known_args(args, namespace)
        # The innermost parser finishes first; an enclosing one must not replace it.
        if not hasattr(parsed, _PARSER_ATTR):
            setattr(parsed, _PARSER_ATTR, self)
        return parsed, extras

    @overload
    def parse_args(
        self, args: Iterable[str] | None = None, namespace: None = None
    ) -> argparse.Namespace: ...
    @overload
    def parse_args(self, args: Iterable[str] | None, namespace: _N) -> _N: ...
    @overload
    def parse_args(self, *, namespace: _N) -> _N: ...
    def parse_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> Any:
        """Parse as argparse does, but leave arguments nobody recognised to the innermost
        subcommand's parser, so the error points to that subcommand's ``--help``.

        Args:
            args: the arguments (default: ``sys.argv[1:]``).
            namespace: the namespace to fill (default: a new one).
        """
        parsed, extras = self.parse_known_args(args, namespace)
        owner = getattr(parsed, _PARSER_ATTR, self)
        delattr(parsed, _PARSER_ATTR)
        if extras:
            owner.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

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


def quiet_on_broken_pipe(command: Callable[[], int]) -> int:
    """Run a command's entry point; if its reader goes away (``interlace models | head -4``),
    stop quietly with status 1 instead of a BrokenPipeError traceback.

    Args:
        command: the entry point, returning the exit status.

    Returns:
        The command's exit status, or 1 when stdout was closed under it.
    """
    try:
        status = command()
        # Flush here rather than at interpreter exit, so a closed pipe is caught below.
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's documented recipe: point stdout at devnull so the interpreter's own flush at
        # exit cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1
    return status


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

    def command() -> int:
        try:
            return run(args)
        except UsageError as error:
            print(f"{prog}: error: {error}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            return 130

    return quiet_on_broken_pipe(command)


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


class _DeprecatedAlias(argparse.Action):
    """Stores its value like the option it stands for, after a one-line note on stderr."""

    def __init__(self, *args: Any, replacement: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replacement = replacement

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: note: {option_string} is deprecated; use {self.replacement}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_deprecated_alias(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    old: str,
    new: str,
    dest: str,
    **kwargs: Any,
) -> None:
    """Accept ``old`` as a hidden, deprecated spelling of the option ``new``.

    The alias is left out of ``--help`` and notes on stderr that it is deprecated; its value
    lands where ``new``'s does, and ``new``'s default stands when it is not given.

    Args:
        parser: the parser (or argument group) that has ``new``.
        old: the deprecated spelling, e.g. ``--batch``.
        new: the option to use instead, e.g. ``--batch-size``.
        dest: ``new``'s destination.
        **kwargs: how the value is read (``type``, ``nargs``), as ``new`` reads it.
    """
    parser.add_argument(
        old,
        dest=dest,
        action=_DeprecatedAlias,
        replacement=new,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
        **kwargs,
    )


def positive_int(text: str) -> int:
    """An argparse ``type`` for counts that must be at least 1.

    Args:
        text: the value as typed.

    Raises:
        argparse.ArgumentTypeError: for anything but an integer >= 1.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_model_shape_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    input_shape: tuple[int, ...] | None = None,
    classes: int | None = None,
    defaults_from: str | None = None,
) -> None:
    """``--input-shape`` and ``--classes``: the sizes a ``--model`` is built with.

    Every command that builds a model from ``--model`` (a zoo name or
    ``package.module:callable``, called as ``callable(input_shape, num_classes)``) takes both,
    defined here once.

    Args:
        parser: the subcommand's parser (or argument group).
        input_shape: the shape used when ``--input-shape`` is not given; None leaves
            ``args.input_shape`` None for the command to fill in (see ``defaults_from``).
        classes: the class count used when ``--classes`` is not given; None as above.
        defaults_from: where the sizes come from when not given (e.g. "the --data set"),
            named in the help when there is no fixed default.
    """
    source = f"default: {defaults_from}" if defaults_from else None
    parser.add_argument(
        "--input-shape",
        type=parse_shape,
        default=input_shape,
        metavar="SHAPE",
        help="shape of one input sample the model is built for, e.g. 3,32,32 or 1x8x8"
        + (f" ({source})" if input_shape is None and source else ""),
    )
    parser.add_argument(
        "--classes",
        type=positive_int,
        default=classes,
        metavar="K",
        help="number of classes the model predicts"
        + (f" ({source})" if classes is None and source else ""),
    )


def add_nprocs_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    default: int | None,
    help_text: str,
    required: bool = False,
) -> None:
    """``-n``/``--nprocs``/``--nproc-per-node``: how many ranks to start on this machine.

    ``--nproc-per-node`` is torchrun's spelling, accepted by every command that starts ranks.

    Args:
        parser: the subcommand's parser (or argument group).
        default: ranks when not given (None: the command decides).
        help_text: what the ranks are, for the help text (the default is appended).
        required: whether the option must be given.
    """
    parser.add_argument(
        "-n",
        "--nprocs",
        "--nproc-per-node",
        dest="nprocs",
        type=int,
        default=default,
        required=required,
        metavar="N",
        help=help_text,
    )


def add_collective_timeout_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
) -> None:
    """``--collective-timeout S``: how long any one collective may wait for its peers.

    Every command that starts ranks takes it, defined here once; ``--timeout`` stays the bound
    on the whole job. Read the value with :func:`collective_timeout_of`.

    Args:
        parser: the subcommand's parser (or argument group).
    """
    # Imported here: interlace.launch imports this module.
    from interlace.launch.rank import (  # noqa: PLC0415
        COLLECTIVE_TIMEOUT_VARIABLE,
        DEFAULT_COLLECTIVE_TIMEOUT_S,
    )

    parser.add_argument(
        "--collective-timeout",
        type=float,
        metavar="S",
        help="end the job, naming the rank that stopped making progress, when any one "
        f"collective waits S seconds for it (default: ${COLLECTIVE_TIMEOUT_VARIABLE} or "
        f"{DEFAULT_COLLECTIVE_TIMEOUT_S:g})",
    )


def collective_timeout_of(seconds: float | None) -> float:
    """The collective timeout a job runs with: ``seconds`` (``--collective-timeout``) when
    given, else ``$INTERLACE_COLLECTIVE_TIMEOUT``, else the launcher's default (300 s).

    Args:
        seconds: the flag's value, or None when it was not given.

    Raises:
        UsageError: when the value is not a positive, finite number of seconds.
    """
    from interlace.launch.rank import collective_timeout_s  # noqa: PLC0415 - see above

    if seconds is None:
        return collective_timeout_s()
    if not 0 < seconds < float("inf"):
        raise UsageError(f"--collective-timeout must be > 0 seconds, got {seconds:g}")
    return float(seconds)


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
