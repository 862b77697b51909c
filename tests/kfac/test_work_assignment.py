"""``KFAC(placement=...)``: round-robin, greedy and LBP precondition alike, on one rank and on four.

Where a decomposition is computed must not change what it is, so every placement has to give
the same preconditioned gradients as a single process with the whole batch. LBP gets injected
cost models (``n^3`` microseconds to decompose, 0.5 ms for any broadcast), which make its
placement known in advance: the smallest factors stay local, the rest spread over several ranks,
so both of its paths (local decomposition, one broadcast per factor) are exercised. One
four-rank launch also runs LBP with cost models measured on the live group.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from interlace import KFAC
from interlace.comm.cost import CostModel
from interlace.kfac.costs import DecompositionCostModel
from interlace.kfac.placements import LBP
from interlace.testing import average_gradients, run_ranks

DTYPE = torch.float64
GLOBAL_BATCH = 8
WORLD = 4
STEPS = 2
MODELS = ("mlp", "conv")
PLACEMENTS = ("round-robin", "greedy", "lbp")
#: Plain SGD between K-FAC steps, so that the second step sees other weights too.
SGD_LR = 0.1
#: Injected LBP costs: decomposing ``n`` costs ``n^3`` microseconds, any broadcast 0.5 ms, so
#: factors of dimension 7 and below stay local and the larger ones are spread.
DECOMPOSITION_COST = DecompositionCostModel(c3=1e-6, c2=0.0, c0=0.0)
BROADCAST_COST = CostModel(a=5e-4, b=0.0)


def _build(kind: str) -> nn.Module:
    torch.manual_seed(4321)
    model: nn.Module
    if kind == "mlp":
        # Four layers of different sizes: factors (A/G) 7/16, 17/12, 12/10, 11/3.
        model = nn.Sequential(
            nn.Linear(6, 16),
            nn.ReLU(),
            nn.Linear(16, 12),
            nn.ReLU(),
            nn.Linear(12, 10, bias=False),
            nn.ReLU(),
            nn.Linear(10, 3),
        )
    elif kind == "conv":
        # Factors 13/3 (the convolution) and 37/4 (the head).
        model = nn.Sequential(
            nn.Conv2d(2, 3, kernel_size=(3, 2), stride=2, padding=1, dilation=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(3 * 3 * 4, 4),
        )
    else:  # pragma: no cover - a typo in a test
        raise ValueError(kind)
    return model.to(DTYPE)


def _batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same on every rank)."""
    generator = torch.Generator().manual_seed(200 + step)
    targets = torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)
    if kind == "conv":
        inputs = torch.randn(GLOBAL_BATCH, 2, 7, 8, generator=generator, dtype=DTYPE)
    else:
        inputs = torch.randn(GLOBAL_BATCH, 6, generator=generator, dtype=DTYPE)
    return inputs, targets


def _kfac(
    model: nn.Module,
    placement: str,
    method: str,
    *,
    measured: bool = False,
    inv_update_steps: int | Callable[[int], int] = 1,
) -> KFAC:
    chosen: str | LBP = placement
    if placement == "lbp" and not measured:
        chosen = LBP(decomposition_cost=DECOMPOSITION_COST, broadcast_cost=BROADCAST_COST)
    return KFAC(
        model,
        damping=0.01,
        factor_decay=0.25,
        kl_clip=None,
        inv_update_steps=inv_update_steps,
        compute_method=method,
        inv_dtype=DTYPE,
        placement=chosen,
    )


def _step(model: nn.Module, precond: KFAC, kind: str, step: int) -> dict[str, torch.Tensor]:
    """One K-FAC step on this rank's share of the global batch; the preconditioned grads."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    share = GLOBAL_BATCH // world
    inputs, targets = _batch(kind, step)
    local = slice(rank * share, (rank + 1) * share)
    model.zero_grad(set_to_none=True)
    functional.cross_entropy(model(inputs[local]), targets[local]).backward()
    average_gradients(model)
    precond.step()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]
    with torch.no_grad():
        for param in model.parameters():
            assert param.grad is not None
            param.sub_(SGD_LR * param.grad)
    return grads


def _train(
    kind: str, placement: str, method: str = "eigen", *, measured: bool = False
) -> dict[str, Any]:
    """``STEPS`` steps; every step's gradients, the placement, and ``describe()``."""
    model = _build(kind)
    precond = _kfac(model, placement, method, measured=measured)
    grads = [_step(model, precond, kind, step) for step in range(STEPS)]
    record = {
        "grads": grads,
        "layers": precond.layers,
        "factor_owners": precond.factor_owners,
        "describe": precond.describe(),
    }
    precond.remove_hooks()
    return record


def _resume(kind: str) -> dict[str, Any]:
    """LBP through a state_dict: a restored copy's next step equals the original's."""

    # No decomposition after the first STEPS, so the next step uses the saved (and, on every
    # rank but a factor's owner, received) decompositions.
    def every(step: int) -> int:
        return 1 if step < STEPS else 1000

    model = _build(kind)
    precond = _kfac(model, "lbp", "eigen", inv_update_steps=every)
    for step in range(STEPS):
        _step(model, precond, kind, step)
    state = precond.state_dict()
    restored_model = copy.deepcopy(model)
    restored = _kfac(restored_model, "lbp", "eigen", inv_update_steps=every)
    restored.load_state_dict(state)
    original = _step(model, precond, kind, STEPS)
    resumed = _step(restored_model, restored, kind, STEPS)
    held = all("A_decomp" in entry and "G_decomp" in entry for entry in state["layers"].values())
    return {"original": original, "resumed": resumed, "held": held}


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    atol = 1e-9 * float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=atol, msg=lambda m: f"{what}: {m}")


def _same_grads(ours: dict[str, Any], theirs: dict[str, Any], what: str) -> None:
    for step, (mine, reference) in enumerate(zip(ours["grads"], theirs["grads"], strict=True)):
        assert set(mine) == set(reference)
        for name, value in reference.items():
            _close(mine[name], value, f"{what} step {step} {name}")


# -- one process -----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("kind", MODELS)
def test_every_placement_preconditions_alike_on_one_process(kind: str, method: str) -> None:
    records = {placement: _train(kind, placement, method) for placement in PLACEMENTS}
    for placement in ("round-robin", "lbp"):
        _same_grads(records[placement], records["greedy"], f"{kind} {method} {placement}")
    # One rank: everything on rank 0, and LBP keeps every factor local (nothing to send).
    assert set(records["round-robin"]["layers"].values()) == {0}
    assert set(records["lbp"]["factor_owners"].values()) == {(None, None)}
    assert "lbp placement" in records["lbp"]["describe"].splitlines()[0]
    assert "greedy placement" in records["greedy"]["describe"].splitlines()[0]


def test_lbp_without_cost_models_measures_nothing_on_one_process() -> None:
    precond = KFAC(_build("mlp"), placement="lbp")
    assert precond.decomposition_cost is None and precond.broadcast_cost is None
    assert "locally" in precond.describe().splitlines()[0]


def test_layer_placements_give_both_factors_one_owner() -> None:
    precond = KFAC(_build("mlp"), placement="round-robin")
    assert all(a == g == 0 for a, g in precond.factor_owners.values())


def test_an_unknown_placement_is_rejected() -> None:
    with pytest.raises(
        ValueError, match=r"placement must be one of 'auto', 'greedy', 'round-robin', 'lbp'"
    ):
        KFAC(_build("mlp"), placement="random")


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_lbp_needs_comm_opt(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"placement='lbp' needs grad_worker_fraction=1"):
        KFAC(_build("mlp"), placement="lbp", grad_worker_fraction=fraction)


# -- four ranks ------------------------------------------------------------------------------


def _rank_run() -> dict[str, Any]:
    records: dict[str, Any] = {
        f"{kind} {placement}": _train(kind, placement)
        for kind in MODELS
        for placement in PLACEMENTS
    }
    records["mlp lbp inverse"] = _train("mlp", "lbp", "inverse")
    records["mlp greedy inverse"] = _train("mlp", "greedy", "inverse")
    records["mlp lbp measured"] = _train("mlp", "lbp", measured=True)
    records["resume"] = _resume("mlp")
    return records


@pytest.mark.slow
def test_four_ranks_precondition_alike_in_every_placement() -> None:
    per_rank = run_ranks(_rank_run, WORLD, timeout=240)
    for kind in MODELS:
        single = _train(kind, "greedy")
        for rank, records in enumerate(per_rank):
            for placement in PLACEMENTS:
                record = records[f"{kind} {placement}"]
                reference = per_rank[0][f"{kind} {placement}"]
                # Every rank derived the same placement (or the collectives would have hung).
                assert record["factor_owners"] == reference["factor_owners"]
                _same_grads(record, single, f"{kind} {placement} rank {rank}")
        owners = per_rank[0][f"{kind} lbp"]["factor_owners"]
        flat = [owner for pair in owners.values() for owner in pair]
        # The injected costs keep some factors local and spread the others over several ranks.
        assert None in flat, owners
        assert len({owner for owner in flat if owner is not None}) >= 2, owners
        assert "predicted makespan" in per_rank[0][f"{kind} lbp"]["describe"].splitlines()[0]
    # Layer-level placements of the four-layer MLP: every rank owns one layer.
    assert sorted(per_rank[0]["mlp round-robin"]["layers"].values()) == [0, 1, 2, 3]
    assert sorted(per_rank[0]["mlp greedy"]["layers"].values()) == [0, 1, 2, 3]
    assert list(per_rank[0]["mlp round-robin"]["layers"].values()) == [0, 1, 2, 3]
    single_inverse = _train("mlp", "greedy", "inverse")
    single_mlp = _train("mlp", "greedy")
    for rank, records in enumerate(per_rank):
        _same_grads(records["mlp lbp inverse"], single_inverse, f"inverse lbp rank {rank}")
        _same_grads(records["mlp greedy inverse"], single_inverse, f"inverse greedy rank {rank}")
        _same_grads(records["mlp lbp measured"], single_mlp, f"measured lbp rank {rank}")
        assert (
            records["mlp lbp measured"]["factor_owners"]
            == per_rank[0]["mlp lbp measured"]["factor_owners"]
        )
        resume = records["resume"]
        assert resume["held"], f"rank {rank} lacks a decomposition in its state_dict"
        for name, value in resume["original"].items():
            _close(resume["resumed"][name], value, f"resumed rank {rank} {name}")
