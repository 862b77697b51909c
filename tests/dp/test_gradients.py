"""When DataParallel sends a gradient (Arrivals) and how averages reach ``.grad``."""

from __future__ import annotations

import torch
from torch import nn

from interlace.dp.gradients import Arrivals, write_averages


class _Launcher:
    def __init__(self) -> None:
        self.seen: set[int] = set()

    def arrived(self, index: int) -> bool:
        return index in self.seen


class _Engine:
    """What Arrivals.finish needs of a BucketEngine: which gradients it has, and add()."""

    def __init__(self) -> None:
        self.launcher = _Launcher()
        self.added: list[tuple[int, float]] = []

    def add(self, index: int, grad: torch.Tensor) -> None:
        self.launcher.seen.add(index)
        self.added.append((index, float(grad.sum())))


def _params(count: int) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros(2)) for _ in range(count)]
    for number, param in enumerate(params):
        param.grad = torch.full((2,), float(number + 1))
    return params


def test_the_first_backward_counts_and_later_ones_send_a_gradient_once_complete() -> None:
    arrivals = Arrivals(3)
    params = _params(3)
    # First backward: parameter 1 arrives twice (a reentrant block used twice); nothing is
    # complete before the end, where every gradient goes out once.
    for index in (0, 1, 2, 1):
        assert not arrivals.complete(index, counting=True)
    engine = _Engine()
    arrivals.finish(engine, params, counting=True)
    assert sorted(index for index, _ in engine.added) == [0, 1, 2]
    # Later: parameter 1 is complete at its second arrival, the others at their first.
    assert arrivals.complete(0, counting=False)
    assert not arrivals.complete(1, counting=False)
    assert arrivals.complete(1, counting=False)
    assert not arrivals.overdue(1)
    assert arrivals.complete(1, counting=False) and arrivals.overdue(1)


def test_gradients_from_no_sync_passes_go_out_at_the_end_unless_they_arrived() -> None:
    arrivals = Arrivals(3)
    params = _params(3)
    arrivals.accumulated.update({0, 2})
    engine = _Engine()
    engine.add(0, params[0].grad)  # used again in the averaging pass: already in its bucket
    arrivals.finish(engine, params, counting=False)
    assert engine.added == [(0, 2.0), (2, 6.0)]
    assert not arrivals.accumulated


def test_averages_are_copied_or_become_the_grad_and_unused_ones_keep_theirs() -> None:
    params = _params(3)
    params[1].grad = None
    kept, owned = params[2].grad, params[0].grad
    averaged = [torch.full((2,), 10.0), torch.full((2,), 20.0), None]
    write_averages(params, averaged, as_views=False)
    assert params[0].grad is owned and params[0].grad.tolist() == [10.0, 10.0]
    assert params[1].grad is not averaged[1] and params[1].grad.tolist() == [20.0, 20.0]
    assert params[2].grad is kept and kept.tolist() == [3.0, 3.0]
    write_averages(params, averaged, as_views=True)
    assert params[0].grad is averaged[0] and params[1].grad is averaged[1]
