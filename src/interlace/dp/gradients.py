"""DataParallel's gradients in and out of the buckets: when each is complete, where averages go.

A gradient is sent once complete: at its hook as a rule, at the end of backward when it came
from ``no_sync()`` passes or a reentrant backward accumulates into it more than once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from interlace.comm.engine import BucketEngine

__all__ = ["Arrivals", "write_averages"]


class Arrivals:
    """Which parameters' gradients of the current backward are complete.

    A reentrant backward (``torch.utils.checkpoint(..., use_reentrant=True)`` around a block
    used twice) accumulates into a gradient once per use; the first backward, whose
    gradients all go out at its end, counts how often each arrives, and later ones send a
    gradient when it has arrived that often.

    Args:
        count: The number of parameters.
    """

    def __init__(self, count: int) -> None:
        self.hits = [0] * count
        self.needed = [1] * count
        self.late: list[int] = []
        #: Parameters given a gradient inside ``no_sync()`` since the last averaging pass.
        self.accumulated: set[int] = set()

    def complete(self, index: int, *, counting: bool) -> bool:
        """A gradient of parameter ``index`` arrived: whether it is complete (send it now).

        Args:
            index: The parameter's index.
            counting: Whether this is the first backward, which only counts.
        """
        hits = self.hits[index] = self.hits[index] + 1
        if hits < self.needed[index] or counting:
            self.late.append(index)
            return False
        return True

    def overdue(self, index: int) -> bool:
        """Whether parameter ``index`` got more gradients than the first backward gave it.

        Args:
            index: The parameter's index.
        """
        return self.hits[index] > self.needed[index]

    def finish(
        self, engine: BucketEngine, params: Sequence[nn.Parameter], *, counting: bool
    ) -> None:
        """Backward is over: hand ``engine`` the gradients complete only now; count afresh.

        Args:
            engine: The bucket engine of this backward.
            params: The parameters, in the engine's order.
            counting: Whether this was the first backward (its counts are kept).
        """
        for index in sorted(self.accumulated.union(self.late)):
            grad = params[index].grad
            if grad is not None and not engine.launcher.arrived(index):
                engine.add(index, grad)
        if counting:
            self.needed = [max(1, hits) for hits in self.hits]
        self.accumulated.clear()
        self.late.clear()
        self.hits = [0] * len(self.hits)


def write_averages(
    params: Sequence[nn.Parameter], averaged: Sequence[torch.Tensor | None], *, as_views: bool
) -> None:
    """Give each parameter its averaged gradient; one no rank produced keeps its ``.grad``
    (as in DDP).

    Args:
        params: The parameters.
        averaged: Their averaged gradients (views into the buckets), None where unused.
        as_views: Make ``.grad`` the bucket's view itself (``gradient_as_bucket_view``)
            instead of a copy.
    """
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for param, grad in zip(params, averaged, strict=True):
        if grad is None:
            continue
        if as_views:
            param.grad = grad
        elif param.grad is None:
            param.grad = grad.clone()
        else:
            targets.append(param.grad)
            sources.append(grad)
    # One batched copy: a Python-level copy per parameter costs more than the copying on
    # models of many small tensors.
    if targets:
        torch._foreach_copy_(targets, sources)
