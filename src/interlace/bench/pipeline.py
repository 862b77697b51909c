"""``interlace bench pipeline``: pipeline schedules against data parallelism and torch's pipelines.

Every contender trains the same model on the same ranks at an **equal global batch** ``B``:

* ``gpipe`` and ``1f1b`` (:mod:`interlace.pipeline`) cut each mini-batch of ``B`` into
  ``--microbatches`` micro-batches and update once per mini-batch (a flush);
* ``naive``, ``pipedream`` and ``spectrain`` stream mini-batches of ``B``, an update per
  mini-batch on every stage, asynchronous 1F1B without a flush; each mini-batch travels in
  ``--microbatches`` chunks computed with its weights (``PipelineStage(chunks=...)``), so a
  stage starts on the first chunk while the rest are in transit;
* ``dp``: :class:`interlace.DataParallel` (MG-WFBP's merged buckets) over the same ranks, each
  rank ``B / N`` samples per step;
* ``torch-gpipe`` and ``torch-1f1b``: ``torch.distributed.pipelining``'s ``ScheduleGPipe`` and
  ``Schedule1F1B`` over the same stage modules, with the same micro-batches and loss.

Rank ``k`` holds stage ``k`` (:func:`interlace.pipeline.stages.local_stage`, rank 0's plan), so
``-n`` is both the number of ranks and of stages. Every contender gets its own copy of the model
(identical initial weights) and its own SGD with momentum. Inputs are synthetic mini-batches
generated once, the same on every rank (the pipelines' first stage reads the inputs, their last
the targets; data parallelism's rank ``r`` takes the ``r``-th of ``N`` equal shards).

One launch per model measures every contender, interleaved: after a warm-up (``--warmup``
mini-batches each, and :class:`~interlace.DataParallel` until its buckets are final), each of
``--iters`` rounds runs every contender for one block of ``--block`` mini-batches, the order
rotating from round to round so a slow spell of the shared machine hits all of them alike. A
block starts behind a barrier and lasts until its slowest rank is done; its throughput is
``block * B`` samples over that time, and a row gives the median over blocks. An asynchronous
schedule runs each block as one stream, so it fills and drains its pipeline once per block
(``(N - 1) / (block + N - 1)`` of its unit-time clock), as a synchronous one does once per
mini-batch; a longer ``--block`` approaches the steady state of an epoch-long stream.

The header states the regime: ranks, link, batch, and the bytes that cross each stage boundary
per mini-batch (activations forward, as many gradient bytes back) against the gradient bytes the
data-parallel all-reduce moves per step, so a reader sees which side is communication-bound.
``--png`` draws one timed block of ``spectrain`` and of ``gpipe`` (their
:meth:`~interlace.pipeline.runtime.PipelineStage.take_events`), a lane per stage on one time
axis from the block's start, so the flush's bubble shows next to the stream.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from interlace.bench.dp import (
    NUM_CLASSES,
    LaunchFailedError,
    launch_on_ranks,
    parse_names,
    parse_shape,
)
from interlace.cliutil import standalone_main
from interlace.errors import UsageError
from interlace.timeline import Event, Timeline

PROG = "interlace bench pipeline"

#: The interlace pipeline schedules, then the baselines, in table order.
INTERLACE_SCHEDULES: tuple[str, ...] = (
    "gpipe",
    "1f1b",
    "naive",
    "pipedream",
    "spectrain",
    "spectrain-reuse",
)
#: ``spectrain-reuse`` is SpecTrain whose backward reuses the forward's prediction (and graph)
#: instead of computing the stage again: ``PipelineStage(spectrain_backward="reuse")``.
REUSE_SUFFIX = "-reuse"
SYNCHRONOUS: tuple[str, ...] = ("gpipe", "1f1b")
TORCH_SCHEDULES: tuple[str, ...] = ("torch-gpipe", "torch-1f1b")
SCHEDULES: tuple[str, ...] = (*INTERLACE_SCHEDULES, "dp", *TORCH_SCHEDULES)
#: The contenders every ratio column is taken against.
TORCH_BASELINE = "torch-gpipe"
DP_BASELINE = "dp"
#: What ``--png`` draws, each in its own group of lanes, when measured.
TIMELINE_SCHEDULES: tuple[str, ...] = ("spectrain", "gpipe")

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
DEFAULT_INPUT_SHAPE: tuple[int, ...] = (3, 32, 32)
DEFAULT_TIMEOUT_S = 1200.0
DEFAULT_LR = 0.01
DEFAULT_MOMENTUM = 0.9
#: Distinct synthetic mini-batches cycled through.
_BATCHES = 4
#: Upper bound on warm-up steps spent waiting for DataParallel's plan (a bug otherwise).
_MAX_PLAN_STEPS = 200


# ================================================================================ pure parts


def describe_schedule(schedule: str, microbatches: int, ranks: int) -> str:
    """How a contender processes one global mini-batch, in a few words."""
    if schedule in SYNCHRONOUS:
        return f"{microbatches} micro-batches, flush"
    if schedule in INTERLACE_SCHEDULES:
        policy = {
            "naive": "latest weights",
            "pipedream": "stashed",
            "spectrain": "predicted",
            "spectrain-reuse": "predicted, forward's reused",
        }
        pieces = f", {microbatches} chunks" if microbatches > 1 else ""
        return f"async 1F1B, {policy[schedule]}{pieces}"
    if schedule == DP_BASELINE:
        return f"{ranks} x 1/{ranks} batch, merged buckets"
    return f"{microbatches} micro-batches, torch.distributed.pipelining"


def fill_drain_fraction(schedule: str, num_stages: int, block: int, microbatches: int) -> float:
    """Share of a stage's unit-time clock lost to filling and draining the pipeline in one block.

    A flushing schedule fills and drains once per mini-batch: ``(N - 1) / (M + N - 1)``; an
    asynchronous stream once per block of mini-batches: ``(N - 1) / (K + N - 1)``. Data
    parallelism has no pipeline (0).
    """
    if schedule == DP_BASELINE:
        return 0.0
    streamed = schedule in INTERLACE_SCHEDULES and schedule not in SYNCHRONOUS
    units = block if streamed else microbatches
    return (num_stages - 1) / (units + num_stages - 1)


@dataclass(frozen=True)
class Row:
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
    #: Per stage (interlace pipelines only): median seconds per block spent computing (forward,
    #: backward, update) and in communication calls (waiting for receives, posting sends).
    stage_compute_s: list[float] | None = None
    stage_comm_s: list[float] | None = None
    #: CPU seconds of all ranks' processes (their gloo threads included) per mini-batch, and
    #: those seconds over the block's wall time: the cores the contender kept busy (medians).
    cpu_s_per_minibatch: float | None = None
    cores_busy: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Regime:
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

    @property
    def allreduce_bytes_per_rank(self) -> float:
        """Bytes each rank sends in a ring all-reduce of all gradients: ``2 (N-1)/N * G``."""
        return 2 * (self.ranks - 1) / self.ranks * self.gradient_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def rows_from_value(value: Mapping[str, Any], regime: Regime, *, block: int) -> list[Row]:
    """One row per contender from a launch's value (:func:`measure_rank`'s), with ratios
    against ``torch-gpipe`` and ``dp`` of the same launch (None where one was not run)."""
    seconds: Mapping[str, list[float]] = value["block_s"]
    per_block = block * regime.batch
    medians: dict[str, float] = {}
    quartiles: dict[str, tuple[float, float, float]] = {}
    for schedule, times in seconds.items():
        rates = [per_block / t for t in times if t > 0]
        if not rates:
            raise ValueError(f"{schedule}: no timed block")
        quartiles[schedule] = _quartiles(rates)
        medians[schedule] = quartiles[schedule][1]
    stats: Mapping[str, Mapping[str, list[float]]] = value.get("stage_stats", {})
    cpu: Mapping[str, list[float]] = value.get("cpu_s", {})
    losses: Mapping[str, float | None] = value.get("losses", {})
    rows = []
    for schedule in seconds:
        p25, median, p75 = quartiles[schedule]
        torch_rate, dp_rate = medians.get(TORCH_BASELINE), medians.get(DP_BASELINE)
        stage = stats.get(schedule)
        cpu_s = cpu.get(schedule)
        rows.append(
            Row(
                model=regime.model,
                schedule=schedule,
                description=describe_schedule(schedule, regime.microbatches, regime.ranks),
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
                fill_drain=fill_drain_fraction(schedule, regime.ranks, block, regime.microbatches),
                mean_loss=losses.get(schedule),
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
            )
        )
    return rows


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(rows: Sequence[Row]) -> str:
    """The markdown table: one line per model and contender."""
    lines = [
        "| model | schedule | how | samples/s | p25-p75 | vs torch-gpipe | vs dp | "
        "CPU s per mini-batch | cores busy |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.model} | {row.schedule} | {row.description} | {row.samples_per_s:.1f} | "
            f"{row.samples_per_s_p25:.1f}-{row.samples_per_s_p75:.1f} | "
            f"{_ratio(row.vs_torch_gpipe)} | {_ratio(row.vs_dp)} | "
            f"{_number(row.cpu_s_per_minibatch, 2)} | {_number(row.cores_busy, 2)} |"
        )
    return "\n".join(lines)


def _megabytes(count: float) -> str:
    return f"{count / 1e6:.2f} MB"


def format_regime(regime: Regime) -> str:
    """One model's regime: activations crossing the stage boundaries against gradients, and
    what each costs on the link (at line rate: a lower bound)."""
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
    batch: int,
    microbatches: int,
    block: int,
    iters: int,
    warmup: int,
    conditions: str = "",
) -> str:
    """The regime in a few lines: ranks, link, batches, how it was timed, then per model."""
    shard = batch // ranks if ranks else batch
    lines = [
        f"{PROG}: {ranks} ranks = {ranks} pipeline stages on {link}; global batch {batch} per "
        f"mini-batch for every contender (gpipe, 1f1b, torch-*: {microbatches} micro-batches of "
        f"{batch // max(microbatches, 1)}, one update per mini-batch; naive, pipedream, "
        f"spectrain: a stream of mini-batches of {batch} in {microbatches} chunks, an update "
        "per mini-batch; dp: "
        f"{shard} per rank).",
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
    ``process``, ``"stage k"``), times from that schedule's block start (``origins``)."""
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


# ================================================================================ rank side


@dataclass(frozen=True)
class PipelineJob:
    """What every rank of one launch measures."""

    model: str
    batch: int
    microbatches: int
    input_shape: tuple[int, ...]
    schedules: tuple[str, ...]
    block: int
    iters: int
    warmup: int
    seed: int = 0
    partition_by: str = "time"
    timeline: bool = False
    lr: float = DEFAULT_LR
    momentum: float = DEFAULT_MOMENTUM


@dataclass
class _Contender:
    """One schedule on one rank: its own copy of the model and optimizer, and how it trains."""

    schedule: str
    train: Callable[[Sequence[tuple[Any, Any]]], float | None]
    #: The interlace stage (for its events), else None.
    stage: Any = None
    #: DataParallel (for its plan), else None.
    wrapper: Any = None
    times: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    comm_s: list[float] = field(default_factory=list)
    loss: float | None = None


def _synthetic_batches(job: PipelineJob) -> list[tuple[Any, Any]]:
    """Global mini-batches, the same on every rank (one generator seeded by the job's seed)."""
    import torch

    generator = torch.Generator().manual_seed(job.seed * 1000 + 7)
    return [
        (
            torch.randn(job.batch, *job.input_shape, generator=generator),
            torch.randint(0, NUM_CLASSES, (job.batch,), generator=generator),
        )
        for _ in range(_BATCHES)
    ]


def _boundary_bytes(blocks: Any, plan: Any, sample: Any, batch: int) -> list[int]:
    """Bytes of one mini-batch's activations at the end of every stage but the last."""
    import torch

    ends = {end for _, end in plan.bounds[:-1]}
    sizes: list[int] = []
    x = sample
    was_training = blocks.training
    blocks.eval()
    with torch.no_grad():
        for index, block in enumerate(blocks):
            x = block(x)
            if index + 1 in ends:
                per_sample = x.numel() * x.element_size() / max(sample.shape[0], 1)
                sizes.append(round(per_sample * batch))
    blocks.train(was_training)
    return sizes


def _mean(values: Sequence[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def _build_contender(
    schedule: str, base: Any, *, plan: Any, job: PipelineJob, rank: int, ranks: int
) -> _Contender:
    """``schedule``'s own copy of ``base`` (identical weights), optimizer and training step."""
    import copy

    import torch
    from torch.nn import functional

    from interlace.dp import DataParallel
    from interlace.pipeline.partition import pipeline_blocks, stage_module
    from interlace.pipeline.runtime import PipelineStage

    model = copy.deepcopy(base)

    def sgd(parameters: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(parameters, lr=job.lr, momentum=job.momentum)

    last = rank == ranks - 1
    if schedule == DP_BASELINE:
        wrapper = DataParallel(model, bucketing="merged")
        optimizer = sgd(wrapper.parameters())
        shard = job.batch // ranks

        def train_dp(batches: Sequence[tuple[Any, Any]]) -> float | None:
            losses = []
            for inputs, targets in batches:
                x = inputs[rank * shard : (rank + 1) * shard]
                y = targets[rank * shard : (rank + 1) * shard]
                optimizer.zero_grad()
                loss = functional.cross_entropy(wrapper(x), y)
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))
            return _mean(losses)

        return _Contender(schedule, train_dp, wrapper=wrapper)

    module = stage_module(pipeline_blocks(model), plan, rank)
    optimizer = sgd(module.parameters())
    if schedule in INTERLACE_SCHEDULES:
        reuse = schedule.endswith(REUSE_SUFFIX)
        stage = PipelineStage(
            module,
            optimizer,
            stage=rank,
            num_stages=ranks,
            schedule=schedule.removesuffix(REUSE_SUFFIX),
            loss_fn=functional.cross_entropy,
            microbatches=job.microbatches,
            spectrain_backward="reuse" if reuse else "recompute",
            # The asynchronous schedules stream each mini-batch in as many pieces as the
            # synchronous ones cut it into, so every contender moves the same messages.
            chunks=1 if schedule in SYNCHRONOUS else job.microbatches,
        )

        def train_interlace(batches: Sequence[tuple[Any, Any]]) -> float | None:
            result = stage.run(list(batches), len(batches))
            return _mean(result.losses) if last else None

        return _Contender(schedule, train_interlace, stage=stage)

    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    torch_stage = TorchStage(module, rank, ranks, torch.device("cpu"))
    kind = ScheduleGPipe if schedule == "torch-gpipe" else Schedule1F1B
    runner = kind(torch_stage, job.microbatches, loss_fn=functional.cross_entropy)

    def train_torch(batches: Sequence[tuple[Any, Any]]) -> float | None:
        losses: list[Any] = []
        for inputs, targets in batches:
            optimizer.zero_grad()
            if rank == 0:
                runner.step(inputs, return_outputs=False)
            elif last:
                runner.step(target=targets, losses=losses, return_outputs=False)
            else:
                runner.step(return_outputs=False)
            optimizer.step()
        return _mean([float(loss.detach()) for loss in losses]) if last else None

    return _Contender(schedule, train_torch)


def _event_dicts(events: Sequence[Event]) -> list[dict[str, Any]]:
    return [
        {
            "name": e.name,
            "category": e.category,
            "start_s": e.start_s,
            "end_s": e.end_s,
            "lane": e.lane,
            "process": e.process,
            "args": dict(e.args),
        }
        for e in events
    ]


def measure_rank(job: PipelineJob) -> dict[str, Any]:
    """One rank of a launch: build every contender, warm up, time interleaved blocks.

    Returns (the same on every rank) each contender's block seconds (maximum over ranks), the
    stage plan, the bytes at the stage boundaries and of the gradients, per-stage compute and
    communication seconds of the interlace pipelines, the mean loss of the last timed block,
    and with ``job.timeline`` the events of one timed block of :data:`TIMELINE_SCHEDULES`.
    """
    import torch
    import torch.distributed as dist

    from interlace.pipeline.partition import pipeline_blocks
    from interlace.pipeline.stages import local_stage
    from interlace.zoo import build_model

    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(job.seed)
    base = build_model(job.model, job.input_shape, NUM_CLASSES)
    batches = _synthetic_batches(job)
    sample = batches[0][0][: max(1, job.batch // job.microbatches)]
    plan = local_stage(base, num_stages=ranks, stage=rank, by=job.partition_by, sample=sample).plan
    boundary = _boundary_bytes(pipeline_blocks(base), plan, sample, job.batch)
    parameters = sum(p.numel() for p in base.parameters() if p.requires_grad)
    gradient_bytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    # The same order on every rank: DataParallel builds process groups and fits its cost model
    # with collectives.
    contenders = [
        _build_contender(s, base, plan=plan, job=job, rank=rank, ranks=ranks) for s in job.schedules
    ]
    del base

    def blocks_from(start: int, count: int) -> list[tuple[Any, Any]]:
        return [batches[(start + i) % len(batches)] for i in range(count)]

    def drain(contender: _Contender) -> list[Event]:
        return list(contender.stage.take_events()) if contender.stage is not None else []

    # Warm-up: every contender ``job.warmup`` mini-batches (at least one: torch's stages infer
    # their shapes on their first step), DataParallel until its plan is final.
    for contender in contenders:
        dist.barrier()
        contender.train(blocks_from(0, max(job.warmup, 1)))
        steps = 0
        while contender.wrapper is not None and not contender.wrapper.planning_done:
            if steps >= _MAX_PLAN_STEPS:
                raise RuntimeError(f"dp had no plan after {steps} warm-up steps")
            contender.train(blocks_from(steps, 1))
            steps += 1
        if contender.wrapper is not None and steps:
            contender.train(blocks_from(0, 1))  # one step on the final buckets
        drain(contender)

    events: dict[str, list[dict[str, Any]]] = {}
    origins: dict[str, float] = {}
    for round_index in range(job.iters):
        shift = round_index % len(contenders)
        data = blocks_from(round_index, job.block)
        for contender in contenders[shift:] + contenders[:shift]:
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            loss = contender.train(data)
            contender.times.append(time.perf_counter() - start)
            contender.cpu_s.append(time.process_time() - cpu_start)
            contender.loss = loss
            recorded = drain(contender)
            if contender.stage is not None:
                contender.compute_s.append(
                    sum(e.duration_s for e in recorded if e.category != "comm")
                )
                contender.comm_s.append(sum(e.duration_s for e in recorded if e.category == "comm"))
            last_round = round_index == job.iters - 1
            if job.timeline and last_round and contender.schedule in TIMELINE_SCHEDULES:
                events[contender.schedule] = _event_dicts(recorded)
                origins[contender.schedule] = start

    flat = torch.tensor([t for c in contenders for t in c.times], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    maxima: list[float] = flat.tolist()
    block_s = {
        c.schedule: maxima[i * job.iters : (i + 1) * job.iters] for i, c in enumerate(contenders)
    }
    cpu_flat = torch.tensor([t for c in contenders for t in c.cpu_s], dtype=torch.float64)
    dist.all_reduce(cpu_flat)  # summed over ranks
    cpu_sums: list[float] = cpu_flat.tolist()
    cpu_s = {
        c.schedule: cpu_sums[i * job.iters : (i + 1) * job.iters] for i, c in enumerate(contenders)
    }
    local = {
        "stats": {
            c.schedule: (statistics.median(c.compute_s), statistics.median(c.comm_s))
            for c in contenders
            if c.stage is not None
        },
        "losses": {c.schedule: c.loss for c in contenders},
        "events": events,
        "origins": origins,
    }
    gathered: list[Any] = [None] * ranks
    dist.all_gather_object(gathered, local)
    stage_stats = {
        schedule: {
            "compute_s": [g["stats"][schedule][0] for g in gathered],
            "comm_s": [g["stats"][schedule][1] for g in gathered],
        }
        for schedule in gathered[0]["stats"]
    }
    losses = {c.schedule: gathered[-1]["losses"][c.schedule] for c in contenders}
    if DP_BASELINE in losses:  # each rank's shard: the mean over ranks is the global batch's
        values = [g["losses"][DP_BASELINE] for g in gathered]
        losses[DP_BASELINE] = _mean([v for v in values if v is not None])
    merged_events = {
        schedule: [e for g in gathered for e in g["events"].get(schedule, [])]
        for schedule in events
    }
    merged_origins = {
        schedule: min(g["origins"][schedule] for g in gathered) for schedule in events
    }
    return {
        "block_s": block_s,
        "cpu_s": cpu_s,
        "plan": plan.describe(),
        "boundary_bytes": boundary,
        "parameters": parameters,
        "gradient_bytes": gradient_bytes,
        "stage_stats": stage_stats,
        "losses": losses,
        "events": merged_events,
        "origins": merged_origins,
    }


# ================================================================================ the command


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

    @property
    def link_text(self) -> str:
        return self.link or "loopback (no emulated network)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``interlace bench pipeline``."""
    parser.add_argument(
        "--models",
        help="comma-separated zoo names or package.module:callable, each an nn.Sequential or a "
        f"model with pipeline_blocks() (default {','.join(DEFAULT_MODELS)})",
    )
    parser.add_argument("--model", help="one model (zoo name or package.module:callable)")
    parser.add_argument(
        "--schedules",
        help=f"comma-separated contenders (default all: {','.join(SCHEDULES)})",
    )
    parser.add_argument(
        "-n",
        "--nprocs",
        type=int,
        default=DEFAULT_NPROCS,
        help=f"ranks = pipeline stages (default {DEFAULT_NPROCS})",
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
        "--batch",
        type=int,
        default=DEFAULT_BATCH,
        help=f"global batch per mini-batch, the same for every contender (default {DEFAULT_BATCH})",
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
    parser.add_argument(
        "--input-shape",
        default=",".join(map(str, DEFAULT_INPUT_SHAPE)),
        help="input shape of the synthetic batches (default 3,32,32; 1,8,8 is the digits shape)",
    )
    parser.add_argument(
        "--partition-by",
        choices=("time", "params"),
        default="time",
        help="balance the stages by measured time or by parameter count (default time)",
    )
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds allowed per launch (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument(
        "--png",
        metavar="PATH",
        help="timeline of one timed block of spectrain and of gpipe on the first model, a lane "
        "per stage (and a Chrome trace next to it)",
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Resolve the defaults and check every value; raises UsageError."""
    from interlace.comm.links import parse_link
    from interlace.zoo import MODEL_NAMES

    if args.model and args.models:
        raise UsageError("--model and --models contradict each other; give one of them")
    if args.model:
        models = parse_names(args.model, None, "model", "model")
    elif args.models:
        models = parse_names(args.models, None, "models", "model")
    else:
        models = DEFAULT_MODELS
    for model in models:
        if ":" not in model and model not in MODEL_NAMES:
            raise UsageError(
                f"unknown model {model!r}; choose from {', '.join(MODEL_NAMES)} or give "
                "package.module:callable"
            )
    schedules = (
        parse_names(args.schedules, SCHEDULES, "schedules", "schedule")
        if args.schedules
        else SCHEDULES
    )
    schedules = tuple(s for s in SCHEDULES if s in schedules)  # table order
    if args.nprocs < 2:
        raise UsageError(f"-n must be >= 2 (a pipeline needs two stages), got {args.nprocs}")
    for flag, value, least in (
        ("--batch", args.batch, 1),
        ("--microbatches", args.microbatches, 1),
        ("--block", args.block, 1),
        ("--iters", args.iters, 1),
        ("--warmup", args.warmup, 0),
    ):
        if value < least:
            raise UsageError(f"{flag} must be >= {least}, got {value}")
    if args.batch % args.nprocs:
        raise UsageError(
            f"--batch {args.batch} does not split into {args.nprocs} equal data-parallel shards; "
            f"use a multiple of -n {args.nprocs}"
        )
    if args.batch % args.microbatches:
        raise UsageError(
            f"--batch {args.batch} does not split into {args.microbatches} equal micro-batches; "
            "use a multiple of --microbatches"
        )
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.no_netem and args.link is not None:
        raise UsageError("--link and --no-netem contradict each other; give one of them")
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
        batch=args.batch,
        microbatches=args.microbatches,
        block=args.block,
        iters=args.iters,
        warmup=args.warmup,
        input_shape=parse_shape(args.input_shape),
        link=link,
        partition_by=args.partition_by,
        seed=args.seed,
        timeout_s=float(args.timeout),
        json_path=args.json,
        png_path=args.png,
    )


def _check_models(config: BenchConfig) -> None:
    """Build each model once here, so a bad model, shape or stage count is one line."""
    from interlace.pipeline.partition import pipeline_blocks
    from interlace.zoo import build_model

    for model in config.models:
        blocks = pipeline_blocks(build_model(model, config.input_shape, NUM_CLASSES))
        if len(blocks) < config.nprocs:
            raise UsageError(
                f"{model} has {len(blocks)} pipeline blocks, too few for {config.nprocs} stages; "
                "use fewer ranks (-n) or a deeper model"
            )


def describe_conditions(config: BenchConfig) -> str:
    """When and where the rows were measured."""
    import torch

    try:
        load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        load = "n/a"
    return (
        f"Machine: {platform.node()} ({os.cpu_count()} CPUs, load {load} at the end), torch "
        f"{torch.__version__}, gloo, 1 thread per rank; stages cut by {config.partition_by} "
        f"(rank 0's plan); input {'x'.join(map(str, config.input_shape))}; SGD lr {DEFAULT_LR:g} "
        f"momentum {DEFAULT_MOMENTUM:g}."
    )


def _one_line(rows: Sequence[Row]) -> str:
    return f"{rows[0].model}: " + ", ".join(
        f"{row.schedule} {row.samples_per_s:.1f}/s" for row in rows
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


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see :func:`add_arguments`); the exit status."""
    config = config_from_args(args)
    _check_models(config)
    if config.link is not None:
        from interlace.launch import netem

        try:
            netem.check_available()
        except netem.NetemUnavailableError as exc:
            raise UsageError(
                f"{exc}; run as root, or pass --no-netem to measure on loopback"
            ) from exc
    from tqdm import tqdm

    from interlace.comm.links import parse_link

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
                )
                try:
                    value = launch_on_ranks(
                        measure_rank,
                        job,
                        nprocs=config.nprocs,
                        link=config.link,
                        timeout_s=config.timeout_s,
                        env={"INTERLACE_CACHE_DIR": cache_dir},
                        note=bar.write,
                        prog=PROG,
                    )
                except LaunchFailedError as exc:
                    failures.append(f"{model}: {exc}")
                    bar.write(f"{PROG}: launch failed: {failures[-1]}")
                    bar.update(1)
                    continue
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
                new_rows = rows_from_value(value, regime, block=config.block)
                rows += new_rows
                bar.write(_one_line(new_rows))
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
    """``interlace bench pipeline`` on its own (``python benchmarks/pipeline.py``)."""
    return standalone_main(
        PROG,
        "Compare interlace's pipeline schedules with DataParallel and "
        "torch.distributed.pipelining at equal global batch on the emulated cluster.",
        add_arguments,
        run,
        argv,
    )
