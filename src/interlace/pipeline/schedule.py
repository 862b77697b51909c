"""Pipeline schedules as pure, checkable lists of actions per stage and clock.

For each stage and clock tick a schedule says what that stage does (receive, forward, send,
backward, update); the runtime only executes it. Built without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

#: Names of the schedules, as ``interlace train --schedule`` takes them.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "pipedream", "spectrain", "naive")
#: The schedules that flush (update once per mini-batch after all its micro-batches).
SYNCHRONOUS: tuple[str, ...] = ("gpipe", "1f1b")
#: The asynchronous 1F1B schedules, by weight policy.
ASYNCHRONOUS: tuple[str, ...] = ("naive", "pipedream", "spectrain")


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
    """What a stage does in one action."""

    RECV_ACT = "recv_act"
    FORWARD = "forward"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"
    UPDATE = "update"


class Weights(str, Enum):
    """Which weights a forward or backward computes with."""

    #: The stage's parameters as they are now.
    CURRENT = "current"
    #: A copy taken at this batch's forward, kept for its backward (PipeDream's stashing).
    STASHED = "stashed"
    #: ``W - ahead * lr * v``, SpecTrain's prediction of the weights ``ahead`` updates later.
    PREDICTED = "predicted"


#: Order of actions within one tick: what is received is needed by the computation, what the
#: computation produces is then sent, and the update comes last.
_TICK_ORDER = {
    Op.RECV_ACT: 0,
    Op.RECV_GRAD: 0,
    Op.FORWARD: 1,
    Op.BACKWARD: 1,
    Op.SEND_ACT: 2,
    Op.SEND_GRAD: 2,
    Op.UPDATE: 3,
}


@dataclass(frozen=True)
class Action:
    """One thing one stage does at one clock tick.

    ``batch`` is the micro-batch index within the step (synchronous schedules) or the mini-batch
    index in the stream (asynchronous ones). ``version`` is how many updates this stage's weights
    have had in this schedule before the action; ``weights`` and ``ahead`` say what a forward or
    backward computes with (``ahead`` is the number of updates predicted, 0 unless predicted).

    Args:
        clock: the tick of the unit-time model.
        stage: the stage that acts.
        op: what it does.
        batch: the micro-batch (synchronous) or mini-batch (asynchronous) index.
        version: updates this stage's weights have had in this schedule before the action.
        weights: which weights a forward or backward computes with.
        ahead: updates predicted ahead (0 unless predicted).
    """

    clock: int
    stage: int
    op: Op
    batch: int
    version: int = 0
    weights: Weights = Weights.CURRENT
    ahead: int = 0

    def __str__(self) -> str:
        text = f"t{self.clock} s{self.stage} {self.op.value}({self.batch})"
        if self.op in (Op.FORWARD, Op.BACKWARD):
            text += f" v{self.version} {self.weights.value}"
            if self.ahead:
                text += f"+{self.ahead}"
        return text


@dataclass(frozen=True)
class Schedule:
    """A named schedule: the actions of every stage, each stage's list in execution order.

    Args:
        name: the schedule's name (one of SCHEDULES).
        num_stages: stages in the pipeline.
        num_batches: micro-batches per step (synchronous) or mini-batches in the stream.
        stages: each stage's actions, in execution order.
    """

    name: str
    num_stages: int
    num_batches: int
    stages: tuple[tuple[Action, ...], ...]

    def for_stage(self, stage: int) -> tuple[Action, ...]:
        """The actions stage ``stage`` executes, in order.

        Args:
            stage: the stage, from 0.
        """
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is out of range for {self.num_stages} stages")
        return self.stages[stage]

    @property
    def synchronous(self) -> bool:
        """True for a schedule that flushes and updates once at the end."""
        return self.name in SYNCHRONOUS

    @property
    def num_clocks(self) -> int:
        """Ticks from the first action to the last, inclusive."""
        return 1 + max(action.clock for actions in self.stages for action in actions)

    def compute_clocks(self, stage: int) -> int:
        """Ticks in which ``stage`` computes (forwards plus backwards).

        Args:
            stage: the stage, from 0.
        """
        return sum(1 for a in self.stages[stage] if a.op in (Op.FORWARD, Op.BACKWARD))

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-ticks left idle in the unit-time model: the pipeline's fill and drain."""
        busy = sum(self.compute_clocks(k) for k in range(self.num_stages))
        return 1.0 - busy / (self.num_stages * self.num_clocks)

    def grid(self) -> str:
        """A text picture: one row per stage, one column per tick, ``F3``/``B3`` for batch 3."""
        width = max(2, len(str(self.num_batches - 1)) + 1)
        rows = []
        for stage, actions in enumerate(self.stages):
            cells = ["." * width] * self.num_clocks
            for action in actions:
                if action.op in (Op.FORWARD, Op.BACKWARD):
                    tag = ("F" if action.op is Op.FORWARD else "B") + str(action.batch)
                    cells[action.clock] = tag.ljust(width)
            rows.append(f"stage {stage}: " + " ".join(cells))
        return "\n".join(rows)


def _check_sizes(num_stages: int, num_batches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"a pipeline needs at least 1 stage, got {num_stages}")
    if num_batches < 1:
        raise ValueError(f"a schedule needs at least 1 batch, got {num_batches}")


def _gpipe_order(num_stages: int, num_batches: int) -> list[list[tuple[Op, int]]]:
    order: list[tuple[Op, int]] = [(Op.FORWARD, b) for b in range(num_batches)]
    order += [(Op.BACKWARD, b) for b in range(num_batches)]
    return [list(order) for _ in range(num_stages)]


def _one_f_one_b_order(num_stages: int, num_batches: int) -> list[list[tuple[Op, int]]]:
    """Stage k: ``N - k`` forwards in flight, then alternate one backward, one forward."""
    orders = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage, num_batches)
        order: list[tuple[Op, int]] = [(Op.FORWARD, b) for b in range(warmup)]
        for b in range(num_batches):
            order.append((Op.BACKWARD, b))
            if warmup + b < num_batches:
                order.append((Op.FORWARD, warmup + b))
        orders.append(order)
    return orders


def _clocks(
    num_stages: int, orders: Sequence[Sequence[tuple[Op, int]]]
) -> list[dict[tuple[Op, int], int]]:
    """Tick of every computation under the unit-time model (docs/notes/train.md describes it)."""
    done: list[dict[tuple[Op, int], int]] = [{} for _ in range(num_stages)]
    position = [0] * num_stages
    free_at = [0] * num_stages
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for stage in range(num_stages):
            while position[stage] < len(orders[stage]):
                op, batch = orders[stage][position[stage]]
                if op is Op.FORWARD:
                    dep = done[stage - 1].get((op, batch)) if stage > 0 else -1
                elif stage < num_stages - 1:
                    dep = done[stage + 1].get((op, batch))
                else:
                    dep = done[stage].get((Op.FORWARD, batch))
                if dep is None:
                    break
                clock = max(free_at[stage], dep + 1)
                done[stage][(op, batch)] = clock
                free_at[stage] = clock + 1
                position[stage] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the per-stage orders deadlock: a stage waits on work never done")
    return done


def _expand(
    name: str,
    num_stages: int,
    num_batches: int,
    orders: Sequence[Sequence[tuple[Op, int]]],
) -> Schedule:
    """Turn per-stage compute orders into full action lists with clocks, versions and weights."""
    clocks = _clocks(num_stages, orders)
    asynchronous = name in ASYNCHRONOUS
    stages = []
    for stage, order in enumerate(orders):
        actions: list[Action] = []
        updates = 0
        forward_version: dict[int, int] = {}
        s_fwd, s_bwd = version_difference(stage, num_stages)
        for op, batch in order:
            clock = clocks[stage][(op, batch)]
            last = stage == num_stages - 1
            if op is Op.FORWARD:
                weights, ahead = Weights.CURRENT, 0
                if name == "spectrain":
                    weights, ahead = Weights.PREDICTED, s_fwd
                forward_version[batch] = updates
                if stage > 0:
                    actions.append(Action(clock, stage, Op.RECV_ACT, batch))
                actions.append(Action(clock, stage, op, batch, updates, weights, ahead))
                if not last:
                    actions.append(Action(clock, stage, Op.SEND_ACT, batch))
                continue
            weights, ahead = Weights.CURRENT, 0
            if name == "pipedream":
                weights = Weights.STASHED
            elif name == "spectrain":
                weights, ahead = Weights.PREDICTED, s_bwd
            version = forward_version[batch] if weights is Weights.STASHED else updates
            if not last:
                actions.append(Action(clock, stage, Op.RECV_GRAD, batch))
            actions.append(Action(clock, stage, op, batch, version, weights, ahead))
            if stage > 0:
                actions.append(Action(clock, stage, Op.SEND_GRAD, batch))
            if asynchronous:
                actions.append(Action(clock, stage, Op.UPDATE, batch, updates))
                updates += 1
        if not asynchronous:
            actions.append(Action(actions[-1].clock, stage, Op.UPDATE, num_batches - 1))
        actions.sort(key=lambda a: (a.clock, _TICK_ORDER[a.op]))
        stages.append(tuple(actions))
    return Schedule(name, num_stages, num_batches, tuple(stages))


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every micro-batch's forward, then every backward, then one update (a flush).

    Args:
        num_stages: stages in the pipeline (>= 1).
        num_microbatches: micro-batches per mini-batch (>= 1).
    """
    _check_sizes(num_stages, num_microbatches)
    return _expand(
        "gpipe", num_stages, num_microbatches, _gpipe_order(num_stages, num_microbatches)
    )


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Synchronous 1F1B (PipeDream-flush): 1F1B order within the step, one update at the end.

    Args:
        num_stages: stages in the pipeline (>= 1).
        num_microbatches: micro-batches per mini-batch (>= 1).
    """
    _check_sizes(num_stages, num_microbatches)
    orders = _one_f_one_b_order(num_stages, num_microbatches)
    return _expand("1f1b", num_stages, num_microbatches, orders)


def async_one_f_one_b(num_stages: int, num_batches: int, policy: str) -> Schedule:
    """Asynchronous 1F1B over ``num_batches`` mini-batches, an update after every backward.

    ``policy`` is ``"naive"``, ``"pipedream"`` or ``"spectrain"``: which weights each pass uses.
    The stream fills the pipeline once at its start and drains it once at its end, so a long
    stream (an epoch) is nearly bubble-free.

    Args:
        num_stages: stages in the pipeline (>= 1).
        num_batches: mini-batches in the stream (>= 1).
        policy: "naive", "pipedream" or "spectrain": which weights each pass uses.
    """
    if policy not in ASYNCHRONOUS:
        raise ValueError(f"policy must be one of {', '.join(ASYNCHRONOUS)}, got {policy!r}")
    _check_sizes(num_stages, num_batches)
    return _expand(policy, num_stages, num_batches, _one_f_one_b_order(num_stages, num_batches))


def build_schedule(name: str, num_stages: int, num_batches: int) -> Schedule:
    """The schedule called ``name`` (one of :data:`SCHEDULES`).

    For ``gpipe`` and ``1f1b`` ``num_batches`` is the number of micro-batches in one step; for
    the asynchronous schedules it is the number of mini-batches in the stream.

    Args:
        name: one of SCHEDULES.
        num_stages: stages in the pipeline (>= 1).
        num_batches: micro-batches in one step (gpipe, 1f1b) or mini-batches in the stream
            (asynchronous schedules).
    """
    if name == "gpipe":
        return gpipe(num_stages, num_batches)
    if name == "1f1b":
        return one_f_one_b(num_stages, num_batches)
    if name in ASYNCHRONOUS:
        return async_one_f_one_b(num_stages, num_batches, name)
    raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
