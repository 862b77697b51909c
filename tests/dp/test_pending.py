"""Pending gradients and the parameter guard: reading waits, metadata and zeroing do not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from interlace.dp.pending import ParamGuard, PendingGrad


class Owner:
    """Stands in for ForwardOverlap: completing writes the average (here: 10x) into the grads."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.completed = 0
        self.due = True
        self.discarded: list[int] = []

    def complete(self) -> None:
        # As the real owner, a second call finds nothing left to do.
        self.completed += self.due
        self.due = False
        pending = [param for param in self.params if isinstance(param.grad, PendingGrad)]
        for param in pending:
            grad = param.grad
            assert isinstance(grad, PendingGrad)
            grad.plain.mul_(10.0)
            param.grad = grad.plain

    def discard(self, grad: PendingGrad) -> None:
        self.discarded.append(grad.param_index)
        self.params[grad.param_index].grad = grad.plain


def _pending() -> tuple[list[nn.Parameter], Owner]:
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    owner = Owner(params)
    for number, param in enumerate(params):
        param.grad = PendingGrad.wrap(torch.full_like(param, number + 1.0), owner, number)
    return params, owner


def test_reading_a_pending_gradient_waits_for_the_averages_first() -> None:
    params, owner = _pending()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1e9)
    assert owner.completed == 1
    # The norm of the completed gradients (10 and 20 per element), not of the local ones.
    assert float(norm) == pytest.approx((3 * 100 + 2 * 400) ** 0.5)
    assert all(type(param.grad) is torch.Tensor for param in params)


def test_metadata_needs_no_wait_and_zeroing_discards_without_waiting() -> None:
    params, owner = _pending()
    grad = params[0].grad
    assert grad is not None
    assert grad.shape == (3,) and grad.dtype == torch.float32 and not grad.requires_grad
    assert owner.completed == 0
    optimizer = torch.optim.SGD(params, lr=0.1)
    optimizer.zero_grad(set_to_none=False)
    assert owner.completed == 0 and owner.discarded == [0, 1]
    assert all(torch.equal(param.grad, torch.zeros_like(param)) for param in params)


def test_results_of_reads_are_plain_tensors_sharing_the_average() -> None:
    params, owner = _pending()
    grad = params[1].grad
    assert grad is not None
    doubled = grad * 2
    assert type(doubled) is torch.Tensor and torch.equal(doubled, torch.full((2,), 40.0))
    assert owner.completed == 1


def test_the_guard_completes_on_a_use_of_a_watched_parameter_only() -> None:
    watched, other = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    owner = Owner([watched])
    guard = ParamGuard(owner, [watched])
    guard.watch()
    try:
        _ = other * 2
        _ = watched.grad, watched.shape, watched.requires_grad
        assert owner.completed == 0
        ema = torch.zeros(2)
        ema.lerp_(watched, 0.1)  # an EMA update reads the parameter
        assert owner.completed == 1
        _ = watched * 2
        assert owner.completed == 1  # once: the guard is spent
    finally:
        assert guard.release()


def test_a_guard_under_another_mode_is_left_inert_until_it_can_be_released() -> None:
    param = nn.Parameter(torch.ones(2))
    owner = Owner([param])
    guard = ParamGuard(owner, [param])
    guard.watch()
    other = ParamGuard(owner, [])
    other.watch()
    assert not guard.release()
    _ = param * 2
    assert owner.completed == 0
    assert other.release() and guard.release()
