"""The vocabulary of pipeline schedules: what a stage does in one action (:class:`Op`), with which
weights (:class:`Weights`), the :class:`Action` itself, and the rules on a stage's actions that
decide whether a backward reuses its forward's graph or a stash. Built without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


def version_difference(stage: int, num_stages: int) -> tuple[int, int]:
    """How many optimizer steps stage ``stage`` of ``num_stages`` predicts ahead: ``(fwd, bwd)``.

    ``s_fwd = stage // 2 + num_stages - stage - 1`` and ``s_bwd = stage // 2`` (SpecTrain's rule
    for the asynchronous 1F1B schedule). For four stages that is ``(3, 0), (2, 0), (2, 1), (1, 1)``;
    a single stage is plain synchronous SGD, ``(0, 0)``.

    Args:
        stage: the stage, from 0.
        num_stages: stages in the pipeline (>= 1).

    Raises :class:`ValueError` when ``num_stages < 1`` or ``stage`` is not in
    ``[0, num_stages)``.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not 0 <= stage < num_stages:
        raise ValueError(
            f"stage must be in [0, {num_stages}) for a {num_stages}-stage pipeline, got {stage}"
        )
    s_bwd = stage // 2
    s_fwd = s_bwd + num_stages - stage - 1
    return s_fwd, s_bwd


class Op(str, Enum):
    """What a stage does in one action; the ops after ``UPDATE`` appear in lowered programs only."""

    RECV_ACT = "recv_act"
    FORWARD = "forward"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"
    UPDATE = "update"
    #: Post the receive of an activation (a gradient), to be taken later by its ``RECV_ACT``.
    POST_ACT = "post_act"
    POST_GRAD = "post_grad"
    #: Make the predicted weights the batch's next computations use.
    PREDICT = "predict"
    #: Copy the weights at a batch's forward, for its backward.
    STASH = "stash"
    #: Compute the stage again on the saved input with the backward's weights, with a graph.
    RECOMPUTE = "recompute"
    #: Wait until every send started so far has completed.
    WAIT_SENDS = "wait_sends"


class Weights(str, Enum):
    """Which weights a forward or backward computes with."""

    #: The stage's parameters as they are now.
    CURRENT = "current"
    #: The weights this batch's forward computed with, kept for its backward (PipeDream's
    #: stashing; a copy where an update falls in between).
    STASHED = "stashed"
    #: ``W - ahead * lr * v``, SpecTrain's prediction of the weights ``ahead`` updates later.
    PREDICTED = "predicted"


#: Actions that say which weights they compute with (or make).
_WITH_WEIGHTS = (Op.FORWARD, Op.BACKWARD, Op.RECOMPUTE, Op.PREDICT, Op.STASH)


@dataclass(frozen=True)
class Action:
    """One thing one stage does at one clock tick.

    ``batch`` is the micro-batch index within the step (synchronous schedules) or the mini-batch
    index in the stream (asynchronous ones). ``version`` is how many updates this stage's weights
    have had in this schedule before the action; ``weights`` and ``ahead`` say what a forward or
    backward computes with (``ahead`` is the number of updates predicted, 0 unless predicted).
    In a lowered program, ``piece`` is the part of the batch a message or computation carries.

    Args:
        clock: the tick of the unit-time model.
        stage: the stage that acts.
        op: what it does.
        batch: the micro-batch (synchronous) or mini-batch (asynchronous) index.
        version: updates this stage's weights have had in this schedule before the action.
        weights: which weights a forward or backward computes with.
        ahead: updates predicted ahead (0 unless predicted).
        piece: the piece of the batch, in a lowered program (None in a schedule's actions).
    """

    clock: int
    stage: int
    op: Op
    batch: int
    version: int = 0
    weights: Weights = Weights.CURRENT
    ahead: int = 0
    piece: int | None = None

    @property
    def predicted(self) -> bool:
        """True where the computation uses weights predicted at least one update ahead."""
        return self.weights is Weights.PREDICTED and self.ahead > 0

    def __str__(self) -> str:
        if self.op is Op.WAIT_SENDS:
            return f"t{self.clock} s{self.stage} {self.op.value}"
        piece = "" if self.piece is None else f".{self.piece}"
        text = f"t{self.clock} s{self.stage} {self.op.value}({self.batch}{piece})"
        if self.op in _WITH_WEIGHTS:
            text += f" v{self.version} {self.weights.value}"
            if self.ahead:
                text += f"+{self.ahead}"
        return text


def same_weights(forward: Action, backward: Action) -> bool:
    """Whether a batch's backward computes with the very weights its forward used.

    True for stashed weights, and for the same weights (current, or predicted as far ahead) at
    the same version, that is with no update in between.

    Args:
        forward: the batch's forward on a stage.
        backward: its backward on the same stage.
    """
    if backward.weights is Weights.STASHED:
        return True

    def ahead(action: Action) -> int:
        return action.ahead if action.weights is Weights.PREDICTED else 0

    return forward.version == backward.version and ahead(forward) == ahead(backward)


def reuses_forward_graph(actions: Sequence[Action]) -> bool:
    """Whether a stage's backwards run on the graphs their forwards built.

    The one rule the runtime and the simulator follow: true when every backward computes with
    its forward's weights (:func:`same_weights`). Otherwise every forward runs without a graph
    and each backward first computes the stage again with its own weights (``RECOMPUTE``), as
    autograd cannot change the weights a kept graph used.

    Args:
        actions: one stage's actions, as
            :meth:`~interlace.pipeline.schedule.Schedule.for_stage` lists them.
    """
    forwards = {a.batch: a for a in actions if a.op is Op.FORWARD}
    return all(same_weights(forwards[a.batch], a) for a in actions if a.op is Op.BACKWARD)


def stashes_weights(actions: Sequence[Action]) -> bool:
    """Whether a stage copies its weights at every forward that is not predicted.

    True when a backward computes with its forward's weights (``STASHED``), those are the
    parameters themselves (the forward is not predicted: a prediction is a new tensor already,
    kept as it is) and an update falls between the two passes, so the parameters will have moved
    by the backward.

    Args:
        actions: one stage's actions, as
            :meth:`~interlace.pipeline.schedule.Schedule.for_stage` lists them.
    """
    forwards = {a.batch: a for a in actions if a.op is Op.FORWARD}
    updates_before = {}  # (op, batch) -> updates earlier in the stage's list
    updates = 0
    for action in actions:
        updates += action.op is Op.UPDATE
        updates_before[(action.op, action.batch)] = updates
    return any(
        updates_before[(Op.BACKWARD, a.batch)] > updates_before[(Op.FORWARD, a.batch)]
        for a in actions
        if a.op is Op.BACKWARD and a.weights is Weights.STASHED and not forwards[a.batch].predicted
    )
