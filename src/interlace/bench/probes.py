"""The simulator's contention probes, taken on the ranks beside the plain module's timings.

:class:`ContentionProbe` runs the start-up, overlap and synchronisation probes as a block of
their own in every round and returns :class:`~interlace.sim.contention.ContentionSamples`;
:func:`hooked_stream_sample` times the job's own all-reduces issued from backward's hooks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional

from interlace.bench.harness import max_over_ranks
from interlace.sim.contention import SMALL_BYTES, ContentionSamples, mixed_sizes


def _iteration_with_startups(
    model: Any, optimizer: Any, batch: tuple[Any, Any], issued: list[Any]
) -> tuple[float, float]:
    """One plain iteration whose backward's hooks append all-reduces to ``issued``: seconds of
    backward, and from backward's start to the end of the last all-reduce."""
    inputs, targets = batch
    optimizer.zero_grad()
    loss = functional.cross_entropy(model(inputs), targets)
    issued.clear()
    start = time.perf_counter()
    loss.backward()
    backward_end = time.perf_counter()
    # Waited for after backward: the stream outlasts backward (a completion callback per
    # all-reduce would take the GIL on gloo's threads and slow the stream).
    for handle in issued:
        handle.wait()
    end = time.perf_counter()
    issued.clear()
    optimizer.step()
    return backward_end - start, end - start


class ContentionProbe:
    """Takes :class:`~interlace.sim.contention.ContentionSamples` beside the plain module's
    measurements.

    Only while its block runs does it hook every parameter of ``model``, so the benchmark's
    own timings of that module see no hooks.

    Args:
        model: The plain module the benchmark times.
        optimizer: Its optimizer.
        flat: A flat tensor of all gradients' size, for the synchronisation probe.
    """

    def __init__(self, model: Any, optimizer: Any, flat: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self.flat = flat
        self._params = [p for p in model.parameters() if p.requires_grad]
        count = len(self._params)
        self._streams = {
            "stream": [torch.zeros(SMALL_BYTES // 4) for _ in range(count)],
            "mixed": [torch.zeros(nbytes // 4) for nbytes in mixed_sizes(count)],
        }
        self._issued: list[Any] = []
        self._raw: dict[str, list[float]] = {
            "stream_backward_s": [],
            "stream_done_s": [],
            "mixed_backward_s": [],
            "mixed_done_s": [],
            "flat_backward_s": [],
            "flat_done_s": [],
            "serial_s": [],
        }

    def block(self, iterations: int, next_batch: Callable[[], tuple[Any, Any]]) -> None:
        """The start-up, overlap and synchronisation probes: ``iterations`` plain iterations of
        each, back to back, timed as a strategy's block is (collective). Run as strategies
        run, they pay what the strategies pay (see docs/notes/sim.md).

        Args:
            iterations: Iterations of each probe.
            next_batch: Gives the next ``(inputs, targets)``.
        """

        # The all-reduces of the stream being probed, in the order the hooks issue them.
        stream: list[Any] = []

        def hook(_param: Any) -> None:
            handle = dist.all_reduce(stream[len(self._issued)], async_op=True)
            if handle is not None:
                self._issued.append(handle)

        hooks = [param.register_post_accumulate_grad_hook(hook) for param in self._params]
        try:
            for name, tensors in self._streams.items():
                stream[:] = tensors
                dist.barrier()
                for _ in range(iterations):
                    backward, done = _iteration_with_startups(
                        self.model, self.optimizer, next_batch(), self._issued
                    )
                    self._raw[f"{name}_backward_s"].append(backward)
                    self._raw[f"{name}_done_s"].append(done)
        finally:
            for handle in hooks:
                handle.remove()
        dist.barrier()
        for _ in range(iterations):
            self._raw["serial_s"].append(self._serial(*next_batch()))

    def add_bulk(self, backward_s: float, done_s: float) -> None:
        """The bytes probe: the benchmark's own plain iteration with the all-reduce of all
        gradients launched as backward starts, its backward and the all-reduce's end, both
        from backward's start.

        Args:
            backward_s: The backward.
            done_s: The all-reduce's end.
        """
        self._raw["flat_backward_s"].append(backward_s)
        self._raw["flat_done_s"].append(done_s)

    def _serial(self, inputs: Any, targets: Any) -> float:
        """One plain iteration with the all-reduce of all gradients after backward."""

        start = time.perf_counter()
        self.optimizer.zero_grad()
        functional.cross_entropy(self.model(inputs), targets).backward()
        dist.all_reduce(self.flat)
        self.optimizer.step()
        return time.perf_counter() - start

    def finish(self) -> ContentionSamples:
        """The samples, each a maximum over ranks (collective: every rank calls it)."""
        maxima = {name: max_over_ranks(values) for name, values in self._raw.items()}
        return ContentionSamples(stream_count=len(self._params), **maxima)


def hooked_stream_sample(
    model: Any, optimizer: Any, inputs: Any, targets: Any, stream: dict[int, Any]
) -> float:
    """One plain iteration whose backward's hooks each issue an all-reduce of a tensor of their
    parameter's size, as per-tensor WFBP issues them (collective): seconds from backward's start
    to the end of the last all-reduce.

    Args:
        model: The plain module.
        optimizer: Its optimizer.
        inputs: A batch's inputs.
        targets: Its targets.
        stream: The tensor each parameter's hook all-reduces, by the parameter's ``id``.
    """
    issued: list[Any] = []

    def hook(param: Any) -> None:
        handle = dist.all_reduce(stream[id(param)], async_op=True)
        if handle is not None:
            issued.append(handle)

    params = [p for p in model.parameters() if p.requires_grad]
    hooks = [param.register_post_accumulate_grad_hook(hook) for param in params]
    try:
        dist.barrier()
        _, done = _iteration_with_startups(model, optimizer, (inputs, targets), issued)
    finally:
        for handle in hooks:
            handle.remove()
    return done
