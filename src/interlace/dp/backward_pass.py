"""When a synchronising backward pass starts and ends: the one owner of that state.

Autograd has no end-of-backward hook; a callback queued on the graph task that runs the
backward stands in for one (lifecycle: docs/notes/dp.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves


class BackwardPass:
    """Finds the start and the end of each backward pass over a wrapped model's outputs.

    The start is the first gradient reaching an output (or, when backward does not pass through
    the outputs, the first parameter gradient); the end is the end of the outermost graph task
    that delivered a parameter gradient, so a reentrant backward nested in it (checkpointing)
    does not end the pass early. A backward that delivers no parameter gradient
    (``torch.autograd.grad``, say) does not end one.

    Args:
        on_end: called once per pass with ``time.perf_counter()`` at its end.
    """

    def __init__(self, on_end: Callable[[float], Any]) -> None:
        self._on_end = on_end
        self._armed = False  # an end callback is queued on the outermost graph task
        #: Whether a parameter gradient arrived and the pass has not ended.
        self.running = False
        self.start: float | None = None
        """``time.perf_counter()`` at the start of the current pass, None before it starts."""

    def forward_ended(self) -> None:
        """A forward ended: the next pass starts afresh."""
        self.start = None

    def output_reached(self) -> None:
        """A gradient reached one of the outputs: the pass has started."""
        if not self._armed:
            # Queued from the outermost graph task: a reentrant backward (checkpointing) nested
            # in it must not end the iteration when it ends.
            self._armed = True
            Variable._execution_engine.queue_callback(self._outermost_ended)
        now = time.perf_counter()
        if self.start is None or now < self.start:
            self.start = now

    def gradient_arrived(self, now: float) -> None:
        """A parameter's gradient arrived at ``now``.

        Args:
            now: ``time.perf_counter()`` at its arrival.
        """
        if self.running:
            return
        self.running = True
        if self.start is None:
            self.start = now
        if not self._armed:
            # Backward did not pass through the output: end with this graph task.
            Variable._execution_engine.queue_callback(self._ended)

    def _outermost_ended(self) -> None:
        self._armed = False
        if self.running:  # else no gradient arrived (torch.autograd.grad, say)
            self._ended()

    def _ended(self) -> None:
        end = time.perf_counter()
        self.running = False
        self._on_end(end)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside a (possibly nested) model output.

    Args:
        value: the output.
    """
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]
