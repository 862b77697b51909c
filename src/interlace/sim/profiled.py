"""Traces from measurements: per-tensor ready times, or the profile DataParallel planned with.

:func:`trace_from_plan` is what ``interlace profile --trace-out`` and the validation write.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from interlace.comm.plan import Plan
from interlace.sim.trace import FactorTrace, TensorTrace, Trace

if TYPE_CHECKING:
    from torch import nn


def from_ready(
    model: str,
    *,
    names: Sequence[str],
    layers: Sequence[str],
    numels: Sequence[int],
    element_bytes: Sequence[int],
    ready_s: Sequence[float],
    forward_s: float,
    backward_s: float,
    step_s: float = 0.0,
    layer_forward_s: dict[str, float] | None = None,
    factors: Sequence[FactorTrace] = (),
    source: str = "",
    workers: int = 1,
    notes: str = "",
    broadcast_bytes: Sequence[int] = (),
) -> Trace:
    """A trace from measured per-tensor ready times (seconds from the start of backward).

    Tensors must come in ready order. Consecutive tensors of one layer form one run; the run's
    backward time is from the previous run's last ready time to its own last one, so the trace
    reproduces every run's ready time exactly. A layer without a measured forward time gets a
    share of ``forward_s`` in proportion to its backward time.

    Args:
        model: The model's name.
        names: Tensor names, in ready order.
        layers: Each tensor's layer.
        numels: Each tensor's elements.
        element_bytes: Each tensor's bytes per element.
        ready_s: Each tensor's ready time.
        forward_s: Whole forward pass.
        backward_s: Whole backward pass (at least the last ready time).
        step_s: Optimizer step.
        layer_forward_s: Measured forward time by layer.
        factors: K-FAC factor sizes.
        source: Where it was measured.
        workers: Ranks it was profiled with.
        notes: Free text.
        broadcast_bytes: Bytes of each collective before forward.

    Raises:
        ValueError: For lists of different lengths or tensors out of ready order.
    """
    count = len(names)
    if not count == len(layers) == len(numels) == len(element_bytes) == len(ready_s):
        raise ValueError("names, layers, numels, element_bytes and ready_s differ in length")
    if any(b < a for a, b in itertools.pairwise(ready_s)):
        raise ValueError("tensors must come in ready order")
    runs: list[tuple[str, list[int]]] = []
    for index in range(count):
        if runs and runs[-1][0] == layers[index]:
            runs[-1][1].append(index)
        else:
            runs.append((layers[index], [index]))
    backward_of: list[float] = [0.0] * count
    previous = 0.0
    for _, indices in runs:
        end = max(ready_s[indices[-1]], 0.0)
        for index in indices:
            backward_of[index] = end - previous
        previous = end
    measured = layer_forward_s or {}
    total_backward = max(previous, 1e-12)
    tensors = tuple(
        TensorTrace(
            names[i],
            layers[i],
            numels[i],
            numels[i] * element_bytes[i],
            measured.get(layers[i], forward_s * backward_of[i] / total_backward),
            backward_of[i],
        )
        for i in range(count)
    )
    return Trace(
        model=model,
        tensors=tensors,
        forward_s=forward_s,
        backward_s=max(backward_s, previous),
        step_s=step_s,
        factors=tuple(factors),
        source=source,
        workers=workers,
        notes=notes,
        broadcast_bytes=tuple(broadcast_bytes),
    )


def trace_from_plan(
    plan: Plan,
    module: nn.Module,
    model: str,
    *,
    step_s: float = 0.0,
    layer_forward_s: dict[str, float] | None = None,
    workers: int = 1,
    source: str = "",
) -> Trace:
    """A simulator trace from the profile DataParallel planned with.

    Args:
        plan: Holds the parameters in ready order with the slowest rank's median ready times,
            and ``forward_s``/``backward_s`` the whole passes, all measured with communication
            held to the end of backward.
        module: Gives element counts, layers (a parameter's owning module) and K-FAC factor
            sizes.
        model: The model's name.
        step_s: The optimizer step, seconds.
        layer_forward_s: Each layer's forward, seconds (see :func:`from_ready`).
        workers: The ranks it was profiled with.
        source: Where it was measured, free text.
    """
    params = dict(module.named_parameters())
    names = [tensor.name for tensor in plan.tensors]
    return from_ready(
        model,
        names=names,
        layers=[name.rpartition(".")[0] or name for name in names],
        numels=[params[name].numel() for name in names],
        element_bytes=[params[name].element_size() for name in names],
        ready_s=[tensor.ready_s for tensor in plan.tensors],
        forward_s=plan.forward_s,
        backward_s=plan.backward_s,
        step_s=step_s,
        layer_forward_s=layer_forward_s,
        factors=factor_sizes(module),
        source=source,
        workers=workers,
        notes="ready times: the slowest rank's medians over DataParallel's profiling passes",
        broadcast_bytes=buffer_broadcast_bytes(module),
    )


def buffer_broadcast_bytes(module: nn.Module) -> list[int]:
    """Bytes of the buffer broadcasts DataParallel (like DDP) makes before every forward: one
    flat message per dtype.

    Args:
        module: The model whose buffers are broadcast.
    """
    by_dtype: dict[str, int] = {}
    for buffer in module.buffers():
        by_dtype[str(buffer.dtype)] = (
            by_dtype.get(str(buffer.dtype), 0) + buffer.numel() * buffer.element_size()
        )
    return [nbytes for nbytes in by_dtype.values() if nbytes > 0]


def factor_sizes(module: nn.Module) -> list[FactorTrace]:
    """K-FAC factor dimensions of every Linear and Conv2d layer (the layers K-FAC handles).

    ``A`` covers a layer's input (a Conv2d's unfolded patch) plus a ones column for the bias;
    ``G`` its output.

    Args:
        module: The model.
    """
    from torch import nn  # noqa: PLC0415 - heavy import; loading and simulating traces need none

    factors = []
    for name, layer in module.named_modules():
        if isinstance(layer, nn.Linear):
            a_dim = layer.in_features + (layer.bias is not None)
            factors.append(FactorTrace(name, a_dim, layer.out_features))
        elif isinstance(layer, nn.Conv2d):
            kernel = layer.kernel_size[0] * layer.kernel_size[1]
            a_dim = layer.in_channels // layer.groups * kernel + (layer.bias is not None)
            factors.append(FactorTrace(name, a_dim, layer.out_channels))
    return factors
