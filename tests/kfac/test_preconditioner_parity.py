"""``KFACPreconditioner`` against kfac-pytorch itself on a ``transformers`` BERT built from a
config: the same parameters after several steps, on one rank and on two under torch DDP.

Skipped where kfac-pytorch or ``transformers`` is not installed.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from interlace.kfac import KFACPreconditioner, KFACWarning
from interlace.testing import run_ranks

#: The arguments both preconditioners take, kfac-pytorch's names and meanings.
ARGUMENTS: dict[str, Any] = {
    "factor_update_steps": 1,
    "inv_update_steps": 1,
    "damping": 0.003,
    "factor_decay": 0.95,
    "kl_clip": 0.001,
    "lr": 0.1,
}
STEPS = 5
BATCH, LENGTH = 8, 12


def _bert() -> nn.Module:
    """A 2-layer, 64-wide BERT classifier (3 embeddings, 14 Linear layers), seeded."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=97,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s global batch."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 97, (BATCH * world, LENGTH), generator=generator)
    labels = torch.randint(0, 3, (BATCH * world,), generator=generator)
    share = slice(rank * BATCH, (rank + 1) * BATCH)
    return tokens[share], labels[share]


def _train(model: nn.Module, precond: Any, steps: int, rank: int, world: int) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=ARGUMENTS["lr"], momentum=0.9)
    for step in range(steps):
        tokens, labels = _batch(step, rank, world)
        optimizer.zero_grad()
        model(input_ids=tokens, labels=labels).loss.backward()
        precond.step()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _relative(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    """``|ours - theirs| / |theirs|`` over all parameters together."""
    difference = torch.cat([(a - b).reshape(-1) for a, b in zip(ours, theirs, strict=True)])
    reference = torch.cat([b.reshape(-1) for b in theirs])
    return float(difference.norm() / reference.norm())


def parity(steps: int, layer_rule: str | None = None) -> dict[str, Any]:
    """Train the BERT ``steps`` steps with kfac-pytorch and with ``KFACPreconditioner`` (under
    DDP when a process group is up); their relative difference and registered layers.

    Args:
        steps: Optimizer steps.
        layer_rule: ``KFACPreconditioner``'s ``layer_rule`` (None: its default).
    """
    from kfac.preconditioner import KFACPreconditioner as KfacPytorch  # noqa: PLC0415

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    reference, ours = _bert(), _bert()
    if world > 1:
        reference = nn.parallel.DistributedDataParallel(reference)
        ours = nn.parallel.DistributedDataParallel(ours)
    theirs = KfacPytorch(reference, **ARGUMENTS)
    keywords = dict(ARGUMENTS) if layer_rule is None else {**ARGUMENTS, "layer_rule": layer_rule}
    with warnings.catch_warnings():  # rank 0 lists the modules left to the optimizer
        warnings.simplefilter("ignore", KFACWarning)
        precond = KFACPreconditioner(ours, **keywords)
    expected = _train(reference, theirs, steps, rank, world)
    got = _train(ours, precond, steps, rank, world)
    return {
        "relative": _relative(got, expected),
        "theirs": sorted(name.removeprefix("module.") for name, _ in theirs._layers.values()),
        "ours": sorted(precond.layers),
    }


def _skip_without_peers() -> None:
    pytest.importorskip("kfac.preconditioner", reason="kfac-pytorch is not installed")
    pytest.importorskip("transformers")


@pytest.mark.parametrize("steps", [1, STEPS])
def test_kfac_pytorchs_numbers_on_bert_on_one_rank(steps: int) -> None:
    _skip_without_peers()
    result = parity(steps)
    print(f"kfac-pytorch parity, 1 rank, {steps} step(s): relative {result['relative']:.2g}")
    assert result["ours"] == result["theirs"] and len(result["ours"]) == 14
    assert result["relative"] <= 1e-5, result["relative"]


@pytest.mark.timeout(120)
def test_kfac_pytorchs_numbers_on_bert_on_two_ranks_under_ddp() -> None:
    _skip_without_peers()
    for result in run_ranks(parity, 2, STEPS, timeout=110):
        print(f"kfac-pytorch parity, 2 ranks, {STEPS} steps: relative {result['relative']:.2g}")
        assert result["ours"] == result["theirs"] and len(result["ours"]) == 14
        assert result["relative"] <= 1e-5, result["relative"]
