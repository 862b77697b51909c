"""SpecTrain weight prediction: the weights a stage will have by the time its gradient lands.

``s`` SGD-momentum steps ahead the weights are close to ``W - s * lr * v``; each stage's ``s``
comes from :func:`version_difference`. Nothing here modifies the model or the optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from interlace.errors import UsageError
from interlace.pipeline.schedule import version_difference

__all__ = ["check_predictable", "predict_weights", "predicted_parameters", "version_difference"]


def predict_weights(weight: Tensor, momentum_buffer: Tensor | None, lr: float, s: int) -> Tensor:
    """The weights ``s`` SGD-momentum steps ahead: a new ``weight - s * lr * momentum_buffer``.

    Neither ``weight`` nor ``momentum_buffer`` is modified, and the result never shares storage
    with them and does not require grad, so it can be swapped into a module for one pass and
    thrown away. With no momentum buffer (no optimizer step yet) or ``s == 0`` it is a copy of the
    current weights.

    Args:
        weight: the current weights.
        momentum_buffer: SGD's momentum buffer of the weights; None before the first step.
        lr: the learning rate of the weights' parameter group.
        s: how many optimizer steps ahead to predict (>= 0).

    Raises :class:`ValueError` for ``s < 0``, a non-finite ``lr``, or a buffer whose shape differs
    from the weight's.
    """
    if s < 0:
        raise ValueError(f"the number of steps to predict ahead must be >= 0, got s={s}")
    if not math.isfinite(lr):
        raise ValueError(f"lr must be finite, got {lr}")
    if momentum_buffer is not None and momentum_buffer.shape != weight.shape:
        raise ValueError(
            f"momentum buffer of shape {tuple(momentum_buffer.shape)} does not match the weight "
            f"of shape {tuple(weight.shape)}"
        )
    if momentum_buffer is None or s == 0:
        return weight.detach().clone()
    # torch.sub with alpha allocates the result: one fused op, nothing written in place.
    return torch.sub(weight.detach(), momentum_buffer.detach(), alpha=s * lr)


def check_predictable(optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`~interlace.errors.UsageError` unless ``optimizer`` supports weight prediction.

    SpecTrain extrapolates along the momentum buffer of :class:`torch.optim.SGD`, so it needs that
    optimizer with ``momentum > 0`` in every parameter group; anything else would run the pipeline
    on stale weights without saying so.

    Args:
        optimizer: the stage's optimizer.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        raise UsageError(
            "SpecTrain weight prediction needs torch.optim.SGD with momentum > 0, got "
            f"{type(optimizer).__name__}; build the optimizer as "
            "torch.optim.SGD(params, lr=..., momentum=0.9) or turn weight prediction off"
        )
    for index, group in enumerate(optimizer.param_groups):
        momentum = float(group.get("momentum", 0.0))
        if not momentum > 0:
            raise UsageError(
                "SpecTrain weight prediction needs torch.optim.SGD with momentum > 0, but "
                f"parameter group {index} has momentum={momentum}; pass momentum=0.9 (or another "
                "positive value) to torch.optim.SGD or turn weight prediction off"
            )


def predicted_parameters(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
    s: int,
) -> dict[str, Tensor]:
    """Predict every parameter ``s`` steps ahead from ``optimizer``'s lr and momentum buffers.

    Each parameter uses the learning rate of its own parameter group and its
    ``optimizer.state[p]["momentum_buffer"]``; a parameter without a buffer yet, or not managed by
    ``optimizer``, is predicted as its current value (docs/notes/train.md says why). Returns
    ``name -> new tensor``; nothing in the model or the optimizer is modified.

    Args:
        named_parameters: the stage's (name, parameter) pairs.
        optimizer: the SGD with momentum that updates them.
        s: how many optimizer steps ahead to predict (>= 0).

    Raises :class:`~interlace.errors.UsageError` when ``optimizer`` is not
    :class:`torch.optim.SGD` with momentum > 0 (:func:`check_predictable`), and
    :class:`ValueError` for ``s < 0``.
    """
    check_predictable(optimizer)
    if s < 0:
        raise ValueError(f"the number of steps to predict ahead must be >= 0, got s={s}")
    lr_of: dict[int, float] = {}
    for group in optimizer.param_groups:
        lr = float(group["lr"])
        for param in group["params"]:
            lr_of[id(param)] = lr
    predicted: dict[str, Tensor] = {}
    for name, param in named_parameters:
        group_lr = lr_of.get(id(param))
        # .get, not [], so looking does not add an empty entry to the optimizer's defaultdict.
        buffer = optimizer.state.get(param, {}).get("momentum_buffer")
        if group_lr is None or not isinstance(buffer, Tensor):
            predicted[name] = predict_weights(param, None, 0.0, s)
        else:
            predicted[name] = predict_weights(param, buffer, group_lr, s)
    return predicted
