"""``interlace bench pipeline``, rows and tables: each contender's throughput against torch's
GPipe and DataParallel, the regime header, and the timeline of a timed block."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from interlace.bench.harness import quartiles
from interlace.bench.pipeline_rank import DP_BASELINE, TORCH_BASELINE
from interlace.bench.tables import Row as BaseRow
from interlace.bench.tables import markdown_table, number, speedup
from interlace.pipeline.schedule import schedule_type
from interlace.sim.pipeline import INTERLACE_PIPELINE_SCHEDULES
from interlace.timeline import Timeline

PROG = "interlace bench pipeline"


def describe_schedule(
    schedule: str,
    microbatches: int,
    ranks: int,
    stages: int | None = None,
    compression: str | None = None,
) -> str:
    """How a contender processes one global mini-batch, in a few words.

    Args:
        schedule: A contender's name.
        microbatches: Pieces per replica's share of a mini-batch.
        ranks: Ranks.
        stages: Stages per pipeline (None: ``ranks``, one replica).
        compression: The type interlace's stage averages travel in (None: float32).
    """
    replicas = ranks // (stages or ranks)
    if schedule == DP_BASELINE:
        return f"{ranks} x 1/{ranks} batch, merged buckets"
    layout = f"{stages} stages x {replicas} replicas, " if replicas > 1 else ""
    if schedule in INTERLACE_PIPELINE_SCHEDULES:
        kind = schedule_type(schedule)
        averaged = ", stages averaged in MG-WFBP buckets" if replicas > 1 else ""
        if averaged and compression:
            averaged += f" sent as {compression}"
        if kind.synchronous:
            return f"{layout}{microbatches} micro-batches, {kind.description}{averaged}"
        pieces = f", {microbatches} chunks" if microbatches > 1 else ""
        return f"{layout}{kind.description}{pieces}{averaged}"
    ddp = " + DDP per stage" if replicas > 1 else ""
    return f"{layout}{microbatches} micro-batches, torch.distributed.pipelining{ddp}"


def fill_drain_fraction(schedule: str, num_stages: int, block: int, microbatches: int) -> float:
    """Share of a stage's unit-time clock lost to filling and draining the pipeline in one block.

    A flushing schedule fills and drains once per mini-batch: ``(N - 1) / (M + N - 1)``; an
    asynchronous stream once per block of mini-batches: ``(N - 1) / (K + N - 1)``. Data
    parallelism has no pipeline (0).

    Args:
        schedule: A contender's name.
        num_stages: Pipeline stages.
        block: Mini-batches per timed block.
        microbatches: Micro-batches per mini-batch.
    """
    if schedule == DP_BASELINE:
        return 0.0
    streamed = schedule in INTERLACE_PIPELINE_SCHEDULES and not schedule_type(schedule).synchronous
    units = block if streamed else microbatches
    return (num_stages - 1) / (units + num_stages - 1)


@dataclass(frozen=True)
class Regime(BaseRow):
    """What decides whether a model is communication-bound here, per mini-batch of ``batch``."""

    model: str
    ranks: int
    link: str
    link_bps: float | None
    batch: int
    microbatches: int
    parameters: int
    gradient_bytes: int
    #: Activation bytes of one mini-batch crossing each stage boundary (as many gradient bytes
    #: cross back).
    boundary_bytes: list[int]
    plan: str = ""
    #: Stages per pipeline (0: ``ranks``, one replica).
    stages: int = 0
    #: Each stage's ``[start, end)`` block range as the run cut the model (what a prediction of
    #: the rows cuts by; empty in runs recorded before it was written: ``plan`` has them).
    bounds: list[list[int]] = field(default_factory=list)
    #: Per contender, each rank's all-reduce cost ``[a, b]`` as the contender fitted it on the
    #: live ranks (undilated; None on a rank that fitted none): a replicated interlace stage's
    #: on its stage group, DataParallel's on all ranks.
    allreduce_costs: dict[str, list[list[float] | None]] = field(default_factory=dict)
    #: The type interlace's stage averages travel in (None: float32).
    stage_compression: str | None = None

    @property
    def num_stages(self) -> int:
        """Stages per pipeline."""
        return self.stages or self.ranks

    @property
    def allreduce_bytes_per_rank(self) -> float:
        """Bytes each rank sends in a ring all-reduce of all gradients: ``2 (N-1)/N * G``."""
        return 2 * (self.ranks - 1) / self.ranks * self.gradient_bytes


@dataclass(frozen=True)
class Row(BaseRow):
    """One contender on one model: its throughput and how it compares."""

    model: str
    schedule: str
    description: str
    samples_per_s: float
    samples_per_s_p25: float
    samples_per_s_p75: float
    blocks: int
    block: int
    batch: int
    microbatches: int
    ranks: int
    link: str
    vs_torch_gpipe: float | None
    vs_dp: float | None
    fill_drain: float
    mean_loss: float | None = None
    #: Stages per pipeline (the rest of the ranks are its replicas).
    stages: int | None = None
    #: Per stage (interlace pipelines only): median seconds per block spent computing (forward,
    #: backward, update) and in communication calls (waiting for receives, posting sends).
    stage_compute_s: list[float] | None = None
    stage_comm_s: list[float] | None = None
    #: CPU seconds of all ranks' processes (their gloo threads included) per mini-batch, and
    #: those seconds over the block's wall time: the cores the contender kept busy (medians).
    cpu_s_per_minibatch: float | None = None
    cores_busy: float | None = None
    #: ``real``, or the emulated trace and dilation (times and rates are then undilated).
    compute: str = "real"
    #: The launch's regime (the same for every contender of a model).
    regime: Regime | None = None


def rows_from_value(value: Mapping[str, Any], regime: Regime, *, block: int) -> list[Row]:
    """One row per contender from a launch's value (:func:`measure_rank`'s), with ratios
    against ``torch-gpipe`` and ``dp`` of the same launch (None where one was not run).

    Args:
        value: Rank 0's value of the launch.
        regime: The launch's regime.
        block: Mini-batches per timed block.
    """
    seconds: Mapping[str, list[float]] = value["block_s"]
    per_block = block * regime.batch
    medians: dict[str, float] = {}
    quartiles_of: dict[str, tuple[float, float, float]] = {}
    for schedule, times in seconds.items():
        rates = [per_block / t for t in times if t > 0]
        if not rates:
            raise ValueError(f"{schedule}: no timed block")
        quartiles_of[schedule] = quartiles(rates)
        medians[schedule] = quartiles_of[schedule][1]
    stats: Mapping[str, Mapping[str, list[float]]] = value.get("stage_stats", {})
    cpu: Mapping[str, list[float]] = value.get("cpu_s", {})
    losses: Mapping[str, float | None] = value.get("losses", {})
    rows = []
    for schedule in seconds:
        p25, median, p75 = quartiles_of[schedule]
        torch_rate, dp_rate = medians.get(TORCH_BASELINE), medians.get(DP_BASELINE)
        stage = stats.get(schedule)
        cpu_s = cpu.get(schedule)
        rows.append(
            Row(
                model=regime.model,
                schedule=schedule,
                description=describe_schedule(
                    schedule,
                    regime.microbatches,
                    regime.ranks,
                    regime.num_stages,
                    regime.stage_compression,
                ),
                samples_per_s=median,
                samples_per_s_p25=p25,
                samples_per_s_p75=p75,
                blocks=len(seconds[schedule]),
                block=block,
                batch=regime.batch,
                microbatches=regime.microbatches,
                ranks=regime.ranks,
                link=regime.link,
                vs_torch_gpipe=None if not torch_rate else median / torch_rate,
                vs_dp=None if not dp_rate else median / dp_rate,
                fill_drain=fill_drain_fraction(
                    schedule, regime.num_stages, block, regime.microbatches
                ),
                mean_loss=losses.get(schedule),
                stages=regime.num_stages,
                stage_compute_s=None if stage is None else list(stage["compute_s"]),
                stage_comm_s=None if stage is None else list(stage["comm_s"]),
                cpu_s_per_minibatch=None if not cpu_s else statistics.median(cpu_s) / block,
                cores_busy=(
                    None
                    if not cpu_s
                    else statistics.median(
                        c / t for c, t in zip(cpu_s, seconds[schedule], strict=True) if t > 0
                    )
                ),
                regime=regime,
            )
        )
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """The markdown table: one line per model and contender.

    Args:
        rows: The rows, in order.
    """
    head = (
        "model",
        "schedule",
        "how",
        "samples/s",
        "p25-p75",
        "vs torch-gpipe",
        "vs dp",
        "CPU s per mini-batch",
        "cores busy",
    )
    lines = [
        (
            row.model,
            row.schedule,
            row.description,
            number(row.samples_per_s, 1),
            f"{number(row.samples_per_s_p25, 1)}-{number(row.samples_per_s_p75, 1)}",
            speedup(row.vs_torch_gpipe),
            speedup(row.vs_dp),
            number(row.cpu_s_per_minibatch),
            number(row.cores_busy),
        )
        for row in rows
    ]
    return markdown_table(head, "lll" + "r" * 6, lines)


def _megabytes(count: float) -> str:
    return f"{count / 1e6:.2f} MB"


def format_regime(regime: Regime) -> str:
    """One model's regime: activations crossing the stage boundaries against gradients, and
    what each costs on the link (at line rate: a lower bound).

    Args:
        regime: One model's regime.
    """
    boundaries = ", ".join(_megabytes(b) for b in regime.boundary_bytes) or "none"
    text = (
        f"{regime.model} ({regime.parameters / 1e6:.2f}M parameters): activations per "
        f"mini-batch of {regime.batch} across the {len(regime.boundary_bytes)} stage "
        f"boundaries {boundaries} (as many gradient bytes back) vs "
        f"{_megabytes(regime.gradient_bytes)} of gradients all-reduced by dp per step"
    )
    if regime.link_bps:
        bytes_per_s = regime.link_bps / 8
        widest = max(regime.boundary_bytes, default=0)
        pipeline_s = widest / bytes_per_s
        allreduce_s = regime.allreduce_bytes_per_rank / bytes_per_s
        bound = (
            "dp is the communication-bound side"
            if allreduce_s > pipeline_s
            else "the pipeline is the communication-bound side"
        )
        text += (
            f"; at {regime.link} the widest boundary takes >= {pipeline_s * 1e3:.0f} ms each way "
            f"per mini-batch, dp's ring all-reduce >= {allreduce_s * 1e3:.0f} ms per step: "
            f"{bound}"
        )
    return text + "."


def format_header(
    regimes: Sequence[Regime],
    *,
    ranks: int,
    link: str,
    stages: int | None = None,
    batch: int,
    microbatches: int,
    block: int,
    iters: int,
    warmup: int,
    conditions: str = "",
) -> str:
    """The regime in a few lines: ranks, link, batches, how it was timed, then per model.

    Args:
        regimes: Each measured model's regime.
        ranks: Ranks.
        link: The link, as the header names it.
        stages: Stages per pipeline (None: ``ranks``, one replica).
        batch: Global batch per mini-batch.
        microbatches: Pieces per mini-batch.
        block: Mini-batches per timed block.
        iters: Timed rounds.
        warmup: Warm-up mini-batches per contender.
        conditions: A line on the machine, or empty.
    """
    shard = batch // ranks if ranks else batch
    num_stages = stages or ranks
    replicas = max(ranks // max(num_stages, 1), 1)
    per_pipeline = batch // replicas
    layout = (
        f"{num_stages} pipeline stages"
        if replicas == 1
        else f"{num_stages} pipeline stages x {replicas} replicas, each pipeline {per_pipeline} "
        "of every mini-batch and each stage's gradients averaged over its replicas"
    )
    lines = [
        f"{PROG}: {ranks} ranks = {layout} on {link}; global batch {batch} per "
        f"mini-batch for every contender (gpipe, 1f1b, torch-*: {microbatches} micro-batches of "
        f"{per_pipeline // max(microbatches, 1)} per pipeline, one update per mini-batch; naive, "
        f"pipedream, spectrain: a stream of mini-batches of {per_pipeline} per pipeline in "
        f"{microbatches} chunks, an update per mini-batch; dp: {shard} per rank).",
        f"Timing: {warmup} warm-up mini-batches each (dp also until its buckets are final), then "
        f"{iters} rounds of one block of {block} mini-batches per contender, interleaved, the "
        "order rotating; block time = max over ranks; samples/s = median over blocks; CPU s per "
        "mini-batch = process CPU time of all ranks (gloo threads included), cores busy = that "
        "CPU time over the block's wall time.",
    ]
    if conditions:
        lines.append(conditions)
    lines += [format_regime(regime) for regime in regimes]
    return "\n".join(lines)


def timeline_from_events(
    events: Mapping[str, Sequence[Mapping[str, Any]]],
    origins: Mapping[str, float],
    descriptions: Mapping[str, str] | None = None,
    title: str = "",
) -> Timeline:
    """One :class:`~interlace.timeline.Timeline` of several schedules' blocks: per schedule a
    group of lanes (``process`` = the schedule), one lane per stage (the events' own
    ``process``, ``"stage k"``), times from that schedule's block start (``origins``).

    Args:
        events: Per schedule, its recorded events as dicts.
        origins: Per schedule, its block's start time.
        descriptions: Per schedule, a few words for its lane group.
        title: The timeline's title.
    """
    timeline = Timeline(title=title)
    for schedule, recorded in events.items():
        origin = origins[schedule]
        label = schedule
        if descriptions and schedule in descriptions:
            label = f"{schedule} ({descriptions[schedule]})"

        def order(event: Mapping[str, Any]) -> tuple[int, float]:
            stage = str(event.get("process", ""))
            digits = stage.rsplit(" ", 1)[-1]
            return (int(digits) if digits.isdigit() else 0, float(event["start_s"]))

        for event in sorted(recorded, key=order):
            args = dict(event.get("args", {}))
            name = str(event["name"])
            batch = args.get("batch")
            if batch is not None and name in ("forward", "backward"):
                name = f"{name[0].upper()}{batch}"
            timeline.add(
                name,
                str(event["category"]),
                float(event["start_s"]) - origin,
                float(event["end_s"]) - origin,
                lane=str(event.get("process", "stage")),
                process=label,
                **args,
            )
    return timeline


def one_line(rows: Sequence[Row]) -> str:
    """One model's rows in one line, as the progress bar shows them.

    Args:
        rows: The rows of one launch (at least one).
    """
    return f"{rows[0].model}: " + ", ".join(
        f"{row.schedule} {row.samples_per_s:.1f}/s" for row in rows
    )
