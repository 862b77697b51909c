"""The main training job: a zoo (or user) model on a data set, data-parallel over the job's ranks.

Each rank runs :func:`train_rank`; ``interlace train -n N`` starts N of them through the launcher,
and the same code runs unchanged as a script under ``torchrun``. Rank 0 shows a progress bar,
prints one line per epoch and writes the run folder (see :mod:`interlace.runlog`).

``optimizer="kfac"`` puts :class:`interlace.KFAC` in front of the same SGD-with-momentum
optimiser and schedule: K-FAC preconditions the averaged gradients, SGD applies them. Everything
else (data, model, communication strategy, learning-rate schedule) is unchanged, so a K-FAC run
and an SGD run of one config differ only in the preconditioning.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, Dataset, Subset
from tqdm import tqdm

from interlace.comm.engine import COMPRESSIONS
from interlace.distenv import DistContext, init_distributed
from interlace.errors import UsageError
from interlace.kfac import KFAC
from interlace.kfac.decomp import COMPUTE_METHODS
from interlace.pipeline.schedule import ASYNCHRONOUS, SCHEDULES, SYNCHRONOUS
from interlace.runlog import RunLog, new_run_dir
from interlace.strategies import STRATEGIES, parse_channels, wrap_model
from interlace.zoo import build_model, load_data, make_loader

#: The ``--optimizer`` choices: plain SGD with momentum, or K-FAC in front of it.
OPTIMIZERS = ("sgd", "kfac")
#: The ``--parallel`` choices: the model replicated (data parallel) or cut into stages.
PARALLELISMS = ("data", "pipeline")
#: The ``--schedule`` choices of ``--parallel pipeline`` (see interlace.pipeline.schedule).
PIPELINE_SCHEDULES = SCHEDULES
#: How ``--parallel pipeline`` balances its stages (see interlace.pipeline.partition).
PARTITION_BY = ("time", "params")


@dataclass
class TrainConfig:
    """Every option of a training run; saved as the run folder's ``config.json``."""

    model: str = "resnet20"
    data: str = "digits"
    strategy: str = "mgwfbp"
    bucket_cap_mb: float | None = None
    channels: int | str = 1
    compression: str | None = None
    epochs: int = 15
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_epochs: float = 1.0
    seed: int = 0
    input_shape: tuple[int, ...] | None = None
    num_classes: int | None = None
    synthetic_size: int | None = None
    max_steps_per_epoch: int | None = None
    runs_dir: str = "runs"
    progress: bool = True
    optimizer: str = "sgd"
    # K-FAC's options (used when optimizer == "kfac"), with kfac-pytorch's defaults; see
    # interlace.KFAC. A K-FAC run keeps every SGD option above: lr, momentum, weight decay and
    # the warm-up + cosine schedule apply to the preconditioned gradients.
    kfac_factor_update_steps: int = 1
    kfac_inv_update_steps: int = 1
    kfac_damping: float = 0.001
    kfac_factor_decay: float = 0.95
    #: The KL-clip bound; 0 turns the clip off (kfac-pytorch's ``kl_clip=None``).
    kfac_kl_clip: float = 0.001
    kfac_compute_method: str = "eigen"
    kfac_grad_worker_fraction: float = 1.0
    kfac_g_normalization: str = "kfac-pytorch"
    # Pipeline parallelism (used when parallel == "pipeline"; see interlace.pipeline). There
    # --batch-size is the mini-batch that goes through the pipeline, so also the global batch.
    parallel: str = "data"
    schedule: str = "spectrain"
    microbatches: int = 4
    partition_by: str = "time"
    spectrain_backward: str = "recompute"
    # Pieces each mini-batch travels in through an asynchronous schedule (1: whole).
    chunks: int = 1
    extra: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """Reject impossible settings before any process starts."""
        checks = [
            (self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}"),
            (
                self.strategy in STRATEGIES,
                f"unknown --strategy '{self.strategy}'; choose one of {', '.join(STRATEGIES)}",
            ),
            (
                self.bucket_cap_mb is None or self.bucket_cap_mb > 0,
                f"--bucket-cap-mb must be > 0, got {self.bucket_cap_mb}",
            ),
            (
                self.compression in (None, *COMPRESSIONS),
                f"unknown --compression '{self.compression}'; choose one of "
                f"{', '.join(COMPRESSIONS)}",
            ),
            (self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}"),
            (self.lr > 0 and math.isfinite(self.lr), f"--lr must be > 0, got {self.lr}"),
            (0 <= self.momentum < 1, f"--momentum must be in [0, 1), got {self.momentum}"),
            (self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}"),
            (self.warmup_epochs >= 0, "--warmup-epochs must be >= 0"),
            (
                self.max_steps_per_epoch is None or self.max_steps_per_epoch >= 1,
                "--max-steps-per-epoch must be >= 1",
            ),
            (
                self.optimizer in OPTIMIZERS,
                f"unknown --optimizer '{self.optimizer}'; choose one of {', '.join(OPTIMIZERS)}",
            ),
            (
                self.kfac_factor_update_steps >= 1,
                f"--kfac-factor-update-steps must be >= 1, got {self.kfac_factor_update_steps}",
            ),
            (
                self.kfac_inv_update_steps >= 1,
                f"--kfac-inv-update-steps must be >= 1, got {self.kfac_inv_update_steps}",
            ),
            (
                self.kfac_damping >= 0 and math.isfinite(self.kfac_damping),
                f"--kfac-damping must be >= 0, got {self.kfac_damping}",
            ),
            (
                0 <= self.kfac_factor_decay < 1,
                f"--kfac-factor-decay must be in [0, 1), got {self.kfac_factor_decay}",
            ),
            (
                self.kfac_kl_clip >= 0 and math.isfinite(self.kfac_kl_clip),
                f"--kfac-kl-clip must be >= 0 (0 turns the clip off), got {self.kfac_kl_clip}",
            ),
            (
                self.kfac_compute_method in COMPUTE_METHODS,
                f"unknown --kfac-compute-method '{self.kfac_compute_method}'; choose one of "
                f"{', '.join(COMPUTE_METHODS)}",
            ),
            (
                0 < self.kfac_grad_worker_fraction <= 1,
                "--kfac-grad-worker-fraction must be in (0, 1] (1 COMM-OPT, 1/n MEM-OPT), got "
                f"{self.kfac_grad_worker_fraction}",
            ),
        ]
        checks += [
            (
                self.parallel in PARALLELISMS,
                f"unknown --parallel '{self.parallel}'; choose one of {', '.join(PARALLELISMS)}",
            ),
            (
                self.schedule in PIPELINE_SCHEDULES,
                f"unknown --schedule '{self.schedule}'; choose one of "
                f"{', '.join(PIPELINE_SCHEDULES)}",
            ),
            (self.microbatches >= 1, f"--microbatches must be >= 1, got {self.microbatches}"),
            (
                self.parallel != "pipeline"
                or self.schedule not in SYNCHRONOUS
                or self.batch_size >= self.microbatches,
                f"--batch-size {self.batch_size} cannot be cut into {self.microbatches} "
                "micro-batches; raise --batch-size or lower --microbatches",
            ),
            (self.chunks >= 1, f"--chunks must be >= 1, got {self.chunks}"),
            (
                self.chunks == 1 or self.schedule not in SYNCHRONOUS,
                f"--chunks applies to {', '.join(ASYNCHRONOUS)}; {self.schedule} cuts a "
                "mini-batch with --microbatches",
            ),
            (
                self.parallel != "pipeline"
                or self.schedule in SYNCHRONOUS
                or self.batch_size >= self.chunks,
                f"--batch-size {self.batch_size} cannot be cut into {self.chunks} chunks; raise "
                "--batch-size or lower --chunks",
            ),
            (
                self.spectrain_backward in ("recompute", "reuse"),
                f"unknown --spectrain-backward '{self.spectrain_backward}'; choose recompute or "
                "reuse",
            ),
            (
                self.partition_by in PARTITION_BY,
                f"unknown --partition-by '{self.partition_by}'; choose one of "
                f"{', '.join(PARTITION_BY)}",
            ),
        ]
        self.channels = parse_channels(self.channels)
        checks.append(
            (
                self.channels == 1 or self.strategy not in ("ddp", "optimal"),
                f"--strategy {self.strategy} sends on one channel; --channels needs mgwfbp, "
                "wfbp, fixed or single",
            )
        )
        for ok, message in checks:
            if not ok:
                raise UsageError(message)


@dataclass(frozen=True)
class TrainResult:
    """What a finished run reports back: its final numbers and where its folder is."""

    final_test_accuracy: float
    final_train_loss: float
    samples_per_s: float
    run_dir: str | None
    epochs: int


def train_rank(config: TrainConfig, run_dir: str | None = None) -> TrainResult:
    """Train on this rank; the job's ranks cooperate through torch DDP.

    ``run_dir`` is where rank 0 writes its records (made fresh when None). Returns the same
    :class:`TrainResult` on every rank.
    """
    config.validate()
    context = init_distributed()
    try:
        if config.parallel == "pipeline":
            from interlace.pipeline.trainer import train_pipeline

            return train_pipeline(config, context, run_dir)
        return _train(config, context, run_dir)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(config: TrainConfig, context: DistContext, run_dir: str | None) -> TrainResult:
    bundle = load_data(config.data, synthetic_size=config.synthetic_size, seed=config.seed)
    input_shape = bundle.input_shape
    num_classes = bundle.num_classes
    if config.input_shape is not None and tuple(config.input_shape) != tuple(input_shape):
        raise UsageError(
            f"--input-shape {config.input_shape} does not match the data '{bundle.name}', "
            f"whose samples have shape {input_shape}; drop --input-shape or pick matching data"
        )
    if config.num_classes is not None and config.num_classes != num_classes:
        raise UsageError(
            f"--classes {config.num_classes} does not match the data '{bundle.name}', "
            f"which has {num_classes} classes"
        )

    torch.manual_seed(config.seed)
    model = build_model(config.model, input_shape, num_classes).to(context.device)
    parallel_model = wrap_model(
        model,
        config.strategy,
        device=context.device,
        bucket_cap_mb=config.bucket_cap_mb,
        channels=config.channels,
        compression=config.compression,
    )
    train_loader = make_loader(
        bundle.train,
        config.batch_size,
        rank=context.rank,
        world_size=context.world_size,
        shuffle=True,
        seed=config.seed,
        drop_last=True,
    )
    test_loader = _eval_loader(bundle.test, config.batch_size, context)
    steps_per_epoch = steps_in_epoch(
        config,
        len(train_loader),
        f"the training split of '{bundle.name}' has {len(bundle.train)} samples, fewer than "
        f"one global batch of {config.batch_size} x {context.world_size} ranks; lower "
        "--batch-size or -n",
    )

    optimizer, schedule = sgd_with_schedule(model.parameters(), config, steps_per_epoch)
    total_steps = config.epochs * steps_per_epoch
    precond = _make_kfac(config, parallel_model, optimizer) if config.optimizer == "kfac" else None

    log = open_run_log(config, context, run_dir, f"n{context.world_size}")
    if log is not None:
        path = log.path
        print(
            f"training {config.model} on {bundle.name} ({len(bundle.train)} train / "
            f"{len(bundle.test)} test) with {context.world_size} rank(s) on "
            f"{context.device.type} ({context.backend}), strategy "
            f"{config.strategy}, channels {config.channels}, "
            f"compression {config.compression or 'none'}, "
            f"global batch {config.batch_size * context.world_size}, run folder {path}",
            flush=True,
        )
        if precond is not None:
            print(precond.describe().splitlines()[0], flush=True)

    show_bar = context.is_main and config.progress and sys.stderr.isatty()
    bar = tqdm(total=total_steps, disable=not show_bar, unit="step", dynamic_ncols=True)
    global_batch = config.batch_size * context.world_size
    result_accuracy = 0.0
    result_loss = math.nan
    throughput = 0.0
    plan_reported = False
    tuning_reported = False
    try:
        for epoch in range(1, config.epochs + 1):
            sampler = train_loader.sampler
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            parallel_model.train()
            loss_sum = torch.zeros(2, dtype=torch.float64, device=context.device)
            started = time.perf_counter()
            for step, (batch_inputs, batch_targets) in enumerate(train_loader):
                if step >= steps_per_epoch:
                    break
                inputs = batch_inputs.to(context.device, non_blocking=True)
                targets = batch_targets.to(context.device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                loss = functional.cross_entropy(parallel_model(inputs), targets)
                loss.backward()
                if precond is not None:
                    precond.step()
                optimizer.step()
                schedule.step()
                loss_sum[0] += loss.detach().double() * targets.numel()
                loss_sum[1] += targets.numel()
                bar.update(1)
                bar.set_postfix(epoch=epoch, loss=f"{loss.item():.3f}", refresh=False)
            if context.device.type == "cuda":
                torch.cuda.synchronize(context.device)
            epoch_s = time.perf_counter() - started
            dist.all_reduce(loss_sum)
            train_loss = float(loss_sum[0] / loss_sum[1])
            throughput = steps_per_epoch * global_batch / epoch_s
            test_loss, test_accuracy = evaluate(model, test_loader, context)
            result_accuracy, result_loss = test_accuracy, train_loss
            if log is not None:
                row = {
                    "epoch": epoch,
                    "train_loss": train_loss,
                    "test_loss": test_loss,
                    "test_accuracy": test_accuracy,
                    "samples_per_s": throughput,
                    "epoch_s": epoch_s,
                    "lr": optimizer.param_groups[0]["lr"],
                }
                log.append(row)
                choice = getattr(parallel_model, "channel_choice", "")
                if choice and not plan_reported:
                    bar.write(f"communication plan: {choice}", file=sys.stdout)
                    plan_reported = True
                tuning = getattr(parallel_model, "tuning_summary", "")
                if tuning and not tuning_reported:
                    bar.write(f"communication plan {tuning}", file=sys.stdout)
                    tuning_reported = True
                bar.write(
                    f"epoch {epoch:3d}/{config.epochs}  train loss {train_loss:.4f}  "
                    f"test loss {test_loss:.4f}  test acc {100 * test_accuracy:6.2f}%  "
                    f"{throughput:8.1f} samples/s",
                    file=sys.stdout,
                )
                sys.stdout.flush()
    finally:
        bar.close()
    if log is not None and not getattr(parallel_model, "planning_done", True):
        print(
            "communication plan: still on trial when training ended (DataParallel tries its "
            "candidate plans for real before keeping one; a longer run, or tune_steps=0, ends "
            "them sooner)",
            flush=True,
        )

    if log is not None:
        finish_run_log(
            log,
            f"{config.model} on {bundle.name}, {context.world_size} rank(s)",
            result_accuracy,
            config.epochs,
            throughput,
        )
    return TrainResult(
        final_test_accuracy=result_accuracy,
        final_train_loss=result_loss,
        samples_per_s=throughput,
        run_dir=str(log.path) if log is not None else None,
        epochs=config.epochs,
    )


def steps_in_epoch(config: TrainConfig, loader_steps: int, too_small: str) -> int:
    """Steps per epoch: the loader's, cut to ``--max-steps-per-epoch``; ``too_small`` is the
    error when not even one batch fits."""
    steps = loader_steps
    if config.max_steps_per_epoch is not None:
        steps = min(steps, config.max_steps_per_epoch)
    if steps == 0:
        raise UsageError(too_small)
    return steps


def sgd_with_schedule(
    parameters: Iterable[torch.nn.Parameter], config: TrainConfig, steps_per_epoch: int
) -> tuple[torch.optim.SGD, torch.optim.lr_scheduler.LambdaLR]:
    """The job's SGD with momentum and its warm-up + cosine schedule, stepped once per update."""
    optimizer = torch.optim.SGD(
        parameters,
        lr=config.lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
    )
    total_steps = config.epochs * steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _Schedule(total_steps, round(config.warmup_epochs * steps_per_epoch))
    )
    return optimizer, schedule


def open_run_log(
    config: TrainConfig, context: DistContext, run_dir: str | None, suffix: str
) -> RunLog | None:
    """Rank 0's run folder (``run_dir``, or a new one named after model, data and ``suffix``);
    None on the other ranks."""
    if not context.is_main:
        return None
    path = (
        Path(run_dir)
        if run_dir
        else new_run_dir(config.runs_dir, f"{_label(config.model)}-{_label(config.data)}-{suffix}")
    )
    return RunLog(path, _config_record(config, context))


def finish_run_log(
    log: RunLog, title: str, accuracy: float, epochs: int, samples_per_s: float
) -> None:
    """Draw the curves and print the final line every training job ends with."""
    log.plot(title)
    print(
        f"final test accuracy: {100 * accuracy:.2f}% after {epochs} epochs "
        f"({samples_per_s:.1f} samples/s); metrics in {log.metrics_path}, curves in "
        f"{log.curves_path}",
        flush=True,
    )


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: DataLoader[tuple[torch.Tensor, torch.Tensor]], context: DistContext
) -> tuple[float, float]:
    """Mean loss and accuracy over the whole test split, each rank scoring its own share."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=context.device)
    for batch_inputs, batch_targets in loader:
        inputs = batch_inputs.to(context.device, non_blocking=True)
        targets = batch_targets.to(context.device, non_blocking=True)
        logits = model(inputs)
        totals[0] += functional.cross_entropy(logits, targets, reduction="sum").double()
        totals[1] += (logits.argmax(dim=1) == targets).sum().double()
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


def _make_kfac(
    config: TrainConfig, parallel_model: nn.Module, optimizer: torch.optim.Optimizer
) -> KFAC:
    """K-FAC on the wrapped model, its KL-clip following the optimiser's scheduled rate.

    What K-FAC refuses only once it sees the job (a ``--kfac-grad-worker-fraction`` that does
    not split this world size evenly, a model with no layer to precondition) becomes a
    :class:`UsageError` naming the flag, like every other bad setting.
    """
    try:
        return KFAC(
            parallel_model,
            factor_update_steps=config.kfac_factor_update_steps,
            inv_update_steps=config.kfac_inv_update_steps,
            damping=config.kfac_damping,
            factor_decay=config.kfac_factor_decay,
            kl_clip=config.kfac_kl_clip or None,
            lr=_CurrentLr(optimizer),
            compute_method=config.kfac_compute_method,
            grad_worker_fraction=config.kfac_grad_worker_fraction,
            g_normalization=config.kfac_g_normalization,
        )
    except ValueError as error:
        flag = (
            "--kfac-grad-worker-fraction"
            if "grad_worker_fraction" in str(error)
            else "--kfac-g-normalization"
            if "g_normalization" in str(error)
            else "--optimizer kfac"
        )
        raise UsageError(f"{flag}: {error}") from None


class _CurrentLr:
    """The optimiser's current learning rate, as K-FAC's ``lr`` callable (for its KL-clip).

    K-FAC's KL-clip bounds the step ``lr * preconditioned gradient``, so it must see the rate the
    warm-up + cosine schedule has set now, not the peak. A class rather than a closure so it
    pickles, like :class:`_Schedule`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def __call__(self, step: int) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


class _Schedule:
    """Linear warm-up then cosine decay to zero: the usual recipe for SGD with momentum.

    A class rather than a closure so the config and schedule pickle across processes.
    """

    def __init__(self, total_steps: int, warmup_steps: int) -> None:
        self.total_steps = max(total_steps, 1)
        self.warmup_steps = max(min(warmup_steps, self.total_steps - 1), 0)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        progress = (step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def _config_record(config: TrainConfig, context: DistContext) -> dict[str, object]:
    record: dict[str, object] = asdict(config)
    record.update(
        world_size=context.world_size,
        backend=context.backend,
        device=str(context.device),
        link=os.environ.get("INTERLACE_LINK", "loopback"),
        torch=torch.__version__,
    )
    return record


def _label(spec: str) -> str:
    """A folder-name-safe short form of a model or data spec."""
    tail = spec.rstrip("/").replace(":", ".").split("/")[-1]
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in tail) or "run"
