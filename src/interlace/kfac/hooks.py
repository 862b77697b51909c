"""The hooks K-FAC leaves on each registered module: the forward hook, safe to deep-copy with the
model, and :class:`FactorHooks`, which sums each layer's ``A`` and ``G`` for the batch from them."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from interlace.kfac.factor_comm import FactorComm
from interlace.kfac.preconditioned_layer import KFACLayer, restart_non_finite
from interlace.kfac.timing import SpanLog
from interlace.kfac.warning import KFACWarning

__all__ = ["FactorHooks", "LayerForwardHook"]

#: ``(layer, module, inputs, output)``: what the hook hands on.
ForwardHook = Callable[[KFACLayer, nn.Module, tuple[Any, ...], Any], None]


class LayerForwardHook:
    """Calls ``forward(layer, module, inputs, output)`` after ``layer``'s module runs.

    ``copy.deepcopy(model)`` (an EMA copy, an evaluation copy) copies the hooks of its modules.
    A copied hook would copy the preconditioner behind it, process groups and all, which cannot
    be copied. So a deep copy shares this hook, and the hook ignores any module other than the
    one it was registered on: the copy is a plain model, not preconditioned.

    Args:
        layer: The registered layer.
        forward: The preconditioner's forward hook.
    """

    def __init__(self, layer: KFACLayer, forward: ForwardHook) -> None:
        self.layer = layer
        self.forward = forward

    def __call__(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if module is self.layer.helper.module:
            self.forward(self.layer, module, inputs, output)

    def __deepcopy__(self, memo: dict[int, Any]) -> LayerForwardHook:
        return self


class FactorHooks:
    """Each registered layer's ``A`` (forward hook) and ``G`` (its output's gradient hook) summed
    for the batch and handed to the factor communication as soon as they are made.

    Their time is kept for the next step's phases: computing factors is ``factor_compute``,
    handing them over (packing, starting a pipelined all-reduce) is ``factor_comm``.

    Args:
        comm: Where each computed factor goes.
        spans: Where each hook's work is timed.
        collecting: Whether a module's pass collects factors now (training, gradients on, a
            factor step).
        layers: The registered layers now (the first step may drop some).
        factor_dtype: dtype the factors are computed in (None: the layer's).
        world_size: The ranks the loss is averaged over (``G``'s normalisation).
        per_example: ``G`` of the per-example loss rather than of the mean loss.
        grad_scale: The loss scale to take out of ``G`` (None: no scaling).
    """

    def __init__(
        self,
        comm: FactorComm,
        spans: SpanLog,
        *,
        collecting: Callable[[nn.Module], bool],
        layers: Callable[[], list[KFACLayer]],
        factor_dtype: torch.dtype | None,
        world_size: int,
        per_example: bool,
        grad_scale: Callable[[], float] | None,
    ) -> None:
        self._comm = comm
        self._spans = spans
        self._collecting = collecting
        self._layers = layers
        self._factor_dtype = factor_dtype
        self._world_size = world_size
        self._per_example = per_example
        self._grad_scale = grad_scale
        #: Rows of the last output gradient (the per-rank batch, as ``G`` saw it).
        self.batch_rows = 1
        self._compute_s = 0.0
        self._hand_over_s = 0.0
        # The loss scale, read once per backward: a read is a device sync on an accelerator.
        self._scale_now: float | None = None
        # Whether a forward hook has checked the sums since the last backward (a new batch).
        self._batch_checked = False

    def take_seconds(self) -> tuple[float, float]:
        """Seconds computing factors and handing them over since the last call."""
        taken = (self._compute_s, self._hand_over_s)
        self._compute_s = self._hand_over_s = 0.0
        return taken

    def forward(
        self, layer: KFACLayer, module: nn.Module, inputs: tuple[Any, ...], output: Any
    ) -> None:
        """``layer``'s forward hook: its ``A``, and a hook on its output's gradient.

        Args:
            layer: The registered layer.
            module: Its module.
            inputs: The module's inputs.
            output: The module's output.
        """
        if not self._collecting(module) or not inputs:
            return
        started = time.perf_counter()
        self._scale_now = None  # a forward: the scale may have changed since the last backward
        if layer.g_count and layer.g_count >= layer.a_count and not self._batch_checked:
            # A backward went through this layer since the last step: a new batch, so either
            # accumulation or a step the caller skipped (say, on a non-finite loss).
            self._batch_checked = True
            self._drop_non_finite_sums()
        with torch.no_grad():
            a = layer.add_input(inputs[0], self._factor_dtype)
            computed = time.perf_counter()
            self._comm.factor_ready((layer.name, "A"), a, layer.a_count)
            handed = time.perf_counter() - computed
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(partial(self.grad, layer))
        ended = time.perf_counter()
        self._compute_s += ended - started - handed
        self._hand_over_s += handed
        self._spans.add(f"A {layer.name}", "factor", started, computed)

    def grad(self, layer: KFACLayer, grad: torch.Tensor) -> None:
        """``layer``'s output-gradient hook: its ``G``.

        Args:
            layer: The registered layer.
            grad: The gradient of the loss with respect to its output.
        """
        started = time.perf_counter()
        self._batch_checked = False
        with torch.no_grad():
            if self._grad_scale is not None:
                if self._scale_now is None:
                    self._scale_now = self._grad_scale()
                grad = grad / self._scale_now  # G of the unscaled loss, as without AMP
            self.batch_rows = grad.shape[0]
            g = layer.add_grad_output(grad, self._factor_dtype, self._world_size, self._per_example)
            computed = time.perf_counter()
            self._comm.factor_ready((layer.name, "G"), g, layer.g_count)
        ended = time.perf_counter()
        self._compute_s += computed - started
        self._hand_over_s += ended - computed
        self._spans.add(f"G {layer.name}", "factor", started, computed)

    def _drop_non_finite_sums(self) -> None:
        """Forget the factor sums that are not finite, so that a batch whose step was skipped
        leaves nothing behind in the next one's."""
        bad = restart_non_finite(self._layers())
        if bad:
            warnings.warn(
                f"K-FAC: the factors summed since the last step() are not finite in "
                f"{', '.join(bad)} (a step skipped after a bad batch?); they are dropped and "
                "this batch's factors start afresh",
                KFACWarning,
                stacklevel=4,
            )
