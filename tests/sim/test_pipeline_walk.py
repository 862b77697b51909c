"""The fast walk of the stage programs against timelines worked by hand and against the gloo
replay of the same programs."""

from __future__ import annotations

import pytest

from interlace.comm.cost import CostModel
from interlace.pipeline.block import HEADER_BYTES
from interlace.sim.network import Link
from interlace.sim.pipeline import HostCost, StageCost, simulate_pipeline
from interlace.sim.pipeline_walk import StageWork, walk_block_s

WIRE = Link(alpha=0.3, beta=0.001)


def _two_stages(reduce_s: float) -> list[StageCost]:
    host = HostCost(update_s=0.5, predict_s=0.5, copy_s=0.5)
    return [
        StageCost(1.0, 2.0, 1000 - HEADER_BYTES, host, reduce_s=reduce_s),
        StageCost(3.0, 4.0, 0.0, host, reduce_s=reduce_s),
    ]


def _works(stages: list[StageCost]) -> list[StageWork]:
    return [
        StageWork(
            forward_s=s.forward_s,
            backward_s=s.backward_s,
            update_s=s.host.update_s,
            weights_s=s.host.predict_s,
            reduce_s=s.reduce_s,
            act_bytes=s.output_bytes,
            act_link=WIRE if k == 0 else None,
        )
        for k, s in enumerate(stages)
    ]


@pytest.mark.parametrize(("reduce_s", "expected"), [(0.0, 13.1), (5.0, 16.1)])
def test_gpipe_of_one_micro_batch_against_a_timeline_worked_by_hand(
    reduce_s: float, expected: float
) -> None:
    # Stage 0's forward ends at 1; the activation (1000 bytes with its header) lands at
    # 1 + 1.0 + 0.3 = 2.3; stage 1 computes 3 + 4 to 9.3; the gradient lands at 10.6; stage 0's
    # backward ends at 12.6 and its update at 13.1. Replicated: stage 0's all-reduce starts
    # with its backward (10.6) and ends 5 s later, so its update runs from 15.6.
    stages = _two_stages(reduce_s)
    replayed = simulate_pipeline(stages, "gpipe", CostModel(WIRE.alpha, WIRE.beta), microbatches=1)
    walked = walk_block_s(_works(stages), "gpipe", pieces=1, block=1)
    assert replayed.block_s == pytest.approx(expected)
    assert walked == pytest.approx(expected)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "naive", "pipedream", "spectrain"])
@pytest.mark.parametrize("reduce_s", [0.0, 5.0])
def test_the_fast_walk_is_the_replay_where_no_link_is_shared(
    schedule: str, reduce_s: float
) -> None:
    # One message at a time on each link: the walk (the planner's) and the gloo replay (the
    # validation's) price the same programs to rounding.
    stages = _two_stages(reduce_s)
    for block in (1, 3):
        replayed = simulate_pipeline(
            stages, schedule, CostModel(WIRE.alpha, WIRE.beta), microbatches=1, block=block
        )
        walked = walk_block_s(_works(stages), schedule, pieces=1, block=block)
        assert walked == pytest.approx(replayed.block_s, rel=1e-12)


def test_torch_stages_under_ddp_wait_for_their_all_reduce_before_sending_on() -> None:
    # DDP's backward returns once its buckets are reduced: stage 1's gradient leaves 5 s after
    # its backward began, not when the backward ends.
    bare = simulate_pipeline(_two_stages(0.0), "torch-gpipe", CostModel(0.0, 0.0), microbatches=1)
    ddp = simulate_pipeline(_two_stages(5.0), "torch-gpipe", CostModel(0.0, 0.0), microbatches=1)
    # bare: 1 + 3 + 4 + 2 + 0.5; with DDP stage 1 holds the gradient until 1 + 3 + 5, stage 0's
    # all-reduce then runs 5 s from its backward's start, before its update.
    assert bare.block_s == pytest.approx(10.5)
    assert ddp.block_s == pytest.approx(1 + 3 + 5 + 5 + 0.5)
