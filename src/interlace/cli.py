"""The ``interlace`` command: ``launch``, ``train``, ``demo``, ``profile``, ``bench``, ``simulate``
and ``models``.

Each subcommand's module (and torch with it) is imported only when that subcommand is parsed, so
``interlace --help`` and ``interlace launch`` stay cheap; bad input is one line and status 2.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence

from interlace import __version__, launch
from interlace.cliutil import OneLineArgumentParser, fail, parse_shape
from interlace.errors import UsageError

PROG = "interlace"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``interlace`` console script.

    Args:
        argv: the arguments after ``interlace`` (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "launch":
        # The launcher owns everything after `launch`, including the user's own command line.
        return launch.main(args_list[1:])

    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 2
    handler = args.handler
    try:
        status: int = handler(args)
    except UsageError as error:
        fail(f"{PROG} {args.command}", str(error))
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    return status


def build_parser() -> OneLineArgumentParser:
    """The ``interlace`` parser; each subcommand adds its flags when it is first used."""
    parser = OneLineArgumentParser(
        prog=PROG,
        description="Faster distributed PyTorch training by interlacing computation with "
        "communication.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=OneLineArgumentParser
    )
    commands.add_parser(
        "launch",
        help="start N ranks of a torchrun-style script, optionally on an emulated network",
        add_help=False,
    )
    commands.add_parser(
        "train",
        help="train a model data-parallel over N ranks",
        populate=_train_arguments(default_epochs=15, default_nprocs=1),
    )
    commands.add_parser(
        "demo",
        help="the main job: resnet20 on the embedded digits data with 4 ranks",
        populate=_train_arguments(default_epochs=12, default_nprocs=4),
    )
    commands.add_parser(
        "profile",
        help="record one iteration of every rank: compute vs communication timeline (PNG + trace)",
        populate=_profile_arguments,
    )

    bench = commands.add_parser("bench", help="benchmarks that back the README's claims")
    benchmarks = bench.add_subparsers(
        dest="benchmark", metavar="BENCHMARK", parser_class=OneLineArgumentParser, required=True
    )
    benchmarks.add_parser(
        "dp",
        help="data-parallel strategies against torch DDP on the emulated cluster",
        populate=_bench_dp_arguments,
    )
    benchmarks.add_parser(
        "kfac",
        help="distributed K-FAC's per-phase iteration breakdown on the emulated cluster",
        populate=_bench_kfac_arguments,
    )
    benchmarks.add_parser(
        "pipeline",
        help="pipeline schedules vs DataParallel and torch's pipelines at equal global batch",
        populate=_bench_pipeline_arguments,
    )

    commands.add_parser(
        "simulate",
        help="predict iteration times at 4..2048 workers from a trace, or --validate them "
        "against measured runs",
        populate=_simulate_arguments,
    )

    models = commands.add_parser("models", help="list the model zoo with parameter counts")
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
    models.add_argument("--input-shape", type=parse_shape, help="input shape, e.g. 3,32,32")
    models.add_argument("--classes", type=int, help="number of classes")
    models.set_defaults(handler=_run_models)
    return parser


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
    from interlace.bench import validate  # noqa: PLC0415 - heavy (torch), only for this subcommand
    from interlace.sim import command  # noqa: PLC0415 - heavy (torch), only for this subcommand

    command.add_arguments(parser)
    validate.add_arguments(parser)
    parser.set_defaults(handler=functools.partial(command.run, runner=validate.run))


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
    specs = args.model or list(MODEL_NAMES)
    shape_text = "x".join(str(size) for size in input_shape)
    print(f"models for input {shape_text}, {num_classes} classes ({source})\n")
    header = f"| {'model':<24} | {'parameters':>12} | {'tensors':>7} | {'gradient MB':>11} |"
    print(header)
    print(f"|{'-' * 26}|{'-' * 14}:|{'-' * 8}:|{'-' * 12}:|")
    for spec in specs:
        summary = summarize_model(spec, build_model(spec, input_shape, num_classes))
        print(
            f"| {spec:<24} | {summary.params:>12,} | {summary.tensors:>7} | "
            f"{summary.trainable_bytes / 1e6:>11.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
