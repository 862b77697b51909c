"""Optimizer steps heard, deferred per parameter and timed: a user's ``optimizer.step()``
applied bucket by bucket.

Any ``torch.optim.Optimizer`` is hooked through torch's global step hooks, so a training loop
needs no new line; the hooks exist only while a listener does, and an optimizer's step reaches
only the listeners holding one of its parameters. A deferred step remembers the hyperparameters
of the moment it was called (a scheduler may change them before the update is applied) and later
runs the optimizer's own update on a subset of its parameters at a time.
"""

from __future__ import annotations

import statistics
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.optim.optimizer import (
    Optimizer,
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from interlace.clock import Mark, StreamClock

__all__ = [
    "DeferredStep",
    "StepListener",
    "StepTimes",
    "listen_to_steps",
    "raw_step",
    "stop_listening",
    "takes_closure",
]


class StepListener(Protocol):
    """Told of the steps of optimizers holding its parameters (``ForwardOverlap``)."""

    def holds(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` steps any of the listener's parameters.

        Args:
            optimizer: The optimizer.
        """

    def before_step(self, optimizer: Optimizer, closure: bool) -> None:
        """An optimizer is about to step.

        Args:
            optimizer: The optimizer.
            closure: Whether the step was given a closure.
        """

    def after_step(self, optimizer: Optimizer) -> None:
        """An optimizer has stepped.

        Args:
            optimizer: The optimizer.
        """


_listeners: weakref.WeakSet[Any] = weakref.WeakSet()
_handles: list[Any] = []
#: Per optimizer: the layout of its groups when the listeners holding it were found, and them.
_routes: weakref.WeakKeyDictionary[Optimizer, tuple[Any, list[weakref.ref[Any]]]] = (
    weakref.WeakKeyDictionary()
)


def listen_to_steps(listener: StepListener) -> None:
    """Tell ``listener`` of the steps of every optimizer that holds one of its parameters, until
    :func:`stop_listening`.

    Args:
        listener: What is told.
    """
    if not _handles:
        _handles.append(register_optimizer_step_pre_hook(_before))
        _handles.append(register_optimizer_step_post_hook(_after))
    _listeners.add(listener)
    _routes.clear()


def stop_listening(listener: StepListener) -> None:
    """Tell ``listener`` nothing more; torch's hooks go once no listener is left.

    Args:
        listener: What was told.
    """
    _listeners.discard(listener)
    _routes.clear()
    if not _listeners:
        for handle in _handles:
            handle.remove()
        _handles.clear()


def _listeners_of(optimizer: Optimizer) -> list[Any]:
    layout = [(id(group["params"]), len(group["params"])) for group in optimizer.param_groups]
    route = _routes.get(optimizer)
    if route is None or route[0] != layout:
        route = (layout, [weakref.ref(each) for each in _listeners if each.holds(optimizer)])
        _routes[optimizer] = route
    found = [each() for each in route[1]]
    return [each for each in found if each is not None]


def _before(optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    listeners = _listeners_of(optimizer)
    if listeners:
        closure = takes_closure(args, kwargs)
        for listener in listeners:
            listener.before_step(optimizer, closure)


def _after(optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for listener in _listeners_of(optimizer):
        listener.after_step(optimizer)


def takes_closure(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether ``optimizer.step(*args, **kwargs)`` (``args`` with the optimizer first) was given
    a closure.

    Args:
        args: The step's positional arguments, the optimizer first.
        kwargs: Its keyword arguments.
    """
    return kwargs.get("closure") is not None or (len(args) > 1 and args[1] is not None)


def raw_step(optimizer: Optimizer) -> Callable[[], Any]:
    """The optimizer's own update, without the step hooks around it (they ran for the user's
    call already).

    Args:
        optimizer: The optimizer.
    """
    step = getattr(type(optimizer).step, "__wrapped__", None)
    if step is None:
        return optimizer.step
    return lambda: step(optimizer)


class DeferredStep:
    """One ``optimizer.step()`` whose update of ``params`` waits for their averaged gradients.

    Args:
        optimizer: The optimizer that was stepped.
        params: Its parameters whose update is deferred.
    """

    def __init__(self, optimizer: Optimizer, params: Sequence[torch.Tensor]) -> None:
        self.optimizer = optimizer
        deferred = {id(param) for param in params}
        #: Per param group, the deferred parameters in the group's order.
        self.by_group = [
            [param for param in group["params"] if id(param) in deferred]
            for group in optimizer.param_groups
        ]
        # A scheduler may change these (in place, for tensor learning rates) before the update
        # is applied: the update must use the values of the moment the user stepped.
        self.hyperparameters = [
            {
                key: value.clone() if isinstance(value, torch.Tensor) else value
                for key, value in group.items()
                if key != "params"
            }
            for group in optimizer.param_groups
        ]
        self._left = set(deferred)
        self._withheld: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    @property
    def hiding(self) -> bool:
        """Whether the deferred parameters' gradients are hidden (:meth:`hide`)."""
        return bool(self._withheld)

    def hide(self) -> None:
        """Hide the deferred parameters' gradients from the optimizer's own call, running now
        (an optimizer skips a parameter without a gradient); :meth:`unhide` gives them back."""
        self._withheld = [(param, param.grad) for group in self.by_group for param in group]
        for param, _ in self._withheld:
            param.grad = None

    def unhide(self) -> None:
        """Give back the gradients :meth:`hide` took."""
        for param, grad in self._withheld:
            param.grad = grad
        self._withheld = []

    def apply(self, params: Sequence[torch.Tensor]) -> None:
        """Update those of ``params`` this step defers, with their gradients as they are now.

        Args:
            params: Parameters whose averaged gradients are in ``.grad`` (None: no update).
        """
        wanted = {id(param) for param in params} & self._left
        if not wanted:
            return
        self._left -= wanted
        groups = self.optimizer.param_groups
        saved = [
            (group["params"], {key: group[key] for key in hyper})
            for group, hyper in zip(groups, self.hyperparameters, strict=True)
        ]
        try:
            for group, hyper, mine in zip(groups, self.hyperparameters, self.by_group, strict=True):
                group["params"] = [param for param in mine if id(param) in wanted]
                group.update(hyper)
            raw_step(self.optimizer)()
        finally:
            for group, (members, values) in zip(groups, saved, strict=True):
                group["params"] = members
                group.update(values)


class StepTimes:
    """The optimizer steps over a wrapper's parameters, timed while profiling (the plans price
    the step).

    Args:
        clock: Times them (a GPU's stream: CUDA events, no host wait).
    """

    def __init__(self, clock: StreamClock) -> None:
        self._clock = clock
        self._marks: list[tuple[Mark, Mark]] = []
        self._started: Mark | None = None

    def start(self) -> None:
        """A timed step begins."""
        self._started = self._clock.mark()

    def stop(self) -> None:
        """The step begun (if any) is over."""
        if self._started is not None:
            self._marks.append((self._started, self._clock.mark()))
            self._started = None

    def median_s(self) -> float:
        """The median timed step in seconds (0 if none was timed)."""
        if not self._marks:
            return 0.0
        return statistics.median(self._clock.seconds(a, b) for a, b in self._marks)

    def clear(self) -> None:
        """Forget the steps timed."""
        self._marks = []
        self._started = None
