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
from torch import Tensor, nn
from torch.nn import functional

from interlace.comm.strategies import STRATEGIES
from interlace.distenv import DistContext, collective_device
from interlace.errors import UsageError
from interlace.pipeline.layout import PipelineLayout
from interlace.pipeline.partition import StagePlan, pipeline_blocks, stage_module
from interlace.pipeline.replication import ReplicaGroups, StageDataParallel, replicated
from interlace.pipeline.results import EvalResult
from interlace.pipeline.runtime import PipelineStage
from interlace.pipeline.schedule import SYNCHRONOUS
from interlace.pipeline.stages import LocalStage, local_stage
from interlace.runlog import RunLog
from interlace.train.checkpoint import SAME_AS, Position, rng_state, set_rng_state
from interlace.train.config import TrainConfig
from interlace.train.records import RunRecords, finish_run
from interlace.train.schedule import optimizer_with_schedule, steps_in_epoch
from interlace.train.shared import TrainResult
from interlace.zoo import DataBundle, build_model, load_data, make_loader

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
    records = RunRecords(config, context, run_dir, resume)
    job = _PipelineJob(config, context, bundle, groups, records)
    try:
        job.restore()
        job.open_log()
        accuracy, train_loss, throughput = job.train()
    finally:
        job.bar.close()
        job.stage.close()
    return job.finish(accuracy, train_loss, throughput)


class _PipelineJob:
    """One rank's pipelined run: its stage (cut, built, restored), data and records, and the
    steps of training it (open the log, train and report each epoch, save, finish).

    Args:
        config: the run's config (already validated).
        context: this rank's place in the job.
        bundle: the run's data.
        groups: this rank's place among the stages and replicas, and their process groups.
        records: the run's records (and the checkpoint it resumes, if any).
    """

    def __init__(
        self,
        config: TrainConfig,
        context: DistContext,
        bundle: DataBundle,
        groups: ReplicaGroups,
        records: RunRecords,
    ) -> None:
        self.config, self.context, self.bundle = config, context, bundle
        self.groups, self.layout, self.records = groups, groups.layout, records
        torch.manual_seed(config.seed)
        model = build_model(config.model, bundle.input_shape, bundle.num_classes)
        self.train_loader = make_loader(
            bundle.train, config.batch_size, shuffle=True, seed=config.seed, drop_last=True
        )
        self.test_loader = make_loader(bundle.test, max(config.batch_size, 64), shuffle=False)
        self.local = self._cut(model)
        module = self.local.module.to(context.device)
        self.steps_per_epoch = steps_in_epoch(
            config,
            len(self.train_loader),
            f"the training split of '{bundle.name}' has {len(bundle.train)} samples, fewer "
            f"than one mini-batch of {config.batch_size}; lower --batch-size",
        )
        self.optimizer, self.schedule = optimizer_with_schedule(
            module.parameters(), config, self.steps_per_epoch
        )
        self.bar = records.progress_bar(config.epochs * self.steps_per_epoch)
        self.stage = self._build_stage(module)
        self.log: RunLog | None = None

    def _cut(self, model: nn.Module) -> LocalStage:
        """This rank's stage of ``model``: as the resumed run cut it, or cut by rank 0's plan."""
        groups, layout, config = self.groups, self.layout, self.config
        resumed = self.records.resumed
        if resumed is not None:
            # The stages as first cut: measuring again could cut elsewhere, and the saved
            # weights fit only their own stage.
            plan = StagePlan(**resumed.state["partition"])
            return LocalStage(
                stage_module(pipeline_blocks(model), plan, groups.stage),
                plan,
                groups.stage,
                layout.stages,
            )
        shard = config.batch_size // layout.replicas
        sample = next(iter(self.train_loader))[0][: max(1, shard // config.microbatches)]
        # Every rank cuts by rank 0's plan, so the replicas of a stage hold the same blocks.
        return local_stage(
            model,
            num_stages=layout.stages,
            stage=groups.stage,
            by=config.partition_by,
            sample=sample,
            data_parallel=groups.data_parallel,
            batch=shard,
        )

    def _build_stage(self, module: nn.Module) -> PipelineStage:
        """The stage's runtime (collective over the job), stepping the schedule and the bar."""
        config, groups = self.config, self.groups

        def after_update() -> None:
            self.schedule.step()
            self.bar.update(1)

        return PipelineStage(
            module,
            self.optimizer,
            stage=groups.stage,
            num_stages=self.layout.stages,
            schedule=config.schedule,
            loss_fn=functional.cross_entropy,
            microbatches=config.microbatches,
            device=self.context.device,
            on_update=after_update,
            spectrain_backward=config.spectrain_backward,
            chunks=config.chunks,
            ranks=groups.ranks,
            group=groups.pipeline,
            data_parallel=_stage_data_parallel(config, groups),
        )

    def restore(self) -> None:
        """Load the checkpoint resumed into the stage, the schedule and the generators."""
        resumed = self.records.resumed
        if resumed is not None:
            self.stage.load_state_dict(resumed.state["stage"])
            self.schedule.load_state_dict(resumed.state["schedule"])
            set_rng_state(resumed.state["rng"])

    @property
    def _replicas(self) -> str:
        return f" x {self.layout.replicas} replicas" if self.layout.replicas > 1 else ""

    def open_log(self) -> None:
        """Open rank 0's run log with the job's header, and print the layout and the cut."""
        config, layout, bundle = self.config, self.layout, self.bundle
        pieces = (
            f" in {config.microbatches} micro-batches"
            if config.schedule in SYNCHRONOUS
            else (f" in {config.chunks} chunks" if config.chunks > 1 else "")
        )
        self.log = self.records.open_log(
            f"pipe{layout.stages}" + (f"x{layout.replicas}" if layout.replicas > 1 else ""),
            bundle.source,
            lambda path: (
                f"training {config.model} on {bundle.name} pipelined over {layout.stages} "
                f"stage(s){self._replicas}, schedule {config.schedule}, mini-batch "
                f"{config.batch_size}{pieces}, run folder {path}"
            ),
        )
        if self.log is not None:
            print(layout.describe(), flush=True)
            print(self.local.plan.describe(), flush=True)

    def train(self) -> tuple[float, float, float]:
        """Train every epoch left, reporting and saving after each; the last epoch's test
        accuracy, training loss and samples per second."""
        config, saves = self.config, self.records.saves
        accuracy, train_loss, throughput = 0.0, math.nan, 0.0
        shards = _replica_shards(self.groups, config.batch_size)
        for epoch in range(self.records.start.epoch, config.epochs + 1):
            sampler = self.train_loader.sampler
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            result = self.stage.run(shards(self.train_loader), self.steps_per_epoch)
            test = self.stage.evaluate(self.test_loader, len(self.test_loader))
            # The last stage saw the losses; every rank gets the epoch's mean and wall time.
            stats = torch.tensor(
                [sum(result.losses) / max(len(result.losses), 1), result.seconds],
                dtype=torch.float64,
                device=collective_device(),
            )
            dist.broadcast(stats, self.groups.ranks[-1], group=self.groups.pipeline)
            train_loss = float(stats[0])
            throughput = self.steps_per_epoch * config.batch_size / float(stats[1])
            accuracy = test.accuracy
            self._report(epoch, train_loss, test, throughput, float(stats[1]))
            if saves is not None and (saves.after_epoch(epoch) or epoch == config.epochs):
                self._save(epoch)
        return accuracy, train_loss, throughput

    def finish(self, accuracy: float, train_loss: float, throughput: float) -> TrainResult:
        """Close rank 0's run log; the run's result on every rank.

        Args:
            accuracy: the last epoch's test accuracy.
            train_loss: its mean training loss.
            throughput: its samples per second.
        """
        config = self.config
        return finish_run(
            self.log,
            f"{config.model} on {self.bundle.name}, {config.schedule} over "
            f"{self.layout.stages} stages{self._replicas}",
            accuracy=accuracy,
            train_loss=train_loss,
            samples_per_s=throughput,
            epochs=config.epochs,
        )

    def _report(
        self, epoch: int, train_loss: float, test: EvalResult, throughput: float, epoch_s: float
    ) -> None:
        """Rank 0: the epoch's row in the run log and on screen."""
        if self.log is None:
            return
        self.log.append(
            {
                "epoch": epoch,
                "train_loss": train_loss,
                "test_loss": test.mean_loss,
                "test_accuracy": test.accuracy,
                "samples_per_s": throughput,
                "epoch_s": epoch_s,
                "lr": self.optimizer.param_groups[0]["lr"],
            }
        )
        self.bar.write(
            f"epoch {epoch:3d}/{self.config.epochs}  train loss {train_loss:.4f}  "
            f"test loss {test.mean_loss:.4f}  test acc {100 * test.accuracy:6.2f}%  "
            f"{throughput:8.1f} samples/s",
            file=sys.stdout,
        )
        sys.stdout.flush()

    def _save(self, epoch: int) -> None:
        """Checkpoint the job after ``epoch``; collective."""
        state: dict[str, Any] = {"rng": rng_state()}
        if self.groups.replica == 0:
            plan = self.local.plan
            state.update(
                stage=self.stage.state_dict(),
                schedule=self.schedule.state_dict(),
                partition={"bounds": plan.bounds, "costs": plan.costs, "by": plan.by},
            )
        else:
            # The replicas of a stage hold the same weights, optimizer and buffers:
            # replica 0 saves them once, and every replica resumes from its copy.
            state[SAME_AS] = self.layout.rank_of(self.groups.stage, 0)
        position = Position(epoch + 1, 0, epoch * self.steps_per_epoch)
        self.records.save(position, state)


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
