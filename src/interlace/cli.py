"""The ``interlace`` command: ``launch``, ``train``, ``demo``, ``profile``, ``bench``, ``simulate``
and ``models``.

Every subcommand answers bad input with one line on stderr and exit status 2 (see
:mod:`interlace.cliutil`); a job whose rank fails exits with that rank's status.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from interlace import __version__
from interlace.cliutil import OneLineArgumentParser, add_channel_arguments, fail
from interlace.errors import UsageError

if TYPE_CHECKING:
    from interlace.launch import LaunchResult

PROG = "interlace"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``interlace`` console script; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "launch":
        # The launcher owns everything after `launch`, including the user's own command line.
        from interlace import launch

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

    train = commands.add_parser("train", help="train a model data-parallel over N ranks")
    _add_job_arguments(train, default_epochs=15)
    train.set_defaults(handler=_run_train)

    demo = commands.add_parser(
        "demo", help="the main job: resnet20 on the embedded digits data with 4 ranks"
    )
    _add_job_arguments(demo, default_epochs=12, default_nprocs=4)
    demo.set_defaults(handler=_run_train)

    profile = commands.add_parser(
        "profile",
        help="record one iteration of every rank: compute vs communication timeline (PNG + trace)",
    )
    profile.add_argument("--model", default="resnet20", help="zoo name or package.module:callable")
    profile.add_argument(
        "--data",
        default="synthetic-cifar10",
        help="data set whose sample shape and classes size the model (default synthetic-cifar10)",
    )
    profile.add_argument("--input-shape", type=_shape, help="input shape, e.g. 3,32,32")
    profile.add_argument("--classes", type=int, help="number of classes")
    profile.add_argument(
        "--strategy", default="mgwfbp", help="ddp, wfbp, fixed, single, mgwfbp or optimal"
    )
    add_channel_arguments(profile)
    profile.add_argument("-n", "--nprocs", type=int, default=4, help="ranks (default 4)")
    profile.add_argument("--link", help="emulated link rate per rank, e.g. 1gbit (needs root)")
    profile.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    profile.add_argument("--steps", type=int, default=10, help="iterations measured")
    profile.add_argument("--warmup", type=int, default=8, help="iterations before measuring")
    profile.add_argument(
        "--optimizer",
        choices=("sgd", "kfac"),
        default="sgd",
        help="kfac: K-FAC (kfac-pytorch's defaults) before each SGD step, drawn on its own lanes",
    )
    profile.add_argument("--out", default="profile", help="folder for timeline.json/.png")
    profile.add_argument("--timeout", type=float, default=600.0)
    profile.add_argument(
        "--trace-out",
        metavar="T",
        help="also write the model's trace for `interlace simulate` (JSON) to T",
    )
    profile.set_defaults(handler=_run_profile)

    bench = commands.add_parser("bench", help="benchmarks that back the README's claims")
    benchmarks = bench.add_subparsers(
        dest="benchmark", metavar="BENCHMARK", parser_class=OneLineArgumentParser, required=True
    )
    bench_dp = benchmarks.add_parser(
        "dp", help="data-parallel strategies against torch DDP on the emulated cluster"
    )
    from interlace.bench import dp as bench_dp_module

    bench_dp_module.add_arguments(bench_dp)
    bench_dp.set_defaults(handler=bench_dp_module.run)
    bench_kfac = benchmarks.add_parser(
        "kfac", help="distributed K-FAC's per-phase iteration breakdown on the emulated cluster"
    )
    from interlace.bench import kfac as bench_kfac_module

    bench_kfac_module.add_arguments(bench_kfac)
    bench_kfac.set_defaults(handler=bench_kfac_module.run)
    bench_pipeline = benchmarks.add_parser(
        "pipeline",
        help="pipeline schedules vs DataParallel and torch's pipelines at equal global batch",
    )
    from interlace.bench import pipeline as bench_pipeline_module

    bench_pipeline_module.add_arguments(bench_pipeline)
    bench_pipeline.set_defaults(handler=bench_pipeline_module.run)

    simulate = commands.add_parser(
        "simulate",
        help="predict iteration times at 4..2048 workers from a trace, or --validate them "
        "against measured runs",
    )
    from interlace.sim import command as simulate_module

    simulate_module.add_arguments(simulate)
    simulate.set_defaults(handler=simulate_module.run)

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
    models.add_argument("--input-shape", type=_shape, help="input shape, e.g. 3,32,32")
    models.add_argument("--classes", type=int, help="number of classes")
    models.set_defaults(handler=_run_models)
    return parser


def _add_job_arguments(
    parser: argparse.ArgumentParser, default_epochs: int, default_nprocs: int = 1
) -> None:
    from interlace.train import (
        OPTIMIZERS,
        PARALLELISMS,
        PARTITION_BY,
        PIPELINE_SCHEDULES,
        TrainConfig,
    )

    defaults = TrainConfig()
    parser.add_argument(
        "--model", default=defaults.model, help="zoo name or package.module:callable"
    )
    parser.add_argument(
        "--data",
        default=defaults.data,
        help="digits, synthetic-cifar10, synthetic-imagenet, or a CIFAR-10 python folder",
    )
    parser.add_argument(
        "--strategy",
        default=defaults.strategy,
        help="how gradients are averaged: ddp (torch DDP), wfbp, fixed, single, mgwfbp or optimal "
        f"(default {defaults.strategy})",
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=defaults.bucket_cap_mb,
        help="bucket cap of the ddp and fixed strategies, MB (default: 25, first bucket 1)",
    )
    add_channel_arguments(parser)
    parser.add_argument(
        "-n",
        "--nprocs",
        type=int,
        default=default_nprocs,
        help=f"number of ranks to start (default {default_nprocs}); ignored under torchrun",
    )
    parser.add_argument(
        "--link",
        help="emulate a network of this rate per rank: 100mbit, 1gbit, 2.5gbit or 10gbit "
        "(needs root); default: plain loopback",
    )
    parser.add_argument("--epochs", type=int, default=default_epochs)
    parser.add_argument(
        "--batch-size", type=int, default=defaults.batch_size, help="per-rank batch size"
    )
    parser.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    parser.add_argument("--momentum", type=float, default=defaults.momentum)
    parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    parser.add_argument("--warmup-epochs", type=float, default=defaults.warmup_epochs)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--input-shape", type=_shape, help="input shape the model expects, e.g. 3,32,32"
    )
    parser.add_argument("--classes", type=int, help="number of classes the model predicts")
    parser.add_argument(
        "--synthetic-size", type=int, help="training samples of a synthetic data set"
    )
    parser.add_argument(
        "--max-steps-per-epoch", type=int, help="cut every epoch short (throughput runs)"
    )
    parser.add_argument(
        "--runs-dir", default=defaults.runs_dir, help="where run folders are made (default runs)"
    )
    parser.add_argument("--out", help="exact run folder to write (default: a new one in runs/)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--timeout", type=float, help="stop the whole job after this many seconds")
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=defaults.optimizer,
        help="sgd (SGD with momentum) or kfac (K-FAC preconditioning in front of that same SGD, "
        f"schedule and all; default {defaults.optimizer})",
    )
    pipeline = parser.add_argument_group(
        "pipeline parallelism (with --parallel pipeline: one stage per rank, -n stages)"
    )
    pipeline.add_argument(
        "--parallel",
        choices=PARALLELISMS,
        default=defaults.parallel,
        help="data: replicate the model (--strategy); pipeline: cut it into -n stages, "
        "--batch-size then being the mini-batch through the pipeline (default data)",
    )
    pipeline.add_argument(
        "--schedule",
        choices=PIPELINE_SCHEDULES,
        default=defaults.schedule,
        help="gpipe or 1f1b (synchronous, micro-batches, one update per mini-batch); "
        "spectrain, pipedream or naive (asynchronous 1F1B, an update per mini-batch, "
        f"with predicted, stashed or latest weights); default {defaults.schedule}",
    )
    pipeline.add_argument(
        "--microbatches",
        type=int,
        default=defaults.microbatches,
        help=f"micro-batches per mini-batch of gpipe and 1f1b (default {defaults.microbatches})",
    )
    pipeline.add_argument(
        "--chunks",
        type=int,
        default=defaults.chunks,
        help="pieces each mini-batch travels in through spectrain, pipedream or naive, all with "
        "the mini-batch's weights and one update: a stage starts on the first while the rest "
        "are in transit (faster on slow links; BatchNorm then normalises per piece); "
        f"default {defaults.chunks}",
    )
    pipeline.add_argument(
        "--spectrain-backward",
        choices=("recompute", "reuse"),
        default=defaults.spectrain_backward,
        help="spectrain's backward: recompute the stage with weights predicted at backward "
        "time (the paper's rule) or reuse the forward's prediction and graph (no second "
        f"forward); default {defaults.spectrain_backward}",
    )
    pipeline.add_argument(
        "--partition-by",
        choices=PARTITION_BY,
        default=defaults.partition_by,
        help="balance stages by measured forward+backward time or by parameter count "
        f"(default {defaults.partition_by})",
    )
    kfac = parser.add_argument_group("K-FAC (with --optimizer kfac; defaults are kfac-pytorch's)")
    kfac.add_argument(
        "--kfac-factor-update-steps",
        type=int,
        default=defaults.kfac_factor_update_steps,
        metavar="N",
        help="update the Kronecker factors every N steps",
    )
    kfac.add_argument(
        "--kfac-inv-update-steps",
        type=int,
        default=defaults.kfac_inv_update_steps,
        metavar="N",
        help="decompose (or invert) the factors every N steps",
    )
    kfac.add_argument(
        "--kfac-damping", type=float, default=defaults.kfac_damping, help="Tikhonov damping"
    )
    kfac.add_argument(
        "--kfac-factor-decay",
        type=float,
        default=defaults.kfac_factor_decay,
        help="running-average decay of the factors, in [0, 1)",
    )
    kfac.add_argument(
        "--kfac-kl-clip",
        type=float,
        default=defaults.kfac_kl_clip,
        help="KL-clip bound on the preconditioned step (0: no clip)",
    )
    kfac.add_argument(
        "--kfac-compute-method",
        default=defaults.kfac_compute_method,
        help="eigen (eigendecompositions) or inverse (damped inverses)",
    )
    kfac.add_argument(
        "--kfac-grad-worker-fraction",
        type=float,
        default=defaults.kfac_grad_worker_fraction,
        metavar="F",
        help="share of ranks preconditioning each layer: 1 COMM-OPT, 1/n MEM-OPT, between HYBRID",
    )
    kfac.add_argument(
        "--kfac-g-normalization",
        choices=("kfac-pytorch", "per-example"),
        default=defaults.kfac_g_normalization,
        help="G from gradients of the mean loss (kfac-pytorch) or of each example's loss "
        "(the per-example Fisher: G times the squared global batch)",
    )


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a shape; write it as comma-separated sizes, e.g. 3,32,32"
        ) from None
    if not shape or any(size < 1 for size in shape):
        raise argparse.ArgumentTypeError(f"'{text}' is not a shape of positive sizes")
    return shape


def _run_train(args: argparse.Namespace) -> int:
    from interlace import launch
    from interlace.distenv import in_launched_job
    from interlace.kfac.placement import worker_count
    from interlace.netem import parse_link
    from interlace.runlog import new_run_dir
    from interlace.train import TrainConfig, run_label, train_rank
    from interlace.zoo import build_model, load_data

    config = TrainConfig(
        model=args.model,
        data=args.data,
        strategy=args.strategy,
        bucket_cap_mb=args.bucket_cap_mb,
        channels=args.channels,
        compression=args.compression,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        warmup_epochs=args.warmup_epochs,
        seed=args.seed,
        input_shape=args.input_shape,
        num_classes=args.classes,
        synthetic_size=args.synthetic_size,
        max_steps_per_epoch=args.max_steps_per_epoch,
        runs_dir=args.runs_dir,
        progress=not args.no_progress,
        optimizer=args.optimizer,
        kfac_factor_update_steps=args.kfac_factor_update_steps,
        kfac_inv_update_steps=args.kfac_inv_update_steps,
        kfac_damping=args.kfac_damping,
        kfac_factor_decay=args.kfac_factor_decay,
        kfac_kl_clip=args.kfac_kl_clip,
        kfac_compute_method=args.kfac_compute_method,
        kfac_grad_worker_fraction=args.kfac_grad_worker_fraction,
        kfac_g_normalization=args.kfac_g_normalization,
        parallel=args.parallel,
        schedule=args.schedule,
        microbatches=args.microbatches,
        partition_by=args.partition_by,
        spectrain_backward=args.spectrain_backward,
        chunks=args.chunks,
    )
    config.validate()

    if in_launched_job():
        # Started by torchrun or `interlace launch`: this process is one rank already.
        train_rank(config, args.out)
        return 0

    if args.nprocs < 1:
        raise UsageError(f"-n must be >= 1, got {args.nprocs}")
    if args.link is not None:
        parse_link(args.link)
    if config.optimizer == "kfac":
        try:
            worker_count(config.kfac_grad_worker_fraction, args.nprocs)
        except ValueError as error:
            raise UsageError(f"--kfac-grad-worker-fraction: {error}") from None
    # Check the model and data here, once, so a typo is one line rather than N tracebacks.
    bundle = load_data(config.data, synthetic_size=config.synthetic_size, seed=config.seed)
    build_model(
        config.model,
        config.input_shape or bundle.input_shape,
        config.num_classes or bundle.num_classes,
    )
    run_dir = args.out or str(
        new_run_dir(
            config.runs_dir, f"{run_label(config.model)}-{run_label(config.data)}-n{args.nprocs}"
        )
    )
    result = launch.run(
        train_rank, args.nprocs, link=args.link, args=(config, run_dir), timeout=args.timeout
    )
    return _report_failure(args, result)


def _run_profile(args: argparse.Namespace) -> int:
    from interlace import launch
    from interlace.netem import parse_link
    from interlace.profile import ProfileConfig, merge_profiles, profile_rank, write_profile
    from interlace.strategies import STRATEGIES, parse_channels
    from interlace.zoo import build_model, load_data

    if args.nprocs < 1:
        raise UsageError(f"-n must be >= 1, got {args.nprocs}")
    if args.strategy not in STRATEGIES:
        raise UsageError(
            f"unknown --strategy '{args.strategy}'; choose one of {', '.join(STRATEGIES)}"
        )
    if args.link is not None:
        parse_link(args.link)
    if args.input_shape is not None and args.classes is not None:
        input_shape, num_classes = args.input_shape, args.classes
    else:
        bundle = load_data(
            args.data, synthetic_size=64 if args.data.startswith("synthetic") else None
        )
        input_shape = args.input_shape or bundle.input_shape
        num_classes = args.classes or bundle.num_classes
    config = ProfileConfig(
        model=args.model,
        strategy=args.strategy,
        channels=parse_channels(args.channels),
        compression=args.compression,
        input_shape=tuple(input_shape),
        num_classes=num_classes,
        batch_size=args.batch_size,
        warmup=args.warmup,
        steps=args.steps,
        trace=args.trace_out is not None,
        optimizer=args.optimizer,
    )
    config.validate()
    if args.trace_out is not None and args.strategy == "ddp":
        raise UsageError(
            "--trace-out needs an interlace strategy (wfbp, fixed, single, mgwfbp or optimal): "
            "the trace comes from the profile DataParallel plans with"
        )
    build_model(config.model, config.input_shape, config.num_classes)
    result = launch.run(
        profile_rank, args.nprocs, link=args.link, args=(config,), timeout=args.timeout
    )
    if result.returncode != 0:
        return _report_failure(args, result)
    link = args.link or "loopback"
    title = (
        f"{config.model}, {config.strategy}, {args.nprocs} ranks, {link}, "
        f"batch {config.batch_size}/rank"
        + (f", channels {config.channels}" if config.channels != 1 else "")
        + (f", {config.compression}" if config.compression else "")
        + (", K-FAC" if config.optimizer == "kfac" else "")
    )
    timeline = merge_profiles(result.values, title)
    trace, picture = write_profile(timeline, args.out)
    for profile in sorted(result.values, key=lambda p: p.rank):
        median = sorted(profile.iteration_s)[len(profile.iteration_s) // 2]
        print(f"rank {profile.rank}: median iteration {median * 1e3:.1f} ms")
    if result.values[0].plan:
        print(result.values[0].plan)
    print(timeline.caption("rank 0"))
    print(f"timeline: {picture}\ntrace:    {trace} (open in https://ui.perfetto.dev)")
    if args.trace_out is not None:
        profiled = next(p.trace for p in result.values if p.trace is not None)
        # An optimizer step ends when the slowest rank's does.
        profiled = replace(profiled, step_s=max(p.step_s for p in result.values))
        written = profiled.save(args.trace_out)
        print(f"simulator trace: {written} ({profiled.describe()})")
    return 0


def _report_failure(args: argparse.Namespace, result: LaunchResult) -> int:
    """The job's status; on failure, why: the timeout, or the failing rank's traceback."""
    if result.returncode != 0:
        if result.timed_out:
            print(
                f"{PROG} {args.command}: stopped after --timeout {args.timeout} s", file=sys.stderr
            )
        elif result.failed_rank is not None and result.failed_rank in result.tracebacks:
            print(result.tracebacks[result.failed_rank].rstrip(), file=sys.stderr)
    return result.returncode


def _run_models(args: argparse.Namespace) -> int:
    from interlace.zoo import MODEL_NAMES, build_model, load_data, summarize_model

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
