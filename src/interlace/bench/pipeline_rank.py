"""``interlace bench pipeline``, rank side: the contenders (pipeline schedules, DataParallel and
torch's pipelines), the job, and the rank code that times them in interleaved blocks."""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from interlace.bench.harness import (
    LR,
    MOMENTUM,
    Contender,
    RankJob,
    event_record,
    make_optimizer,
    max_over_ranks_each,
    rotated,
    steps_until,
)
from interlace.dp import DataParallel
from interlace.emulate.pipeline import EmulatedPipelineModel
from interlace.pipeline.partition import pipeline_blocks, stage_module
from interlace.pipeline.replication import ReplicaGroups, StageDataParallel, replicated
from interlace.pipeline.runtime import PipelineStage
from interlace.pipeline.schedule import schedule_type
from interlace.pipeline.stages import local_stage
from interlace.sim.pipeline import INTERLACE_PIPELINE_SCHEDULES, TORCH_PIPELINE_SCHEDULES
from interlace.timeline import Event

#: interlace's schedules, data parallelism, then torch's, in table order (the simulator's names).
SCHEDULES: tuple[str, ...] = (
    *INTERLACE_PIPELINE_SCHEDULES,
    "dp",
    *TORCH_PIPELINE_SCHEDULES,
)
#: The contenders every ratio column is taken against.
TORCH_BASELINE = "torch-gpipe"
DP_BASELINE = "dp"
#: What ``--png`` draws, each in its own group of lanes, when measured.
TIMELINE_SCHEDULES: tuple[str, ...] = ("spectrain", "gpipe")
#: The stream of the job's seed its mini-batches come from: the same on every rank.
BATCH_STREAM = 7


@dataclass(frozen=True, kw_only=True)
class PipelineJob(RankJob):
    """What every rank of one launch measures: ``iters`` rounds of one block of ``block``
    mini-batches of ``batch`` (the global batch) per contender.

    Args:
        microbatches: Pieces per mini-batch.
        schedules: The contenders, in table order.
        block: Mini-batches per timed block.
        partition_by: A StageCut name (``auto``: by time with one replica, time+allreduce with
            several).
        timeline: Whether to record one timed block of :data:`TIMELINE_SCHEDULES`.
        stages: Stages per pipeline (None: every rank a stage); the ranks form replicas of it,
            each stage's gradients averaged over them (interlace: MG-WFBP buckets; torch: the
            stage module under DDP).
        stage_compression: The type interlace's stage averages travel in (None: float32).
        lr: SGD's learning rate.
        momentum: SGD's momentum.
    """

    microbatches: int
    schedules: tuple[str, ...]
    block: int
    partition_by: str = "auto"
    timeline: bool = False
    stages: int | None = None
    stage_compression: str | None = None
    lr: float = LR
    momentum: float = MOMENTUM

    #: The emulated pipeline model takes the inputs of ``input_shape`` and predicts classes.
    emulated_takes_logits = False

    def emulated_module(self, trace: str, dilation: float) -> torch.nn.Module:
        """The trace's emulated block sequence, predicting ``num_classes`` classes.

        Args:
            trace: A shipped trace's name or a trace file.
            dilation: The time-dilation factor.
        """
        return EmulatedPipelineModel(trace, dilation, classes=self.num_classes)


@dataclass(kw_only=True)
class PipelineContender(Contender):
    """One schedule on one rank: its own copy of the model and optimizer, and how it trains.

    Args:
        train: Trains on a list of mini-batches; the mean loss where this rank knows it.
        stage: The interlace stage (for its events), else None.
        cpu_s: Process CPU seconds of each timed block.
        compute_s: Seconds of each timed block spent computing (interlace stages only).
        comm_s: Seconds of each timed block spent in communication calls (same).
        loss: The mean loss of the last timed block.
    """

    train: Callable[[Sequence[tuple[Any, Any]]], float | None]
    stage: Any = None
    cpu_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    comm_s: list[float] = field(default_factory=list)
    loss: float | None = None


def _boundary_bytes(blocks: Any, plan: Any, sample: Any, batch: int) -> list[int]:
    """Bytes of one mini-batch's activations at the end of every stage but the last."""
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


def _replica_shard(
    batches: Sequence[tuple[Any, Any]], groups: ReplicaGroups
) -> list[tuple[Any, Any]]:
    """This replica's share of each global mini-batch (all of it with one replica)."""
    replicas = groups.layout.replicas
    if replicas == 1:
        return list(batches)
    shard = len(batches[0][0]) // replicas
    cut = slice(groups.replica * shard, (groups.replica + 1) * shard)
    return [(inputs[cut], targets[cut]) for inputs, targets in batches]


def _build_contender(
    schedule: str, base: Any, *, plan: Any, job: PipelineJob, groups: ReplicaGroups
) -> PipelineContender:
    """``schedule``'s own copy of ``base`` (identical weights), optimizer and training step."""
    model = copy.deepcopy(base)
    rank, ranks = groups.rank, groups.layout.world_size
    last = groups.is_last
    if schedule == DP_BASELINE:
        wrapper = DataParallel(model, bucketing="merged")
        optimizer = make_optimizer(model, wrapper.parameters(), lr=job.lr, momentum=job.momentum)
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

        return PipelineContender(schedule, wrapper=wrapper, train=train_dp)

    module = stage_module(pipeline_blocks(model), plan, groups.stage)
    optimizer = make_optimizer(module, lr=job.lr, momentum=job.momentum)
    stages = groups.layout.stages
    if schedule in INTERLACE_PIPELINE_SCHEDULES:
        schedule_class = schedule_type(schedule)
        averaging = groups.data_parallel
        stage = PipelineStage(
            module,
            optimizer,
            stage=groups.stage,
            num_stages=stages,
            schedule=schedule_class,
            loss_fn=functional.cross_entropy,
            microbatches=job.microbatches,
            # The asynchronous schedules stream each mini-batch in as many pieces as the
            # synchronous ones cut it into, so every contender moves the same messages.
            chunks=1 if schedule_class.synchronous else job.microbatches,
            ranks=groups.ranks,
            group=groups.pipeline,
            data_parallel=(
                None
                if averaging is None
                else StageDataParallel(averaging, compression=job.stage_compression)
            ),
        )

        def train_interlace(batches: Sequence[tuple[Any, Any]]) -> float | None:
            result = stage.run(_replica_shard(batches, groups), len(batches))
            return _mean(result.losses) if last else None

        return PipelineContender(schedule, train=train_interlace, stage=stage)

    # torch's combination: the stage module under DDP over the stage's replicas; torch's stage
    # runs every micro-batch's backward but the last under DDP's no_sync. With DDP's bucket
    # rebuild (the default) the second step fails an internal assertion (docs/pipeline.md):
    # find_unused_parameters=True is the setting without that rebuild.
    wrapped: torch.nn.Module = (
        module
        if groups.data_parallel is None
        else DistributedDataParallel(
            module, process_group=groups.data_parallel, find_unused_parameters=True
        )
    )
    torch_stage = TorchStage(
        wrapped, groups.stage, stages, torch.device("cpu"), group=groups.pipeline
    )
    kind = ScheduleGPipe if schedule == "torch-gpipe" else Schedule1F1B
    runner = kind(torch_stage, job.microbatches, loss_fn=functional.cross_entropy)

    def train_torch(batches: Sequence[tuple[Any, Any]]) -> float | None:
        losses: list[Any] = []
        for inputs, targets in _replica_shard(batches, groups):
            optimizer.zero_grad()
            if groups.is_first:
                runner.step(inputs, return_outputs=False)
            elif last:
                runner.step(target=targets, losses=losses, return_outputs=False)
            else:
                runner.step(return_outputs=False)
            optimizer.step()
        return _mean([float(loss.detach()) for loss in losses]) if last else None

    return PipelineContender(schedule, train=train_torch)


def _fitted_cost(contender: PipelineContender) -> list[float] | None:
    """The all-reduce cost ``[a, b]`` the contender fitted on this rank (None: none fitted)."""
    if contender.wrapper is not None:
        cost = contender.wrapper.cost_model
    elif contender.stage is not None and contender.stage.averager is not None:
        cost = contender.stage.averager.cost_model
    else:
        return None
    return None if cost is None else [float(cost.a), float(cost.b)]


def measure_rank(job: PipelineJob) -> dict[str, Any]:
    """One rank of a launch: build every contender, warm up, time interleaved blocks.

    Returns (the same on every rank) each contender's block seconds (maximum over ranks), the
    stage plan (and its block ranges, ``bounds``), the bytes at the stage boundaries and of the
    gradients, per-stage compute and communication seconds of the interlace pipelines, the mean
    loss of the last timed block, and with ``job.timeline`` the events of one timed block of
    :data:`TIMELINE_SCHEDULES`.

    Args:
        job: The model, contenders and blocks to time.
    """
    ranks = dist.get_world_size()
    groups = replicated(job.stages or ranks)
    shard = job.batch // groups.layout.replicas
    torch.manual_seed(job.seed)
    base = job.module()
    batches = job.batches(BATCH_STREAM)
    sample = batches[0][0][: max(1, shard // job.microbatches)]
    stages = groups.layout.stages
    # Every contender, torch's included, runs on this one cut (rank 0's plan).
    plan = local_stage(
        base,
        num_stages=stages,
        stage=groups.stage,
        by=job.partition_by,
        sample=sample,
        data_parallel=groups.data_parallel,
        batch=shard,
    ).plan
    # Per pipeline: each replica's share of the mini-batch crosses its boundaries.
    boundary = _boundary_bytes(pipeline_blocks(base), plan, sample, shard)
    parameters = sum(p.numel() for p in base.parameters() if p.requires_grad)
    gradient_bytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    # The same order on every rank: DataParallel builds process groups and fits its cost model
    # with collectives.
    contenders = [
        _build_contender(s, base, plan=plan, job=job, groups=groups) for s in job.schedules
    ]
    del base

    def blocks_from(start: int, count: int) -> list[tuple[Any, Any]]:
        return [batches[(start + i) % len(batches)] for i in range(count)]

    def drain(contender: PipelineContender) -> list[Event]:
        return list(contender.stage.take_events()) if contender.stage is not None else []

    def warm_up(contender: PipelineContender) -> None:
        dist.barrier()
        contender.train(blocks_from(0, max(job.warmup, 1)))
        wrapper = contender.wrapper
        if wrapper is not None and steps_until(
            lambda _: bool(wrapper.planning_done),
            lambda step: contender.train(blocks_from(step, 1)),
            contender.name,
        ):
            contender.train(blocks_from(0, 1))  # one step on the final buckets
        drain(contender)

    # Warm-up: every contender ``job.warmup`` mini-batches (at least one: torch's stages infer
    # their shapes on their first step), DataParallel until its plan is final.
    for contender in contenders:
        warm_up(contender)

    events: dict[str, list[dict[str, Any]]] = {}
    origins: dict[str, float] = {}
    for round_index in range(job.iters):
        data = blocks_from(round_index, job.block)
        for contender in rotated(contenders, round_index):
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
            if job.timeline and last_round and contender.name in TIMELINE_SCHEDULES:
                events[contender.name] = [event_record(event) for event in recorded]
                origins[contender.name] = start

    maxima = max_over_ranks_each([c.times for c in contenders])
    block_s = {c.name: times for c, times in zip(contenders, maxima, strict=True)}
    cpu_flat = torch.tensor([t for c in contenders for t in c.cpu_s], dtype=torch.float64)
    dist.all_reduce(cpu_flat)  # summed over ranks
    cpu_sums: list[float] = cpu_flat.tolist()
    cpu_s = {
        c.name: cpu_sums[i * job.iters : (i + 1) * job.iters] for i, c in enumerate(contenders)
    }
    local = {
        "stats": {
            c.name: (statistics.median(c.compute_s), statistics.median(c.comm_s))
            for c in contenders
            if c.stage is not None
        },
        "losses": {c.name: c.loss for c in contenders},
        "costs": {c.name: _fitted_cost(c) for c in contenders},
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
    losses = {c.name: gathered[-1]["losses"][c.name] for c in contenders}
    # Each rank's all-reduce cost as its contender fitted it: a replicated interlace stage's
    # on its stage group, DataParallel's on every rank ([a, b], seconds and seconds per byte).
    costs = {
        c.name: [g["costs"][c.name] for g in gathered]
        for c in contenders
        if any(g["costs"][c.name] is not None for g in gathered)
    }
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
        "layout": groups.layout.describe(),
        "bounds": [list(bounds) for bounds in plan.bounds],
        "boundary_bytes": boundary,
        "parameters": parameters,
        "gradient_bytes": gradient_bytes,
        "stage_stats": stage_stats,
        "allreduce_costs": costs,
        "losses": losses,
        "events": merged_events,
        "origins": merged_origins,
    }
