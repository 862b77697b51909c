"""The job's optimizer and learning-rate schedule: SGD, AdamW, warm-up and cosine decay."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from interlace.errors import UsageError
from interlace.train.config import TrainConfig
from interlace.train.shared import WarmupCosine

__all__ = ["optimizer_with_schedule", "steps_in_epoch", "warmup_steps_of"]


def steps_in_epoch(config: TrainConfig, loader_steps: int, too_small: str) -> int:
    """Steps per epoch: the loader's, cut to ``--max-steps-per-epoch``.

    Args:
        config: the run's config.
        loader_steps: batches the training loader yields per epoch.
        too_small: the error message when not even one batch fits.

    Raises:
        UsageError: ``too_small``, when the epoch has no step.
    """
    steps = loader_steps
    if config.max_steps_per_epoch is not None:
        steps = min(steps, config.max_steps_per_epoch)
    if steps == 0:
        raise UsageError(too_small)
    return steps


def warmup_steps_of(config: TrainConfig, steps_per_epoch: int) -> int:
    """Steps of linear warm-up: ``--warmup-steps``, else ``--warmup-epochs`` in steps.

    Args:
        config: the run's config.
        steps_per_epoch: optimizer steps per epoch.
    """
    if config.warmup_steps is not None:
        return config.warmup_steps
    return round(config.warmup_epochs * steps_per_epoch)


def optimizer_with_schedule(
    parameters: Iterable[torch.nn.Parameter], config: TrainConfig, steps_per_epoch: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The job's optimizer and its warm-up + cosine schedule, stepped once per update.

    SGD with momentum (also under K-FAC, which preconditions its gradients), or
    :class:`torch.optim.AdamW` with torch's default betas and eps for ``optimizer="adamw"``;
    ``weight_decay`` is SGD's L2 term or AdamW's decoupled decay, on every parameter.

    Args:
        parameters: the parameters to train.
        config: optimizer, lr, momentum, weight decay, epochs and warm-up come from here.
        steps_per_epoch: optimizer steps per epoch.
    """
    optimizer: torch.optim.Optimizer
    if config.optimizer == "adamw":
        optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay)
    else:
        optimizer = torch.optim.SGD(
            parameters,
            lr=config.lr,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
        )
    total_steps = config.epochs * steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(total_steps, warmup_steps_of(config, steps_per_epoch))
    )
    return optimizer, schedule
