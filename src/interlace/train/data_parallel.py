"""Data-parallel training: the model replicated on every rank, gradients averaged by a strategy.

With ``optimizer="kfac"`` :class:`interlace.KFAC` preconditions the averaged gradients in front
of the same SGD and schedule, so a K-FAC run and an SGD run of one config differ only there. On
text data the same loop trains a language model: the loss is the mean over every predicted token.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import Overlap, gates_from_timings, plan_overlap
from interlace.comm.plan import MIB, Bucketing, ReadyTensor
from interlace.comm.planners import make_plan
from interlace.distenv import DistContext
from interlace.dp import DataParallel
from interlace.dp.plan_state import plan_state_of
from interlace.errors import OptionError, UsageError
from interlace.kfac import KFAC, KFACPreconditioner
from interlace.runlog import METRIC_COLUMNS, PERPLEXITY_COLUMNS, RunLog
from interlace.train.checkpoint import Position, rng_state, set_rng_state
from interlace.train.config import TrainConfig, default_kfac_kl_clip
from interlace.train.kfac_options import kfac_keywords, kfac_options, shown_as_flags
from interlace.train.records import RunRecords, finish_run
from interlace.train.schedule import optimizer_with_schedule, steps_in_epoch
from interlace.train.shared import TrainResult
from interlace.wrapping import wrap_model
from interlace.zoo import DataBundle, build_model, load_data, make_loader, token_cross_entropy
from interlace.zoo.text import TokenWindows, unigram_perplexity


def train_data_parallel(
    config: TrainConfig, context: DistContext, run_dir: str | None, resume: bool = False
) -> TrainResult:
    """Train ``config.model`` replicated over the job's ranks; same result on every rank.

    Args:
        config: the run's config (already validated).
        context: this rank's place in the job (process group initialised).
        run_dir: where rank 0 writes its records (made fresh when None).
        resume: continue ``run_dir`` from its latest checkpoint.
    """
    bundle = _load_matching_data(config)
    if config.optimizer == "kfac" and config.kfac_kl_clip is None:
        # Resolved before the run folder is written, so config.json holds the clip that ran.
        global_batch = config.batch_size * context.world_size
        config = replace(config, kfac_kl_clip=default_kfac_kl_clip(global_batch))
    records = RunRecords(config, context, run_dir, resume)
    job = _DataParallelJob(config, context, bundle, records)
    job.restore()
    job.open_log()
    return job.run()


def _load_matching_data(config: TrainConfig) -> DataBundle:
    """The run's data, checked against ``--input-shape`` and ``--classes`` where given."""
    bundle = load_data(
        config.data,
        synthetic_size=config.synthetic_size,
        seed=config.seed,
        seq_len=config.seq_len,
        data_file=config.data_file,
    )
    input_shape = bundle.input_shape
    if config.input_shape is not None and tuple(config.input_shape) != tuple(input_shape):
        raise UsageError(
            f"--input-shape {config.input_shape} does not match the data '{bundle.name}', "
            f"whose samples have shape {input_shape}; drop --input-shape or pick matching data"
        )
    if config.num_classes is not None and config.num_classes != bundle.num_classes:
        raise UsageError(
            f"--classes {config.num_classes} does not match the data '{bundle.name}', "
            f"which has {bundle.num_classes} classes"
        )
    return bundle


class _DataParallelJob:
    """One rank's data-parallel run: the model, its wrapper, data, optimizer and records, and
    the steps of training it (restore, open the log, train and report each epoch, finish).

    Args:
        config: the run's config (already validated, K-FAC's clip resolved).
        context: this rank's place in the job.
        bundle: the run's data.
        records: the run's records (and the checkpoint it resumes, if any).
    """

    def __init__(
        self, config: TrainConfig, context: DistContext, bundle: DataBundle, records: RunRecords
    ) -> None:
        self.config, self.context, self.bundle, self.records = config, context, bundle, records
        self.text = isinstance(bundle.train, TokenWindows) and isinstance(bundle.test, TokenWindows)
        torch.manual_seed(config.seed)
        self.model = build_model(config.model, bundle.input_shape, bundle.num_classes).to(
            context.device
        )
        self.parallel_model = wrap_model(
            self.model,
            config.strategy,
            device=context.device,
            bucket_cap_mb=config.bucket_cap_mb,
            channels=config.channels,
            compression=config.compression,
        )
        self.train_loader = make_loader(
            bundle.train,
            config.batch_size,
            rank=context.rank,
            world_size=context.world_size,
            shuffle=True,
            seed=config.seed,
            drop_last=True,
        )
        self.test_loader = _eval_loader(bundle.test, config.batch_size, context)
        self.steps_per_epoch = steps_in_epoch(
            config,
            len(self.train_loader),
            f"the training split of '{bundle.name}' has {len(bundle.train)} samples, fewer "
            f"than one global batch of {config.batch_size} x {context.world_size} ranks; lower "
            "--batch-size or -n",
        )
        self.optimizer, self.schedule = optimizer_with_schedule(
            self.model.parameters(), config, self.steps_per_epoch
        )
        self.precond = (
            make_kfac(config, self.parallel_model, self.optimizer, context.world_size)
            if config.optimizer == "kfac"
            else None
        )
        self.log: RunLog | None = None
        self.global_step = records.start.global_step
        self.reported: set[str] = set()  # the one-off plan lines already written

    def restore(self) -> None:
        """Load the checkpoint resumed, or fix the buckets of a ``--deterministic`` run."""
        resumed, wrapper = self.records.resumed, self.parallel_model
        if resumed is not None:
            saved = resumed.state
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
            self.schedule.load_state_dict(saved["schedule"])
            if self.precond is not None:
                self.precond.load_state_dict(saved["kfac"])
            # --replan leaves the wrapper unplanned: it profiles, plans and tries plans afresh.
            plan = saved["plan"]
            if plan is not None and isinstance(wrapper, DataParallel) and not self.config.replan:
                wrapper.load_plan_state(plan)
        elif self.config.deterministic and isinstance(wrapper, DataParallel):
            wrapper.load_plan_state(fixed_plan_state(wrapper, self.config))

    def open_log(self) -> None:
        """Open rank 0's run log, with the job's header and what it set up."""
        config, context, bundle = self.config, self.context, self.bundle
        self.log = self.records.open_log(
            f"n{context.world_size}",
            bundle.source,
            lambda path: (
                f"training {config.model} on {bundle.name} ({len(bundle.train)} train / "
                f"{len(bundle.test)} test) with {context.world_size} rank(s) on "
                f"{context.device.type} ({context.backend}), strategy "
                f"{config.strategy}, channels {config.channels}, "
                f"compression {config.compression or 'none'}, "
                f"global batch {config.batch_size * context.world_size}, run folder {path}"
            ),
            (*METRIC_COLUMNS, *PERPLEXITY_COLUMNS) if self.text else METRIC_COLUMNS,
        )
        if self.log is None:
            return
        if config.deterministic and isinstance(self.parallel_model, DataParallel):
            print(
                f"deterministic: {len(self.parallel_model.buckets)} fixed bucket(s), not planned "
                "from measured times",
                flush=True,
            )
        if self.precond is not None:
            print(self.precond.describe().splitlines()[0], flush=True)
        if self.records.resumed is not None and config.replan:
            print(
                "replan: the checkpoint's plan is dropped; profiling and planning again", flush=True
            )

    def save(self, position: Position, loss_sum: torch.Tensor) -> None:
        """Checkpoint every rank's state at ``position``; collective.

        Args:
            position: where in the data the run is.
            loss_sum: the epoch's running loss and its count so far.
        """
        wrapper = self.parallel_model
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "kfac": self.precond.state_dict() if self.precond is not None else None,
            "plan": wrapper.plan_state() if isinstance(wrapper, DataParallel) else None,
            "loss_sum": loss_sum,
            "rng": rng_state(),
        }
        self.records.save(position, state)

    def run(self) -> TrainResult:
        """Train every epoch left, reporting and saving after each; the run's result."""
        config, start = self.config, self.records.start
        bar = self.records.progress_bar(config.epochs * self.steps_per_epoch)
        accuracy, train_loss, test_loss, throughput = 0.0, math.nan, math.nan, 0.0
        try:
            for epoch in range(start.epoch, config.epochs + 1):
                train_loss, throughput, epoch_s, loss_sum = self._train_epoch(epoch, bar)
                test_loss, accuracy = evaluate(self.model, self.test_loader, self.context)
                row = {
                    "epoch": epoch,
                    "train_loss": train_loss,
                    "test_loss": test_loss,
                    "test_accuracy": accuracy,
                    "samples_per_s": throughput,
                    "epoch_s": epoch_s,
                    "lr": self.optimizer.param_groups[0]["lr"],
                }
                self._report(row, bar)
                saves = self.records.saves
                if saves is not None and (saves.after_epoch(epoch) or epoch == config.epochs):
                    self.save(Position(epoch + 1, 0, self.global_step), torch.zeros_like(loss_sum))
        finally:
            bar.close()
        return self._finish(accuracy, train_loss, test_loss, throughput)

    def _epoch_batches(self, epoch: int) -> tuple[Iterator[Any], int, torch.Tensor]:
        """The epoch's batches (past those a resumed run did), how many are skipped, and the
        epoch's running loss and count (a resumed epoch's so far)."""
        resumed, start = self.records.resumed, self.records.start
        sampler = self.train_loader.sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        skip = start.step if epoch == start.epoch else 0
        loss_sum = torch.zeros(2, dtype=torch.float64, device=self.context.device)
        continuing = resumed is not None and epoch == start.epoch
        if continuing and skip == 0:
            set_rng_state(resumed.state["rng"])  # type: ignore[union-attr]
        # Making the iterator draws from torch's generator: a resumed epoch makes it anew,
        # then takes the generator's state of the moment the checkpoint was saved.
        batches = iter(skip_batches(self.train_loader, skip))
        if continuing and skip > 0:
            set_rng_state(resumed.state["rng"])  # type: ignore[union-attr]
            loss_sum.copy_(resumed.state["loss_sum"])  # type: ignore[union-attr]
        return batches, skip, loss_sum

    def _train_epoch(self, epoch: int, bar: Any) -> tuple[float, float, float, torch.Tensor]:
        """One epoch's steps; its mean training loss over the ranks, samples per second, wall
        time, and the loss sum (for the shape of the next checkpoint's)."""
        config, device = self.config, self.context.device
        self.parallel_model.train()
        batches, skip, loss_sum = self._epoch_batches(epoch)
        saves = self.records.saves
        started = time.perf_counter()
        for step in range(skip, self.steps_per_epoch):
            batch_inputs, batch_targets = next(batches)
            targets = batch_targets.to(device, non_blocking=True)
            loss = self._step(batch_inputs.to(device, non_blocking=True), targets)
            loss_sum[0] += loss.double() * targets.numel()
            loss_sum[1] += targets.numel()
            self.global_step += 1
            bar.update(1)
            shown = {"ppl": f"{math.exp(loss.item()):.2f}"} if self.text else {}
            bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}", **shown, refresh=False)
            if saves is not None and saves.after_step(self.global_step):
                self.save(Position(epoch, step + 1, self.global_step), loss_sum)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        epoch_s = time.perf_counter() - started
        dist.all_reduce(loss_sum)
        global_batch = config.batch_size * self.context.world_size
        throughput = (self.steps_per_epoch - skip) * global_batch / epoch_s
        return float(loss_sum[0] / loss_sum[1]), throughput, epoch_s, loss_sum

    def _step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One optimizer step on a batch; its loss, detached."""
        config = self.config
        self.optimizer.zero_grad(set_to_none=True)
        with _autocast(config, self.context.device):
            loss = token_cross_entropy(self.parallel_model(inputs), targets)
        loss.backward()
        if self.precond is not None:
            self.precond.step(loss=loss.detach())
        if config.clip_grad_norm is not None:
            # Reads every averaged gradient: under the forward overlap it waits for
            # all of them here (docs/training.md).
            nn.utils.clip_grad_norm_(self.model.parameters(), config.clip_grad_norm)
        self.optimizer.step()
        self.schedule.step()
        return loss.detach()

    def _report(self, row: dict[str, float], bar: Any) -> None:
        """Rank 0: the epoch's row in the run log and on screen, and the plan once chosen."""
        if self.log is None:
            return
        if self.text:
            row.update(
                train_perplexity=math.exp(row["train_loss"]),
                test_perplexity=math.exp(row["test_loss"]),
            )
        self.log.append(row)
        for attribute, prefix in (
            ("channel_choice", "communication plan: "),
            ("tuning_summary", "communication plan "),
        ):
            said = getattr(self.parallel_model, attribute, "")
            if said and attribute not in self.reported:
                bar.write(prefix + said, file=sys.stdout)
                self.reported.add(attribute)
        bar.write(_epoch_line(row, self.config.epochs, self.text), file=sys.stdout)
        sys.stdout.flush()

    def _finish(
        self, accuracy: float, train_loss: float, test_loss: float, throughput: float
    ) -> TrainResult:
        """End the run: say if the plan is still on trial, close the log, report the result."""
        if self.log is not None and not getattr(self.parallel_model, "planning_done", True):
            print(
                "communication plan: still on trial when training ended (DataParallel tries its "
                "candidate plans for real before keeping one; a longer run, or tune_steps=0, ends "
                "them sooner)",
                flush=True,
            )
        bundle = self.bundle
        perplexities = None
        if isinstance(bundle.train, TokenWindows) and isinstance(bundle.test, TokenWindows):
            unigram = unigram_perplexity(bundle.train.tokens, bundle.test.targets())
            perplexities = (math.exp(test_loss), unigram)
        return finish_run(
            self.log,
            f"{self.config.model} on {bundle.name}, {self.context.world_size} rank(s)",
            accuracy=accuracy,
            train_loss=train_loss,
            samples_per_s=throughput,
            epochs=self.config.epochs,
            perplexities=perplexities,
        )


def _autocast(config: TrainConfig, device: torch.device) -> torch.autocast:
    """The forward's autocast: bfloat16 under ``--precision bf16``, else off."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16")


def _epoch_line(row: dict[str, float], epochs: int, text: bool) -> str:
    """Rank 0's line after an epoch: losses, then accuracy or perplexities, and throughput."""
    line = f"epoch {int(row['epoch']):3d}/{epochs}  train loss {row['train_loss']:.4f}  "
    if text:
        line += (
            f"(ppl {row['train_perplexity']:.2f})  test loss {row['test_loss']:.4f} "
            f"(ppl {row['test_perplexity']:.2f})  next-token acc "
        )
    else:
        line += f"test loss {row['test_loss']:.4f}  test acc "
    return line + f"{100 * row['test_accuracy']:6.2f}%  {row['samples_per_s']:8.1f} samples/s"


def fixed_plan_state(model: DataParallel, config: TrainConfig) -> dict[str, Any]:
    """Buckets that depend on the model alone, for ``--deterministic``.

    The gradients in reverse registration order (the order backward usually produces them),
    cut as the strategy would without measurements: one per tensor for ``wfbp``, one in all
    for ``single``, DDP's caps (``--bucket-cap-mb``, first bucket 1 MB) otherwise; ``overlap``
    sends those buckets in the order the next forward needs them. The bucket
    layout fixes the order in which an all-reduce of more than two ranks adds, so the same
    seed gives the same numbers.

    Args:
        model: the wrapped model.
        config: the strategy, caps, channels and compression come from here.

    Returns:
        What :meth:`DataParallel.load_plan_state` takes.
    """
    names = model.parameter_names
    sizes = {name: p.numel() * p.element_size() for name, p in model.module.named_parameters()}
    wire = 0.5 if config.compression is not None else 1.0
    order = list(reversed(range(len(names))))
    tensors = [ReadyTensor(names[i], max(int(sizes[names[i]] * wire), 1), 0.0) for i in order]
    bucketing = {"wfbp": Bucketing.PER_TENSOR, "single": Bucketing.SINGLE}.get(
        config.strategy, Bucketing.FIXED
    )
    plan = make_plan(
        bucketing,
        tensors,
        CostModel(0.0, 0.0),
        cap_bytes=(25.0 if config.bucket_cap_mb is None else config.bucket_cap_mb) * MIB,
        first_cap_bytes=MIB,
        channels=int(config.channels),
    )
    if model.overlap is Overlap.FORWARD:
        # The same buckets, sent in the order the next forward needs them (registration order
        # of the layers standing for forward order), each whole: the sums do not change.
        position = [0] * len(order)
        for place, index in enumerate(order):
            position[index] = place
        plan = plan_overlap(
            tensors,
            gates_from_timings(model.gate_layout(), position, 0.0),
            CostModel(0.0, 0.0),
            groups=plan.groups,
            forward_s=0.0,
            channels=int(config.channels),
        )
    return plan_state_of(names, order, plan)


def skip_batches(
    loader: DataLoader[tuple[torch.Tensor, torch.Tensor]], count: int
) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
    """``loader`` without its first ``count`` batches of this epoch (its sampler's order).

    Args:
        loader: a loader with a sampler and a batch size (``make_loader``'s).
        count: batches to skip; 0 returns ``loader`` itself.
    """
    if count == 0:
        return loader
    assert loader.batch_size is not None
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=_SkipFirst(loader.sampler, count * loader.batch_size),
        drop_last=loader.drop_last,
        num_workers=loader.num_workers,
    )


class _SkipFirst(Sampler[int]):
    """A sampler's indices without the first ``count``."""

    def __init__(self, sampler: Sampler[int] | Iterable[int], count: int) -> None:
        self.sampler = sampler
        self.count = count

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.count, None)

    def __len__(self) -> int:
        return max(len(self.sampler) - self.count, 0)  # type: ignore[arg-type]


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: DataLoader[tuple[torch.Tensor, torch.Tensor]], context: DistContext
) -> tuple[float, float]:
    """Mean loss and accuracy over the whole test split, each rank scoring its own share.

    Args:
        model: the model to score (put in eval mode for the pass, then restored).
        loader: this rank's share of the test split.
        context: this rank's place in the job; the sums are all-reduced over it.

    Returns:
        ``(mean loss, accuracy)`` over every rank's samples (a language model's: over every
        predicted token), the same on every rank.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=context.device)
    for batch_inputs, batch_targets in loader:
        inputs = batch_inputs.to(context.device, non_blocking=True)
        targets = batch_targets.to(context.device, non_blocking=True)
        logits = model(inputs)
        totals[0] += token_cross_entropy(logits, targets, reduction="sum").double()
        totals[1] += (logits.argmax(dim=-1) == targets).sum().double()
        totals[2] += targets.numel()
    dist.all_reduce(totals)
    model.train(was_training)
    count = max(float(totals[2]), 1.0)
    return float(totals[0]) / count, float(totals[1]) / count


def _eval_loader(
    dataset: Dataset[tuple[torch.Tensor, torch.Tensor]], batch_size: int, context: DistContext
) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
    # A strided split rather than DistributedSampler: its padding would count some test samples
    # twice, and the reported accuracy must be over exactly the test split.
    indices = list(range(context.rank, len(dataset), context.world_size))  # type: ignore[arg-type]
    return DataLoader(Subset(dataset, indices), batch_size=max(batch_size, 64), shuffle=False)


def make_kfac(
    config: TrainConfig,
    parallel_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    world_size: int | None = None,
) -> KFAC:
    """K-FAC on the wrapped model with the config's ``kfac_*`` options
    (:class:`~interlace.kfac.KFACPreconditioner`, which takes every keyword the flags name).

    Its KL-clip follows the optimiser's scheduled rate unless ``kfac_lr`` fixes one; its bound,
    when ``kfac_kl_clip`` is None, is :func:`~interlace.train.config.default_kfac_kl_clip` of the
    global batch.

    Args:
        config: the ``kfac_*`` options come from here.
        parallel_model: the model as wrapped for data parallelism.
        optimizer: the SGD that applies the preconditioned gradients; K-FAC's KL-clip reads its
            current learning rate at every step.
        world_size: the job's ranks, for the KL-clip's default by global batch when
            ``kfac_kl_clip`` is None (None: the process group's, or 1 without one).

    Raises:
        UsageError: naming the flag, for what K-FAC refuses only once it sees the job (a
            ``--kfac-grad-worker-fraction`` that does not split this world size evenly, a model
            with no layer to precondition).
    """
    keywords = kfac_keywords(config)
    keywords.setdefault("lr", _CurrentLr(optimizer))
    if config.kfac_kl_clip is None:  # not given: the clip the race found safe at this batch
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
        keywords["kl_clip"] = default_kfac_kl_clip(config.batch_size * world_size)
    try:
        return KFACPreconditioner(parallel_model, **keywords)
    except OptionError as error:
        raise UsageError(shown_as_flags(error, kfac_options(TrainConfig))) from None


class _CurrentLr:
    """The optimiser's current learning rate, as K-FAC's ``lr`` callable (for its KL-clip).

    K-FAC's KL-clip bounds the step ``lr * preconditioned gradient``, so it must see the rate the
    warm-up + cosine schedule has set now, not the peak. A class rather than a closure so it
    pickles, like :class:`~interlace.train.config.WarmupCosine`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def __call__(self, step: int) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
