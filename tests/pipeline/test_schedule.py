"""Pipeline schedules against golden action lists worked out by hand, and their invariants;
the programs they lower to (what a stage runs) against golden lists, and the weight rules."""

from __future__ import annotations

import pytest

from interlace.pipeline.predict import version_difference
from interlace.pipeline.schedule import (
    SCHEDULE_TYPES,
    SCHEDULES,
    Action,
    Op,
    Schedule,
    Weights,
    async_one_f_one_b,
    build_schedule,
    gpipe,
    one_f_one_b,
    reuses_forward_graph,
    same_weights,
    stashes_weights,
)


def _lines(schedule: Schedule, stage: int) -> list[str]:
    return [str(action) for action in schedule.for_stage(stage)]


def test_gpipe_two_stages_two_microbatches_golden() -> None:
    schedule = gpipe(2, 2)
    assert _lines(schedule, 0) == [
        "t0 s0 forward(0) v0 current",
        "t0 s0 send_act(0)",
        "t1 s0 forward(1) v0 current",
        "t1 s0 send_act(1)",
        "t4 s0 recv_grad(0)",
        "t4 s0 backward(0) v0 current",
        "t5 s0 recv_grad(1)",
        "t5 s0 backward(1) v0 current",
        "t5 s0 update(1)",
    ]
    assert _lines(schedule, 1) == [
        "t1 s1 recv_act(0)",
        "t1 s1 forward(0) v0 current",
        "t2 s1 recv_act(1)",
        "t2 s1 forward(1) v0 current",
        "t3 s1 backward(0) v0 current",
        "t3 s1 send_grad(0)",
        "t4 s1 backward(1) v0 current",
        "t4 s1 send_grad(1)",
        "t4 s1 update(1)",
    ]


def _compute(schedule: Schedule, stage: int) -> list[tuple[str, int, int]]:
    """(F or B, batch, clock) of each computation of ``stage``."""
    return [
        ("F" if a.op is Op.FORWARD else "B", a.batch, a.clock)
        for a in schedule.for_stage(stage)
        if a.op in (Op.FORWARD, Op.BACKWARD)
    ]


def test_one_f_one_b_two_stages_three_microbatches_golden() -> None:
    schedule = one_f_one_b(2, 3)
    # Stage 0 keeps two forwards in flight, stage 1 one; clocks by hand from the unit-time rule.
    assert _compute(schedule, 0) == [
        ("F", 0, 0),
        ("F", 1, 1),
        ("B", 0, 3),
        ("F", 2, 4),
        ("B", 1, 5),
        ("B", 2, 7),
    ]
    assert _compute(schedule, 1) == [
        ("F", 0, 1),
        ("B", 0, 2),
        ("F", 1, 3),
        ("B", 1, 4),
        ("F", 2, 5),
        ("B", 2, 6),
    ]
    updates = [a for a in schedule.for_stage(0) if a.op is Op.UPDATE]
    assert [(a.clock, a.batch) for a in updates] == [(7, 2)]


def test_gpipe_four_stages_matches_the_textbook_picture() -> None:
    schedule = gpipe(4, 4)
    assert schedule.grid().splitlines() == [
        "stage 0: F0 F1 F2 F3 .. .. .. .. .. .. B0 B1 B2 B3",
        "stage 1: .. F0 F1 F2 F3 .. .. .. .. B0 B1 B2 B3 ..",
        "stage 2: .. .. F0 F1 F2 F3 .. .. B0 B1 B2 B3 .. ..",
        "stage 3: .. .. .. F0 F1 F2 F3 B0 B1 B2 B3 .. .. ..",
    ]
    # (N - 1) / (M + N - 1) of each stage's time is bubble: 3/7.
    assert schedule.bubble_fraction == pytest.approx(3 / 7)


def test_pipedream_two_stages_golden_with_versions() -> None:
    schedule = async_one_f_one_b(2, 3, "pipedream")
    assert _lines(schedule, 0) == [
        "t0 s0 forward(0) v0 current",
        "t0 s0 send_act(0)",
        "t1 s0 forward(1) v0 current",
        "t1 s0 send_act(1)",
        "t3 s0 recv_grad(0)",
        "t3 s0 backward(0) v0 stashed",
        "t3 s0 update(0)",
        "t4 s0 forward(2) v1 current",
        "t4 s0 send_act(2)",
        "t5 s0 recv_grad(1)",
        "t5 s0 backward(1) v0 stashed",
        "t5 s0 update(1)",
        "t7 s0 recv_grad(2)",
        "t7 s0 backward(2) v1 stashed",
        "t7 s0 update(2)",
    ]
    assert _lines(schedule, 1) == [
        "t1 s1 recv_act(0)",
        "t1 s1 forward(0) v0 current",
        "t2 s1 backward(0) v0 stashed",
        "t2 s1 send_grad(0)",
        "t2 s1 update(0)",
        "t3 s1 recv_act(1)",
        "t3 s1 forward(1) v1 current",
        "t4 s1 backward(1) v1 stashed",
        "t4 s1 send_grad(1)",
        "t4 s1 update(1)",
        "t5 s1 recv_act(2)",
        "t5 s1 forward(2) v2 current",
        "t6 s1 backward(2) v2 stashed",
        "t6 s1 send_grad(2)",
        "t6 s1 update(2)",
    ]


def test_spectrain_four_stages_predicts_by_the_papers_rule() -> None:
    schedule = async_one_f_one_b(4, 12, "spectrain")
    expected = {0: (3, 0), 1: (2, 0), 2: (2, 1), 3: (1, 1)}
    for stage, (s_fwd, s_bwd) in expected.items():
        forwards = [a for a in schedule.for_stage(stage) if a.op is Op.FORWARD]
        backwards = [a for a in schedule.for_stage(stage) if a.op is Op.BACKWARD]
        assert {(a.weights, a.ahead) for a in forwards} == {(Weights.PREDICTED, s_fwd)}
        assert {(a.weights, a.ahead) for a in backwards} == {(Weights.PREDICTED, s_bwd)}
        for action in backwards:
            forward = forwards[action.batch]
            # N - k - 1 updates fall between a batch's forward and its backward once the pipe
            # is full (the first batches find fewer: no update has happened yet).
            assert action.version - forward.version == min(4 - stage - 1, action.batch)
            # Both passes aim at the same future version of the weights.
            if action.batch >= 4 - stage - 1:
                assert forward.version + s_fwd == action.version + s_bwd


def test_naive_uses_current_weights_and_no_prediction() -> None:
    schedule = async_one_f_one_b(3, 5, "naive")
    for stage in range(3):
        for action in schedule.for_stage(stage):
            if action.op in (Op.FORWARD, Op.BACKWARD):
                assert (action.weights, action.ahead) == (Weights.CURRENT, 0)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("stages", "batches"), [(1, 3), (2, 5), (4, 4), (4, 9), (3, 2)])
def test_every_schedule_is_consistent(name: str, stages: int, batches: int) -> None:
    schedule = build_schedule(name, stages, batches)
    for stage in range(stages):
        actions = schedule.for_stage(stage)
        clocks = [a.clock for a in actions]
        assert clocks == sorted(clocks)
        forwards = [a.batch for a in actions if a.op is Op.FORWARD]
        backwards = [a.batch for a in actions if a.op is Op.BACKWARD]
        assert forwards == list(range(batches))
        assert sorted(backwards) == list(range(batches))
        updates = [a for a in actions if a.op is Op.UPDATE]
        assert len(updates) == (1 if schedule.synchronous else batches)
        # One computation per tick on a stage.
        compute = [a.clock for a in actions if a.op in (Op.FORWARD, Op.BACKWARD)]
        assert len(compute) == len(set(compute))
        # Every send is received by the neighbour at a later tick (when it needs it).
        for action in actions:
            if action.op is Op.SEND_ACT:
                peer = schedule.for_stage(stage + 1)
                assert any(
                    p.op is Op.RECV_ACT and p.batch == action.batch and p.clock >= action.clock + 1
                    for p in peer
                )
            if action.op is Op.SEND_GRAD:
                peer = schedule.for_stage(stage - 1)
                assert any(
                    p.op is Op.RECV_GRAD and p.batch == action.batch and p.clock >= action.clock + 1
                    for p in peer
                )
        # Activations kept in flight on stage k never exceed N - k under 1F1B.
        if name != "gpipe":
            live = peak = 0
            for action in actions:
                live += {Op.FORWARD: 1, Op.BACKWARD: -1}.get(action.op, 0)
                peak = max(peak, live)
            assert peak <= stages - stage


def test_async_steady_state_has_no_bubble() -> None:
    """A long asynchronous stream fills and drains once: idle share shrinks as it grows."""
    short = async_one_f_one_b(4, 8, "spectrain").bubble_fraction
    long = async_one_f_one_b(4, 200, "spectrain").bubble_fraction
    assert long < short
    assert long < 0.02
    # GPipe with 4 micro-batches idles 3/7 of the time whatever the number of steps.
    assert gpipe(4, 4).bubble_fraction > 0.4


def test_version_difference_is_what_the_schedule_uses() -> None:
    for stages in (2, 3, 5):
        schedule = async_one_f_one_b(stages, 3 * stages, "spectrain")
        for stage in range(stages):
            s_fwd, _ = version_difference(stage, stages)
            first = next(a for a in schedule.for_stage(stage) if a.op is Op.FORWARD)
            assert first.ahead == s_fwd


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        build_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match="at least 1 stage"):
        gpipe(0, 2)
    with pytest.raises(ValueError, match="at least 1 batch"):
        one_f_one_b(2, 0)
    with pytest.raises(ValueError, match="policy must be one of"):
        async_one_f_one_b(2, 2, "gpipe")
    with pytest.raises(ValueError, match="out of range"):
        gpipe(2, 2).for_stage(2)


def _program(schedule: Schedule, stage: int, pieces: int = 1) -> list[str]:
    return [str(action) for action in schedule.program(stage, pieces)]


def test_gpipe_two_stages_program_golden() -> None:
    """Receives posted first in the order the neighbour sends; each computation between its
    message in and its message out; the update; the wait on the sends."""
    schedule = gpipe(2, 2)
    assert _program(schedule, 0) == [
        "t0 s0 post_grad(0.0)",
        "t0 s0 post_grad(1.0)",
        "t0 s0 forward(0.0) v0 current",
        "t0 s0 send_act(0.0)",
        "t1 s0 forward(1.0) v0 current",
        "t1 s0 send_act(1.0)",
        "t4 s0 recv_grad(0.0)",
        "t4 s0 backward(0.0) v0 current",
        "t5 s0 recv_grad(1.0)",
        "t5 s0 backward(1.0) v0 current",
        "t5 s0 update(1)",
        "t5 s0 wait_sends",
    ]
    assert _program(schedule, 1) == [
        "t0 s1 post_act(0.0)",
        "t0 s1 post_act(1.0)",
        "t1 s1 recv_act(0.0)",
        "t1 s1 forward(0.0) v0 current",
        "t2 s1 recv_act(1.0)",
        "t2 s1 forward(1.0) v0 current",
        "t3 s1 backward(0.0) v0 current",
        "t3 s1 send_grad(0.0)",
        "t4 s1 backward(1.0) v0 current",
        "t4 s1 send_grad(1.0)",
        "t4 s1 update(1)",
        "t4 s1 wait_sends",
    ]


def test_one_f_one_b_middle_stage_program_golden() -> None:
    # Stage 1 of 3 keeps two forwards in flight; it posts both neighbours' messages up front.
    assert _program(one_f_one_b(3, 2), 1) == [
        "t0 s1 post_act(0.0)",
        "t0 s1 post_act(1.0)",
        "t0 s1 post_grad(0.0)",
        "t0 s1 post_grad(1.0)",
        "t1 s1 recv_act(0.0)",
        "t1 s1 forward(0.0) v0 current",
        "t1 s1 send_act(0.0)",
        "t2 s1 recv_act(1.0)",
        "t2 s1 forward(1.0) v0 current",
        "t2 s1 send_act(1.0)",
        "t4 s1 recv_grad(0.0)",
        "t4 s1 backward(0.0) v0 current",
        "t4 s1 send_grad(0.0)",
        "t6 s1 recv_grad(1.0)",
        "t6 s1 backward(1.0) v0 current",
        "t6 s1 send_grad(1.0)",
        "t6 s1 update(1)",
        "t6 s1 wait_sends",
    ]


def test_spectrain_two_stages_in_two_pieces_program_golden() -> None:
    """Stage 0 predicts once per mini-batch (s_fwd = 1) for both pieces; its backward (s_bwd = 0)
    computes each piece again with the current weights before taking the piece's gradient.
    Stage 1 (s_fwd = s_bwd = 0, no update in between) backpropagates the forward's graph."""
    schedule = async_one_f_one_b(2, 2, "spectrain")
    assert _program(schedule, 0, pieces=2) == [
        "t0 s0 post_grad(0.0)",
        "t0 s0 post_grad(0.1)",
        "t0 s0 post_grad(1.0)",
        "t0 s0 post_grad(1.1)",
        "t0 s0 predict(0) v0 predicted+1",
        "t0 s0 forward(0.0) v0 predicted+1",
        "t0 s0 send_act(0.0)",
        "t0 s0 forward(0.1) v0 predicted+1",
        "t0 s0 send_act(0.1)",
        "t1 s0 predict(1) v0 predicted+1",
        "t1 s0 forward(1.0) v0 predicted+1",
        "t1 s0 send_act(1.0)",
        "t1 s0 forward(1.1) v0 predicted+1",
        "t1 s0 send_act(1.1)",
        "t3 s0 recompute(0.0) v0 predicted",
        "t3 s0 recv_grad(0.0)",
        "t3 s0 backward(0.0) v0 predicted",
        "t3 s0 recompute(0.1) v0 predicted",
        "t3 s0 recv_grad(0.1)",
        "t3 s0 backward(0.1) v0 predicted",
        "t3 s0 update(0)",
        "t5 s0 recompute(1.0) v1 predicted",
        "t5 s0 recv_grad(1.0)",
        "t5 s0 backward(1.0) v1 predicted",
        "t5 s0 recompute(1.1) v1 predicted",
        "t5 s0 recv_grad(1.1)",
        "t5 s0 backward(1.1) v1 predicted",
        "t5 s0 update(1)",
        "t5 s0 wait_sends",
    ]
    assert _program(schedule, 1, pieces=2) == [
        "t0 s1 post_act(0.0)",
        "t0 s1 post_act(0.1)",
        "t0 s1 post_act(1.0)",
        "t0 s1 post_act(1.1)",
        "t1 s1 recv_act(0.0)",
        "t1 s1 forward(0.0) v0 predicted",
        "t1 s1 recv_act(0.1)",
        "t1 s1 forward(0.1) v0 predicted",
        "t2 s1 backward(0.0) v0 predicted",
        "t2 s1 send_grad(0.0)",
        "t2 s1 backward(0.1) v0 predicted",
        "t2 s1 send_grad(0.1)",
        "t2 s1 update(0)",
        "t3 s1 recv_act(1.0)",
        "t3 s1 forward(1.0) v1 predicted",
        "t3 s1 recv_act(1.1)",
        "t3 s1 forward(1.1) v1 predicted",
        "t4 s1 backward(1.0) v1 predicted",
        "t4 s1 send_grad(1.0)",
        "t4 s1 backward(1.1) v1 predicted",
        "t4 s1 send_grad(1.1)",
        "t4 s1 update(1)",
        "t4 s1 wait_sends",
    ]


def test_spectrain_four_stages_predicts_again_before_computing_again() -> None:
    # Stage 2 of 4: s_fwd = 1 + 4 - 2 - 1 = 2, s_bwd = 1; its backward predicts from the
    # weights at backward time, then computes the stage again on them.
    assert _program(async_one_f_one_b(4, 2, "spectrain"), 2) == [
        "t0 s2 post_act(0.0)",
        "t0 s2 post_act(1.0)",
        "t0 s2 post_grad(0.0)",
        "t0 s2 post_grad(1.0)",
        "t2 s2 predict(0) v0 predicted+2",
        "t2 s2 recv_act(0.0)",
        "t2 s2 forward(0.0) v0 predicted+2",
        "t2 s2 send_act(0.0)",
        "t3 s2 predict(1) v0 predicted+2",
        "t3 s2 recv_act(1.0)",
        "t3 s2 forward(1.0) v0 predicted+2",
        "t3 s2 send_act(1.0)",
        "t5 s2 predict(0) v0 predicted+1",
        "t5 s2 recompute(0.0) v0 predicted+1",
        "t5 s2 recv_grad(0.0)",
        "t5 s2 backward(0.0) v0 predicted+1",
        "t5 s2 send_grad(0.0)",
        "t5 s2 update(0)",
        "t7 s2 predict(1) v1 predicted+1",
        "t7 s2 recompute(1.0) v1 predicted+1",
        "t7 s2 recv_grad(1.0)",
        "t7 s2 backward(1.0) v1 predicted+1",
        "t7 s2 send_grad(1.0)",
        "t7 s2 update(1)",
        "t7 s2 wait_sends",
    ]


def test_pipedream_three_stages_copies_the_weights_at_each_forward() -> None:
    # Stage 1 of 3: one update falls between a mini-batch's forward and its backward once the
    # pipe is full, so every forward stashes a copy, which its backward then uses.
    assert _program(async_one_f_one_b(3, 3, "pipedream"), 1) == [
        "t0 s1 post_act(0.0)",
        "t0 s1 post_act(1.0)",
        "t0 s1 post_act(2.0)",
        "t0 s1 post_grad(0.0)",
        "t0 s1 post_grad(1.0)",
        "t0 s1 post_grad(2.0)",
        "t1 s1 stash(0) v0 stashed",
        "t1 s1 recv_act(0.0)",
        "t1 s1 forward(0.0) v0 current",
        "t1 s1 send_act(0.0)",
        "t2 s1 stash(1) v0 stashed",
        "t2 s1 recv_act(1.0)",
        "t2 s1 forward(1.0) v0 current",
        "t2 s1 send_act(1.0)",
        "t4 s1 recv_grad(0.0)",
        "t4 s1 backward(0.0) v0 stashed",
        "t4 s1 send_grad(0.0)",
        "t4 s1 update(0)",
        "t5 s1 stash(2) v1 stashed",
        "t5 s1 recv_act(2.0)",
        "t5 s1 forward(2.0) v1 current",
        "t5 s1 send_act(2.0)",
        "t6 s1 recv_grad(1.0)",
        "t6 s1 backward(1.0) v0 stashed",
        "t6 s1 send_grad(1.0)",
        "t6 s1 update(1)",
        "t8 s1 recv_grad(2.0)",
        "t8 s1 backward(2.0) v1 stashed",
        "t8 s1 send_grad(2.0)",
        "t8 s1 update(2)",
        "t8 s1 wait_sends",
    ]


#: (schedule, stages, batches) -> per stage (reuses the forward's graph, stashes the weights).
WEIGHT_RULES = {
    ("gpipe", 4, 6): [(True, False)] * 4,
    ("1f1b", 4, 6): [(True, False)] * 4,
    # An update falls between the passes on every stage but the last.
    ("naive", 4, 6): [(False, False)] * 3 + [(True, False)],
    ("pipedream", 4, 6): [(True, True)] * 3 + [(True, False)],
    # Forward and backward predict differently far ahead on every stage but the last.
    ("spectrain", 4, 6): [(False, False)] * 3 + [(True, False)],
    # The forward's prediction is kept: no copy, no second forward.
    ("spectrain-reuse", 4, 6): [(True, False)] * 4,
    # One mini-batch meets no update between its passes: the weights stay the forward's.
    ("naive", 3, 1): [(True, False)] * 3,
    ("pipedream", 3, 1): [(True, False)] * 3,
    ("spectrain", 3, 1): [(False, False)] * 2 + [(True, False)],
}


@pytest.mark.parametrize(("name", "stages", "batches"), list(WEIGHT_RULES))
def test_graph_reuse_and_stashing_follow_the_actions(name: str, stages: int, batches: int) -> None:
    schedule = build_schedule(name, stages, batches)
    rules = [
        (reuses_forward_graph(schedule.for_stage(k)), stashes_weights(schedule.for_stage(k)))
        for k in range(stages)
    ]
    assert rules == WEIGHT_RULES[(name, stages, batches)]
    for stage in range(stages):
        ops = [a.op for a in schedule.program(stage)]
        assert schedule.reuses_forward_graph(stage) == (Op.RECOMPUTE not in ops)
        assert ops.count(Op.STASH) == (batches if rules[stage][1] else 0)


def test_same_weights_compares_versions_and_predictions() -> None:
    forward = Action(0, 0, Op.FORWARD, 0, 1, Weights.PREDICTED, 2)
    assert same_weights(forward, Action(3, 0, Op.BACKWARD, 0, 1, Weights.PREDICTED, 2))
    assert not same_weights(forward, Action(3, 0, Op.BACKWARD, 0, 2, Weights.PREDICTED, 1))
    assert same_weights(forward, Action(3, 0, Op.BACKWARD, 0, 1, Weights.STASHED))
    # Predicted zero updates ahead is the current weights.
    current = Action(0, 0, Op.FORWARD, 0, 1)
    assert same_weights(current, Action(3, 0, Op.BACKWARD, 0, 1, Weights.PREDICTED, 0))
    assert not same_weights(current, Action(3, 0, Op.BACKWARD, 0, 2))


@pytest.mark.parametrize("name", list(SCHEDULE_TYPES))
@pytest.mark.parametrize(("stages", "batches", "pieces"), [(1, 2, 1), (2, 3, 2), (4, 5, 3)])
def test_every_program_runs_each_piece_once_in_order(
    name: str, stages: int, batches: int, pieces: int
) -> None:
    schedule = build_schedule(name, stages, batches)
    for stage in range(stages):
        program = schedule.program(stage, pieces)
        first, last = stage == 0, stage == stages - 1
        # A message is posted first, taken just before the computation that needs it, and
        # what a computation produces is sent right after it.
        expected = (
            ([] if first else [Op.POST_ACT])
            + ([] if last else [Op.POST_GRAD])
            + ([] if first else [Op.RECV_ACT])
            + [Op.FORWARD]
            + ([] if last else [Op.SEND_ACT])
            + ([] if schedule.reuses_forward_graph(stage) else [Op.RECOMPUTE])
            + ([] if last else [Op.RECV_GRAD])
            + [Op.BACKWARD]
            + ([] if first else [Op.SEND_GRAD])
        )
        for batch in range(batches):
            for piece in range(pieces):
                ops = [a.op for a in program if (a.batch, a.piece) == (batch, piece)]
                assert ops == expected, (stage, batch, piece)
        assert program[-1].op is Op.WAIT_SENDS
        updates = [a for a in program if a.op is Op.UPDATE]
        assert updates == [a for a in schedule.for_stage(stage) if a.op is Op.UPDATE]


class _BackwardsOutOfTurn(Schedule):
    """Stage 0 runs its backwards first to last, stage 1 last to first."""

    name = "out-of-turn"

    def orders(self) -> list[list[tuple[Op, int]]]:
        forwards = [(Op.FORWARD, b) for b in range(self.num_batches)]
        backwards = [(Op.BACKWARD, b) for b in range(self.num_batches)]
        return [forwards + backwards, forwards + backwards[::-1]]


class _BackwardBeforeForward(Schedule):
    name = "backward-first"

    def orders(self) -> list[list[tuple[Op, int]]]:
        return [[(Op.BACKWARD, 0), (Op.FORWARD, 0)]] * self.num_stages


def test_a_program_takes_messages_in_the_order_they_are_sent() -> None:
    schedule = _BackwardsOutOfTurn(2, 3)
    with pytest.raises(ValueError, match=r"stage 0 takes batches \[0, 1, 2\] in another order"):
        schedule.program(0)
    assert [a.batch for a in schedule.program(1) if a.op is Op.SEND_GRAD] == [2, 1, 0]
    with pytest.raises(ValueError, match="pieces must be >= 1"):
        gpipe(2, 2).program(0, pieces=0)


def test_a_schedule_must_run_each_forward_before_its_backward() -> None:
    with pytest.raises(ValueError, match="forward once, then its backward once"):
        _BackwardBeforeForward(2, 1)
