"""Data-parallel training: the model replicated on every rank, gradients averaged by a strategy.

With ``optimizer="kfac"`` :class:`interlace.KFAC` preconditions the averaged gradients in front
of the same SGD and schedule, so a K-FAC run and an SGD run of one config differ only there.
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, Dataset, Subset
from tqdm import tqdm

from interlace.distenv import DistContext
from interlace.errors import UsageError
from interlace.kfac import KFAC
from interlace.strategies import wrap_model
from interlace.train.config import (
    TrainConfig,
    TrainResult,
    finish_run,
    open_run_log,
    sgd_with_schedule,
    steps_in_epoch,
)
from interlace.zoo import build_model, load_data, make_loader


def train_data_parallel(
    config: TrainConfig, context: DistContext, run_dir: str | None
) -> TrainResult:
    """Train ``config.model`` replicated over the job's ranks; same result on every rank.

    Args:
        config: the run's config (already validated).
        context: this rank's place in the job (process group initialised).
        run_dir: where rank 0 writes its records (made fresh when None).
    """
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
    precond = make_kfac(config, parallel_model, optimizer) if config.optimizer == "kfac" else None

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

    return finish_run(
        log,
        f"{config.model} on {bundle.name}, {context.world_size} rank(s)",
        accuracy=result_accuracy,
        train_loss=result_loss,
        samples_per_s=throughput,
        epochs=config.epochs,
    )


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
        ``(mean loss, accuracy)`` over every rank's samples, the same on every rank.
    """
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


def make_kfac(
    config: TrainConfig, parallel_model: nn.Module, optimizer: torch.optim.Optimizer
) -> KFAC:
    """K-FAC on the wrapped model, its KL-clip following the optimiser's scheduled rate.

    Args:
        config: the ``kfac_*`` options come from here.
        parallel_model: the model as wrapped for data parallelism.
        optimizer: the SGD that applies the preconditioned gradients; K-FAC's KL-clip reads its
            current learning rate at every step.

    Raises:
        UsageError: naming the flag, for what K-FAC refuses only once it sees the job (a
            ``--kfac-grad-worker-fraction`` that does not split this world size evenly, a model
            with no layer to precondition).
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
    pickles, like :class:`~interlace.train.config.WarmupCosine`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def __call__(self, step: int) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
