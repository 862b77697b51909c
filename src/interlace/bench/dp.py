"""``interlace bench dp``: every data-parallel strategy against PyTorch DDP, at chosen regimes.

Per model, a calibration launch picks the link rates that give target communication/compute
ratios; one launch per (model, ratio) then times every strategy side by side
(:mod:`interlace.bench.dp_rank`) and prints rows against DDP (:mod:`interlace.bench.dp_report`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from interlace.bench.dp_rank import (
    REAL_COMPUTE,
    Calibration,
    CalibrationJob,
    MeasureJob,
    calibrate_rank,
    measure_rank,
    variant_label,
)
from interlace.bench.dp_report import (
    LaunchContext,
    Row,
    format_cluster,
    format_rate,
    format_summary,
    format_table,
    one_line,
    plot_speedups,
    rate_for_ratio,
    rows_from_measurement,
)
from interlace.bench.harness import (
    DEFAULT_BATCH,
    DEFAULT_INPUT_SHAPE,
    NUM_CLASSES,
    LaunchFailedError,
    add_timeout_arguments,
    check_launch_args,
    check_netem,
    default_batch,
    launch_on_ranks,
    machine_load,
    parse_names,
    parse_ratios,
    split_blocks,
)
from interlace.cliutil import (
    add_model_shape_arguments,
    add_nprocs_argument,
    collective_timeout_of,
    standalone_main,
)
from interlace.comm.cost import CostModel
from interlace.comm.links import parse_link
from interlace.comm.strategies import BENCH_STRATEGIES, STRATEGIES
from interlace.emulate import Compute, add_compute_arguments, compute_from_args, dilate_rate
from interlace.errors import UsageError
from interlace.launch.rank import DEFAULT_COLLECTIVE_TIMEOUT_S
from interlace.sim.network import NETWORK_HELP, parse_network
from interlace.wrapping import parse_channels
from interlace.zoo import build_model

PROG = "interlace bench dp"

DEFAULT_MODELS: tuple[str, ...] = ("mlp", "resnet20", "resnet56", "vgg11", "transformer")
DEFAULT_STRATEGIES: tuple[str, ...] = ("ddp", "wfbp", "fixed", "single", "mgwfbp")
DEFAULT_RATIOS: tuple[float, ...] = (0.5, 1.0, 2.0)

#: The link the calibration runs at: fast enough to be quick, slow enough to be faithful.
REF_LINK = "1gbit"
#: Slowest link chosen: below it, tbf's 96 KiB bucket is a visible share of a transfer.
MIN_LINK = "20mbit"
#: Fastest link chosen: on a 2-core machine faster shaping is not reproduced faithfully.
MAX_LINK = "2.5gbit"

#: Per-rank batch on emulated compute: the batch only feeds the gradients' arithmetic.
EMULATED_BATCH = 8

DEFAULT_ITERS = 12
DEFAULT_WARMUP = 2
DEFAULT_ROUNDS = 3
DEFAULT_NPROCS = 4
DEFAULT_TIMEOUT_S = 900.0

#: ``--quick``: two models at one ratio and fewer iterations, about two minutes.
QUICK_MODELS: tuple[str, ...] = ("mlp", "resnet20")
QUICK_RATIOS: tuple[float, ...] = (1.0,)
QUICK_ITERS = 8
QUICK_WARMUP = 1
QUICK_ROUNDS = 2


@dataclass(frozen=True)
class BenchConfig:
    """A validated benchmark run."""

    models: tuple[str, ...]
    strategies: tuple[str, ...]
    ratios: tuple[float, ...]
    nprocs: int
    iters: int
    warmup: int
    rounds: int
    input_shape: tuple[int, ...]
    batch_size: int | None
    link: str | None
    netem: bool
    timeout_s: float
    ref_link: str
    min_link: str
    max_link: str
    seed: int
    json_path: str | None
    png_path: str | None
    num_classes: int = NUM_CLASSES
    #: What the ranks compute on; on emulated compute ``models`` holds the trace's name.
    compute: Compute = REAL_COMPUTE
    #: The target cluster (``--network``) whose all-reduce ``a`` and ``b`` the rows show.
    network: str | None = None
    #: Seconds any one collective may wait for its peers (``--collective-timeout``).
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S

    def batch_for(self, model: str) -> int:
        """The per-rank batch of ``model``: ``--batch-size``, else the model's default.

        Args:
            model: A zoo name or ``package.module:callable``.
        """
        if self.batch_size is not None:
            return self.batch_size
        if self.compute.emulated:
            return EMULATED_BATCH
        return default_batch(model)

    @property
    def calibrates(self) -> bool:
        return self.netem and self.link is None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``interlace bench dp``.

    Args:
        parser: The parser (or subcommand parser) to add them to.
    """
    parser.add_argument(
        "--models",
        help=f"comma-separated zoo models or package.module:callable "
        f"(default {','.join(DEFAULT_MODELS)}; --quick: {','.join(QUICK_MODELS)})",
    )
    parser.add_argument("--model", help="one model (zoo name or package.module:callable)")
    parser.add_argument(
        "--strategies",
        "--strategy",
        dest="strategies",
        help=f"comma-separated strategies (default {','.join(DEFAULT_STRATEGIES)})",
    )
    parser.add_argument(
        "--channels",
        default="1",
        help="comma-separated channel settings each interlace strategy runs with, e.g. 1,auto "
        "or 1,2,4 (default 1); the table gains the channels asked for and used",
    )
    parser.add_argument(
        "--compression",
        default="none",
        help="comma-separated compressions each strategy runs with: none, fp16, bf16 "
        "(default none)",
    )
    parser.add_argument(
        "--ratios",
        help="target communication/compute ratios; each picks a link rate per model "
        f"(default {','.join(f'{r:g}' for r in DEFAULT_RATIOS)}; --quick: "
        f"{','.join(f'{r:g}' for r in QUICK_RATIOS)})",
    )
    add_nprocs_argument(parser, default=DEFAULT_NPROCS, help_text="ranks")
    parser.add_argument(
        "--iters",
        type=int,
        help=f"timed iterations per strategy and launch (default {DEFAULT_ITERS}; "
        f"--quick: {QUICK_ITERS})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        help="untimed iterations per strategy after its buckets are final "
        f"(default {DEFAULT_WARMUP}; --quick: {QUICK_WARMUP})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="round-robin blocks the timed iterations are split into "
        f"(default {DEFAULT_ROUNDS}; --quick: {QUICK_ROUNDS})",
    )
    add_model_shape_arguments(parser, input_shape=DEFAULT_INPUT_SHAPE, classes=NUM_CLASSES)
    parser.add_argument(
        "--batch-size",
        type=int,
        help="per-rank batch for every model (default: per model, "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_BATCH.items())
        + ")",
    )
    parser.add_argument(
        "--link",
        help="use this link for every row instead of calibrating one per ratio "
        "(e.g. 100mbit, 1gbit, 300mbit)",
    )
    parser.add_argument(
        "--no-netem",
        action="store_true",
        help="run on loopback without an emulated network (no root needed; no ratios)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a ~2-minute run: fewer models, one ratio, fewer iterations",
    )
    add_timeout_arguments(parser, DEFAULT_TIMEOUT_S)
    parser.add_argument(
        "--ref-link",
        default=REF_LINK,
        help=f"link of the calibration launch (default {REF_LINK})",
    )
    parser.add_argument(
        "--min-link",
        default=MIN_LINK,
        help=f"slowest link a ratio may pick (default {MIN_LINK})",
    )
    parser.add_argument(
        "--max-link",
        default=MAX_LINK,
        help=f"fastest link a ratio may pick (default {MAX_LINK})",
    )
    add_compute_arguments(parser)
    parser.add_argument(
        "--network",
        metavar="SPEC",
        help="the target cluster whose all-reduce start-up a and per-byte b the rows show beside "
        f"the measured ones, e.g. osu:10gbe ({NETWORK_HELP})",
    )
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument("--png", metavar="PATH", help="plot speed-ups vs DDP")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Resolve ``--quick`` and defaults and check every value; raises UsageError.

    Args:
        args: The parsed flags (see :func:`add_arguments`).
    """

    quick = bool(args.quick)
    compute = compute_from_args(args)
    if args.model and args.models:
        raise UsageError("--model and --models contradict each other; give one of them")
    if compute.emulated and (args.models or args.model):
        raise UsageError(
            "--model/--models and --compute emulated:TRACE contradict each other: the trace is "
            "the model"
        )
    if compute.emulated:
        models: tuple[str, ...] = (compute.name,)
    elif args.model:
        models = (args.model,)
    elif args.models:
        models = parse_names(args.models, None, "models", "model")
    else:
        models = QUICK_MODELS if quick else DEFAULT_MODELS
    if compute.emulated and args.link is None and not args.no_netem:
        raise UsageError(
            "--compute emulated:TRACE needs --link RATE (the target cluster's link; the ranks run "
            "at RATE / dilation) or --no-netem"
        )
    network = getattr(args, "network", None)
    if network is not None:
        parse_network(network)
    strategies = (
        parse_names(args.strategies, BENCH_STRATEGIES, "strategies", "strategy")
        if args.strategies
        else DEFAULT_STRATEGIES
    )
    strategies = expand_variants(strategies, args.channels, args.compression)
    ratios = (
        parse_ratios(args.ratios) if args.ratios else (QUICK_RATIOS if quick else DEFAULT_RATIOS)
    )
    iters = args.iters if args.iters is not None else (QUICK_ITERS if quick else DEFAULT_ITERS)
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if quick else DEFAULT_WARMUP)
    rounds = args.rounds if args.rounds is not None else (QUICK_ROUNDS if quick else DEFAULT_ROUNDS)
    check_launch_args(
        args,
        () if compute.emulated else models,
        prefix="--model: " if args.model else "--models: ",
        ranks_reason="data parallelism needs ranks to average",
    )
    if iters < 1:
        raise UsageError(f"--iters must be >= 1, got {iters}")
    if warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {warmup}")
    if rounds < 1:
        raise UsageError(f"--rounds must be >= 1, got {rounds}")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    for value in (args.link, args.ref_link, args.min_link, args.max_link):
        if value is not None:
            parse_link(value)
    if parse_link(args.min_link) > parse_link(args.max_link):
        raise UsageError(f"--min-link {args.min_link} is faster than --max-link {args.max_link}")
    return BenchConfig(
        models=models,
        strategies=strategies,
        ratios=ratios,
        nprocs=args.nprocs,
        iters=iters,
        warmup=warmup,
        rounds=rounds,
        input_shape=tuple(args.input_shape),
        num_classes=args.classes,
        batch_size=args.batch_size,
        link=args.link,
        netem=not args.no_netem,
        timeout_s=float(args.timeout),
        collective_timeout_s=collective_timeout_of(args.collective_timeout),
        ref_link=args.ref_link,
        min_link=args.min_link,
        max_link=args.max_link,
        seed=args.seed,
        json_path=args.json,
        png_path=args.png,
        compute=compute,
        network=network,
    )


def expand_variants(
    strategies: Sequence[str], channels_text: str, compression_text: str
) -> tuple[str, ...]:
    """Every strategy with every channel setting and compression (torch's wrappers: one channel
    only; FSDP2 uncompressed).

    Args:
        strategies: Strategy names.
        channels_text: The ``--channels`` value (comma-separated).
        compression_text: The ``--compression`` value (comma-separated).
    """

    channel_settings = [parse_channels(part.strip()) for part in channels_text.split(",")]
    compressions: list[str | None] = []
    for part in (piece.strip() for piece in compression_text.split(",")):
        if part not in ("none", "fp16", "bf16"):
            raise UsageError(f"--compression: unknown {part!r}; choose none, fp16 or bf16")
        compressions.append(None if part == "none" else part)
    labels: list[str] = []
    for strategy in strategies:
        torch_wrapper = STRATEGIES[strategy].torch_wrapper
        for compression in compressions if torch_wrapper != "fsdp2" else [None]:
            for channels in channel_settings if torch_wrapper is None else [1]:
                labels.append(variant_label(strategy, channels, compression))
    return tuple(dict.fromkeys(labels))


def _check_models_build(config: BenchConfig) -> None:
    """Build each model once here, so a bad model or shape is one line, not N tracebacks."""

    if config.compute.emulated:
        return
    for model in config.models:
        build_model(model, config.input_shape, config.num_classes)


@dataclass
class _Plan:
    model: str
    context: LaunchContext


def _launch_plan(config: BenchConfig, calibrations: dict[str, Calibration] | None) -> list[_Plan]:

    plans = []
    for model in config.models:
        if not config.netem:
            plans.append(_Plan(model, LaunchContext(None, "loopback")))
            continue
        if config.link is not None:
            plans.append(_Plan(model, launch_context(config)))
            continue
        assert calibrations is not None
        calibration = calibrations[model]
        for ratio in config.ratios:
            choice = rate_for_ratio(
                ratio,
                calibration.compute_s,
                parse_link(config.ref_link),
                calibration.allreduce_s,
                latency_s=calibration.latency_s,
                min_bps=parse_link(config.min_link),
                max_bps=parse_link(config.max_link),
            )
            wanted = (
                "inf" if not math.isfinite(choice.wanted_bps) else format_rate(choice.wanted_bps)
            )
            context = LaunchContext(
                ratio, choice.link, choice.clamped, wanted if choice.clamped else None
            )
            plans.append(_Plan(model, context))
    return plans


def launch_context(config: BenchConfig) -> LaunchContext:
    """The context of a launch at ``--link``: on emulated compute the ranks run at the link's
    rate / dilation, and ``--network`` gives the target's all-reduce cost.

    Args:
        config: A run with a fixed ``--link``.
    """
    assert config.link is not None
    target: CostModel | None = None
    if config.network is not None:
        target = parse_network(config.network).cost(config.nprocs)
    if not config.compute.emulated:
        return LaunchContext(None, config.link, target=target, target_name=config.network)
    emulated = format_rate(dilate_rate(config.link, config.compute.dilation))
    return LaunchContext(
        None, config.link, emulated_link=emulated, target=target, target_name=config.network
    )


def describe_conditions(config: BenchConfig) -> str:
    """One paragraph saying when, where and how the rows were measured.

    Args:
        config: The run.
    """
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    load = machine_load()
    network = (
        "loopback (no emulated network)"
        if not config.netem
        else f"emulated cluster, fixed link {config.link}"
        if config.link is not None
        else f"emulated cluster, links chosen per model from a calibration at {config.ref_link} "
        f"(clamped to {config.min_link}..{config.max_link})"
    )
    return (
        f"{now}; {platform.node()} ({os.cpu_count()} CPUs, load {load} at the end), torch "
        f"{torch.__version__}, gloo; {config.nprocs} ranks on {network}; "
        + (
            f"compute {config.compute.label()}, every time undilated (measured / "
            f"{config.compute.dilation:g}), links at the given rate / "
            f"{config.compute.dilation:g}"
            if config.compute.emulated
            else f"input {'x'.join(map(str, config.input_shape))}"
        )
        + f"; per strategy {config.warmup} warm-up "
        f"iterations after its buckets are final, then {config.iters} timed in "
        f"{len(split_blocks(config.iters, config.rounds))} round-robin rounds; iteration = "
        "forward + backward + SGD step, wall clock, maximum over ranks per iteration, median over "
        "iterations; "
        + (
            "bound = the trace's forward + max(its backward, one all-reduce of all gradients) + "
            "the measured step (the ideal-bound row)."
            if config.compute.emulated
            else "bound = forward + max(backward, one all-reduce of all gradients) + step of "
            "the plain module, measured in the same rounds; contended bound = the same iteration "
            "run with that all-reduce launched as backward starts (what perfect overlap costs on "
            "these cores)."
        )
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see :func:`add_arguments`); the exit status.

    Args:
        args: The parsed flags (see :func:`add_arguments`).
    """
    config = config_from_args(args)
    _check_models_build(config)
    if config.netem:
        check_netem()
    cache_dir = tempfile.mkdtemp(prefix="interlace-bench-dp-")
    rows: list[Row] = []
    failures: list[str] = []
    try:
        total = (1 if config.calibrates else 0) + len(_launch_plan_shape(config))
        with tqdm(total=total, unit="launch", desc=PROG, dynamic_ncols=True) as bar:
            calibrations = None
            if config.calibrates:
                bar.set_postfix_str(f"calibrating at {config.ref_link}")
                job = CalibrationJob(
                    config.models,
                    tuple(config.batch_for(m) for m in config.models),
                    config.input_shape,
                    config.seed,
                    num_classes=config.num_classes,
                )
                try:
                    found = launch_on_ranks(
                        calibrate_rank,
                        job,
                        nprocs=config.nprocs,
                        link=config.ref_link,
                        timeout_s=config.timeout_s,
                        collective_timeout_s=config.collective_timeout_s,
                        cache_dir=cache_dir,
                        note=bar.write,
                        prog=PROG,
                    )
                except LaunchFailedError as exc:
                    print(f"{PROG}: calibration failed: {exc}", file=sys.stderr)
                    return 1
                calibrations = {c.model: c for c in found}
                bar.update(1)
                for c in found:
                    bar.write(
                        f"calibration {c.model}: compute {c.compute_s * 1e3:.1f} ms, all-reduce "
                        f"of all gradients {c.allreduce_s * 1e3:.1f} ms at {config.ref_link} "
                        f"(tiny all-reduce {c.latency_s * 1e3:.2f} ms)"
                    )
            for plan in _launch_plan(config, calibrations):
                ratio = "-" if plan.context.ratio is None else f"{plan.context.ratio:g}"
                bar.set_postfix_str(f"{plan.model} ratio {ratio} at {plan.context.link}")
                measure = MeasureJob(
                    plan.model,
                    config.batch_for(plan.model),
                    config.input_shape,
                    config.strategies,
                    config.iters,
                    config.warmup,
                    config.rounds,
                    config.seed,
                    num_classes=config.num_classes,
                    compute=config.compute,
                )
                link = (plan.context.emulated_link or plan.context.link) if config.netem else None
                try:
                    measurement = launch_on_ranks(
                        measure_rank,
                        measure,
                        nprocs=config.nprocs,
                        link=link,
                        timeout_s=config.timeout_s,
                        collective_timeout_s=config.collective_timeout_s,
                        cache_dir=cache_dir,
                        note=bar.write,
                        prog=PROG,
                    )
                except LaunchFailedError as exc:
                    message = f"{plan.model} at {plan.context.link}: {exc}"
                    failures.append(message)
                    bar.write(f"{PROG}: launch failed: {message}")
                else:
                    new_rows = rows_from_measurement(measurement, plan.context)
                    rows.extend(new_rows)
                    bar.write(one_line(new_rows))
                    for row in new_rows:
                        if row.tuning:
                            bar.write(f"  {row.strategy} {row.tuning}")
                bar.update(1)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)

    print(f"\n{PROG}: {describe_conditions(config)}\n")
    if rows:
        print(format_summary(rows))
        print()
        print(format_table(rows))
        cluster = format_cluster(rows)
        if cluster:
            print(f"\nall-reduce a + b*M{' (undilated)' if config.compute.emulated else ''}:")
            print(cluster)
    if config.json_path:
        Path(config.json_path).write_text(
            json.dumps([row.to_dict() for row in rows], indent=1) + "\n"
        )
    if config.png_path and rows:
        plot_speedups(rows, config.png_path)
    if failures:
        print(f"\n{PROG}: {len(failures)} launch(es) failed:", file=sys.stderr)
        for message in failures:
            print(f"  {message.splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


def _launch_plan_shape(config: BenchConfig) -> list[tuple[str, float | None]]:
    """The launches a run makes, before calibration (for the progress bar's total)."""
    if config.calibrates:
        return [(m, r) for m in config.models for r in config.ratios]
    return [(m, None) for m in config.models]


def main(argv: list[str] | None = None) -> int:
    """``interlace bench dp`` on its own (``python benchmarks/dp.py``); the exit status.

    Args:
        argv: The arguments (default: the command line).
    """
    return standalone_main(
        PROG,
        "Compare data-parallel strategies with PyTorch DDP on the emulated cluster, "
        "at link rates chosen for target communication/compute ratios.",
        add_arguments,
        run,
        argv,
    )
