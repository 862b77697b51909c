"""DDP with torch's bf16 hook on gloo (wrap_model), and DataParallel's bf16 compression."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from interlace.comm.cost import CostModel
from interlace.dp import DataParallel
from interlace.errors import UsageError
from interlace.testing import run_ranks
from interlace.wrapping import bf16_hook_any_backend, wrap_model

STEPS = 5
#: A cost model that makes several buckets of the small model (planning without measuring it).
COST = CostModel(a=2e-4, b=1e-9)


def _net() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(
        nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 5)
    )


def _reference_bf16_average(grad: torch.Tensor, world: int) -> torch.Tensor:
    """What torch's bf16 hook leaves in a gradient, written out here: this rank's gradient cast
    to bfloat16 and divided by the world size, summed over ranks in bfloat16, cast back."""
    mine = grad.to(torch.bfloat16).div_(world)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    total = gathered[0].clone()
    for other in gathered[1:]:
        total += other
    return total.to(torch.float32)


def _train() -> dict[str, Any]:
    """DDP with the bf16 hook (as ``wrap_model`` registers it on gloo), DataParallel with
    ``compression="bf16"`` with and without the forward overlap, and uncompressed DDP, each
    trained from the same weights on the same batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = _net()
    models = {name: copy.deepcopy(base) for name in ("ddp", "ours", "overlap", "plain")}
    wrapped = {
        "ddp": wrap_model(models["ddp"], "ddp", compression="bf16"),
        "plain": wrap_model(models["plain"], "ddp"),
        **{
            name: DataParallel(
                models[name],
                compression="bf16",
                overlap=overlap,
                profile_steps=1,
                cost_model=COST,
                tune_steps=0,
            )
            for name, overlap in (("ours", "backward"), ("overlap", "forward"))
        },
    }
    optimizers = {
        name: torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        for name, model in wrapped.items()
    }
    generator = torch.Generator().manual_seed(70 + rank)
    grads_match_reference = True
    for _ in range(STEPS):
        inputs = torch.randn(24, 32, generator=generator)
        targets = torch.randint(0, 5, (24,), generator=generator)
        local = copy.deepcopy(models["ddp"])
        local.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(local(inputs), targets).backward()
        for name, model in wrapped.items():
            optimizers[name].zero_grad()
            nn.functional.cross_entropy(model(inputs), targets).backward()
        for mine, averaged in zip(local.parameters(), models["ddp"].parameters(), strict=True):
            assert mine.grad is not None and averaged.grad is not None
            expected = _reference_bf16_average(mine.grad, world)
            grads_match_reference &= torch.equal(expected, averaged.grad)
        for optimizer in optimizers.values():
            optimizer.step()
    wrapped["overlap"].synchronize()
    weights = {
        name: [p.detach().clone() for p in model.parameters()] for name, model in models.items()
    }
    return {"weights": weights, "grads_match_reference": grads_match_reference}


def _largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(300)
def test_bf16_compression_trains_as_ddp_with_torchs_bf16_hook() -> None:
    for result in run_ranks(_train, 2, timeout=240):
        weights = result["weights"]
        # The hook did what torch's bf16 hook does, on gloo.
        assert result["grads_match_reference"]
        # DataParallel divides in float32 before the cast, torch's hook after it in bfloat16:
        # by 2 ranks both are exact, so the numbers are DDP's.
        for name in ("ours", "overlap"):
            assert _largest_difference(weights[name], weights["ddp"]) == 0.0, name
        # And the compression did round: uncompressed DDP ends elsewhere.
        assert _largest_difference(weights["plain"], weights["ddp"]) > 1e-4


def test_the_gloo_hook_is_torchs_under_another_name() -> None:
    assert bf16_hook_any_backend.__name__ != default_hooks.bf16_compress_hook.__name__
    assert "bf16_compress_hook" in (bf16_hook_any_backend.__doc__ or "")


def test_ddp_takes_no_channels() -> None:
    with pytest.raises(UsageError, match="one channel"):
        wrap_model(nn.Linear(2, 2), "ddp", channels=2, compression="bf16")
