"""Levenberg-Marquardt adaptive damping: the rule against a reference written here, agreement
across ranks, exact resume from a checkpoint, bad settings refused, kfac-pytorch's path intact."""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from interlace.errors import UsageError
from interlace.kfac import (
    KFAC,
    DampingAdaptation,
    KFACPreconditioner,
    LevenbergMarquardt,
)
from interlace.kfac.damping import levenberg_marquardt_update
from interlace.testing import average_gradients, run_ranks

INTERVAL = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int, rank: int = 0, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    inputs = torch.randn(size, 6, generator=generator)
    return inputs, torch.randint(0, 3, (size,), generator=generator)


def _flat(matrix_of: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone().double() for name, tensor in matrix_of.items()}


def _matrices(model: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    """Each Linear's weight and bias (or their gradients) as one ``(out, in + 1)`` matrix."""
    out = {}
    for name, module in model.named_children():
        if isinstance(module, nn.Linear):
            weight, bias = module.weight, module.bias
            if grads:
                assert weight.grad is not None and bias.grad is not None
                weight, bias = weight.grad, bias.grad
            out[name] = torch.cat([weight, bias.reshape(-1, 1)], dim=1)
    return _flat(out)


def _train(precond: KFAC, model: nn.Module, steps: range, optimizer: Any) -> list[dict[str, Any]]:
    """Train with ``step(loss=...)``; record what the reference needs at every step."""
    records = []
    for step in steps:
        inputs, targets = _batch(step)
        optimizer.zero_grad()
        loss = functional.cross_entropy(model(inputs), targets)
        loss.backward()
        record = {"loss": float(loss.detach()), "params": _matrices(model, False)}
        record["grads"] = _matrices(model, True)
        precond.step(loss=loss)
        record["factors"] = {
            name: (layer.a_factor.double().clone(), layer.g_factor.double().clone())
            for name, layer in precond.kfac_layers.items()
            if layer.a_factor is not None and layer.g_factor is not None
        }
        record["damping"] = precond.damping
        optimizer.step()
        records.append(record)
    return records


def _reference_dampings(
    records: list[dict[str, Any]], start: float, interval: int, batch: int
) -> list[float]:
    """The damping after each step, from the recorded run, by Martens & Grosse's rule.

    The model for the step ``t -> t + 1`` is ``g.d + 1/2 vec(d)^T (batch^2 A kron G) vec(d)``
    (factors of the mean loss, scaled to the per-example Fisher); the measured change is the mean
    loss of a window's second half minus its first.
    """
    omega = (20 / 19) ** interval
    low, high = start / 100, start * 100
    predicted = []
    for before, after in itertools.pairwise(records):
        total = 0.0
        for name, grad in before["grads"].items():
            delta = after["params"][name] - before["params"][name]
            a, g = before["factors"][name]
            vec = delta.t().reshape(-1)  # column-stacked, so kron(A, G) acts as G d A
            total += float(grad.reshape(-1) @ delta.reshape(-1))
            total += 0.5 * batch**2 * float(vec @ torch.kron(a, g) @ vec)
        predicted.append(total)
    damping, out = start, []
    for t in range(len(records)):
        first = t - 2 * interval + 1
        if first >= 0 and (t - (2 * interval - 1)) % interval == 0:
            losses = [r["loss"] for r in records[first : t + 1]]
            measured = sum(losses[interval:]) / interval - sum(losses[:interval]) / interval
            # The measured change telescopes into each start's own interval of steps.
            model = (
                sum(predicted[first + i + j] for i in range(interval) for j in range(interval))
                / interval
            )
            rho = measured / model if model < 0 else -math.inf
            if rho < 0.25:
                damping *= omega
            elif rho > 0.75:
                damping /= omega
            damping = min(max(damping, low), high)
        out.append(damping)
    return out


def test_the_rule_moves_damping_by_omega_within_bounds() -> None:
    bounds = (1e-3, 1.0)
    assert levenberg_marquardt_update(0.01, 0.1, 2.0, bounds) == pytest.approx(0.02)
    assert levenberg_marquardt_update(0.01, 0.9, 2.0, bounds) == pytest.approx(0.005)
    assert levenberg_marquardt_update(0.01, 0.5, 2.0, bounds) == 0.01
    assert levenberg_marquardt_update(0.01, math.nan, 2.0, bounds) == pytest.approx(0.02)
    assert levenberg_marquardt_update(0.8, -3.0, 2.0, bounds) == 1.0
    assert levenberg_marquardt_update(0.0015, 5.0, 2.0, bounds) == 1e-3


def test_damping_follows_a_reference_of_the_rule() -> None:
    model = _model()
    start = 0.01
    precond = KFAC(model, damping=start, damping_adaptation=LevenbergMarquardt(interval=INTERVAL))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    records = _train(precond, model, range(16), optimizer)
    expected = _reference_dampings(records, start, INTERVAL, batch=16)
    assert [r["damping"] for r in records] == pytest.approx(expected, rel=1e-9)
    assert len({round(d, 12) for d in expected}) > 2  # the rule moved it, more than once


def test_a_non_finite_loss_raises_the_damping() -> None:
    model = _model()
    precond = KFAC(model, damping=0.01, damping_adaptation=LevenbergMarquardt(interval=1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dampings = []
    for step in range(3):
        inputs, targets = _batch(step)
        optimizer.zero_grad()
        loss = functional.cross_entropy(model(inputs), targets)
        loss.backward()
        precond.step(loss=loss if step < 2 else torch.tensor(math.inf))
        optimizer.step()
        dampings.append(precond.damping)
    assert dampings[2] == pytest.approx(dampings[1] * 20 / 19)


def test_resume_from_a_checkpoint_is_exact() -> None:
    def fresh() -> tuple[nn.Module, KFAC, torch.optim.Optimizer]:
        model = _model()
        settings = LevenbergMarquardt(interval=INTERVAL)
        precond = KFAC(model, damping=0.01, damping_adaptation=settings)
        return model, precond, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    model, precond, optimizer = fresh()
    whole = _train(precond, model, range(14), optimizer)

    model, precond, optimizer = fresh()
    first = _train(precond, model, range(7), optimizer)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), precond.state_dict()))
    model, precond, optimizer = fresh()
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    precond.load_state_dict(saved[2])
    second = _train(precond, model, range(7, 14), optimizer)

    assert [r["damping"] for r in first + second] == [r["damping"] for r in whole]
    last = zip(second[-1]["params"].values(), whole[-1]["params"].values(), strict=True)
    for ours, reference in last:
        assert torch.equal(ours, reference)


def _ranks_run(_: None) -> list[float]:
    """Two ranks, different batches, gradients averaged by hand: the damping after each step."""
    rank = dist.get_rank()
    model = _model()
    precond = KFAC(model, damping=0.01, damping_adaptation=LevenbergMarquardt(interval=INTERVAL))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    dampings = []
    for step in range(14):
        inputs, targets = _batch(step, rank, size=8)
        optimizer.zero_grad()
        loss = functional.cross_entropy(model(inputs), targets)
        loss.backward()
        average_gradients(model)
        precond.step(loss=loss)
        optimizer.step()
        dampings.append(precond.damping)
    return dampings


def test_ranks_agree_and_equal_one_process_on_the_global_batch() -> None:
    per_rank = run_ranks(_ranks_run, 2, None, timeout=120)
    assert per_rank[0] == per_rank[1]

    model = _model()
    precond = KFAC(model, damping=0.01, damping_adaptation=LevenbergMarquardt(interval=INTERVAL))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    single = []
    for step in range(14):
        halves = [_batch(step, rank, size=8) for rank in (0, 1)]
        inputs = torch.cat([h[0] for h in halves])
        targets = torch.cat([h[1] for h in halves])
        optimizer.zero_grad()
        loss = functional.cross_entropy(model(inputs), targets)
        loss.backward()
        precond.step(loss=loss)
        optimizer.step()
        single.append(precond.damping)
    assert per_rank[0] == pytest.approx(single, rel=1e-9)
    assert len(set(single)) > 1


@pytest.mark.parametrize(
    "choice",
    [
        DampingAdaptation.LEVENBERG_MARQUARDT,
        "levenberg-marquardt",
        "Levenberg_Marquardt",
        LevenbergMarquardt(interval=3, omega=1.5, min_damping=1e-5, max_damping=0.5),
    ],
)
def test_the_choice_is_an_enum_its_string_or_settings(choice: Any) -> None:
    precond = KFAC(_model(), damping_adaptation=choice)
    assert precond.adaptive_damping is not None
    fixed = KFAC(_model(), damping_adaptation=DampingAdaptation.FIXED)
    assert fixed.adaptive_damping is None


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: LevenbergMarquardt(interval=0), "interval must be an integer >= 1, got 0"),
        (lambda: LevenbergMarquardt(omega=1.0), "omega must be a number > 1, got 1.0"),
        (lambda: LevenbergMarquardt(min_damping=-1.0), "min_damping must be a finite number > 0"),
        (
            lambda: LevenbergMarquardt(min_damping=1.0, max_damping=0.1),
            "min_damping 1.0 is above max_damping 0.1",
        ),
        (
            lambda: KFAC(_model(), damping=lambda step: 0.01),
            "adapts a number, got a callable damping; pass damping=<number>, or "
            "damping_adaptation='fixed'",
        ),
        (lambda: KFAC(_model(), damping=0.0), "needs a damping > 0 to start from, got 0.0"),
        (
            lambda: KFAC(
                _model(), damping=2.0, damping_adaptation=LevenbergMarquardt(max_damping=1)
            ),
            "damping 2.0 is outside the Levenberg-Marquardt bounds [0.02, 1]",
        ),
        (
            lambda: KFAC(_model(), damping_adaptation="trust-region"),
            "damping_adaptation must be one of 'fixed', 'levenberg-marquardt'",
        ),
    ],
)
def test_bad_settings_are_one_line_errors(build: Any, message: str) -> None:
    with pytest.raises(UsageError) as raised:
        build()
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def _gradients_after(precond_of: Any, with_loss: bool) -> list[torch.Tensor]:
    model = _model()
    precond = precond_of(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(12):
        inputs, targets = _batch(step)
        optimizer.zero_grad()
        loss = functional.cross_entropy(model(inputs), targets)
        loss.backward()
        precond.step(loss=loss) if with_loss else precond.step()
        optimizer.step()
    return [param.detach().clone() for param in model.parameters()]


def test_kfac_pytorchs_path_is_fixed_damping_exactly() -> None:
    fixed = _gradients_after(lambda m: KFAC(m, damping_adaptation="fixed"), with_loss=False)
    # interlace.KFAC's default adapts only when step() is given the loss: kfac-pytorch's calls
    # never give it.
    assert all(
        torch.equal(a, b)
        for a, b in zip(_gradients_after(KFAC, with_loss=False), fixed, strict=True)
    )
    # The kfac-pytorch name keeps fixed damping even when a loss is passed.
    alias = _gradients_after(KFACPreconditioner, with_loss=True)
    assert all(torch.equal(a, b) for a, b in zip(alias, fixed, strict=True))
    adapted = _gradients_after(
        lambda m: KFAC(m, damping_adaptation=LevenbergMarquardt(interval=1)), with_loss=True
    )
    assert not all(torch.equal(a, b) for a, b in zip(adapted, fixed, strict=True))


def test_the_models_scale_turns_g_into_the_per_example_fisher_factor() -> None:
    # The model scores d with batch^2 * G: the second moment of the per-example gradients with
    # respect to the layer's output, which the mean loss divides by the batch.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3))
    precond = KFAC(model, factor_decay=0.0)
    inputs, targets = _batch(0)
    functional.cross_entropy(model(inputs), targets).backward()
    precond.step()
    outputs = model(inputs).detach().requires_grad_(True)
    per_example = functional.cross_entropy(outputs, targets, reduction="none")
    (rows,) = torch.autograd.grad(per_example.sum(), outputs)
    g_factor = precond.kfac_layers["0"].g_factor
    assert g_factor is not None
    torch.testing.assert_close(len(inputs) ** 2 * g_factor, rows.t() @ rows / len(inputs))


def test_a_fixed_damping_checkpoint_sets_where_adaptation_goes_on() -> None:
    fixed = KFAC(_model(), damping=0.02, damping_adaptation="fixed")
    adaptive = KFAC(_model(), damping=0.01)
    adaptive.load_state_dict(fixed.state_dict())
    assert adaptive.damping == 0.02
