"""Pending gradients and deferred-update marks: reading waits, metadata and zeroing do not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from interlace.dp.forward_overlap.pending import DeferredMarks, PendingGrad


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


def test_marks_complete_on_a_use_of_a_marked_parameter_only() -> None:
    watched, other = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    owner = Owner([watched])
    marks = DeferredMarks(owner)
    marks.mark([watched])
    assert isinstance(watched, nn.Parameter) and marks.marked
    _ = other * 2
    _ = watched.grad, watched.shape, watched.requires_grad
    watched.grad = None
    assert owner.completed == 0
    ema = torch.zeros(2)
    ema.lerp_(watched, 0.1)  # an EMA update reads the parameter
    assert owner.completed == 1 and not marks.marked
    assert type(watched) is nn.Parameter
    _ = watched * 2
    assert owner.completed == 1  # once: the marks are cleared
    assert torch.equal(ema, torch.full((2,), 0.1))


class Counting(TorchFunctionMode):
    """A user's mode: counts the torch calls made inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_marks_push_no_mode_and_a_users_mode_around_them_ends_with_its_block() -> None:
    param = nn.Parameter(torch.ones(2))
    owner = Owner([param])
    marks = DeferredMarks(owner)
    with Counting() as counting:
        marks.mark([param])
        saved = param.detach().clone()  # completes, inside the user's mode
    assert _get_current_function_mode_stack() == []
    assert counting.calls >= 1 and owner.completed == 1 and torch.equal(saved, torch.ones(2))


def test_marks_are_cleared_without_completing() -> None:
    params = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))]
    owner = Owner(params)
    marks = DeferredMarks(owner)
    marks.mark(params)
    marks.mark(params[:1])  # marked once
    marks.clear()
    _ = params[0] * 2
    assert owner.completed == 0 and all(type(param) is nn.Parameter for param in params)


def test_some_marks_are_lifted_and_the_others_still_complete() -> None:
    first, second, third = (nn.Parameter(torch.ones(2)) for _ in range(3))
    owner = Owner([first, second, third])
    marks = DeferredMarks(owner)
    marks.mark([first, second, third])
    marks.keep_only([second, third])  # the forward starts; two layers may not run
    assert type(first) is nn.Parameter and marks.marked
    marks.unmark([second, first])  # a gate applies its bucket (first is not marked: no-op)
    _ = first * 2, second * 2
    assert owner.completed == 0 and type(second) is nn.Parameter
    _ = third * 2  # the one still marked: used outside its layer
    assert owner.completed == 1 and not marks.marked and type(third) is nn.Parameter
