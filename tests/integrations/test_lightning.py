"""InterlaceStrategy against Lightning's own DDP strategy: same losses and weights, on 2 ranks."""

from __future__ import annotations

from typing import Any

import pytest

pl = pytest.importorskip("lightning.pytorch")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

import interlace  # noqa: E402
from interlace.errors import UsageError  # noqa: E402
from interlace.integrations.lightning import InterlaceStrategy  # noqa: E402
from interlace.testing import run_ranks  # noqa: E402

STEPS = 6
BATCH = 8
LR = 0.1


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(11)
    inputs = torch.randn(64, 8, generator=generator)
    targets = inputs[:, :1] * 0.5 - inputs[:, 1:2] + 0.1 * torch.randn(64, 1, generator=generator)
    return TensorDataset(inputs, targets)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


class Regression(pl.LightningModule):  # type: ignore[misc]
    """A tiny regression whose losses (this rank's) are kept for the comparison."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], _index: int) -> torch.Tensor:
        inputs, targets = batch
        loss = nn.functional.mse_loss(self.net(inputs), targets)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_dataset(), batch_size=BATCH)


def _fit(strategy: Any) -> dict[str, Any]:
    module = Regression()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return {"losses": module.losses, "weights": [p.detach().clone() for p in module.parameters()]}


def _manual_kfac_reference() -> dict[str, Any]:
    """DDP and interlace.KFAC in a plain loop over Lightning's shard of the data."""
    net = _net()
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    precond = interlace.KFAC(model, lr=LR)
    # As Lightning shards training data: shuffled with seed 0, reshuffled every epoch.
    sampler = DistributedSampler(_dataset(), shuffle=True, seed=0)
    loader = DataLoader(_dataset(), batch_size=BATCH, sampler=sampler)
    losses: list[float] = []
    for epoch in range(STEPS):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            if len(losses) == STEPS:
                break
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            precond.step()
            optimizer.step()
            losses.append(loss.item())
    return {"losses": losses, "weights": [p.detach().clone() for p in net.parameters()]}


def _compare(_: None) -> dict[str, Any]:
    interlace_options = {"bucketing": "single", "tune_steps": 0}
    return {
        "ddp": _fit("ddp"),
        "interlace": _fit(InterlaceStrategy(**interlace_options)),
        "kfac": _fit(InterlaceStrategy(kfac={}, **interlace_options)),
        "kfac_reference": _manual_kfac_reference(),
        "world": dist.get_world_size(),
    }


def _assert_same(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    assert len(ours["losses"]) == STEPS
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=1e-9)
    for mine, theirs in zip(ours["weights"], reference["weights"], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-8)


@pytest.mark.timeout(460)  # above the harness's own limit, which reports better
def test_interlace_strategy_trains_like_lightning_ddp() -> None:
    results = run_ranks(_compare, 2, None, timeout=400)
    for result in results:
        assert result["world"] == 2
        _assert_same(result["interlace"], result["ddp"])
        _assert_same(result["kfac"], result["kfac_reference"])
    # The ranks saw different halves of the data, and K-FAC changed the steps.
    assert results[0]["ddp"]["losses"][0] != results[1]["ddp"]["losses"][0]
    assert results[0]["kfac"]["losses"][-1] != pytest.approx(results[0]["ddp"]["losses"][-1])


def test_the_trainer_knows_the_strategy_by_name() -> None:
    trainer = pl.Trainer(strategy="interlace", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, InterlaceStrategy)


def test_kfac_options_must_be_a_dict() -> None:
    with pytest.raises(UsageError, match="kfac must be a dict"):
        InterlaceStrategy(kfac="damping=0.01")  # type: ignore[arg-type]
