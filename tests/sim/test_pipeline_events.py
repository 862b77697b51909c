"""Computations that slow each other down while they run together (stages sharing a host's
cores), against times worked out by hand."""

from __future__ import annotations

import pytest

from interlace.comm.cost import CostModel
from interlace.sim.pipeline import StageCost, simulate_pipeline
from interlace.sim.pipeline_events import (
    Compute,
    Message,
    Post,
    ProgramReplay,
    Send,
    Wait,
    replay_programs,
)

FREE = CostModel(0.0, 0.0)


def _ends(replay: ProgramReplay, stage: int) -> list[float]:
    return [s.end_s for s in replay.computations if s.stage == stage]


def test_two_computations_at_once_each_take_twice_as_long() -> None:
    replay = replay_programs([[Compute(1.0, "f")], [Compute(1.0, "f")]], FREE, slowdown=(1.0, 2.0))
    assert replay.finish_s == pytest.approx((2.0, 2.0))


def test_a_computation_speeds_up_when_the_other_ends() -> None:
    # Both run at half speed until stage 1's 0.5 s ends at t = 1; stage 1's next 1 s runs beside
    # stage 0's last 0.5 s at half speed until t = 2, then alone: 0.5 s more, t = 2.5.
    replay = replay_programs(
        [[Compute(1.0, "f")], [Compute(0.5, "f"), Compute(1.0, "b")]], FREE, slowdown=(1.0, 2.0)
    )
    assert _ends(replay, 0) == pytest.approx([2.0])
    assert _ends(replay, 1) == pytest.approx([1.0, 2.5])


def test_a_stage_waiting_on_a_message_does_not_slow_the_others() -> None:
    # Stage 1 waits (computing nothing) for stage 0's message, so stage 0 runs alone until it
    # sends at t = 1; then both compute 1 s together at a third of their speed: t = 4.
    message = Message(("x",), 0, 1, 0.0)
    replay = replay_programs(
        [
            [Compute(1.0, "f"), Send(message), Wait((message,)), Compute(1.0, "f")],
            [Post(message), Wait((message,)), Compute(1.0, "f")],
        ],
        FREE,
        slowdown=(1.0, 3.0),
    )
    assert replay.finish_s == pytest.approx((4.0, 4.0))


def test_missing_entries_repeat_the_last_slowdown() -> None:
    programs = [[Compute(1.0, "f")] for _ in range(3)]
    assert replay_programs(programs, FREE, slowdown=(1.0, 1.5)).finish_s == pytest.approx(
        (1.5, 1.5, 1.5)
    )


def test_no_slowdown_is_the_replay_without_contention() -> None:
    stages = [StageCost(4.0, 8.0, 100.0), StageCost(4.0, 8.0, 100.0), StageCost(4.0, 8.0, 0.0)]
    cost = CostModel(0.1, 0.001)
    for schedule in ("gpipe", "1f1b", "spectrain", "torch-1f1b"):
        plain = simulate_pipeline(stages, schedule, cost, microbatches=4, block=2)
        ones = simulate_pipeline(stages, schedule, cost, microbatches=4, block=2, slowdown=(1.0,))
        assert ones.block_s == pytest.approx(plain.block_s, rel=1e-12)
        slowed = simulate_pipeline(
            stages, schedule, cost, microbatches=4, block=2, slowdown=(1.0, 1.2, 1.4)
        )
        assert slowed.block_s > plain.block_s


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "spectrain", "pipedream", "torch-1f1b"])
def test_one_slowdown_for_every_count_stretches_a_block_without_messages(schedule: str) -> None:
    stages = [StageCost(4.0, 8.0, 100.0), StageCost(3.0, 9.0, 100.0), StageCost(4.0, 8.0, 0.0)]
    plain = simulate_pipeline(stages, schedule, FREE, microbatches=4, block=2)
    slowed = simulate_pipeline(stages, schedule, FREE, microbatches=4, block=2, slowdown=(2.0,))
    assert slowed.block_s == pytest.approx(2.0 * plain.block_s, rel=1e-12)


def test_a_slowdown_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        replay_programs([[Compute(1.0, "f")]], FREE, slowdown=(1.0, 0.0))
