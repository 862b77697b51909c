"""BackwardPass: one end per backward pass, at the end of the outermost graph task."""

from __future__ import annotations

import time

import torch
from torch.utils.checkpoint import checkpoint

from interlace.dp.backward_pass import BackwardPass, tensors_in


def _watched(weight: torch.Tensor) -> tuple[BackwardPass, list[float], list[str]]:
    ends: list[float] = []
    events: list[str] = []
    backward = BackwardPass(ends.append)

    def arrived(param: torch.Tensor) -> None:
        events.append("gradient")
        backward.gradient_arrived(time.perf_counter())

    weight.register_post_accumulate_grad_hook(arrived)
    return backward, ends, events


def test_a_pass_through_the_output_ends_once_after_every_gradient() -> None:
    weight = torch.ones(3, requires_grad=True)
    backward, ends, _ = _watched(weight)
    output = (weight * 2).sum()
    output.register_hook(lambda grad: backward.output_reached())
    backward.forward_ended()
    output.backward()
    assert len(ends) == 1
    assert backward.start is not None and backward.start <= ends[0]


def test_a_reentrant_checkpoint_does_not_end_the_pass_early() -> None:
    weight = torch.ones(3, requires_grad=True)
    backward, ends, events = _watched(weight)

    def block(x: torch.Tensor) -> torch.Tensor:
        return x * weight

    x = torch.ones(3, requires_grad=True)
    output = (checkpoint(block, x, use_reentrant=True) * weight).sum()
    output.register_hook(lambda grad: backward.output_reached())
    backward.forward_ended()
    output.backward()
    # Two gradients into the weight, one inside the nested graph task: still one end.
    assert events == ["gradient", "gradient"]
    assert len(ends) == 1


def test_a_pass_not_through_the_output_ends_with_its_graph_task() -> None:
    weight = torch.ones(3, requires_grad=True)
    backward, ends, _ = _watched(weight)
    backward.forward_ended()
    (weight * 3).sum().backward()
    assert len(ends) == 1
    assert backward.start is not None


def test_a_backward_that_delivers_no_parameter_gradient_ends_nothing() -> None:
    weight = torch.ones(3, requires_grad=True)
    backward, ends, _ = _watched(weight)
    output = (weight * 2).sum()
    output.register_hook(lambda grad: backward.output_reached())
    torch.autograd.grad(output, weight)
    assert ends == []


def test_tensors_in_finds_nested_tensors() -> None:
    first, second = torch.zeros(1), torch.ones(2)
    found = tensors_in({"a": [first, 3], "b": (second, "text")})
    assert [t.shape for t in found] == [first.shape, second.shape]
