"""How a pipeline stage runs a block of mini-batches, without torch: the schedule steps, each
message's piece and the header sent ahead of each tensor. The runtime runs these and the
simulator prices them.
"""

from __future__ import annotations

from dataclasses import dataclass

from interlace.pipeline.schedule import Action, Schedule

__all__ = [
    "HEADER_BYTES",
    "HEADER_LEN",
    "HEADER_TAG",
    "MAX_DIMS",
    "PAYLOAD_TAG",
    "BlockPlan",
    "block_plan",
    "piece_of",
]

#: Tags of the two messages that carry one tensor: its header, then its payload.
HEADER_TAG = 1
PAYLOAD_TAG = 2
#: A header is ``[dtype code, ndim, size_0, ..., size_7]``, int64.
MAX_DIMS = 8
HEADER_LEN = 2 + MAX_DIMS
#: Bytes of one header on the wire.
HEADER_BYTES = HEADER_LEN * 8


@dataclass(frozen=True)
class BlockPlan:
    """A block of mini-batches as schedule steps.

    Args:
        units: Units of one step's schedule (its ``num_batches``): micro-batches for a
            synchronous schedule, the block's mini-batches for an asynchronous stream.
        steps: How many times that schedule runs: once per mini-batch (synchronous), or once.
        pieces: Pieces each unit travels in (``Schedule.program``'s ``pieces``): 1, or the
            chunks of an asynchronous stream.
    """

    units: int
    steps: int
    pieces: int


def block_plan(
    kind: type[Schedule], num_batches: int, *, microbatches: int, chunks: int
) -> BlockPlan:
    """How ``num_batches`` mini-batches run under ``kind``: a synchronous schedule takes one
    step (one update) per mini-batch, of ``microbatches`` micro-batches; an asynchronous one
    streams them all once, each in ``chunks`` pieces.

    Args:
        kind: The schedule class.
        num_batches: Mini-batches in the block (>= 1).
        microbatches: Micro-batches per mini-batch (synchronous schedules).
        chunks: Pieces per mini-batch (asynchronous schedules).

    Raises:
        ValueError: For a count below 1.
    """
    for name, count in (("num_batches", num_batches), ("microbatches", microbatches)):
        if count < 1:
            raise ValueError(f"{name} must be >= 1, got {count}")
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if kind.synchronous:
        return BlockPlan(units=microbatches, steps=num_batches, pieces=1)
    return BlockPlan(units=num_batches, steps=1, pieces=chunks)


def piece_of(action: Action) -> int:
    """The piece a lowered program's message or computation carries.

    Args:
        action: An action of :meth:`~interlace.pipeline.schedule.Schedule.program`.

    Raises:
        ValueError: For an action of an unlowered schedule (it names no piece).
    """
    if action.piece is None:
        raise ValueError(f"{action} names no piece: use a lowered program (Schedule.program)")
    return action.piece
