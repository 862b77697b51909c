"""Pipeline schedules: what every stage does at each clock tick, and the program it runs.

A :class:`Schedule` lists each stage's actions (receive, forward, send, backward, update) and
lowers them to the program a stage runs, message by message (:meth:`Schedule.program`): the
runtime executes that program and the simulator prices it. The actions' vocabulary (ops,
weights, the graph-reuse rule) lives in :mod:`interlace.pipeline.actions` and is importable from
here. Built without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from interlace.pipeline.actions import (
    Action,
    Op,
    Weights,
    reuses_forward_graph,
    same_weights,
    stashes_weights,
    version_difference,
)

__all__ = [
    "ASYNCHRONOUS",
    "SCHEDULES",
    "SCHEDULE_TYPES",
    "SYNCHRONOUS",
    "Action",
    "AsyncOneFOneB",
    "GPipe",
    "Naive",
    "OneFOneB",
    "Op",
    "PipeDream",
    "Schedule",
    "SpecTrain",
    "SpecTrainReuse",
    "Weights",
    "async_one_f_one_b",
    "build_schedule",
    "gpipe",
    "gpipe_order",
    "one_f_one_b",
    "one_f_one_b_order",
    "reuses_forward_graph",
    "same_weights",
    "schedule_type",
    "stashes_weights",
    "version_difference",
]


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


class Schedule:
    """A pipeline schedule: every stage's actions on the unit-time clock, and its programs.

    A schedule is a subclass that sets :attr:`name` and :attr:`synchronous` and says in which
    order each stage runs its forwards and backwards (:meth:`orders`) and with which weights
    (:meth:`weights_for`); clocks, messages, weight versions and updates follow from those. What
    the runtime and the simulator use is :meth:`program` (a stage's lowered program, messages
    and all), :meth:`reuses_forward_graph` and :attr:`synchronous`.

    Args:
        num_stages: stages in the pipeline (>= 1).
        num_batches: micro-batches per step (synchronous) or mini-batches in the stream.
    """

    #: The schedule's name (``interlace train --schedule``, the benchmark's contenders).
    name: ClassVar[str] = ""
    #: True: one update after all the micro-batches of a mini-batch (a flush), each mini-batch
    #: run as a step of its own. False: an update after every backward, over one stream of
    #: mini-batches, each of which may travel in chunks.
    synchronous: ClassVar[bool] = True
    #: What it is, in a few words (the benchmark's tables).
    description: ClassVar[str] = ""

    def __init__(self, num_stages: int, num_batches: int) -> None:
        if num_stages < 1:
            raise ValueError(f"a pipeline needs at least 1 stage, got {num_stages}")
        if num_batches < 1:
            raise ValueError(f"a schedule needs at least 1 batch, got {num_batches}")
        self.num_stages = num_stages
        self.num_batches = num_batches
        self.stages: tuple[tuple[Action, ...], ...] = _expand(self)
        self._programs: dict[tuple[int, int], tuple[Action, ...]] = {}

    # ---------------------------------------------------------------------------------------
    # what a schedule defines
    # ---------------------------------------------------------------------------------------

    def orders(self) -> list[list[tuple[Op, int]]]:
        """Each stage's forwards and backwards, ``(Op.FORWARD or Op.BACKWARD, batch)``, in order."""
        raise NotImplementedError(f"{type(self).__name__} does not say its orders")

    def weights_for(self, op: Op, stage: int) -> tuple[Weights, int]:
        """The weights a forward or backward on ``stage`` computes with, and ``ahead``.

        Args:
            op: ``Op.FORWARD`` or ``Op.BACKWARD``.
            stage: the stage, from 0.
        """
        return Weights.CURRENT, 0

    # ---------------------------------------------------------------------------------------
    # what the runtime and the simulator use
    # ---------------------------------------------------------------------------------------

    def for_stage(self, stage: int) -> tuple[Action, ...]:
        """The actions stage ``stage`` executes, in order.

        Args:
            stage: the stage, from 0.
        """
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is out of range for {self.num_stages} stages")
        return self.stages[stage]

    def reuses_forward_graph(self, stage: int) -> bool:
        """Whether ``stage``'s backwards run on their forwards' graphs: the module's rule,
        :func:`reuses_forward_graph`, on the stage's actions.

        Args:
            stage: the stage, from 0.
        """
        return reuses_forward_graph(self.for_stage(stage))

    @property
    def predicts(self) -> bool:
        """True when some computation uses predicted weights (the optimizer must allow it)."""
        return any(a.weights is Weights.PREDICTED for actions in self.stages for a in actions)

    def program(self, stage: int, pieces: int = 1) -> tuple[Action, ...]:
        """What stage ``stage`` runs, message by message, each batch in ``pieces`` pieces.

        First the receive of every message the stage will take is posted, in the order its
        neighbour sends them. Then, per forward: the weights it computes with are made (a
        prediction, or a copy where :func:`stashes_weights`), and each piece is received,
        computed and sent on. Per backward: a stage that does not reuse the forward's graph
        makes the backward's weights, and each piece is computed again, its gradient received,
        the backward run and the input's gradient sent back. Updates stay where the schedule
        has them, and the program ends waiting on its sends.

        Args:
            stage: the stage, from 0.
            pieces: pieces each batch travels in (>= 1).

        Raises :class:`ValueError` when a stage would take messages in another order than its
        neighbour sends them.
        """
        if pieces < 1:
            raise ValueError(f"pieces must be >= 1, got {pieces}")
        key = (stage, pieces)
        if key not in self._programs:
            self._programs[key] = self._lower(stage, pieces)
        return self._programs[key]

    def _lower(self, stage: int, pieces: int) -> tuple[Action, ...]:
        actions = self.for_stage(stage)
        keep = reuses_forward_graph(actions)
        stash = stashes_weights(actions)
        lowered: list[Action] = []
        for recv, send, post, peer in (
            (Op.RECV_ACT, Op.SEND_ACT, Op.POST_ACT, stage - 1),
            (Op.RECV_GRAD, Op.SEND_GRAD, Op.POST_GRAD, stage + 1),
        ):
            taken = [a.batch for a in actions if a.op is recv]
            if not 0 <= peer < self.num_stages:
                continue
            sent = [a.batch for a in self.stages[peer] if a.op is send]
            if taken != sent:
                raise ValueError(
                    f"{self.name}: stage {stage} takes batches {taken} in another order than "
                    f"stage {peer} sends them, {sent}"
                )
            lowered += [Action(0, stage, post, b, piece=p) for b in sent for p in range(pieces)]
        messages = {(a.op, a.batch, a.clock) for a in actions}
        for action in actions:
            if action.op is Op.UPDATE:
                lowered.append(action)
            if action.op not in (Op.FORWARD, Op.BACKWARD):
                continue
            forward = action.op is Op.FORWARD
            recv, send = (Op.RECV_ACT, Op.SEND_ACT) if forward else (Op.RECV_GRAD, Op.SEND_GRAD)
            receives = (recv, action.batch, action.clock) in messages
            sends = (send, action.batch, action.clock) in messages
            clock, batch = action.clock, action.batch
            computed = (action.version, action.weights, action.ahead)
            if action.predicted and (forward or not keep):
                lowered.append(Action(clock, stage, Op.PREDICT, batch, *computed))
            elif stash and forward and not action.predicted:
                lowered.append(
                    Action(clock, stage, Op.STASH, batch, action.version, Weights.STASHED)
                )
            for piece in range(pieces):
                if not forward and not keep:
                    lowered.append(Action(clock, stage, Op.RECOMPUTE, batch, *computed, piece))
                if receives:
                    lowered.append(Action(clock, stage, recv, batch, piece=piece))
                lowered.append(Action(clock, stage, action.op, batch, *computed, piece))
                if sends:
                    lowered.append(Action(clock, stage, send, batch, piece=piece))
        lowered.append(Action(actions[-1].clock, stage, Op.WAIT_SENDS, actions[-1].batch))
        return tuple(lowered)

    # ---------------------------------------------------------------------------------------
    # the unit-time picture
    # ---------------------------------------------------------------------------------------

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


def _check_orders(schedule: Schedule, orders: Sequence[Sequence[tuple[Op, int]]]) -> None:
    """Every stage runs each batch's forward once, then its backward once."""
    if len(orders) != schedule.num_stages:
        raise ValueError(
            f"{schedule.name}: orders for {len(orders)} stages, expected {schedule.num_stages}"
        )
    expected = sorted(
        (op, b) for op in (Op.FORWARD, Op.BACKWARD) for b in range(schedule.num_batches)
    )
    for stage, order in enumerate(orders):
        where = {step: i for i, step in enumerate(order)}
        if sorted(order) != expected or any(
            where[(Op.BACKWARD, b)] < where[(Op.FORWARD, b)] for b in range(schedule.num_batches)
        ):
            raise ValueError(
                f"{schedule.name}: stage {stage} must run every batch's forward once, then its "
                "backward once"
            )


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


def _expand(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    """A schedule's per-stage orders as full action lists with clocks, versions and weights."""
    orders = schedule.orders()
    _check_orders(schedule, orders)
    num_stages = schedule.num_stages
    clocks = _clocks(num_stages, orders)
    stages = []
    for stage, order in enumerate(orders):
        actions: list[Action] = []
        updates = 0
        forward_version: dict[int, int] = {}
        last = stage == num_stages - 1
        for op, batch in order:
            clock = clocks[stage][(op, batch)]
            weights, ahead = schedule.weights_for(op, stage)
            if op is Op.FORWARD:
                forward_version[batch] = updates
                if stage > 0:
                    actions.append(Action(clock, stage, Op.RECV_ACT, batch))
                actions.append(Action(clock, stage, op, batch, updates, weights, ahead))
                if not last:
                    actions.append(Action(clock, stage, Op.SEND_ACT, batch))
                continue
            version = forward_version[batch] if weights is Weights.STASHED else updates
            if not last:
                actions.append(Action(clock, stage, Op.RECV_GRAD, batch))
            actions.append(Action(clock, stage, op, batch, version, weights, ahead))
            if stage > 0:
                actions.append(Action(clock, stage, Op.SEND_GRAD, batch))
            if not schedule.synchronous:
                actions.append(Action(clock, stage, Op.UPDATE, batch, updates))
                updates += 1
        if schedule.synchronous:
            actions.append(Action(actions[-1].clock, stage, Op.UPDATE, schedule.num_batches - 1))
        actions.sort(key=lambda a: (a.clock, _TICK_ORDER[a.op]))
        stages.append(tuple(actions))
    return tuple(stages)


def gpipe_order(num_stages: int, num_batches: int) -> list[list[tuple[Op, int]]]:
    """Every stage: all forwards, then all backwards, in batch order (torch's ScheduleGPipe too).

    Args:
        num_stages: The stages.
        num_batches: The (micro-)batches.
    """
    order: list[tuple[Op, int]] = [(Op.FORWARD, b) for b in range(num_batches)]
    order += [(Op.BACKWARD, b) for b in range(num_batches)]
    return [list(order) for _ in range(num_stages)]


def one_f_one_b_order(num_stages: int, num_batches: int) -> list[list[tuple[Op, int]]]:
    """Stage k: ``N - k`` forwards in flight, then alternate one backward, one forward (torch's
    Schedule1F1B too).

    Args:
        num_stages: The stages.
        num_batches: The (micro-)batches.
    """
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


class GPipe(Schedule):
    """GPipe: every micro-batch's forward, then every backward, then one update (a flush).

    Args:
        num_stages: stages in the pipeline (>= 1).
        num_batches: micro-batches per mini-batch (>= 1).
    """

    name = "gpipe"
    description = "flush"

    def orders(self) -> list[list[tuple[Op, int]]]:
        return gpipe_order(self.num_stages, self.num_batches)


class OneFOneB(Schedule):
    """Synchronous 1F1B (PipeDream-flush): 1F1B order within the step, one update at the end.

    Args:
        num_stages: stages in the pipeline (>= 1).
        num_batches: micro-batches per mini-batch (>= 1).
    """

    name = "1f1b"
    description = "flush"

    def orders(self) -> list[list[tuple[Op, int]]]:
        return one_f_one_b_order(self.num_stages, self.num_batches)


class AsyncOneFOneB(Schedule):
    """Asynchronous 1F1B over a stream of mini-batches, an update after every backward.

    The stream fills the pipeline once at its start and drains it once at its end, so a long
    stream (an epoch) is nearly bubble-free. Each policy is a subclass that picks the weights.

    Args:
        num_stages: stages in the pipeline (>= 1).
        num_batches: mini-batches in the stream (>= 1).
    """

    synchronous = False

    def orders(self) -> list[list[tuple[Op, int]]]:
        return one_f_one_b_order(self.num_stages, self.num_batches)


class Naive(AsyncOneFOneB):
    """Asynchronous 1F1B on the latest weights in both passes.

    Args:
        num_stages: stages in the pipeline (>= 1).
        num_batches: mini-batches in the stream (>= 1).
    """

    name = "naive"
    description = "async 1F1B, latest weights"


class PipeDream(AsyncOneFOneB):
    """Asynchronous 1F1B whose backward uses the weights its forward used (stashed).

    Args:
        num_stages: stages in the pipeline (>= 1).
        num_batches: mini-batches in the stream (>= 1).
    """

    name = "pipedream"
    description = "async 1F1B, stashed"

    def weights_for(self, op: Op, stage: int) -> tuple[Weights, int]:
        return (Weights.STASHED, 0) if op is Op.BACKWARD else (Weights.CURRENT, 0)


class SpecTrain(AsyncOneFOneB):
    """Asynchronous 1F1B on weights predicted ahead by :func:`version_difference` (the paper's
    backward: predicted from the weights at backward time).

    Args:
        num_stages: stages in the pipeline (>= 1).
        num_batches: mini-batches in the stream (>= 1).
    """

    name = "spectrain"
    description = "async 1F1B, predicted"

    def weights_for(self, op: Op, stage: int) -> tuple[Weights, int]:
        s_fwd, s_bwd = version_difference(stage, self.num_stages)
        return Weights.PREDICTED, s_fwd if op is Op.FORWARD else s_bwd


class SpecTrainReuse(SpecTrain):
    """SpecTrain whose backward reuses the forward's prediction (and graph): both aim at the same
    future version of the weights, and the forward is not computed twice.

    Args:
        num_stages: stages in the pipeline (>= 1).
        num_batches: mini-batches in the stream (>= 1).
    """

    name = "spectrain-reuse"
    description = "async 1F1B, predicted, forward's reused"

    def weights_for(self, op: Op, stage: int) -> tuple[Weights, int]:
        if op is Op.BACKWARD:
            return Weights.STASHED, 0
        return super().weights_for(op, stage)


#: Every schedule by name, in the order the benchmark's tables list them.
SCHEDULE_TYPES: dict[str, type[Schedule]] = {
    kind.name: kind for kind in (GPipe, OneFOneB, Naive, PipeDream, SpecTrain, SpecTrainReuse)
}
#: Names of the schedules, as ``interlace train --schedule`` takes them (SpecTrain's reuse is
#: its ``--spectrain-backward``).
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "pipedream", "spectrain", "naive")
#: The schedules that flush (update once per mini-batch after all its micro-batches).
SYNCHRONOUS: tuple[str, ...] = tuple(
    n for n, kind in SCHEDULE_TYPES.items() if n in SCHEDULES and kind.synchronous
)
#: The asynchronous 1F1B schedules, by weight policy.
ASYNCHRONOUS: tuple[str, ...] = tuple(
    n for n, kind in SCHEDULE_TYPES.items() if n in SCHEDULES and not kind.synchronous
)


def schedule_type(name: str) -> type[Schedule]:
    """The schedule called ``name`` (a key of :data:`SCHEDULE_TYPES`).

    Args:
        name: the schedule's name.
    """
    if name not in SCHEDULE_TYPES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_TYPES)}")
    return SCHEDULE_TYPES[name]


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe over ``num_microbatches`` micro-batches (:class:`GPipe`).

    Args:
        num_stages: stages in the pipeline (>= 1).
        num_microbatches: micro-batches per mini-batch (>= 1).
    """
    return GPipe(num_stages, num_microbatches)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Synchronous 1F1B over ``num_microbatches`` micro-batches (:class:`OneFOneB`).

    Args:
        num_stages: stages in the pipeline (>= 1).
        num_microbatches: micro-batches per mini-batch (>= 1).
    """
    return OneFOneB(num_stages, num_microbatches)


def async_one_f_one_b(num_stages: int, num_batches: int, policy: str) -> Schedule:
    """Asynchronous 1F1B over ``num_batches`` mini-batches with a weight policy.

    Args:
        num_stages: stages in the pipeline (>= 1).
        num_batches: mini-batches in the stream (>= 1).
        policy: "naive", "pipedream" or "spectrain": which weights each pass uses.
    """
    if policy not in ASYNCHRONOUS:
        raise ValueError(f"policy must be one of {', '.join(ASYNCHRONOUS)}, got {policy!r}")
    return SCHEDULE_TYPES[policy](num_stages, num_batches)


def build_schedule(name: str, num_stages: int, num_batches: int) -> Schedule:
    """The schedule called ``name`` over ``num_stages`` stages and ``num_batches`` batches.

    For the synchronous schedules ``num_batches`` is the number of micro-batches in one step;
    for the asynchronous ones it is the number of mini-batches in the stream.

    Args:
        name: a key of :data:`SCHEDULE_TYPES`.
        num_stages: stages in the pipeline (>= 1).
        num_batches: micro-batches in one step (synchronous schedules) or mini-batches in the
            stream (asynchronous ones).
    """
    return schedule_type(name)(num_stages, num_batches)
