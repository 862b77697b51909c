"""The forward hook K-FAC leaves on each registered module, safe to deep-copy with the model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from interlace.kfac.preconditioned_layer import KFACLayer

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
