"""Pipelines on emulated compute: a traced model as a sequence of blocks of device time.

:class:`EmulatedPipelineModel` holds one :class:`EmulatedBlock` per traced layer and lists them
as its pipeline blocks, so interlace's pipeline stages, torch's ``PipelineStage`` and data
parallelism cut and wrap it like a zoo model. A block's forward and backward take the layer's
traced time, with its share of the pass outside the layers, scaled to the micro-batch and times
the dilation, as device time. Its output is a real tensor of the traced activation size, so what
crosses a stage boundary is what the traced model sends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from interlace.emulate.device import DeviceClock
from interlace.emulate.dilation import DEFAULT_DILATION, check_dilation
from interlace.emulate.model import gradient_factor
from interlace.errors import UsageError
from interlace.sim.trace import Trace, load_trace

#: The per-rank batch a trace's times are taken for when it does not record one.
FALLBACK_TRACE_BATCH = 32


class _BlockTime(torch.autograd.Function):
    """One block's forward and backward: device time, an output of the traced size, cheap
    gradients (a scalar from the upstream gradient times a fixed factor per tensor)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, block: EmulatedBlock, *params: torch.Tensor) -> Any:
        rows = x.shape[0] if x.dim() else 1
        block.clock.spend(block.forward_s * rows / block.traced_batch)
        ctx.block = block
        ctx.rows = rows
        ctx.input_shape = x.shape
        ctx.input_dtype = x.dtype
        # The output carries one number from the input, so a stage's result depends on what it
        # was sent; filling it is one write per element, as a device kernel's output would be.
        level = float(x.detach().reshape(-1)[:1].sum()) if x.numel() else 0.0
        return torch.full((rows, *block.output_shape), 1e-3 * level + 1e-2 * block.position)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        block: EmulatedBlock = ctx.block
        block.clock.spend(block.backward_s * ctx.rows / block.traced_batch)
        scale = float(grad_out.reshape(-1)[:1].sum())
        grad_in = (
            torch.full(ctx.input_shape, scale, dtype=ctx.input_dtype)
            if ctx.input_dtype.is_floating_point
            else None
        )
        grads = tuple(
            torch.full((numel,), scale * factor) for numel, factor in block.gradient_factors
        )
        return (grad_in, None, *grads)


class EmulatedBlock(nn.Module):
    """One traced layer as a pipeline block: its parameters, output size and device times.

    Args:
        name: The traced layer's name.
        position: Its place in forward order.
        params: ``(numel)`` of each traced tensor of the layer.
        output_shape: One sample's output shape.
        forward_s: Undilated forward time for ``traced_batch`` samples, seconds.
        backward_s: Undilated backward time for ``traced_batch`` samples, seconds.
        traced_batch: The batch the times were traced at; a micro-batch of ``m`` samples takes
            ``m / traced_batch`` of them.
        first: The model-wide index of the layer's first parameter.
        clock: Where device time is spent (it holds the dilation).
    """

    def __init__(
        self,
        name: str,
        position: int,
        params: list[int],
        output_shape: tuple[int, ...],
        *,
        forward_s: float,
        backward_s: float,
        traced_batch: int,
        first: int,
        clock: DeviceClock,
    ) -> None:
        super().__init__()
        self.name = name
        self.position = position
        self.output_shape = tuple(output_shape)
        self.forward_s = forward_s
        self.backward_s = backward_s
        self.traced_batch = max(int(traced_batch), 1)
        self.clock = clock
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(numel)) for numel in params)
        self.gradient_factors = [
            (numel, gradient_factor(first + i)) for i, numel in enumerate(params)
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor of ``(batch, *output_shape)`` after the block's forward device time.

        Args:
            x: The block's input (only its batch dimension is read, and one element).
        """
        out: torch.Tensor = _BlockTime.apply(x, self, *self.weights)  # type: ignore[no-untyped-call]
        return out


class EmulatedPipelineModel(nn.Module):
    """A traced model as a sequence of :class:`EmulatedBlock`, one per traced layer.

    :meth:`pipeline_blocks` lists them, so
    :func:`interlace.pipeline.partition.pipeline_blocks` cuts the model like a zoo model's.

    Args:
        trace: A :class:`~interlace.sim.trace.Trace` with activation sizes, a shipped trace's
            name or a trace file.
        dilation: Multiplies every device time.
        classes: The last block's output size, when a loss needs a given number of classes
            (None: the traced size).

    Raises:
        UsageError: For an unknown or unreadable trace, a bad dilation, or a trace without
            activation sizes for every layer.
    """

    def __init__(
        self,
        trace: Trace | str | Path,
        dilation: float = DEFAULT_DILATION,
        *,
        classes: int | None = None,
    ) -> None:
        loaded = trace if isinstance(trace, Trace) else load_trace(trace)
        dilation = check_dilation(dilation)
        clock = DeviceClock(dilation)
        missing = [name for name, _ in loaded.layers if loaded.activation(name) is None]
        if missing:
            raise UsageError(
                f"trace {loaded.model!r} records no activation size for {len(missing)} of its "
                f"{len(loaded.layers)} layers (first: {missing[-1]}); a pipeline needs them: "
                "profile the model with `interlace profile --trace-out`"
            )
        batch = loaded.batch_size or FALLBACK_TRACE_BATCH
        blocks: list[EmulatedBlock] = []
        first = 0
        # A pipeline cuts between layers, so the passes' time outside them is spread over the
        # layers; the whole model then spends the traced passes, as EmulatedModel does.
        forward_scale, backward_scale = loaded.pass_scales
        forward_layers = list(reversed(loaded.layers))
        for position, (name, indices) in enumerate(forward_layers):
            tensors = [loaded.tensors[i] for i in reversed(indices)]
            activation = loaded.activation(name)
            assert activation is not None
            shape = activation.shape
            if classes is not None and position == len(forward_layers) - 1:
                shape = (classes,)
            blocks.append(
                EmulatedBlock(
                    name,
                    position,
                    [t.numel for t in tensors],
                    shape,
                    forward_s=tensors[0].layer_forward_s * forward_scale,
                    backward_s=tensors[0].layer_backward_s * backward_scale,
                    traced_batch=batch,
                    first=first,
                    clock=clock,
                )
            )
            first += len(tensors)
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.trace = loaded
        self.dilation = dilation
        #: Where every block spends its device time.
        self.clock = clock

    def emulated_blocks(self) -> list[EmulatedBlock]:
        """The blocks, in forward order."""
        return [block for block in self.blocks if isinstance(block, EmulatedBlock)]

    def pipeline_blocks(self) -> list[nn.Module]:
        """The blocks whose composition is :meth:`forward`, for cutting into stages."""
        return list(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def device_s(self, batch: int) -> float:
        """Dilated device time of one forward and backward pass over ``batch`` samples.

        Args:
            batch: Samples in the pass.
        """
        return (
            sum(
                (b.forward_s + b.backward_s) * batch / b.traced_batch
                for b in self.emulated_blocks()
            )
            * self.clock.dilation
        )
