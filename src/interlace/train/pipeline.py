"""Training with the model pipelined over the job's ranks: ``interlace train --parallel pipeline``.

The ranks form ``-n / --stages`` replicas of a pipeline (one by default, of ``-n`` stages); the
``--batch-size`` mini-batch is the global batch, split evenly over the replicas, and each stage's
gradients are averaged over its replicas.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import functional

from interlace.comm.strategies import STRATEGIES
from interlace.distenv import DistContext, collective_device
from interlace.errors import UsageError
from interlace.pipeline.layout import PipelineLayout
from interlace.pipeline.partition import StagePlan, pipeline_blocks, stage_module
from interlace.pipeline.replication import ReplicaGroups, StageDataParallel, replicated
from interlace.pipeline.runtime import PipelineStage
from interlace.pipeline.schedule import SYNCHRONOUS
from interlace.pipeline.stages import LocalStage, local_stage
from interlace.train.checkpoint import SAME_AS, Position, rng_state, set_rng_state
from interlace.train.config import TrainConfig
from interlace.train.records import RunRecords, finish_run
from interlace.train.schedule import optimizer_with_schedule, steps_in_epoch
from interlace.train.shared import TrainResult
from interlace.zoo import build_model, load_data, make_loader

Batch = tuple[Tensor, Tensor]


def train_pipeline(
    config: TrainConfig, context: DistContext, run_dir: str | None, resume: bool = False
) -> TrainResult:
    """Train ``config.model`` pipelined over the job's ranks; same result on every rank.

    Every rank builds the same data loaders (one data stream, one shuffle); stage 0 reads the
    inputs, the last stage the targets, and every rank reports the last stage's numbers.

    Args:
        config: the run's config (already validated), with ``parallel == "pipeline"``.
        context: this rank's place in the job (process group initialised).
        run_dir: where rank 0 writes its records (made fresh when None).
        resume: continue ``run_dir`` from its latest checkpoint (taken between epochs).

    Raises:
        UsageError: for an optimizer other than SGD, or spectrain without momentum.
    """
    if config.optimizer != "sgd":
        raise UsageError("--parallel pipeline trains with SGD and momentum; drop --optimizer kfac")
    if config.schedule == "spectrain" and config.momentum <= 0:
        raise UsageError("--schedule spectrain predicts from the momentum: use --momentum > 0")
    bundle = load_data(config.data, synthetic_size=config.synthetic_size, seed=config.seed)
    check_pipeline_ranks(config, context.world_size)
    groups = replicated(config.stages or context.world_size)
    layout = groups.layout
    records = RunRecords(config, context, run_dir, resume)
    resumed, start = records.resumed, records.start
    torch.manual_seed(config.seed)
    model = build_model(config.model, bundle.input_shape, bundle.num_classes)
    train_loader = make_loader(
        bundle.train, config.batch_size, shuffle=True, seed=config.seed, drop_last=True
    )
    test_loader = make_loader(bundle.test, max(config.batch_size, 64), shuffle=False)
    if resumed is not None:
        # The stages as first cut: measuring again could cut elsewhere, and the saved
        # weights fit only their own stage.
        plan = StagePlan(**resumed.state["partition"])
        local = LocalStage(
            stage_module(pipeline_blocks(model), plan, groups.stage),
            plan,
            groups.stage,
            layout.stages,
        )
    else:
        shard = config.batch_size // layout.replicas
        sample = next(iter(train_loader))[0][: max(1, shard // config.microbatches)]
        # Every rank cuts by rank 0's plan, so the replicas of a stage hold the same blocks.
        local = local_stage(
            model,
            num_stages=layout.stages,
            stage=groups.stage,
            by=config.partition_by,
            sample=sample,
        )
    module = local.module.to(context.device)
    steps_per_epoch = steps_in_epoch(
        config,
        len(train_loader),
        f"the training split of '{bundle.name}' has {len(bundle.train)} samples, fewer "
        f"than one mini-batch of {config.batch_size}; lower --batch-size",
    )
    optimizer, schedule = optimizer_with_schedule(module.parameters(), config, steps_per_epoch)
    total_steps = config.epochs * steps_per_epoch
    bar = records.progress_bar(total_steps)

    def after_update() -> None:
        schedule.step()
        bar.update(1)

    stage = PipelineStage(
        module,
        optimizer,
        stage=groups.stage,
        num_stages=layout.stages,
        schedule=config.schedule,
        loss_fn=functional.cross_entropy,
        microbatches=config.microbatches,
        device=context.device,
        on_update=after_update,
        spectrain_backward=config.spectrain_backward,
        chunks=config.chunks,
        ranks=groups.ranks,
        group=groups.pipeline,
        data_parallel=_stage_data_parallel(config, groups),
    )
    if resumed is not None:
        stage.load_state_dict(resumed.state["stage"])
        schedule.load_state_dict(resumed.state["schedule"])
        set_rng_state(resumed.state["rng"])
    pieces = (
        f" in {config.microbatches} micro-batches"
        if config.schedule in SYNCHRONOUS
        else (f" in {config.chunks} chunks" if config.chunks > 1 else "")
    )
    replicas = f" x {layout.replicas} replicas" if layout.replicas > 1 else ""
    log = records.open_log(
        f"pipe{layout.stages}" + (f"x{layout.replicas}" if layout.replicas > 1 else ""),
        bundle.source,
        lambda path: (
            f"training {config.model} on {bundle.name} pipelined over {layout.stages} "
            f"stage(s){replicas}, schedule {config.schedule}, mini-batch {config.batch_size}"
            f"{pieces}, run folder {path}"
        ),
    )
    if log is not None:
        print(layout.describe(), flush=True)
        print(local.plan.describe(), flush=True)

    saves = records.saves
    partition = {"bounds": local.plan.bounds, "costs": local.plan.costs, "by": local.plan.by}

    accuracy, train_loss, throughput = 0.0, math.nan, 0.0
    last = groups.ranks[-1]
    shards = _replica_shards(groups, config.batch_size)
    try:
        for epoch in range(start.epoch, config.epochs + 1):
            sampler = train_loader.sampler
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            result = stage.run(shards(train_loader), steps_per_epoch)
            test = stage.evaluate(test_loader, len(test_loader))
            # The last stage saw the losses; every rank gets the epoch's mean and wall time.
            stats = torch.tensor(
                [sum(result.losses) / max(len(result.losses), 1), result.seconds],
                dtype=torch.float64,
                device=collective_device(),
            )
            dist.broadcast(stats, last, group=groups.pipeline)
            train_loss = float(stats[0])
            throughput = steps_per_epoch * config.batch_size / float(stats[1])
            accuracy = test.accuracy
            if log is not None:
                log.append(
                    {
                        "epoch": epoch,
                        "train_loss": train_loss,
                        "test_loss": test.mean_loss,
                        "test_accuracy": accuracy,
                        "samples_per_s": throughput,
                        "epoch_s": float(stats[1]),
                        "lr": optimizer.param_groups[0]["lr"],
                    }
                )
                bar.write(
                    f"epoch {epoch:3d}/{config.epochs}  train loss {train_loss:.4f}  "
                    f"test loss {test.mean_loss:.4f}  test acc {100 * accuracy:6.2f}%  "
                    f"{throughput:8.1f} samples/s",
                    file=sys.stdout,
                )
                sys.stdout.flush()
            if saves is not None and (saves.after_epoch(epoch) or epoch == config.epochs):
                state: dict[str, Any] = {"rng": rng_state()}
                if groups.replica == 0:
                    state.update(
                        stage=stage.state_dict(),
                        schedule=schedule.state_dict(),
                        partition=partition,
                    )
                else:
                    # The replicas of a stage hold the same weights, optimizer and buffers:
                    # replica 0 saves them once, and every replica resumes from its copy.
                    state[SAME_AS] = layout.rank_of(groups.stage, 0)
                position = Position(epoch + 1, 0, epoch * steps_per_epoch)
                records.save(position, state)
    finally:
        bar.close()
        stage.close()
    return finish_run(
        log,
        f"{config.model} on {bundle.name}, {config.schedule} over {layout.stages} stages{replicas}",
        accuracy=accuracy,
        train_loss=train_loss,
        samples_per_s=throughput,
        epochs=config.epochs,
    )


def _stage_data_parallel(config: TrainConfig, groups: ReplicaGroups) -> StageDataParallel | None:
    """The stage's gradient average over its replicas, by ``--strategy``'s buckets; None with
    one replica."""
    if groups.data_parallel is None:
        return None
    strategy = STRATEGIES[config.strategy]
    assert strategy.bucketing is not None  # TrainConfig.validate allows planned ones only
    cap = config.bucket_cap_mb if config.bucket_cap_mb is not None else strategy.cap_bytes / 1e6
    first = strategy.first_cap_bytes
    return StageDataParallel(
        groups.data_parallel,
        bucketing=strategy.bucketing,
        bucket_cap_mb=cap,
        first_bucket_cap_mb=cap if first is None else first / 1e6,
        channels=config.channels,
        compression=config.compression,
    )


def _replica_shards(
    groups: ReplicaGroups, batch_size: int
) -> Callable[[Iterable[Batch]], Iterator[Batch]]:
    """This replica's share of every mini-batch: one data stream, cut evenly by replica."""
    replicas = groups.layout.replicas
    shard = batch_size // replicas
    cut = slice(groups.replica * shard, (groups.replica + 1) * shard)

    def shards(batches: Iterable[Batch]) -> Iterator[Batch]:
        for inputs, targets in batches:
            yield (inputs[cut], targets[cut]) if replicas > 1 else (inputs, targets)

    return shards


def replicas_of(config: TrainConfig, world_size: int) -> int:
    """Pipeline replicas of a ``--parallel pipeline`` run on ``world_size`` ranks.

    Args:
        config: the run's config.
        world_size: the job's ranks.

    Raises:
        UsageError: when ``--stages`` does not divide the ranks.
    """
    stages = world_size if config.stages is None else config.stages
    return PipelineLayout.for_world(world_size, stages).replicas


def check_pipeline_ranks(config: TrainConfig, world_size: int) -> None:
    """Check that ``--parallel pipeline``'s stages and mini-batch fit ``world_size`` ranks.

    Args:
        config: the run's config, with ``parallel="pipeline"``.
        world_size: the job's ranks.

    Raises:
        UsageError: when ``--stages`` does not divide the ranks or the mini-batch does not split
            into equal replica shards that still hold a micro-batch (or chunk) each.
    """
    replicas = replicas_of(config, world_size)
    if replicas == 1:
        return
    if config.batch_size % replicas:
        raise UsageError(
            f"--batch-size {config.batch_size} does not split into {replicas} equal replica "
            f"shards (-n {world_size} / --stages {config.stages}); use a multiple of {replicas}"
        )
    pieces = config.microbatches if config.schedule in SYNCHRONOUS else config.chunks
    if config.batch_size // replicas < pieces:
        raise UsageError(
            f"--batch-size {config.batch_size} leaves {config.batch_size // replicas} samples "
            f"per replica, too few for {pieces} pieces; raise --batch-size"
        )
