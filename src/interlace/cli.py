"""The ``interlace`` command: ``launch``, ``train``, ``demo``, ``profile``, ``bench``, ``simulate``,
``plan`` and ``models``.

Each subcommand's module (and torch with it) is imported only when that subcommand is parsed, so
``interlace --help`` and ``interlace launch`` stay cheap; bad input is one line and status 2.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from interlace import __version__
from interlace.cliutil import (
    OneLineArgumentParser,
    add_model_shape_arguments,
    fail,
    quiet_on_broken_pipe,
)
from interlace.errors import UsageError

PROG = "interlace"

#: What ``interlace demo`` trains: the training job's default model and data (``TrainConfig``),
#: on these ranks for these epochs.
DEMO_MODEL = "resnet20"
DEMO_DATA = "digits"
DEMO_NPROCS = 4
DEMO_EPOCHS = 12


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``interlace`` console script.

    Args:
        argv: the arguments after ``interlace`` (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    return quiet_on_broken_pipe(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "launch":
        # The launcher owns everything after `launch`, including the user's own command line.
        from interlace import launch  # noqa: PLC0415 - only for `interlace launch`

        return launch.main(args_list[1:])

    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 2
    handler = args.handler
    # The command as typed, down to the benchmark: `interlace bench dp`.
    prog = " ".join([PROG, args.command, *([args.benchmark] if "benchmark" in args else [])])
    try:
        status: int = handler(args)
    except UsageError as error:
        fail(prog, str(error))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return status


def build_parser() -> OneLineArgumentParser:
    """The ``interlace`` parser; each subcommand adds its flags when it is first used."""
    parser = OneLineArgumentParser(
        prog=PROG,
        description="Faster distributed PyTorch training by interlacing computation with "
        "communication.",
        epilog=f"'{PROG} COMMAND --help' describes a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=OneLineArgumentParser
    )
    _add_command(
        commands,
        "launch",
        help="start N ranks of a torchrun-style script, optionally on an emulated network",
        add_help=False,
    )
    _add_command(
        commands,
        "train",
        help="train a model over N ranks with data parallelism (--strategy) or pipeline "
        "parallelism (--parallel pipeline), SGD, AdamW or K-FAC; --model gpt --data "
        "pydoc-topics trains a language model",
        populate=_train_arguments(default_epochs=15, default_nprocs=1),
    )
    _add_command(
        commands,
        "demo",
        help=f"train with the defaults: {DEMO_MODEL} on the embedded {DEMO_DATA} data, "
        f"{DEMO_NPROCS} ranks, {DEMO_EPOCHS} epochs (takes train's options)",
        populate=_train_arguments(default_epochs=DEMO_EPOCHS, default_nprocs=DEMO_NPROCS),
    )
    _add_command(
        commands,
        "profile",
        help="record one iteration of every rank: compute vs communication timeline (PNG + trace)",
        populate=_profile_arguments,
    )

    _add_command(
        commands,
        "trace",
        help="record a model's per-layer trace on one device (CUDA events on a GPU) for "
        "simulate and the emulated model",
        populate=_trace_arguments,
    )

    bench = _add_command(commands, "bench", help="benchmarks that back the README's claims")
    benchmarks = bench.add_subparsers(
        dest="benchmark", metavar="BENCHMARK", parser_class=OneLineArgumentParser, required=True
    )
    _add_command(
        benchmarks,
        "dp",
        help="data-parallel strategies against torch DDP on the emulated cluster",
        populate=_bench_dp_arguments,
    )
    _add_command(
        benchmarks,
        "kfac",
        help="distributed K-FAC's per-phase iteration breakdown on the emulated cluster",
        populate=_bench_kfac_arguments,
    )
    _add_command(
        benchmarks,
        "pipeline",
        help="pipeline schedules vs DataParallel and torch's pipelines at equal global batch",
        populate=_bench_pipeline_arguments,
    )

    _add_command(
        commands,
        "simulate",
        help="predict iteration times at 4..2048 workers from a trace, or --validate them "
        "against measured runs",
        populate=_simulate_arguments,
    )

    _add_command(
        commands,
        "plan",
        help="rank every configuration the simulator can price for a model on a cluster "
        "(data parallelism, K-FAC, pipelines x replicas) with the flags that run it",
        populate=_plan_arguments,
    )

    models = _add_command(commands, "models", help="list the model zoo with parameter counts")
    models.add_argument(
        "--data",
        default="digits",
        help="data set whose input shape and class count size the models (default: digits)",
    )
    models.add_argument(
        "--model",
        action="append",
        help="a zoo name or package.module:callable (repeatable; default: the whole zoo)",
    )
    add_model_shape_arguments(models, defaults_from="the --data set's")
    models.set_defaults(handler=_run_models)
    return parser


def _add_command(
    group: argparse._SubParsersAction[OneLineArgumentParser],
    name: str,
    *,
    help: str,
    **kwargs: Any,
) -> OneLineArgumentParser:
    """Add subcommand ``name``: its one-line summary in the list, and at the top of its own
    ``--help`` too."""
    description = help[0].upper() + help[1:] + "."
    return group.add_parser(name, help=help, description=description, **kwargs)


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, with its options added, by the words that name it.

    The keys are ``train``, ``bench dp`` and so on (``bench`` itself included, and ``launch``,
    whose parser is the launcher's own); adding the options imports torch.

    Returns:
        The parsers, in the order ``interlace --help`` lists them.
    """
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    child.format_help()  # adds a lazily populated parser's options
                    found[" ".join([*words, name])] = child
                    walk(child, [*words, name])

    walk(build_parser(), [])
    from interlace import launch  # noqa: PLC0415 - its modules are not needed to run the others

    found["launch"] = launch.build_parser()
    return found


# Each function below imports its subcommand's module when that subcommand is parsed: the
# modules need torch (over a second to import), which `interlace --help` and `launch` do without.


def _train_arguments(
    default_epochs: int, default_nprocs: int
) -> Callable[[argparse.ArgumentParser], None]:
    def populate(parser: argparse.ArgumentParser) -> None:
        from interlace.train import command  # noqa: PLC0415 - heavy (torch), only for this subcommand

        command.add_arguments(parser, default_epochs=default_epochs, default_nprocs=default_nprocs)
        parser.set_defaults(handler=command.run)

    return populate


def _profile_arguments(parser: argparse.ArgumentParser) -> None:
    from interlace import profile  # noqa: PLC0415 - heavy (torch), only for this subcommand

    profile.add_arguments(parser)
    parser.set_defaults(handler=profile.run)


def _trace_arguments(parser: argparse.ArgumentParser) -> None:
    from interlace import record  # noqa: PLC0415 - heavy (torch), only for this subcommand

    record.add_arguments(parser)
    parser.set_defaults(handler=record.run)


def _bench_dp_arguments(parser: argparse.ArgumentParser) -> None:
    from interlace.bench import dp  # noqa: PLC0415 - heavy (torch), only for this subcommand

    dp.add_arguments(parser)
    parser.set_defaults(handler=dp.run)


def _bench_kfac_arguments(parser: argparse.ArgumentParser) -> None:
    from interlace.bench import kfac  # noqa: PLC0415 - heavy (torch), only for this subcommand

    kfac.add_arguments(parser)
    parser.set_defaults(handler=kfac.run)


def _bench_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    from interlace.bench import pipeline  # noqa: PLC0415 - heavy (torch), only for this subcommand

    pipeline.add_arguments(parser)
    parser.set_defaults(handler=pipeline.run)


def _simulate_arguments(parser: argparse.ArgumentParser) -> None:
    # The simulator itself needs no torch: only `--validate`, which measures on ranks, imports it.
    from interlace.emulate.compute import add_compute_arguments  # noqa: PLC0415 - this subcommand
    from interlace.sim import command  # noqa: PLC0415 - only for this subcommand

    command.add_arguments(parser)
    # --validate's compute: the zoo models' own kernels, or a trace's device time (emulated).
    add_compute_arguments(parser)
    parser.set_defaults(handler=functools.partial(command.run, runner=_run_validation))


def _plan_arguments(parser: argparse.ArgumentParser) -> None:
    # Torch-free, like the simulator it ranks with.
    from interlace.sim import plan_command  # noqa: PLC0415 - only for this subcommand

    plan_command.add_arguments(parser)
    parser.set_defaults(handler=plan_command.run)


def _run_validation(args: argparse.Namespace, png_path: Path | None) -> int:
    from interlace.bench import validate  # noqa: PLC0415 - heavy (torch), only for --validate

    return validate.run(args, png_path)


def _run_models(args: argparse.Namespace) -> int:
    from interlace.zoo import (  # noqa: PLC0415 - heavy import (torch), only for `interlace models`
        MODEL_NAMES,
        build_model,
        load_data,
        summarize_model,
    )

    if args.input_shape is not None and args.classes is not None:
        input_shape, num_classes, source = args.input_shape, args.classes, "given shape"
    else:
        bundle = load_data(args.data)
        input_shape = args.input_shape or bundle.input_shape
        num_classes = args.classes or bundle.num_classes
        source = bundle.name
    # Every model is built before anything is printed: a bad one is an error line, not a table
    # cut short. Listing the whole zoo, a model made for other data (a 1-D model on images,
    # an image model on sequences) is named below the table instead.
    summaries, other_data = [], []
    for spec in args.model or list(MODEL_NAMES):
        try:
            summaries.append(summarize_model(spec, build_model(spec, input_shape, num_classes)))
        except UsageError:
            if args.model:
                raise
            other_data.append(spec)
    shape_text = "x".join(str(size) for size in input_shape)
    print(f"models for input {shape_text}, {num_classes} classes ({source})\n")
    rows = [
        (s.name, f"{s.params:,}", str(s.tensors), f"{s.trainable_bytes / 1e6:.2f}")
        for s in summaries
    ]
    print(format_table(("model", "parameters", "tensors", "gradient MB"), rows, right=(1, 2, 3)))
    if other_data:
        print(f"\nmade for other data than {shape_text}: {', '.join(other_data)}")
    return 0


def format_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()
) -> str:
    """A Markdown table whose columns (and separator row) line up in plain text too.

    Args:
        header: the column titles.
        rows: the cells, one sequence per row, as many as ``header``.
        right: indices of the columns aligned right (numbers).

    Returns:
        The table's lines, joined by newlines.
    """
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = (
            cell.rjust(width) if index in right else cell.ljust(width)
            for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
        )
        return "| " + " | ".join(padded) + " |"

    # `---:` marks a right-aligned column; the colon takes the place of the cell's last space.
    separator = (
        "|"
        + "|".join(
            "-" * (width + 1) + ":" if index in right else "-" * (width + 2)
            for index, width in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([line(header), separator, *(line(row) for row in rows)])


if __name__ == "__main__":
    raise SystemExit(main())
