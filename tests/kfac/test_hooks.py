"""K-FAC's module hooks: a deep copy of a preconditioned model is a plain model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional

from interlace import KFAC
from interlace.testing import run_ranks


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


def _train_step(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(16, 5, generator=generator)
    targets = torch.randint(0, 3, (16,), generator=generator)
    functional.cross_entropy(model(inputs), targets).backward()


def _deep_copy_run(factor_comm: str) -> bool:
    """On every rank: copy a preconditioned model, train the copy, check both; True if done."""
    model = _model()
    precond = KFAC(model, factor_comm=factor_comm, inv_update_steps=1)
    _train_step(model, 0)
    precond.step()
    layers = precond.layers
    factors = {name: precond.state_dict()["layers"][name]["A"].clone() for name in layers}

    twin = copy.deepcopy(model)
    for seed in (1, 2):
        _train_step(twin, seed)  # the copy's forwards and backwards feed no factor
    after = precond.state_dict()["layers"]
    for name in layers:
        torch.testing.assert_close(after[name]["A"], factors[name], rtol=0, atol=0)

    # The original still collects and preconditions: its factors move on its own step.
    model.zero_grad()
    _train_step(model, 3)
    precond.step()
    moved = precond.state_dict()["layers"]
    assert any(not torch.equal(moved[name]["A"], factors[name]) for name in layers)
    # The copy's gradients are its own plain ones: preconditioning leaves them as computed.
    plain = copy.deepcopy(twin)
    plain.zero_grad()
    _train_step(plain, 4)
    reference = _model()
    reference.load_state_dict(plain.state_dict())
    _train_step(reference, 4)
    for ours, theirs in zip(plain.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)
    return True


FACTOR_COMMS = ("bulk", "pipelined")


def _deep_copy_runs(_: None) -> dict[str, bool]:
    """Both factor communications in one job (starting ranks costs more than a run); a run
    that fails is named in the error."""
    done = {}
    for factor_comm in FACTOR_COMMS:
        try:
            done[factor_comm] = _deep_copy_run(factor_comm)
        except Exception as error:
            raise RuntimeError(f"the {factor_comm} run failed") from error
    return done


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, bool]]:
    # Two ranks: the preconditioner then holds process groups, which cannot be copied.
    return run_ranks(_deep_copy_runs, 2, None, timeout=180)


@pytest.mark.parametrize("factor_comm", FACTOR_COMMS)
def test_a_deep_copy_of_a_preconditioned_model_is_not_preconditioned(
    factor_comm: str, two_ranks: list[dict[str, bool]]
) -> None:
    assert [done[factor_comm] for done in two_ranks] == [True, True]
