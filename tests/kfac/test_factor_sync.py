"""``factor_sync``: factors held on each rank between decompositions give the running averages,
and so the preconditioned gradients, of averaging every factor update (and of one process)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from interlace import KFAC
from interlace.kfac import FactorSync
from interlace.kfac.factor_modes import Pipelined
from interlace.testing import average_gradients, run_ranks, run_scenarios

DTYPE = torch.float64
GLOBAL_BATCH = 8
STEPS = 8


def _build() -> nn.Module:
    torch.manual_seed(99)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(700 + step)
    inputs = torch.randn(GLOBAL_BATCH, 5, generator=generator, dtype=DTYPE)
    return inputs, torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)


def _train(rank: int, world: int, options: dict[str, Any], sync_at: int = -1) -> dict[str, Any]:
    """``STEPS`` K-FAC steps on this rank's share of each global batch (gradients averaged by
    hand), recording the preconditioned gradients and, after each step, the running averages;
    ``sync_at``: the step after which every rank calls ``sync_factors()``."""
    model = _build().to(DTYPE)
    precond = KFAC(
        model,
        damping=0.01,
        factor_decay=0.7,
        inv_dtype=DTYPE,
        damping_adaptation="fixed",
        **options,
    )
    share = GLOBAL_BATCH // world
    grads, factors, comm_spans = [], [], []
    for step in range(STEPS):
        inputs, targets = _batch(step)
        local = slice(rank * share, (rank + 1) * share)
        model.zero_grad(set_to_none=True)
        functional.cross_entropy(model(inputs[local]), targets[local]).backward()
        average_gradients(model)
        precond.step()
        if step == sync_at:
            precond.sync_factors()
        comm_spans.append(
            [event.name for event in precond.take_events() if event.category == "comm"]
        )
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})  # type: ignore[union-attr]
        factors.append(
            {
                name: (layer.a_factor.clone(), layer.g_factor.clone())  # type: ignore[union-attr]
                for name, layer in precond.kfac_layers.items()
            }
        )
        with torch.no_grad():
            for param in model.parameters():
                param.sub_(0.1 * param.grad)
    precond.remove_hooks()
    return {
        "grads": grads,
        "factors": factors,
        "comm_spans": comm_spans,
        "plan": precond.factor_plan,
        "settled": precond.factor_plan_settled,
    }


#: Decompositions every 3 steps; factors every step, or every 2 (so a decomposition step that
#: updates no factors finds running averages to average).
SCENARIOS: dict[str, dict[str, Any]] = {
    "bulk": {"factor_comm": "bulk", "inv_update_steps": 3},
    "pipelined": {
        "factor_comm": Pipelined(fusion="none", profile_steps=1, tune_steps=0),
        "inv_update_steps": 3,
    },
    "factors every 2": {"factor_comm": "bulk", "inv_update_steps": 3, "factor_update_steps": 2},
    "every update": {"factor_comm": "bulk", "inv_update_steps": 3, "factor_sync": "every-update"},
    # Decompositions every step: nothing is held, and pipelining runs as before.
    "every step": {
        "factor_comm": Pipelined(fusion="none", profile_steps=1, tune_steps=0),
        "inv_update_steps": 1,
    },
}


class Branchy(nn.Module):
    """Two Linear layers, and a third (``extra``) only where ``use_extra`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(5, 6)
        self.extra = nn.Linear(6, 6)
        self.last = nn.Linear(6, 3)
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.first(x))
        if self.use_extra:
            x = torch.tanh(self.extra(x))
        out: torch.Tensor = self.last(x)
        return out


def _train_branchy(rank: int) -> dict[str, Any]:
    """``extra`` runs on rank 0 alone, in steps 0 to 2: registered (it ran somewhere) but not
    folded at step 0 (not everywhere), then folded by rank 0 alone in the held steps 1 and 2;
    the decomposition at step 3 must agree on the layers, not hang."""
    torch.manual_seed(5)
    model = Branchy().to(DTYPE)
    precond = KFAC(model, inv_update_steps=3, inv_dtype=DTYPE, damping_adaptation="fixed")
    factors = []
    for step in range(5):
        model.use_extra = rank == 0 and step < 3
        inputs, targets = _batch(step)
        model.zero_grad(set_to_none=True)
        functional.cross_entropy(model(inputs), targets).backward()
        average_gradients(model)
        precond.step()
        factors.append(
            {name: layer.a_factor is not None for name, layer in precond.kfac_layers.items()}
        )
    a_last = precond.kfac_layers["last"].a_factor
    assert a_last is not None
    precond.remove_hooks()
    return {"has_factors": factors, "last_a": a_last.clone()}


def _rank_scenarios() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    scenarios = {
        name: (lambda options=options: _train(rank, world, options))
        for name, options in SCENARIOS.items()
    }
    scenarios["synced by hand"] = lambda: _train(rank, world, {"inv_update_steps": 4}, sync_at=5)
    scenarios["branchy"] = lambda: _train_branchy(rank)
    return run_scenarios(scenarios)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """Every scenario on 2 ranks, from one launch."""
    return run_ranks(_rank_scenarios, 2, timeout=180)  # type: ignore[no-any-return]


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12, msg=lambda m: f"{what}: {m}")


def _decomposition_steps(options: dict[str, Any]) -> list[int]:
    return [step for step in range(STEPS) if step % options["inv_update_steps"] == 0]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_held_factors_precondition_like_one_process(
    two_ranks: list[dict[str, Any]], name: str
) -> None:
    options = SCENARIOS[name]
    single = _train(0, 1, options)
    for rank, records in enumerate(two_ranks):
        record = records[name]
        for step, (ours, theirs) in enumerate(zip(record["grads"], single["grads"], strict=True)):
            for param, value in theirs.items():
                _close(ours[param], value, f"rank {rank} step {step} {param}")
        # At a decomposition step every rank holds the global running averages.
        for step in _decomposition_steps(options):
            for layer, (a, g) in single["factors"][step].items():
                mine_a, mine_g = record["factors"][step][layer]
                _close(mine_a, a, f"rank {rank} step {step} {layer} A")
                _close(mine_g, g, f"rank {rank} step {step} {layer} G")


def test_between_decompositions_each_rank_holds_its_own(
    two_ranks: list[dict[str, Any]],
) -> None:
    """Held steps send nothing (the ranks' running averages differ); a decomposition step
    averages them in one bulk all-reduce; averaging every update sends at every step."""
    held = [records["bulk"] for records in two_ranks]
    a_on = [record["factors"][1]["0"][0] for record in held]
    assert not torch.allclose(a_on[0], a_on[1])
    spans = held[0]["comm_spans"]
    assert "running-average all-reduce" in spans[3]
    # Not even the agreement on which layers have factors: a held step has no collective.
    assert all(spans[step] == [] for step in (1, 2, 4, 5))
    every = two_ranks[0]["every update"]["comm_spans"]
    assert all("factor all-reduce" in every[step] for step in range(STEPS))


def test_pipelining_starts_only_when_every_factor_step_decomposes(
    two_ranks: list[dict[str, Any]],
) -> None:
    records = two_ranks[0]
    assert records["pipelined"]["plan"] is None
    assert records["pipelined"]["settled"]
    assert records["every step"]["plan"] == [[i] for i in range(6)]


def test_sync_factors_averages_the_held_running_averages(
    two_ranks: list[dict[str, Any]],
) -> None:
    single = _train(0, 1, {"inv_update_steps": 4})
    for rank, records in enumerate(two_ranks):
        record = records["synced by hand"]
        for layer, (a, g) in single["factors"][5].items():
            _close(record["factors"][5][layer][0], a, f"rank {rank} {layer} A")
            _close(record["factors"][5][layer][1], g, f"rank {rank} {layer} G")
        assert any("running-average" in span for span in record["comm_spans"][5])
        for step, (ours, theirs) in enumerate(zip(record["grads"], single["grads"], strict=True)):
            for param, value in theirs.items():
                _close(ours[param], value, f"rank {rank} step {step} {param}")


def test_a_bad_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="factor_sync"):
        KFAC(nn.Linear(3, 2), factor_sync="sometimes")
    assert KFAC(nn.Linear(3, 2)).factor_sync is FactorSync.AT_DECOMPOSITION


def test_a_layer_first_run_on_some_ranks_in_a_held_step_is_dropped_everywhere(
    two_ranks: list[dict[str, Any]],
) -> None:
    """Rank 0 folds ``extra`` in held steps; at the decomposition the ranks agree to drop it."""
    first, second = (records["branchy"] for records in two_ranks)
    assert first["has_factors"][1]["extra"] and not second["has_factors"][1]["extra"]
    for records in (first, second):
        assert not records["has_factors"][3]["extra"]
        assert records["has_factors"][3]["last"]
    _close(first["last_a"], second["last_a"], "last A on both ranks")


@pytest.mark.parametrize(
    ("sync", "factor_update_steps", "inv_update_steps", "holds"),
    [
        ("at-decomposition", 1, 10, True),
        ("at-decomposition", 2, 3, True),
        ("at-decomposition", 1, 1, False),
        ("at-decomposition", 10, 5, False),
        ("every-update", 1, 10, False),
    ],
)
def test_factors_are_held_where_some_factor_steps_do_not_decompose(
    sync: str, factor_update_steps: int, inv_update_steps: int, holds: bool
) -> None:
    assert FactorSync(sync).holds(factor_update_steps, inv_update_steps) is holds
