"""K-FAC never switches itself off: registration waits for a training step, the KL-clip holds on
overflowing gradients, skipped and repeated steps leave nothing behind, bad values are refused."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional

from interlace.errors import UsageError
from interlace.kfac import KFAC, KFACWarning


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, generator=generator) * scale, torch.randint(
        0, 3, (16,), generator=generator
    )


def _backward(model: nn.Module, seed: int, scale: float = 1.0) -> None:
    inputs, targets = _batch(seed, scale)
    model.zero_grad()
    functional.cross_entropy(model(inputs), targets).backward()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


# -- registration ----------------------------------------------------------------------------


def test_a_step_before_the_first_backward_drops_no_layer() -> None:
    model = _mlp()
    precond = KFAC(model)
    with pytest.warns(KFACWarning, match="no training-mode forward and backward behind it"):
        precond.step()
    _backward(model, 0)
    raw = _grads(model)
    precond.step()
    assert set(precond.layers) == {"0", "2"}
    assert not precond.skipped
    assert all(not torch.equal(a, b) for a, b in zip(_grads(model), raw, strict=True))


def test_a_first_iteration_in_eval_mode_drops_no_layer() -> None:
    model = _mlp()
    precond = KFAC(model)
    model.eval()
    _backward(model, 0)
    with pytest.warns(KFACWarning, match=r"eval\(\) mode"):
        precond.step()
    model.train()
    _backward(model, 1)
    precond.step()
    assert set(precond.layers) == {"0", "2"}
    assert precond.kfac_layers["0"].a_factor is not None


# -- KL-clip ---------------------------------------------------------------------------------


def test_the_kl_clip_holds_when_the_products_overflow_float32() -> None:
    model = _mlp()
    unclipped_model = copy.deepcopy(model)
    precond = KFAC(model, kl_clip=1e-3, lr=0.1)
    unclipped = KFAC(unclipped_model, kl_clip=None)
    for seed, scale in ((0, 1.0), (1, 1e22)):
        # Inputs x1e22: finite gradients whose float32 products with the preconditioned ones
        # overflow.
        for net, kfac in ((model, precond), (unclipped_model, unclipped)):
            _backward(net, seed, scale)
            raw = {name: kfac.kfac_layers[name].grad_matrix() for name in kfac}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", KFACWarning)  # this batch's factors overflow
                kfac.step()
    # kfac-pytorch's clip in float64: V = nu V' with nu = min(1, sqrt(kl_clip / (lr^2 <V', G>))).
    products = 0.0
    for name in unclipped:
        full = unclipped.kfac_layers[name].grad_matrix()
        assert full is not None and raw[name] is not None
        products += float((full.double() * raw[name].double()).sum())  # type: ignore[union-attr]
    nu = min(1.0, math.sqrt(1e-3 / (0.1**2 * products)))
    assert nu < 1e-10
    for name in precond:
        clipped, full = (
            precond.kfac_layers[name].grad_matrix(),
            unclipped.kfac_layers[name].grad_matrix(),
        )
        assert clipped is not None and full is not None
        torch.testing.assert_close(clipped.double(), nu * full.double(), rtol=1e-4, atol=0.0)


def test_preconditioned_gradients_that_overflow_are_clipped_to_zero() -> None:
    model = _mlp()
    precond = KFAC(model, kl_clip=1e-3, lr=0.1)
    _backward(model, 0)
    precond.step()
    _backward(model, 1)
    for param in model.parameters():
        # Finite, but near float32's largest: preconditioning overflows them.
        param.grad.fill_(3e38)  # type: ignore[union-attr]
    with pytest.warns(KFACWarning, match="overflow"):
        precond.step()
    for name in precond:
        grad = precond.kfac_layers[name].grad_matrix()
        assert grad is not None and bool((grad == 0).all())


# -- skipped and repeated steps --------------------------------------------------------------


def test_a_skipped_step_on_a_bad_batch_leaves_the_next_factors_clean() -> None:
    model = _mlp()
    clean = copy.deepcopy(model)
    precond, reference = KFAC(model), KFAC(clean)
    for net, kfac in ((model, precond), (clean, reference)):
        _backward(net, 0)
        kfac.step()
    # A batch whose loss is not finite: the caller skips both step()s.
    _backward(model, 1, scale=math.inf)
    with pytest.warns(KFACWarning, match="not finite in 0"):
        _backward(model, 2)
    precond.step()
    _backward(clean, 2)
    reference.step()
    for name in precond:
        ours, theirs = precond.kfac_layers[name], reference.kfac_layers[name]
        assert ours.a_factor is not None and theirs.a_factor is not None
        assert ours.g_factor is not None and theirs.g_factor is not None
        torch.testing.assert_close(ours.a_factor, theirs.a_factor)
        torch.testing.assert_close(ours.g_factor, theirs.g_factor)


def test_finite_accumulated_batches_are_kept() -> None:
    model = _mlp()
    precond = KFAC(model, factor_decay=0.0)
    _backward(model, 0)
    inputs_0, _ = _batch(0)
    model.zero_grad()
    _backward(model, 1)  # a second batch before the step: accumulated, not dropped
    inputs_1, _ = _batch(1)
    precond.step()
    rows = torch.cat([torch.cat([inputs_0, inputs_1]), torch.ones(32, 1)], dim=1)
    a = precond.kfac_layers["0"].a_factor
    assert a is not None
    torch.testing.assert_close(a, rows.t() @ rows / 32)


def test_a_second_step_without_a_backward_does_nothing_and_warns() -> None:
    model = _mlp()
    precond = KFAC(model)
    _backward(model, 0)
    precond.step()
    once = _grads(model)
    with pytest.warns(KFACWarning, match="no backward since the last one"):
        precond.step()
    assert precond.steps == 1
    for got, expected in zip(_grads(model), once, strict=True):
        assert torch.equal(got, expected)
    # The next backward is preconditioned as usual.
    _backward(model, 1)
    precond.step()
    assert precond.steps == 2


def test_a_new_gradient_at_a_freed_gradients_address_is_preconditioned() -> None:
    model = _mlp()
    precond = KFAC(model, factor_update_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KFACWarning)
        for seed in range(30):
            # zero_grad() frees the gradients; the allocator often hands the next backward's
            # gradients the same addresses, so the same id() must not read as "no backward".
            _backward(model, seed)
            precond.step()
    assert precond.steps == 30


# -- refused values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": math.inf}, "lr must be a finite number, got inf"),
        ({"lr": math.nan}, "lr must be a finite number, got nan"),
        ({"damping": math.inf}, "damping must be a finite number"),
        ({"kl_clip": math.inf}, r"kl_clip must be a finite number, got inf \(use kl_clip=None"),
        ({"factor_decay": math.nan}, "factor_decay must be a finite number"),
        ({"lr": True}, "lr must be a finite number, got True"),
        ({"factor_update_steps": True}, "factor_update_steps must be an integer >= 1, got True"),
        ({"inv_update_steps": 2.5}, "inv_update_steps must be an integer >= 1, got 2.5"),
        ({"accumulation_steps": True}, "accumulation_steps must be an integer >= 1, got True"),
        ({"bucket_cap_mb": math.inf}, "bucket_cap_mb must be a finite number >= 0"),
        ({"grad_worker_fraction": True}, "grad_worker_fraction must be a number in"),
        ({"compute_method": 1}, "compute_method must be one of"),
    ],
)
def test_bools_as_numbers_and_non_finite_numbers_are_refused(
    kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(UsageError, match=match):
        KFAC(_mlp(), **kwargs)


def test_a_callable_that_turns_non_finite_is_refused_at_that_step() -> None:
    model = _mlp()
    precond = KFAC(model, lr=lambda step: 0.1 if step == 0 else math.inf)
    _backward(model, 0)
    precond.step()
    _backward(model, 1)
    with pytest.raises(UsageError, match=r"lr must be a finite number, got inf \(at step 1\)"):
        precond.step()
