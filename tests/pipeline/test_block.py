"""A block of mini-batches as schedule steps, a message's piece and the header's size."""

from __future__ import annotations

import pytest

from interlace.pipeline.block import HEADER_BYTES, BlockPlan, block_plan, piece_of
from interlace.pipeline.schedule import Action, GPipe, Op, PipeDream


def test_a_synchronous_schedule_steps_once_per_mini_batch() -> None:
    assert block_plan(GPipe, 3, microbatches=4, chunks=1) == BlockPlan(units=4, steps=3, pieces=1)


def test_an_asynchronous_schedule_streams_the_block_once_in_chunks() -> None:
    plan = block_plan(PipeDream, 3, microbatches=4, chunks=2)
    assert plan == BlockPlan(units=3, steps=1, pieces=2)


@pytest.mark.parametrize(
    ("counts", "name"),
    [((0, 1, 1), "num_batches"), ((1, 0, 1), "microbatches"), ((1, 1, 0), "chunks")],
)
def test_counts_below_one_are_refused(counts: tuple[int, int, int], name: str) -> None:
    batches, microbatches, chunks = counts
    with pytest.raises(ValueError, match=f"{name} must be >= 1"):
        block_plan(GPipe, batches, microbatches=microbatches, chunks=chunks)


def test_a_header_is_ten_int64_and_only_lowered_actions_name_a_piece() -> None:
    assert HEADER_BYTES == 10 * 8
    assert piece_of(Action(0, 0, Op.FORWARD, 0, piece=1)) == 1
    with pytest.raises(ValueError, match="names no piece"):
        piece_of(Action(0, 0, Op.FORWARD, 0))
