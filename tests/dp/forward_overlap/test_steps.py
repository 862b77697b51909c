"""Deferred optimizer steps: a step applied part by part equals the step applied at once."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from interlace.dp.forward_overlap.steps import DeferredStep, takes_closure

OptimizerMaker = Callable[[list[dict[str, object]]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptimizerMaker] = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1),
    "sgd-momentum-nesterov-decay": lambda groups: torch.optim.SGD(
        groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3
    ),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
    "adamw-tensor-lr": lambda groups: torch.optim.AdamW(groups, lr=torch.tensor(1e-2)),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _groups(model: nn.Module) -> list[dict[str, object]]:
    first, second = model[0], model[2]
    # Two groups with their own learning rate, so a group's hyperparameters must follow it.
    return [
        {"params": list(first.parameters())},
        {"params": list(second.parameters()), "lr": 0.05},
    ]


def _gradients(model: nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)


# The step is applied through DeferredStep, so torch's scheduler never sees optimizer.step().
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_step_applied_in_parts_in_any_order_is_the_step(name: str) -> None:
    reference, deferred = _model(), _model()
    ref_opt = OPTIMIZERS[name](_groups(reference))
    opt = OPTIMIZERS[name](_groups(deferred))
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    params = list(deferred.parameters())
    for step in range(6):
        _gradients(reference, step)
        _gradients(deferred, step)
        ref_opt.step()
        ref_sched.step()
        pending = DeferredStep(opt, params)
        # The scheduler moves on before the update is applied, as in a training loop whose
        # next forward applies it: the update still uses the step's own learning rate.
        sched.step()
        parts = [params[3:], params[:1], params[1:3]] if step % 2 else [params[::-1]]
        for part in parts:
            pending.apply(part)
        for mine, theirs in zip(params, reference.parameters(), strict=True):
            assert torch.equal(mine, theirs), (name, step)
    assert opt.state_dict()["param_groups"] == ref_opt.state_dict()["param_groups"]
    for mine, theirs in zip(opt.state.values(), ref_opt.state.values(), strict=True):
        for key, value in theirs.items():
            assert torch.equal(torch.as_tensor(mine[key]), torch.as_tensor(value)), key


def test_a_part_is_applied_once_and_parameters_without_gradients_are_skipped() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    params = list(model.parameters())
    _gradients(model, 0)
    params[0].grad = None
    before = [param.detach().clone() for param in params]
    pending = DeferredStep(opt, params[:2])
    pending.apply(params)  # only the two it defers; the first has no gradient
    pending.apply(params)
    assert torch.equal(params[0], before[0])
    assert torch.equal(params[1], before[1] - params[1].grad)
    assert all(torch.equal(p, b) for p, b in zip(params[2:], before[2:], strict=True))
    # The groups are left as they were.
    assert opt.param_groups[0]["params"] == params and opt.param_groups[0]["lr"] == 1.0


def test_hooks_of_the_users_step_do_not_run_again_for_each_part() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    _gradients(model, 0)
    pending = DeferredStep(opt, list(model.parameters()))
    pending.apply(list(model.parameters())[:2])
    pending.apply(list(model.parameters())[2:])
    assert calls == []


def test_a_closure_is_recognised_however_it_is_passed() -> None:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    assert takes_closure((opt, lambda: 0.0), {})
    assert takes_closure((opt,), {"closure": lambda: 0.0})
    assert not takes_closure((opt,), {}) and not takes_closure((opt, None), {})


def test_the_snapshot_is_a_copy_of_tensor_hyperparameters() -> None:
    model = _model()
    lr = torch.tensor(0.1)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    pending = DeferredStep(opt, list(model.parameters()))
    lr.fill_(0.0)  # a scheduler updating a tensor learning rate in place
    assert float(pending.hyperparameters[0]["lr"]) == pytest.approx(0.1)
    assert copy.copy(pending.hyperparameters[0]["betas"]) == (0.9, 0.999)
