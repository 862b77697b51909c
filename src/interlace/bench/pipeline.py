"""``interlace bench pipeline``: pipeline schedules against data parallelism and torch's pipelines.

Every contender trains the same model on the same ranks at an equal global batch; one launch per
model times them in interleaved blocks (:mod:`interlace.bench.pipeline_rank`) and prints their
throughput (:mod:`interlace.bench.pipeline_report`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from interlace.bench.harness import LR, MOMENTUM, undilated
from interlace.bench.pipeline_rank import (
    SCHEDULES,
    TIMELINE_SCHEDULES,
    PipelineJob,
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
from interlace.bench.session import Session
from interlace.bench.skeleton import BenchConfig, Benchmark, Flags, parse_names
from interlace.bench.tables import machine, write_timeline
from interlace.comm.links import parse_link
from interlace.errors import UsageError
from interlace.pipeline.cut import StageCut
from interlace.pipeline.layout import PipelineLayout
from interlace.pipeline.partition import PLAN_BY, pipeline_blocks

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

FLAGS = Flags(
    models=DEFAULT_MODELS,
    models_help="comma-separated zoo names or package.module:callable, each an nn.Sequential or "
    f"a model with pipeline_blocks() (default {','.join(DEFAULT_MODELS)})",
    nprocs=DEFAULT_NPROCS,
    nprocs_help=f"ranks = pipeline stages x replicas (default {DEFAULT_NPROCS}, one replica)",
    link=DEFAULT_LINK,
    link_help=f"emulated link per rank (default {DEFAULT_LINK}, where data parallelism of a "
    "large model is communication-bound)",
    batch=DEFAULT_BATCH,
    batch_help="global batch per mini-batch, the same for every contender (split over the ranks "
    f"by dp; default {DEFAULT_BATCH})",
    iters=DEFAULT_ITERS,
    iters_help="timed rounds, one block per contender each",
    warmup=DEFAULT_WARMUP,
    warmup_help="untimed mini-batches per contender first",
    timeout_s=DEFAULT_TIMEOUT_S,
    png_help="timeline of one timed block of spectrain and of gpipe on the first model, a lane "
    "per stage (and a Chrome trace next to it)",
)


@dataclass(frozen=True, kw_only=True)
class PipelineConfig(BenchConfig):
    """A validated ``interlace bench pipeline`` run: the shared settings and the pipeline's.

    Args:
        schedules: The contenders, in table order.
        microbatches: Pieces per mini-batch.
        block: Mini-batches per timed block.
        partition_by: A :class:`~interlace.pipeline.cut.StageCut` name (``auto``: by time
            with one replica, by time+allreduce with several).
        stages: Stages per pipeline (None: ``nprocs``, one replica).
        stage_compression: ``fp16``/``bf16``: interlace's stage averages travel in that type
            (data parallelism and torch's DDP stay float32); None: float32.
    """

    schedules: tuple[str, ...]
    microbatches: int
    block: int
    partition_by: str = StageCut.AUTO.value
    stages: int | None = None
    stage_compression: str | None = None

    @property
    def layout(self) -> PipelineLayout:
        """The ranks as pipeline stages x replicas."""
        return PipelineLayout.for_world(self.nprocs, self.stages or self.nprocs)

    @property
    def batch(self) -> int:
        """The global batch per mini-batch, the same for every contender."""
        return self.batch_for("")

    def pipeline_job(self, model: str, *, timeline: bool = False) -> PipelineJob:
        """The job of ``model``'s launch.

        Args:
            model: The model.
            timeline: Whether the launch records a timed block's events.
        """
        return self.job(
            PipelineJob,
            model,
            microbatches=self.microbatches,
            schedules=self.schedules,
            block=self.block,
            partition_by=self.partition_by,
            timeline=timeline,
            stages=self.stages,
            stage_compression=self.stage_compression,
        )


def describe_conditions(config: PipelineConfig) -> str:
    """When and where the rows were measured.

    Args:
        config: The run.
    """
    return (
        f"Machine: {machine()}, 1 thread per rank; stages cut by {config.partition_by} "
        f"(rank 0's plan); input {'x'.join(map(str, config.input_shape))}; SGD lr {LR:g} "
        f"momentum {MOMENTUM:g}; compute {config.compute.label()}"
        + (
            " (device time"
            + (f"; links at {config.launch_link}" if config.launch_link else "")
            + "; every time and rate undilated)."
            if config.compute.emulated
            else "."
        )
    )


def _write_timeline(
    value: Mapping[str, Any], config: PipelineConfig, model: str, path: str
) -> str | None:
    """Draw the launch's timed block of :data:`TIMELINE_SCHEDULES` to ``path``; a line saying
    so, or None when the launch recorded none of them."""
    events: Mapping[str, Sequence[Mapping[str, Any]]] = value.get("events", {})
    if not events:
        return None
    ordered = {s: events[s] for s in TIMELINE_SCHEDULES if s in events}
    layout = config.layout
    descriptions = {
        s: describe_schedule(
            s, config.microbatches, config.nprocs, layout.stages, config.stage_compression
        )
        for s in ordered
    }
    timeline = timeline_from_events(
        ordered,
        value["origins"],
        descriptions,
        title=f"{model}: one block of {config.block} mini-batches of {config.batch}, "
        f"{layout.stages} stages x {layout.replicas} replica(s) on {config.link_text}",
    )
    return write_timeline(timeline, path)


class PipelineBenchmark(Benchmark[PipelineConfig, Row]):
    """``interlace bench pipeline``: per model, one launch times every contender in interleaved
    blocks at an equal global batch."""

    prog = PROG
    description = (
        "Compare interlace's pipeline schedules with DataParallel and "
        "torch.distributed.pipelining at equal global batch on the emulated cluster."
    )
    flags = FLAGS

    def add_own_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The contenders, the pieces of a mini-batch, the block and the stages' split.

        Args:
            parser: The parser.
        """
        parser.add_argument(
            "--schedules",
            "--schedule",
            dest="schedules",
            help=f"comma-separated contenders (default all: {','.join(SCHEDULES)})",
        )
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
            help="mini-batches per timed block (an asynchronous schedule's stream fills and "
            f"drains once per block; default {DEFAULT_BLOCK})",
        )
        parser.add_argument(
            "--stages",
            type=int,
            default=None,
            help="stages per pipeline: the -n ranks run -n / --stages replicas, each stage "
            "averaged over its replicas (interlace's schedules: MG-WFBP buckets during the "
            "stage's backward; torch's: the stage module under DDP); default -n (one replica)",
        )
        parser.add_argument(
            "--stage-compression",
            choices=("fp16", "bf16"),
            default=None,
            help="with --stages: interlace's stage averages travel in this type (data "
            "parallelism and torch's DDP stay float32); default float32",
        )
        parser.add_argument(
            "--partition-by",
            choices=PLAN_BY,
            default=StageCut.AUTO.value,
            help="balance the stages by measured time, by parameter count, or by time plus each "
            "stage's all-reduce over its replicas (time+allreduce); default auto: time with one "
            "replica, time+allreduce with --stages below -n",
        )

    def config_from_args(self, args: argparse.Namespace) -> PipelineConfig:
        """Resolve the defaults and check every value; raises UsageError.

        Args:
            args: The parsed flags (see :meth:`add_arguments`).
        """
        schedules = (
            parse_names(args.schedules, SCHEDULES, "schedules", "schedule")
            if args.schedules
            else SCHEDULES
        )
        for flag, value in (("--microbatches", args.microbatches), ("--block", args.block)):
            if value < 1:
                raise UsageError(f"{flag} must be >= 1, got {value}")
        config = PipelineConfig.from_args(
            args,
            FLAGS,
            ranks_reason="a pipeline needs two stages",
            schedules=tuple(s for s in SCHEDULES if s in schedules),  # table order
            microbatches=args.microbatches,
            block=args.block,
            partition_by=args.partition_by,
            stages=args.stages,
            stage_compression=args.stage_compression,
        )
        if config.batch % config.nprocs:
            raise UsageError(
                f"--batch-size {config.batch} does not split into {config.nprocs} equal "
                f"data-parallel shards; use a multiple of -n {config.nprocs}"
            )
        if config.batch % config.microbatches:
            raise UsageError(
                f"--batch-size {config.batch} does not split into {config.microbatches} equal "
                "micro-batches; use a multiple of --microbatches"
            )
        replicas = config.layout.replicas
        if config.stage_compression and replicas == 1:
            raise UsageError(
                f"--stage-compression {config.stage_compression} compresses the average over "
                "a stage's replicas; give --stages below -n, or drop it"
            )
        if config.batch % (replicas * config.microbatches):
            raise UsageError(
                f"--batch-size {config.batch} does not split into {replicas} replica shards of "
                f"{config.microbatches} equal pieces; use a multiple of "
                f"{replicas * config.microbatches}"
            )
        trace = Path(config.png_path).with_suffix(".json") if config.png_path else None
        if config.json_path and trace and Path(config.json_path).resolve() == trace.resolve():
            raise UsageError(
                f"--json {config.json_path} is where --png {config.png_path} puts its Chrome "
                "trace; choose another"
            )
        return config

    def check(self, config: PipelineConfig) -> None:
        """Build each model once here, so a bad model, shape or stage count is one line.

        Args:
            config: The run.
        """
        for model in config.models:
            blocks = pipeline_blocks(config.pipeline_job(model).module())
            stages = config.layout.stages
            if len(blocks) < stages:
                raise UsageError(
                    f"{model} has {len(blocks)} pipeline blocks, too few for {stages} "
                    "stages; use fewer stages (--stages or -n) or a deeper model"
                )

    def measure(self, config: PipelineConfig, session: Session) -> list[Row]:
        """One launch per model; with ``--png`` the first model's timed block as a timeline.

        Args:
            config: The run.
            session: Where the launches go.
        """
        link_bps = parse_link(config.link) if config.link is not None else None
        rows: list[Row] = []
        drawn = False
        for model in config.models:
            job = config.pipeline_job(model, timeline=bool(config.png_path) and not drawn)
            value = session.launch(measure_rank, job, what=model, link=config.link)
            if value is None:
                continue
            value = undilated(
                value,
                config.compute.dilation,
                ("block_s", "cpu_s", "stage_stats", "allreduce_costs"),
            )
            regime = Regime(
                model=model,
                ranks=config.nprocs,
                link=config.link_text,
                link_bps=link_bps,
                batch=config.batch,
                microbatches=config.microbatches,
                parameters=value["parameters"],
                gradient_bytes=value["gradient_bytes"],
                boundary_bytes=list(value["boundary_bytes"]),
                plan=value["plan"],
                stages=config.layout.stages,
                bounds=[list(b) for b in value["bounds"]],
                allreduce_costs=dict(value.get("allreduce_costs", {})),
                stage_compression=config.stage_compression,
            )
            new_rows = [
                replace(row, compute=config.compute.label())
                for row in rows_from_value(value, regime, block=config.block)
            ]
            rows += new_rows
            session.note(one_line(new_rows))
            if job.timeline and config.png_path:
                written = _write_timeline(value, config, model, config.png_path)
                if written is not None:
                    session.wrote(written)
                    drawn = True
        if config.png_path and not drawn:
            session.note(f"{PROG}: no timeline drawn: measure spectrain or gpipe for --png")
        return rows

    def report(self, config: PipelineConfig, rows: list[Row]) -> None:
        """The regime of every model and how it was timed, then the table.

        Args:
            config: The run.
            rows: Its rows.
        """
        regimes = {row.model: row.regime for row in rows if row.regime is not None}
        print()
        print(config.layout.describe())
        print(
            format_header(
                list(regimes.values()),
                ranks=config.nprocs,
                stages=config.layout.stages,
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


BENCHMARK = PipelineBenchmark()
add_arguments = BENCHMARK.add_arguments
config_from_args = BENCHMARK.config_from_args
run = BENCHMARK.run
main = BENCHMARK.main
