"""The skeleton every benchmark command fills in: its shared flags, its config and its run.

A benchmark is a :class:`Benchmark`: it states its own flags and defaults (:class:`Flags`), its
config (a :class:`BenchConfig`), what it launches (:meth:`Benchmark.measure`, through a
:class:`~interlace.bench.session.Session`) and how it prints its rows; the rest is here, once.
"""

from __future__ import annotations

import argparse
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from interlace.bench.harness import (
    DEFAULT_INPUT_SHAPE,
    NUM_CLASSES,
    REAL_COMPUTE,
    RankJob,
    default_batch,
)
from interlace.bench.session import Session, check_netem, run_link
from interlace.bench.tables import Row, write_json
from interlace.cliutil import (
    add_collective_timeout_argument,
    add_deprecated_alias,
    add_model_shape_arguments,
    add_nprocs_argument,
    collective_timeout_of,
    standalone_main,
)
from interlace.comm.links import parse_link
from interlace.emulate import Compute, add_compute_arguments, compute_from_args
from interlace.errors import UsageError
from interlace.zoo import MODEL_NAMES, build_model

_Job = TypeVar("_Job", bound=RankJob)
_Config = TypeVar("_Config", bound="BenchConfig")
_Row = TypeVar("_Row", bound=Row)


# ================================================================================ flags


@dataclass(frozen=True)
class Flags:
    """What a benchmark's shared flags default to, and the words of their help that differ.

    Args:
        models: Models measured when neither ``--model`` nor ``--models`` is given.
        models_help: ``--models``' help.
        nprocs: Ranks when ``-n`` is not given.
        nprocs_help: What the ranks are, for ``-n``'s help.
        link: The emulated link when ``--link`` is not given (None: the benchmark picks one).
        link_help: ``--link``'s help.
        batch: ``--batch-size`` when not given (None: per model, :data:`DEFAULT_BATCH`).
        batch_help: ``--batch-size``'s help.
        iters: ``--iters`` when not given.
        iters_help: ``--iters``' help.
        warmup: ``--warmup`` when not given.
        warmup_help: ``--warmup``'s help.
        timeout_s: ``--timeout`` when not given.
        png_help: ``--png``'s help.
    """

    models: tuple[str, ...]
    models_help: str
    nprocs: int
    nprocs_help: str
    link: str | None
    link_help: str
    batch: int | None
    batch_help: str
    iters: int
    iters_help: str
    warmup: int
    warmup_help: str
    timeout_s: float
    png_help: str


def _with_default(text: str, value: object) -> str:
    """``text``, naming ``value`` as its default unless it names one already."""
    return text if "default" in text else f"{text} (default {value})"


def add_shared_arguments(parser: argparse.ArgumentParser, flags: Flags) -> None:
    """The flags every benchmark takes: models, ranks, link, batch, sizes, counts, seed,
    timeouts, compute, and where the rows and the chart go.

    ``--iters``, ``--warmup``, ``--link`` and ``--models`` stay None when not given, so that a
    benchmark can tell them apart from its defaults (``--quick``, ``--ablation``).

    Args:
        parser: The benchmark's parser.
        flags: Its defaults and help.
    """
    parser.add_argument("--models", help=flags.models_help)
    parser.add_argument("--model", help="one model (zoo name or package.module:callable)")
    add_nprocs_argument(parser, default=flags.nprocs, help_text=flags.nprocs_help)
    parser.add_argument("--link", help=flags.link_help)
    parser.add_argument(
        "--no-netem", action="store_true", help="plain loopback instead of the emulated cluster"
    )
    parser.add_argument("--batch-size", type=int, default=flags.batch, help=flags.batch_help)
    add_deprecated_alias(parser, "--batch", "--batch-size", "batch_size", type=int)
    add_model_shape_arguments(parser, input_shape=DEFAULT_INPUT_SHAPE, classes=NUM_CLASSES)
    parser.add_argument("--iters", type=int, help=_with_default(flags.iters_help, flags.iters))
    parser.add_argument("--warmup", type=int, help=_with_default(flags.warmup_help, flags.warmup))
    parser.add_argument("--seed", type=int, default=0, help="model and data seed")
    add_timeout_arguments(parser, flags.timeout_s)
    add_compute_arguments(parser)
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument("--png", metavar="PATH", help=f"{flags.png_help} ('none': no plot)")


def add_timeout_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: float
) -> None:
    """``--timeout`` (the bound on each launch) and ``--collective-timeout`` (the bound on any
    one collective in it), as every command that launches ranks for measurements takes them.

    Args:
        parser: The command's parser (or argument group).
        default: Seconds allowed per launch when ``--timeout`` is not given.
    """
    parser.add_argument(
        "--timeout",
        type=float,
        default=default,
        help=f"seconds allowed per launch (default {default:g})",
    )
    add_collective_timeout_argument(parser)


def parse_names(text: str, allowed: Sequence[str] | None, what: str, one: str) -> tuple[str, ...]:
    """Comma-separated names, duplicates dropped.

    Args:
        text: The flag's value.
        allowed: The names accepted, or None for any.
        what: The flag without its dashes (``"models"``), for messages.
        one: What a single item is called (``"model"``), for messages.

    Raises:
        UsageError: No name was given, or one is not in ``allowed``.
    """
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not names:
        raise UsageError(f"--{what}: name at least one")
    if allowed is not None:
        for name in names:
            if name not in allowed:
                raise UsageError(
                    f"--{what}: unknown {one} {name!r}; choose from {', '.join(allowed)}"
                )
    return names


def parse_ratios(text: str) -> tuple[float, ...]:
    """``"0.5,1,2"`` -> ``(0.5, 1.0, 2.0)``; every ratio must be a finite number > 0.

    Args:
        text: Comma-separated ratios (``--ratios``).

    Raises:
        UsageError: A ratio is not a number or not > 0.
    """
    ratios: list[float] = []
    for part in text.split(","):
        item = part.strip()
        try:
            value = float(item)
        except ValueError:
            raise UsageError(
                f"--ratios: {item!r} is not a number; give comma-separated communication/compute "
                "ratios such as 0.5,1,2"
            ) from None
        if not value > 0 or not math.isfinite(value):
            raise UsageError(f"--ratios: every ratio must be > 0, got {item}")
        ratios.append(value)
    return tuple(dict.fromkeys(ratios))


def check_limits(
    nprocs: int | None,
    batch_size: int | None,
    timeout: float,
    collective_timeout: float | None,
    *,
    min_ranks: int = 2,
    ranks_reason: str = "",
) -> float:
    """Refuse a rank count, batch or time limit that cannot run, in one line.

    Args:
        nprocs: ``-n`` (None: the command's own counts).
        batch_size: ``--batch-size`` (None: per model).
        timeout: ``--timeout``, seconds per launch.
        collective_timeout: ``--collective-timeout`` (None: the default).
        min_ranks: The fewest ranks the command can measure on.
        ranks_reason: Why, for the message.

    Returns:
        The collective timeout the launches run with.

    Raises:
        UsageError: For the first value that is wrong.
    """
    if nprocs is not None and nprocs < min_ranks:
        reason = f" ({ranks_reason})" if ranks_reason else ""
        raise UsageError(f"-n must be >= {min_ranks}{reason}, got {nprocs}")
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
    if not 0 < timeout < math.inf:
        raise UsageError(f"--timeout must be > 0 seconds, got {timeout}")
    return collective_timeout_of(collective_timeout)


def check_models(models: Sequence[str], flag: str) -> None:
    """Refuse a model that is neither a zoo name nor ``package.module:callable``.

    Args:
        models: The models asked for.
        flag: The flag that named them, for the message.

    Raises:
        UsageError: For the first unknown model.
    """
    for model in models:
        if ":" not in model and model not in MODEL_NAMES:
            raise UsageError(
                f"{flag}: unknown model {model!r}; choose from {', '.join(MODEL_NAMES)} or give "
                "package.module:callable"
            )


# ================================================================================ config


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """A benchmark run's shared settings, checked; each benchmark's config adds its own.

    Args:
        models: Zoo names or ``package.module:callable``; on emulated compute the trace's name.
        nprocs: Ranks of every launch.
        link: The target cluster's link, or None (loopback, or links the benchmark picks).
        netem: Whether the launches run on the emulated cluster.
        compute: The models' own kernels, or a trace's device time (then the ranks' links run
            at ``link`` / dilation and every time is undilated).
        input_shape: One sample's shape.
        num_classes: Classes the models predict.
        batch_size: ``--batch-size`` (None: per model, :func:`default_batch`).
        iters: Timed iterations.
        warmup: Untimed iterations first.
        seed: The model and data seed.
        timeout_s: Seconds allowed per launch.
        collective_timeout_s: Seconds any one collective may wait for its peers.
        json_path: Where the rows go as JSON (None: nowhere).
        png_path: Where the chart goes (None: no chart).
    """

    models: tuple[str, ...]
    nprocs: int
    link: str | None
    netem: bool
    compute: Compute = REAL_COMPUTE
    input_shape: tuple[int, ...] = DEFAULT_INPUT_SHAPE
    num_classes: int = NUM_CLASSES
    batch_size: int | None = None
    iters: int
    warmup: int
    seed: int = 0
    timeout_s: float
    collective_timeout_s: float
    json_path: str | None = None
    png_path: str | None = None

    @property
    def launch_link(self) -> str | None:
        """The link the ranks run at: ``link``, divided by the dilation on emulated compute."""
        return run_link(self.link, self.compute)

    @property
    def link_text(self) -> str:
        """The link as rows name it (a benchmark that picks its links names them itself)."""
        return self.link or "loopback"

    def batch_for(self, model: str) -> int:
        """The batch of ``model``: ``--batch-size``, else the model's default.

        Args:
            model: A zoo name or ``package.module:callable``.
        """
        return self.batch_size if self.batch_size is not None else default_batch(model)

    def job(self, kind: type[_Job], model: str, **own: Any) -> _Job:
        """The job every rank of ``model``'s launch is told: the shared fields from here.

        Args:
            kind: The benchmark's job class.
            model: The model of the launch.
            **own: The fields the benchmark's job adds.
        """
        return kind(
            model=model,
            batch=self.batch_for(model),
            input_shape=self.input_shape,
            iters=self.iters,
            warmup=self.warmup,
            seed=self.seed,
            num_classes=self.num_classes,
            compute=self.compute,
            **own,
        )

    @classmethod
    def from_args(
        cls: type[_Config],
        args: argparse.Namespace,
        flags: Flags,
        *,
        min_ranks: int = 2,
        ranks_reason: str = "",
        **own: Any,
    ) -> _Config:
        """The shared flags resolved against ``flags`` and checked, with the benchmark's own
        fields.

        Args:
            args: The parsed flags (:func:`add_shared_arguments`).
            flags: The defaults (a benchmark may pass others, e.g. for ``--quick``).
            min_ranks: The fewest ranks the benchmark can measure on.
            ranks_reason: Why, for the message.
            **own: The benchmark's own fields, resolved.

        Raises:
            UsageError: For the first value that is wrong.
        """
        compute = compute_from_args(args)
        if args.model and args.models:
            raise UsageError("--model and --models contradict each other; give one of them")
        if compute.emulated and (args.model or args.models):
            raise UsageError(
                "--model/--models and --compute emulated:TRACE contradict each other: the trace "
                "is the model; leave out --model/--models"
            )
        if compute.emulated:
            models: tuple[str, ...] = (compute.name,)
        elif args.model:
            models = (args.model,)
        elif args.models:
            models = parse_names(args.models, None, "models", "model")
        else:
            models = flags.models
        if not compute.emulated:
            check_models(models, "--model" if args.model else "--models")
        collective_timeout_s = check_limits(
            args.nprocs,
            args.batch_size,
            args.timeout,
            args.collective_timeout,
            min_ranks=min_ranks,
            ranks_reason=ranks_reason,
        )
        if args.no_netem and args.link is not None:
            raise UsageError("--link and --no-netem contradict each other; give one of them")
        link = None if args.no_netem else (args.link or flags.link)
        if link is not None:
            parse_link(link)
        iters = flags.iters if args.iters is None else args.iters
        warmup = flags.warmup if args.warmup is None else args.warmup
        if iters < 1:
            raise UsageError(f"--iters must be >= 1, got {iters}")
        if warmup < 0:
            raise UsageError(f"--warmup must be >= 0, got {warmup}")
        return cls(
            models=models,
            nprocs=args.nprocs,
            link=link,
            netem=not args.no_netem,
            compute=compute,
            input_shape=tuple(args.input_shape),
            num_classes=args.classes,
            batch_size=args.batch_size,
            iters=iters,
            warmup=warmup,
            seed=args.seed,
            timeout_s=float(args.timeout),
            collective_timeout_s=collective_timeout_s,
            json_path=args.json,
            png_path=None if args.png is None or args.png.lower() == "none" else args.png,
            **own,
        )


# ================================================================================ the command


class Benchmark(ABC, Generic[_Config, _Row]):
    """One ``interlace bench`` command, the skeleton every benchmark fills in.

    :meth:`run` is every benchmark's: the config from the flags, each model built once here,
    one :class:`Session` of launches (:meth:`measure`), the tables (:meth:`report`), the rows
    as JSON, the chart (:meth:`plot`), the files written and the failures, and the exit status.
    """

    #: The command as typed, and what it compares.
    prog: ClassVar[str]
    description: ClassVar[str]
    #: The shared flags' defaults and help.
    flags: ClassVar[Flags]

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The command's flags: the shared ones, then its own.

        Args:
            parser: The parser (or subcommand parser) to add them to.
        """
        add_shared_arguments(parser, self.flags)
        self.add_own_arguments(parser)

    def add_own_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The flags only this benchmark takes (none by default).

        Args:
            parser: The parser.
        """

    @abstractmethod
    def config_from_args(self, args: argparse.Namespace) -> _Config:
        """Resolve the defaults and check every value; raises UsageError.

        Args:
            args: The parsed flags.
        """

    def check(self, config: _Config) -> None:
        """Build each model once here, so that a bad model or shape is one line, not a
        traceback per rank (a trace is no zoo model).

        Args:
            config: The run.
        """
        if not config.compute.emulated:
            for model in config.models:
                build_model(model, config.input_shape, config.num_classes)

    def launches(self, config: _Config) -> int:
        """How many launches the run makes (one per model by default).

        Args:
            config: The run.
        """
        return len(config.models)

    @abstractmethod
    def measure(self, config: _Config, session: Session) -> list[_Row]:
        """Every launch of the run, and the rows made of what they measured.

        Args:
            config: The run.
            session: Where the launches go.
        """

    @abstractmethod
    def report(self, config: _Config, rows: list[_Row]) -> None:
        """Print how the rows were measured and their tables.

        Args:
            config: The run.
            rows: Its rows.
        """

    def records(self, rows: list[_Row]) -> list[dict[str, Any]]:
        """The rows as the JSON list holds them.

        Args:
            rows: The run's rows.
        """
        return [row.to_dict() for row in rows]

    def plot(self, config: _Config, rows: list[_Row]) -> str | None:
        """Draw the rows to ``config.png_path`` (nothing by default).

        Args:
            config: The run (with a ``--png``).
            rows: Its rows (at least one).

        Returns:
            A line saying what was written, or None.
        """
        return None

    def run(self, args: argparse.Namespace) -> int:
        """Run the benchmark described by ``args``; the exit status.

        Args:
            args: The parsed flags (see :meth:`add_arguments`).
        """
        config = self.config_from_args(args)
        self.check(config)
        if config.netem:
            check_netem()
        with Session(
            self.prog,
            self.launches(config),
            nprocs=config.nprocs,
            timeout_s=config.timeout_s,
            collective_timeout_s=config.collective_timeout_s,
            compute=config.compute,
        ) as session:
            rows = self.measure(config, session)
        self.report(config, rows)
        if config.json_path:
            write_json(config.json_path, self.records(rows))
        if config.png_path and rows:
            Path(config.png_path).parent.mkdir(parents=True, exist_ok=True)
            drawn = self.plot(config, rows)
            if drawn is not None:
                session.wrote(drawn)
        return session.finish()

    def main(self, argv: list[str] | None = None) -> int:
        """The benchmark on its own (``python benchmarks/NAME.py``); the exit status.

        Args:
            argv: The arguments (default: the command line).
        """
        return standalone_main(self.prog, self.description, self.add_arguments, self.run, argv)
