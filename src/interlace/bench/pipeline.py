"""``interlace bench pipeline``: pipeline schedules against data parallelism and torch's pipelines.

Every contender trains the same model on the same ranks at an equal global batch; one launch per
model times them in interleaved blocks (:mod:`interlace.bench.pipeline_rank`) and prints their
throughput (:mod:`interlace.bench.pipeline_report`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from interlace.bench.harness import (
    DEFAULT_INPUT_SHAPE,
    NUM_CLASSES,
    LaunchFailedError,
    add_timeout_arguments,
    check_launch_args,
    check_netem,
    launch_on_ranks,
    machine_load,
    parse_names,
)
from interlace.bench.pipeline_rank import (
    DEFAULT_LR,
    DEFAULT_MOMENTUM,
    SCHEDULES,
    TIMELINE_SCHEDULES,
    PipelineJob,
    build_pipeline_model,
    measure_rank,
)
from interlace.bench.pipeline_report import (
    PROG,
    Regime,
    Row,
    describe_schedule,
    format_header,
    format_table,
    one_line,
    rows_from_value,
    timeline_from_events,
)
from interlace.cliutil import (
    add_deprecated_alias,
    add_model_shape_arguments,
    add_nprocs_argument,
    collective_timeout_of,
    standalone_main,
)
from interlace.comm.links import parse_link
from interlace.emulate.compute import (
    Compute,
    ComputeKind,
    add_compute_arguments,
    compute_from_args,
)
from interlace.emulate.device import dilate_link
from interlace.errors import UsageError
from interlace.launch.rank import DEFAULT_COLLECTIVE_TIMEOUT_S
from interlace.pipeline.partition import pipeline_blocks

#: vgg11: 9.8M parameters in a few large tensors against a few MB of activations per mini-batch,
#: the case where data parallelism is bound by its all-reduce on a slow link; resnet20: 0.27M
#: parameters against 32x32 feature maps, the opposite case (activations outweigh gradients).
DEFAULT_MODELS: tuple[str, ...] = ("vgg11", "resnet20")
DEFAULT_LINK = "100mbit"
DEFAULT_NPROCS = 4
DEFAULT_BATCH = 64
DEFAULT_MICROBATCHES = 4
DEFAULT_BLOCK = 24
"""Mini-batches per timed block. Training streams a whole epoch through an asynchronous schedule
(CIFAR-10 at 64 a mini-batch: 781), filling and draining once; a block of 24 keeps that fill and
drain at ``3 / 27`` of a 4-stage block's clock, near the epoch's steady state, at a benchmark
cost of minutes."""
DEFAULT_ITERS = 3
DEFAULT_WARMUP = 2
DEFAULT_TIMEOUT_S = 1200.0


@dataclass(frozen=True)
class BenchConfig:
    """A validated benchmark run."""

    models: tuple[str, ...]
    schedules: tuple[str, ...]
    nprocs: int
    batch: int
    microbatches: int
    block: int
    iters: int
    warmup: int
    input_shape: tuple[int, ...]
    link: str | None
    partition_by: str
    seed: int
    timeout_s: float
    json_path: str | None
    png_path: str | None
    num_classes: int = NUM_CLASSES
    #: Real kernels, or a trace's device time: then ``models`` is the trace, the launches run
    #: on ``link`` divided by the dilation, and every time is divided by it.
    compute: Compute = field(default_factory=lambda: Compute(ComputeKind.REAL))
    #: Seconds any one collective may wait for its peers (``--collective-timeout``).
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S

    @property
    def link_text(self) -> str:
        return self.link or "loopback (no emulated network)"

    @property
    def launch_link(self) -> str | None:
        """The link the ranks run on: ``link``, dilated for emulated compute."""
        if self.link is None or not self.compute.emulated:
            return self.link
        return dilate_link(self.link, self.compute.dilation)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``interlace bench pipeline``.

    Args:
        parser: The parser (or subcommand parser) to add them to.
    """
    parser.add_argument(
        "--models",
        help="comma-separated zoo names or package.module:callable, each an nn.Sequential or a "
        f"model with pipeline_blocks() (default {','.join(DEFAULT_MODELS)})",
    )
    parser.add_argument("--model", help="one model (zoo name or package.module:callable)")
    parser.add_argument(
        "--schedules",
        "--schedule",
        dest="schedules",
        help=f"comma-separated contenders (default all: {','.join(SCHEDULES)})",
    )
    add_nprocs_argument(
        parser,
        default=DEFAULT_NPROCS,
        help_text=f"ranks = pipeline stages (default {DEFAULT_NPROCS})",
    )
    parser.add_argument(
        "--link",
        help=f"emulated link per rank (default {DEFAULT_LINK}, where data parallelism of a large "
        "model is communication-bound)",
    )
    parser.add_argument(
        "--no-netem", action="store_true", help="plain loopback instead of the emulated cluster"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH,
        help="global batch per mini-batch, the same for every contender (split over the ranks "
        f"by dp; default {DEFAULT_BATCH})",
    )
    add_deprecated_alias(parser, "--batch", "--batch-size", "batch_size", type=int)
    parser.add_argument(
        "--microbatches",
        type=int,
        default=DEFAULT_MICROBATCHES,
        help="pieces per mini-batch: micro-batches of gpipe, 1f1b and torch's schedules, "
        "chunks streamed with the mini-batch's weights by naive, pipedream and spectrain "
        f"(default {DEFAULT_MICROBATCHES})",
    )
    parser.add_argument(
        "--block",
        type=int,
        default=DEFAULT_BLOCK,
        help="mini-batches per timed block (an asynchronous schedule's stream fills and drains "
        f"once per block; default {DEFAULT_BLOCK})",
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=DEFAULT_ITERS,
        help=f"timed rounds, one block per contender each (default {DEFAULT_ITERS})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP,
        help=f"untimed mini-batches per contender first (default {DEFAULT_WARMUP})",
    )
    add_model_shape_arguments(parser, input_shape=DEFAULT_INPUT_SHAPE, classes=NUM_CLASSES)
    parser.add_argument(
        "--partition-by",
        choices=("time", "params"),
        default="time",
        help="balance the stages by measured time or by parameter count (default time)",
    )
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    add_timeout_arguments(parser, DEFAULT_TIMEOUT_S)
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument(
        "--png",
        metavar="PATH",
        help="timeline of one timed block of spectrain and of gpipe on the first model, a lane "
        "per stage (and a Chrome trace next to it)",
    )
    add_compute_arguments(parser)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Resolve the defaults and check every value; raises UsageError.

    Args:
        args: The parsed flags (see :func:`add_arguments`).
    """
    compute = compute_from_args(args)
    if args.model and args.models:
        raise UsageError("--model and --models contradict each other; give one of them")
    if compute.emulated and (args.model or args.models):
        raise UsageError(
            "--compute emulated:TRACE runs the trace's model; leave out --model/--models"
        )
    if compute.emulated:
        models: tuple[str, ...] = (str(compute.trace),)
    elif args.model:
        models = parse_names(args.model, None, "model", "model")
    elif args.models:
        models = parse_names(args.models, None, "models", "model")
    else:
        models = DEFAULT_MODELS
    # An emulated run's model is its trace, which compute_from_args has checked.
    check_launch_args(
        args,
        () if compute.emulated else models,
        prefix="",
        ranks_reason="a pipeline needs two stages",
    )
    schedules = (
        parse_names(args.schedules, SCHEDULES, "schedules", "schedule")
        if args.schedules
        else SCHEDULES
    )
    schedules = tuple(s for s in SCHEDULES if s in schedules)  # table order
    for flag, value, least in (
        ("--batch-size", args.batch_size, 1),
        ("--microbatches", args.microbatches, 1),
        ("--block", args.block, 1),
        ("--iters", args.iters, 1),
        ("--warmup", args.warmup, 0),
    ):
        if value < least:
            raise UsageError(f"{flag} must be >= {least}, got {value}")
    if args.batch_size % args.nprocs:
        raise UsageError(
            f"--batch-size {args.batch_size} does not split into {args.nprocs} equal "
            f"data-parallel shards; use a multiple of -n {args.nprocs}"
        )
    if args.batch_size % args.microbatches:
        raise UsageError(
            f"--batch-size {args.batch_size} does not split into {args.microbatches} equal "
            "micro-batches; use a multiple of --microbatches"
        )
    if (
        args.json
        and args.png
        and Path(args.json).resolve() == Path(args.png).with_suffix(".json").resolve()
    ):
        raise UsageError(
            f"--json {args.json} is where --png {args.png} puts its Chrome trace; choose another"
        )
    link = None if args.no_netem else (args.link or DEFAULT_LINK)
    if link is not None:
        parse_link(link)
    return BenchConfig(
        models=models,
        schedules=schedules,
        nprocs=args.nprocs,
        batch=args.batch_size,
        microbatches=args.microbatches,
        block=args.block,
        iters=args.iters,
        warmup=args.warmup,
        input_shape=tuple(args.input_shape),
        num_classes=args.classes,
        link=link,
        partition_by=args.partition_by,
        seed=args.seed,
        timeout_s=float(args.timeout),
        collective_timeout_s=collective_timeout_of(args.collective_timeout),
        json_path=args.json,
        png_path=args.png,
        compute=compute,
    )


def _check_models(config: BenchConfig) -> None:
    """Build each model once here, so a bad model, shape or stage count is one line."""
    for model in config.models:
        blocks = pipeline_blocks(
            build_pipeline_model(model, config.input_shape, config.compute, config.num_classes)
        )
        if len(blocks) < config.nprocs:
            raise UsageError(
                f"{model} has {len(blocks)} pipeline blocks, too few for {config.nprocs} stages; "
                "use fewer ranks (-n) or a deeper model"
            )


def describe_conditions(config: BenchConfig) -> str:
    """When and where the rows were measured.

    Args:
        config: The run.
    """
    load = machine_load()
    return (
        f"Machine: {platform.node()} ({os.cpu_count()} CPUs, load {load} at the end), torch "
        f"{torch.__version__}, gloo, 1 thread per rank; stages cut by {config.partition_by} "
        f"(rank 0's plan); input {'x'.join(map(str, config.input_shape))}; SGD lr {DEFAULT_LR:g} "
        f"momentum {DEFAULT_MOMENTUM:g}; compute {config.compute.label()}"
        + (
            " (device time"
            + (f"; links at {config.launch_link}" if config.launch_link else "")
            + "; every time and rate undilated)."
            if config.compute.emulated
            else "."
        )
    )


def _write_timeline(
    value: Mapping[str, Any], config: BenchConfig, model: str, path: str
) -> Path | None:
    events: Mapping[str, Sequence[Mapping[str, Any]]] = value.get("events", {})
    if not events:
        return None
    ordered = {s: events[s] for s in TIMELINE_SCHEDULES if s in events}
    descriptions = {s: describe_schedule(s, config.microbatches, config.nprocs) for s in ordered}
    timeline = timeline_from_events(
        ordered,
        value["origins"],
        descriptions,
        title=f"{model}: one block of {config.block} mini-batches of {config.batch}, "
        f"{config.nprocs} stages on {config.link or 'loopback'}",
    )
    target = Path(path)
    timeline.to_png(target)
    timeline.to_chrome_trace(target.with_suffix(".json"))
    return target


def undilated_value(value: dict[str, Any], dilation: float) -> dict[str, Any]:
    """A launch's value with its times divided by ``dilation``: wall times, and CPU seconds
    too, so that the cores a contender keeps busy stay a fraction of its wall time.

    Args:
        value: :func:`measure_rank`'s value.
        dilation: The run's dilation (1 for real compute).
    """
    if dilation == 1:
        return value
    out = dict(value)
    for key in ("block_s", "cpu_s"):
        out[key] = {k: [t / dilation for t in v] for k, v in value.get(key, {}).items()}
    out["stage_stats"] = {
        schedule: {key: [t / dilation for t in times] for key, times in stats.items()}
        for schedule, stats in value.get("stage_stats", {}).items()
    }
    return out


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see :func:`add_arguments`); the exit status.

    Args:
        args: The parsed flags (see :func:`add_arguments`).
    """
    config = config_from_args(args)
    _check_models(config)
    if config.link is not None:
        check_netem()
    link_bps = parse_link(config.link) if config.link is not None else None
    cache_dir = tempfile.mkdtemp(prefix="interlace-bench-pipeline-")
    rows: list[Row] = []
    regimes: list[Regime] = []
    failures: list[str] = []
    timeline_path: Path | None = None
    try:
        with tqdm(total=len(config.models), unit="model", desc=PROG, dynamic_ncols=True) as bar:
            for model in config.models:
                bar.set_postfix_str(model)
                job = PipelineJob(
                    model=model,
                    batch=config.batch,
                    microbatches=config.microbatches,
                    input_shape=config.input_shape,
                    schedules=config.schedules,
                    block=config.block,
                    iters=config.iters,
                    warmup=config.warmup,
                    seed=config.seed,
                    partition_by=config.partition_by,
                    timeline=bool(config.png_path) and timeline_path is None,
                    num_classes=config.num_classes,
                    compute=config.compute,
                )
                try:
                    value = launch_on_ranks(
                        measure_rank,
                        job,
                        nprocs=config.nprocs,
                        link=config.launch_link,
                        timeout_s=config.timeout_s,
                        collective_timeout_s=config.collective_timeout_s,
                        cache_dir=cache_dir,
                        note=bar.write,
                        prog=PROG,
                    )
                except LaunchFailedError as exc:
                    failures.append(f"{model}: {exc}")
                    bar.write(f"{PROG}: launch failed: {failures[-1]}")
                    bar.update(1)
                    continue
                value = undilated_value(value, config.compute.dilation)
                regime = Regime(
                    model=model,
                    ranks=config.nprocs,
                    link=config.link or "loopback",
                    link_bps=link_bps,
                    batch=config.batch,
                    microbatches=config.microbatches,
                    parameters=value["parameters"],
                    gradient_bytes=value["gradient_bytes"],
                    boundary_bytes=list(value["boundary_bytes"]),
                    plan=value["plan"],
                )
                regimes.append(regime)
                new_rows = [
                    replace(row, compute=config.compute.label())
                    for row in rows_from_value(value, regime, block=config.block)
                ]
                rows += new_rows
                bar.write(one_line(new_rows))
                if job.timeline and config.png_path:
                    timeline_path = _write_timeline(value, config, model, config.png_path)
                bar.update(1)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)

    print()
    print(
        format_header(
            regimes,
            ranks=config.nprocs,
            link=config.link_text,
            batch=config.batch,
            microbatches=config.microbatches,
            block=config.block,
            iters=config.iters,
            warmup=config.warmup,
            conditions=describe_conditions(config),
        )
    )
    print()
    if rows:
        print(format_table(rows))
    if config.json_path:
        path = Path(config.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = [row.to_dict() for row in rows]
        by_model = {regime.model: regime.to_dict() for regime in regimes}
        for item in record:
            item["regime"] = by_model.get(item["model"])
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"\nrows written to {path}")
    if timeline_path is not None:
        print(
            f"timeline written to {timeline_path} "
            f"(Chrome trace: {timeline_path.with_suffix('.json')})"
        )
    elif config.png_path:
        print(f"{PROG}: no timeline drawn: measure spectrain or gpipe for --png", file=sys.stderr)
    if failures:
        print(f"\n{PROG}: {len(failures)} launch(es) failed:", file=sys.stderr)
        for message in failures:
            print(f"  {message.splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``interlace bench pipeline`` on its own (``python benchmarks/pipeline.py``).

    Args:
        argv: The arguments (default: the command line).
    """
    return standalone_main(
        PROG,
        "Compare interlace's pipeline schedules with DataParallel and "
        "torch.distributed.pipelining at equal global batch on the emulated cluster.",
        add_arguments,
        run,
        argv,
    )
