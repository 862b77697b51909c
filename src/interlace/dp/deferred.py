"""Optimizer steps deferred per parameter: a user's ``optimizer.step()`` applied bucket by bucket.

Any ``torch.optim.Optimizer`` is hooked through torch's global step hooks, so a training loop
needs no new line. A deferred step remembers the hyperparameters of the moment it was called (a
scheduler may change them before the update is applied) and later runs the optimizer's own
update on a subset of its parameters at a time.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.optim.optimizer import (
    Optimizer,
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

__all__ = ["DeferredStep", "StepListener", "listen_to_steps", "raw_step", "takes_closure"]


class StepListener(Protocol):
    """Told of every optimizer step in the process (``ForwardOverlap``)."""

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


def listen_to_steps(listener: StepListener) -> None:
    """Tell ``listener`` of every optimizer step from now on (while it lives).

    Args:
        listener: What is told.
    """
    if not _handles:
        _handles.append(register_optimizer_step_pre_hook(_before))
        _handles.append(register_optimizer_step_post_hook(_after))
    _listeners.add(listener)


def _before(optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    closure = takes_closure(args, kwargs)
    for listener in list(_listeners):
        listener.before_step(optimizer, closure)


def _after(optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for listener in list(_listeners):
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

    @property
    def done(self) -> bool:
        """Whether every deferred parameter was updated."""
        return not self._left

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
