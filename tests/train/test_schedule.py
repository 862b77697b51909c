"""The job's optimizer and schedule: SGD or AdamW, warm-up in epochs or steps, then cosine."""

from __future__ import annotations

import itertools

import pytest
import torch

from interlace.errors import UsageError
from interlace.train import TrainConfig, optimizer_with_schedule, steps_in_epoch, warmup_steps_of


def _weights() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(3))]


def test_adamw_gets_the_decoupled_weight_decay_and_sgd_its_momentum() -> None:
    adamw, _ = optimizer_with_schedule(
        _weights(), TrainConfig(optimizer="adamw", lr=1e-3, weight_decay=0.1), 10
    )
    assert isinstance(adamw, torch.optim.AdamW)
    assert adamw.param_groups[0]["weight_decay"] == 0.1
    for name in ("sgd", "kfac"):
        sgd, _ = optimizer_with_schedule(_weights(), TrainConfig(optimizer=name), 10)
        assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9


def test_warmup_steps_replace_warmup_epochs() -> None:
    assert warmup_steps_of(TrainConfig(warmup_epochs=1.5), 10) == 15
    assert warmup_steps_of(TrainConfig(warmup_epochs=1.5, warmup_steps=4), 10) == 4
    config = TrainConfig(optimizer="adamw", lr=1.0, epochs=2, warmup_steps=4)
    optimizer, schedule = optimizer_with_schedule(_weights(), config, 10)
    rates = []
    for _ in range(20):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    # Linear warm-up over 4 steps, the peak at step 4, cosine down over the other 16.
    assert rates[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert all(later < earlier for earlier, later in itertools.pairwise(rates[4:]))


def test_an_epoch_without_a_step_is_refused() -> None:
    with pytest.raises(UsageError, match="too small"):
        steps_in_epoch(TrainConfig(), 0, "too small")
