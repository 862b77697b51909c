"""A pipeline stage's bookkeeping of its batches: cutting a mini-batch into micro-batches and
pieces, what a stage keeps of a batch between its forward and its backward, and what it puts
back after the backward."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from interlace.errors import UsageError

#: An ``(input, target)`` pair.
Batch = tuple[Tensor, Tensor]


@dataclass
class Piece:
    """One piece of a batch between its forward and its backward on this stage.

    Args:
        input: the stage's input (stage 0's data, or the activation received).
        output: the graph's root, from a kept forward or a recomputation.
        outgoing: computed, to be sent by the next SEND action.
        grad: the output's gradient, received.
        rng_state: the random-number state before the forward, for a recomputation.
        target: the targets (last stage only).
        scale: its share of the mini-batch's samples (scales the last stage's loss).
    """

    input: Tensor | None = None
    output: Tensor | None = None
    outgoing: Tensor | None = None
    grad: Tensor | None = None
    rng_state: Tensor | None = None
    target: Tensor | None = None
    scale: float = 1.0


@dataclass
class InFlight:
    """What a stage keeps of one batch between its forward and its backward: its pieces (one,
    or ``chunks`` for a streamed asynchronous mini-batch) and the weight copies they use.

    Args:
        pieces: the batch's pieces.
        leaves: weights a PREDICT or STASH made for the batch.
        graph_leaves: the weights the backward's graph is over.
        saved_buffers: the buffers before a recomputation.
    """

    pieces: list[Piece]
    leaves: dict[str, Tensor] | None = None
    graph_leaves: dict[str, Tensor] | None = None
    saved_buffers: list[Tensor] | None = None


def next_batch(source: Iterator[Batch] | None, stage: int) -> Batch | None:
    """The next batch of ``source`` (None without one), or a clear error when it ran out.

    Args:
        source: the stage's batches, or None on a stage that reads none.
        stage: the stage's index, for the error.
    """
    if source is None:
        return None
    try:
        return next(source)
    except StopIteration:
        raise UsageError(
            f"pipeline stage {stage} ran out of batches: pass num_batches no larger "
            "than the number of batches"
        ) from None


def split_microbatches(batch: Batch | None, microbatches: int) -> list[tuple[Batch | None, float]]:
    """Micro-batches of a mini-batch, each with its share of the mini-batch's samples.

    Args:
        batch: the mini-batch, or None on a stage that reads none.
        microbatches: how many micro-batches to cut it into.
    """
    if batch is None:
        return [(None, 1.0)] * microbatches
    inputs, targets = batch
    if inputs.shape[0] < microbatches:
        raise UsageError(
            f"a mini-batch of {inputs.shape[0]} samples cannot be cut into "
            f"{microbatches} micro-batches; use a larger batch or fewer micro-batches"
        )
    total = inputs.shape[0]
    xs = torch.tensor_split(inputs, microbatches)
    ys = torch.tensor_split(targets, microbatches)
    return [((x, y), x.shape[0] / total) for x, y in zip(xs, ys, strict=True)]


def unit_batches(batches: Iterable[Batch | None]) -> Iterator[tuple[Batch | None, float]]:
    """Whole mini-batches as units, each its own mini-batch's full share.

    Args:
        batches: the mini-batches.
    """
    for batch in batches:
        yield batch, 1.0


def cut_pieces(
    batch: Batch | None,
    scale: float,
    count: int,
    device: torch.device,
    *,
    is_first: bool,
    is_last: bool,
) -> list[Piece]:
    """A unit's pieces: the whole unit, or its ``count`` parts for an asynchronous stream.

    Stage 0 holds their inputs and the last stage their targets; the pieces' scales split the
    unit's share of the mini-batch by sample count.

    Args:
        batch: the unit, or None on a stage that reads none.
        scale: the unit's share of its mini-batch.
        count: pieces per unit.
        device: where the stage computes.
        is_first: whether this is stage 0 (it keeps the inputs).
        is_last: whether this is the last stage (it keeps the targets).
    """
    if batch is None:
        return [Piece(scale=scale / count) for _ in range(count)]
    inputs, targets = batch
    if inputs.shape[0] < count:
        raise UsageError(
            f"a mini-batch of {inputs.shape[0]} samples cannot be cut into {count} chunks; "
            "use a larger batch or fewer chunks"
        )
    total = inputs.shape[0]
    xs = torch.tensor_split(inputs, count)
    ys = torch.tensor_split(targets, count)
    return [
        Piece(
            input=x.to(device) if is_first else None,
            target=y.to(device) if is_last else None,
            scale=scale * x.shape[0] / total,
        )
        for x, y in zip(xs, ys, strict=True)
    ]


def end_backward(module: nn.Module, state: InFlight) -> None:
    """After a batch's last backward action: the forward's buffers back, gradients summed.

    Args:
        module: the stage's module.
        state: the batch's bookkeeping.
    """
    if state.saved_buffers:
        # The recomputation moved BatchNorm's running statistics a second time for this
        # batch; put back the forward's. Only after backward: autograd saved them.
        with torch.no_grad():
            for buffer, saved in zip(module.buffers(), state.saved_buffers, strict=True):
                buffer.copy_(saved)
    if state.graph_leaves is not None:
        accumulate(module, state.graph_leaves)


def accumulate(module: nn.Module, leaves: dict[str, Tensor]) -> None:
    """Add the gradients that landed on weight copies to the real parameters' ``.grad``.

    Args:
        module: the stage's module.
        leaves: the weight copies, by parameter name.
    """
    for name, param in module.named_parameters():
        grad = leaves[name].grad
        if grad is None:
            continue
        param.grad = grad if param.grad is None else param.grad + grad
