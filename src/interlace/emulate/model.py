"""An emulated model built from a trace: the traced parameters, device time instead of compute.

Each traced layer is a module whose forward and backward sleep the layer's traced time x the
dilation, leaving the cores to communication, and whose gradients are cheap, deterministic
functions of the inputs.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from interlace.emulate.device import DeviceClock
from interlace.emulate.dilation import DEFAULT_DILATION, check_dilation
from interlace.sim.trace import Trace, load_trace

_NOT_A_NAME = re.compile(r"\W")
#: torch runs an elementwise kernel on one thread up to this many elements (its grain size).
_SERIAL_ELEMENTS = 32768


@dataclass(frozen=True)
class EmulationCost:
    """The CPU time the emulation itself took, against the device time it emulated.

    Args:
        cpu_s: CPU time spent in the emulated layers' forward and backward (thread CPU time:
            the gradient arithmetic and bookkeeping, not the sleeps), seconds.
        device_s: The emulated device time over the same passes (dilated), seconds.
        iterations: Backward passes counted.
    """

    cpu_s: float
    device_s: float
    iterations: int

    @property
    def fraction(self) -> float:
        """CPU time per emulated device second (0.01 means 1%)."""
        return self.cpu_s / self.device_s if self.device_s > 0 else 0.0

    def describe(self) -> str:
        """One line: CPU ms and device ms per iteration, and their ratio."""
        per = max(self.iterations, 1)
        return (
            f"emulation CPU {1e3 * self.cpu_s / per:.2f} ms per iteration against "
            f"{1e3 * self.device_s / per:.1f} ms of device time ({100 * self.fraction:.2f}%)"
        )


class _Meter:
    """Running totals of an emulated model's own CPU time and its device time."""

    def __init__(self) -> None:
        #: Spends the layers' forward times, carrying each sleep's overshoot to the next.
        self.clock = DeviceClock()
        self.cpu_s = 0.0
        self.device_s = 0.0
        self.iterations = 0
        #: ``time.perf_counter()`` at which the emulated device finished its latest backward
        #: work, and the index of the layer that did it (-1: none in this backward pass).
        self.device_free = 0.0
        self.last_index = -1


class _DeviceTime(torch.autograd.Function):
    """Forward and backward of one emulated layer: device time, pass-through, cheap gradients.

    Arguments of ``apply``: the input, the layer, then the layer's parameters (so that autograd
    hands their gradients to their accumulators as soon as this backward returns).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: EmulatedLayer, *params: torch.Tensor) -> Any:
        cpu = time.thread_time()
        layer.meter.clock.spend(layer.forward_s)
        ctx.layer = layer
        ctx.save_for_backward(x)
        out = x.clone()
        layer.meter.cpu_s += time.thread_time() - cpu
        layer.meter.device_s += layer.forward_s
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        cpu, start = time.thread_time(), time.perf_counter()
        layer: EmulatedLayer = ctx.layer
        meter = layer.meter
        # A device runs the layers' backward kernels back to back while the host runs the
        # hooks (bucket copies, launches) of the layer before: this layer ends one backward time
        # after the previous one did on the device, not after the host came back to it.
        if meter.last_index != layer.index + 1:
            meter.device_free = start  # the first emulated layer of this backward pass
        deadline = meter.device_free + layer.backward_s
        (x,) = ctx.saved_tensors
        # One scalar per layer from the batch and the upstream gradient, times a fixed factor per
        # parameter: different inputs give different gradients at one write per element.
        scale = float((grad_out * x).sum()) * layer.scale
        grads = tuple(_filled(numel, scale * factor) for numel, factor in layer.factors)
        # The gradients are made within the layer's device time, not after it.
        time.sleep(max(deadline - time.perf_counter(), 0.0))
        meter.device_free = deadline
        meter.last_index = layer.index
        meter.cpu_s += time.thread_time() - cpu
        meter.device_s += layer.backward_s
        if layer.index == 0:
            meter.iterations += 1
            meter.last_index = -1
        return (grad_out, None, *grads)


class _BackwardRest(torch.autograd.Function):
    """The part of backward no traced layer owns (parameter-free kernels), after the last layer.

    Arguments of ``apply``: the input, the model, and a fresh leaf that makes autograd reach
    this node after the first layer's backward.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, model: EmulatedModel, anchor: torch.Tensor) -> Any:
        ctx.model = model
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        model: EmulatedModel = ctx.model
        meter = model._meter
        cpu, start = time.thread_time(), time.perf_counter()
        # Ends one rest after the device finished the first layer's backward, as the replay has it.
        deadline = (meter.device_free or start) + model.backward_rest_s
        time.sleep(max(deadline - time.perf_counter(), 0.0))
        meter.cpu_s += time.thread_time() - cpu
        meter.device_s += model.backward_rest_s
        return grad_out, None, torch.zeros(())


class EmulatedLayer(nn.Module):
    """One traced layer: one flat parameter per traced tensor, and its dilated device times.

    Args:
        name: The traced layer's name.
        index: The layer's place in forward order (0 nearest the input).
        params: ``(parameter name, numel)`` of each traced tensor, in trace order.
        forward_s: Dilated forward device time, seconds.
        backward_s: Dilated backward device time, seconds.
        first: The index of the layer's first parameter in the model.
        meter: Where the model totals the emulation's CPU and device time.
    """

    def __init__(
        self,
        name: str,
        index: int,
        params: list[tuple[str, int]],
        *,
        forward_s: float,
        backward_s: float,
        first: int,
        meter: _Meter,
    ) -> None:
        super().__init__()
        self.name = name
        self.index = index
        self.forward_s = forward_s
        self.backward_s = backward_s
        self.scale = 1.0 / (index + 1)
        self.meter = meter
        #: ``(numel, factor)`` of each parameter: its gradient is the layer's scalar x factor.
        self.factors: list[tuple[int, float]] = []
        for position, (given, numel) in enumerate(params):
            # Two traced tensors of one layer may share a name.
            param_name = f"p{position}_{given}" if hasattr(self, given) else given
            self.register_parameter(param_name, nn.Parameter(torch.zeros(numel)))
            self.factors.append((numel, gradient_factor(first + position)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as a new tensor, after the layer's forward device time.

        Args:
            x: The input.
        """
        out: torch.Tensor = _DeviceTime.apply(x, self, *self.parameters())  # type: ignore[no-untyped-call]
        return out


class EmulatedModel(nn.Module):
    """A model emulated from a trace: its traced parameters, its traced time as device time.

    One :class:`EmulatedLayer` per traced layer, in forward order (the trace's backward order
    reversed), each with one flat parameter per traced tensor of that size. The forward pass
    returns its input unchanged (as a new tensor); each layer's forward and backward take the
    layer's traced time x ``dilation`` as sleep, so the cores stay free for communication. In
    the forward the time outside the layers is spread over them (:attr:`Trace.pass_scales`), so
    a forward pre-hook waits between layers as on the traced device. A layer's
    backward returns its parameters' gradients before the next layer's backward starts, so
    torch DDP's and :class:`interlace.DataParallel`'s gradient hooks fire layer by layer as on
    the traced device. Gradients are a per-layer scalar (from the batch and the upstream
    gradient) times a fixed factor per parameter (:func:`gradient_factor`).

    Args:
        trace: A :class:`~interlace.sim.trace.Trace`, a shipped trace's name
            (``googlenet-k80``) or a trace file.
        dilation: Multiplies every device time (:data:`DEFAULT_DILATION`).

    Raises:
        UsageError: For an unknown trace name, an unreadable trace, or a dilation that is not a
            finite number > 0.
    """

    def __init__(self, trace: Trace | str | Path, dilation: float = DEFAULT_DILATION) -> None:
        super().__init__()
        self.dilation = check_dilation(dilation)
        self.trace = trace if isinstance(trace, Trace) else load_trace(trace)
        self._meter = _Meter()
        # Each layer's forward as the simulator's gates have it: its share of the whole pass.
        gates = self.trace.forward_gates()
        forward_layers = list(reversed(self.trace.layers))
        layers: list[EmulatedLayer] = []
        first = 0
        for index, (name, indices) in enumerate(forward_layers):
            # Forward order is the trace's backward order reversed, within a layer too.
            tensors = [self.trace.tensors[i] for i in reversed(indices)]
            params = [(_param_name(t.name, name, i), t.numel) for i, t in enumerate(tensors)]
            layers.append(
                EmulatedLayer(
                    name,
                    index,
                    params,
                    forward_s=gates[index].forward_s * self.dilation,
                    backward_s=tensors[0].layer_backward_s * self.dilation,
                    first=first,
                    meter=self._meter,
                )
            )
            first += len(params)
        self.layers = nn.ModuleList(layers)
        # Parameter-free kernels (activations, pooling) take the trace's totals beyond its
        # layers' own times: forward's spread over the layers (all of it at the end where the
        # layers record no forward time), backward's after its last layer.
        trace = self.trace
        layers_forward_s = sum(layer.forward_s for layer in layers)
        self.forward_rest_s = max(trace.forward_s * self.dilation - layers_forward_s, 0.0)
        self.backward_rest_s = (
            max(trace.backward_s - trace.layer_backward_total_s, 0) * self.dilation
        )

    @property
    def step_s(self) -> float:
        """Dilated device time of one optimizer step (the trace's ``step_s`` x dilation)."""
        return self.trace.step_s * self.dilation

    @property
    def device_s(self) -> float:
        """Dilated device time of one forward and backward pass, seconds (the trace's totals)."""
        layers = sum(layer.forward_s + layer.backward_s for layer in self.emulated_layers())
        return layers + self.forward_rest_s + self.backward_rest_s

    def named_trace(self) -> Trace:
        """The (undilated) trace with each tensor named as the model's parameter that stands
        for it, so plans made on the wrapped model (bucket tensor names) apply to the trace."""
        names = [name for name, _ in self.named_parameters()]
        # Parameters run in forward order, the trace's tensors in backward order.
        tensors = tuple(
            replace(tensor, name=name)
            for tensor, name in zip(self.trace.tensors, reversed(names), strict=True)
        )
        return replace(self.trace, tensors=tensors)

    def emulated_layers(self) -> list[EmulatedLayer]:
        """The layers, in forward order."""
        return [layer for layer in self.layers if isinstance(layer, EmulatedLayer)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.with_backward_rest(x)
        for layer in self.emulated_layers():
            x = layer(x)
        if self.forward_rest_s > 1e-9:
            self._meter.clock.spend(self.forward_rest_s)
            self._meter.device_s += self.forward_rest_s
        return x

    def with_backward_rest(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` through the node whose backward sleeps the rest of backward (none: ``x``).

        Args:
            x: The model's input.
        """
        if self.backward_rest_s <= 0 or not torch.is_grad_enabled():
            return x
        anchor = torch.zeros((), requires_grad=True)
        out: torch.Tensor = _BackwardRest.apply(x, self, anchor)  # type: ignore[no-untyped-call]
        return out

    def emulation_cost(self) -> EmulationCost:
        """The emulation's own CPU time and the device time emulated since the last reset."""
        meter = self._meter
        return EmulationCost(meter.cpu_s, meter.device_s, meter.iterations)

    def reset_emulation_cost(self) -> None:
        """Start counting :meth:`emulation_cost` afresh (e.g. after warm-up iterations)."""
        self._meter.cpu_s = self._meter.device_s = 0.0
        self._meter.iterations = 0


class EmulatedStep(torch.optim.Optimizer):
    """An optimizer whose step is the traced step's device time: a sleep, parameters unchanged.

    On a GPU the optimizer step runs on the device; on the CPU a real step over the emulated
    model's parameters would hold a core for as long as a backward pass. The emulated model's
    gradients teach nothing, so its step only needs to take the right time: the traced step's
    share for the parameters it updates (all of them, or a bucket's when the update is deferred;
    a shard's under FSDP2).

    Args:
        model: The emulated model whose parameters (and ``step_s``) the step stands for.
        params: The parameters to own (default ``model.parameters()``); a wrapper's
            ``parameters()`` are the same tensors.
    """

    def __init__(self, model: EmulatedModel, params: Any = None) -> None:
        super().__init__(model.parameters() if params is None else params, {})
        self._step_s = model.step_s
        self._numel = sum(
            _local_numel(param) for group in self.param_groups for param in group["params"]
        )
        self._clock = DeviceClock()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Sleep the traced step's device time, in proportion to the parameters that have a
        gradient (an optimizer updates only those).

        Args:
            closure: Re-evaluates the loss, as for any optimizer; its value is returned.
        """
        loss = closure() if closure is not None else None
        stepped = sum(
            _local_numel(param)
            for group in self.param_groups
            for param in group["params"]
            if param.grad is not None
        )
        if self._step_s > 0 and stepped:
            self._clock.spend(self._step_s * stepped / max(self._numel, 1))
        return loss


def _local_numel(param: torch.Tensor) -> int:
    """The elements this rank updates: a sharded parameter's (FSDP2's DTensor) local part."""
    to_local = getattr(param, "to_local", None)
    return int(to_local().numel()) if callable(to_local) else param.numel()


def gradient_factor(position: int) -> float:
    """The fixed factor of the gradient of the model's ``position``-th parameter (0-based).

    Args:
        position: The parameter's place in :meth:`EmulatedModel.parameters` order.
    """
    return 1.0 + 0.5 * math.sin(position + 1.0)


def _filled(numel: int, value: float) -> torch.Tensor:
    """A new tensor of ``numel`` copies of ``value``, filled on this thread alone.

    Pieces no larger than torch's parallel grain stay serial: an intra-op thread pool woken
    here would spin on the cores the communication needs while the next layer sleeps.
    """
    out = torch.empty(numel)
    for piece in out.split(_SERIAL_ELEMENTS):
        piece.fill_(value)
    return out


def _param_name(tensor: str, layer: str, position: int) -> str:
    """The tensor's name within its layer, made a valid attribute name."""
    short = tensor[len(layer) + 1 :] if tensor.startswith(layer + ".") else tensor
    short = _NOT_A_NAME.sub("_", short)
    return short if short and not short[0].isdigit() else f"p{position}_{short}"


def measure_cost(
    emulated: EmulatedModel,
    batch: torch.Tensor,
    iterations: int = 3,
    wrapper: nn.Module | None = None,
) -> EmulationCost:
    """Process CPU time of forward + backward against their emulated device time.

    Runs ``wrapper`` (or ``emulated`` itself) ``iterations`` times on ``batch`` with
    ``output.sum()`` as the loss, after one warm-up pass. Process CPU time counts every thread,
    so with a wrapper it includes the wrapper's own work (hooks, copies, communication).

    Args:
        emulated: The emulated model.
        batch: The input.
        iterations: Timed passes (>= 1).
        wrapper: A module wrapping ``emulated`` (torch DDP, :class:`interlace.DataParallel`).

    Returns:
        The totals over the timed passes.
    """
    model = emulated if wrapper is None else wrapper
    iterations = max(int(iterations), 1)
    model(batch).sum().backward()
    cpu = time.process_time()
    for _ in range(iterations):
        model.zero_grad(set_to_none=True)
        model(batch).sum().backward()
    return EmulationCost(time.process_time() - cpu, emulated.device_s * iterations, iterations)
