"""Replicated pipelines priced fast: ``S`` stages x ``R`` replicas on a flat or two-level network.

Each stage walks its lowered program (:meth:`interlace.pipeline.schedule.Schedule.program`, what
the runtime runs) in order. A message (payload and its header) takes ``b * bytes`` on the
sending rank's outgoing link of its level (inside a node or between nodes; one level on a flat
network), which carries that rank's sends one after another, then ``a`` to land. A replicated
stage averages its gradients as :func:`interlace.pipeline.layout.averaging_points` says, in
DataParallel's bucket plan for the stage's tensors, priced on the stage group's all-reduce cost
(:meth:`interlace.sim.network.Network.group_cost`). The exact gloo replay of one flat pipeline
is :mod:`interlace.sim.pipeline_events`; this walk is what the planner can afford at 2048 ranks.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import Overlap
from interlace.comm.plan import ReadyTensor
from interlace.comm.strategies import Strategy
from interlace.errors import UsageError
from interlace.pipeline.block import HEADER_BYTES, block_plan, piece_of
from interlace.pipeline.cut import cut_stages
from interlace.pipeline.layout import PipelineLayout, averaging_points
from interlace.pipeline.schedule import SCHEDULE_TYPES, Op
from interlace.sim.network import Link, Network
from interlace.sim.pipeline import StageCost, stage_costs, trace_bounds
from interlace.sim.pipeline_events import SEND_BUFFER_BYTES
from interlace.sim.simulation import strategy_named, wire_tensors
from interlace.sim.trace import Trace

__all__ = [
    "PipelineConfig",
    "PipelinePrice",
    "StageWork",
    "kept",
    "price_pipeline",
    "stage_reduce_s",
    "walk_programs",
]


@dataclass(frozen=True)
class PipelineConfig:
    """One replicated pipeline to price.

    Args:
        stages: Stages per pipeline (>= 2).
        replicas: Pipelines whose stages average their gradients (>= 1).
        schedule: A key of :data:`interlace.pipeline.schedule.SCHEDULE_TYPES`.
        batch: Samples per mini-batch through one pipeline.
        pieces: Micro-batches per mini-batch (synchronous schedules) or chunks (asynchronous).
        strategy: The DataParallel strategy that plans each stage's all-reduce.
        compression: ``"fp16"``/``"bf16"``: the stage all-reduce sends half the bytes.
    """

    stages: int
    replicas: int
    schedule: str
    batch: int
    pieces: int
    strategy: str = "mgwfbp"
    compression: str | None = None

    @property
    def synchronous(self) -> bool:
        """Whether the schedule flushes (one update per mini-batch after all its pieces)."""
        return SCHEDULE_TYPES[self.schedule].synchronous


@dataclass(frozen=True)
class StageWork:
    """What one stage does per piece and per mini-batch, for :func:`walk_programs`.

    Args:
        forward_s: One piece's forward (and a recompute's).
        backward_s: One piece's backward.
        update_s: One optimizer step.
        weights_s: One prediction or stash of the stage's weights.
        reduce_s: From the start of the launching backward to the end of the stage's
            all-reduce (0: one replica).
        act_bytes: Bytes of one piece's output sent to the next stage (0 on the last).
        act_link: The link that output crosses (None on the last stage).
    """

    forward_s: float
    backward_s: float
    update_s: float
    weights_s: float
    reduce_s: float
    act_bytes: float
    act_link: Link | None


@dataclass(frozen=True)
class PipelinePrice:
    """A replicated pipeline's steady-state mini-batch and what it is made of.

    Args:
        config: What was priced.
        iteration_s: Seconds per mini-batch (every replica's at once).
        compute_s: The critical stage's computing, per mini-batch (the stage that waits least
            on its neighbours' work; the other terms are its too).
        bubble_s: Its waits on its neighbours' work (fill, drain, imbalance).
        p2p_s: Its waits on messages in flight.
        allreduce_s: Its wait for its gradients' all-reduce before the update.
        buckets: All-reduces per stage update (0 with one replica).
        bounds: Each stage's ``[start, end)`` layers.
    """

    config: PipelineConfig
    iteration_s: float
    compute_s: float
    bubble_s: float
    p2p_s: float
    allreduce_s: float
    buckets: int
    bounds: tuple[tuple[int, int], ...]

    def terms(self) -> dict[str, float]:
        """The iteration by term: compute, pipeline bubble, p2p, all-reduce."""
        return {
            "compute": self.compute_s,
            "pipeline bubble": self.bubble_s,
            "p2p": self.p2p_s,
            "all-reduce": self.allreduce_s,
        }


@dataclass
class _Stage:
    """One stage's walk: where it is in its program, its clock and its accounts."""

    clock: float = 0.0
    position: int = 0
    pending: float = 0.0  # when its sends so far are complete
    reduce_done: float = 0.0
    busy: float = 0.0
    bubble: float = 0.0
    p2p: float = 0.0
    allreduce: float = 0.0


# Compiled instructions: (code, message or neighbour, message).
_RECV, _SEND, _WAIT_SENDS, _UPDATE, _FORWARD, _BACKWARD, _LAUNCH, _WEIGHTS = range(8)
_CODES = {
    Op.RECV_ACT: _RECV,
    Op.RECV_GRAD: _RECV,
    Op.SEND_ACT: _SEND,
    Op.SEND_GRAD: _SEND,
    Op.WAIT_SENDS: _WAIT_SENDS,
    Op.UPDATE: _UPDATE,
    Op.FORWARD: _FORWARD,
    Op.RECOMPUTE: _FORWARD,
    Op.BACKWARD: _BACKWARD,
    Op.PREDICT: _WEIGHTS,
    Op.STASH: _WEIGHTS,
}


@functools.lru_cache(maxsize=512)
def _compiled(
    schedule: str, stages: int, block: int, pieces: int
) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Every stage's program of ``block`` mini-batches as small integer triples: the schedule's
    lowered programs, each message numbered, each launching backward marked."""
    kind = SCHEDULE_TYPES[schedule]
    plan = block_plan(kind, block, microbatches=pieces, chunks=pieces)
    program = kind(stages, plan.units)
    numbers: dict[tuple[object, ...], int] = {}
    compiled = []
    for k in range(stages):
        actions = program.program(k, plan.pieces)
        launches = {p.backward for p in averaging_points(actions)}
        mine = []
        for step in range(plan.steps):
            for index, action in enumerate(actions):
                code = _CODES.get(action.op)
                if code is None:
                    continue  # receives are posted up front (the Inbox): nothing to wait for
                if code in (_RECV, _SEND):
                    forward = action.op in (Op.RECV_ACT, Op.SEND_ACT)
                    into = k if code == _RECV else (k + 1 if forward else k - 1)
                    key = (forward, step, action.batch, piece_of(action), into)
                    mine.append((code, into, numbers.setdefault(key, len(numbers))))
                elif code == _BACKWARD and index in launches:
                    mine.append((_LAUNCH, 0, 0))
                else:
                    mine.append((code, 0, 0))
        compiled.append(tuple(mine))
    return tuple(compiled)


def walk_programs(
    works: Sequence[StageWork],
    schedule: str,
    *,
    pieces: int,
    block: int,
) -> list[list[tuple[float, float, float, float, float]]]:
    """Walk every stage's program of ``block`` mini-batches; per stage, after each update, its
    clock and its busy, bubble, p2p and all-reduce seconds so far.

    Args:
        works: Each stage's work and the link to the next stage.
        schedule: A key of :data:`~interlace.pipeline.schedule.SCHEDULE_TYPES`.
        pieces: Micro-batches (synchronous) or chunks (asynchronous) per mini-batch.
        block: Mini-batches.

    Raises:
        ValueError: When the programs deadlock.
    """
    programs = _compiled(schedule, len(works), block, pieces)
    count = len(works)
    stages = [_Stage() for _ in range(count)]
    arrivals: dict[int, tuple[float, float]] = {}  # message -> (issued, arrival)
    out_free: dict[int, float] = {}
    # Each boundary's link as a number (a rank's sends on one level share its outgoing link).
    levels: dict[Link, int] = {}
    level = [levels.setdefault(w.act_link, len(levels)) if w.act_link else 0 for w in works]
    marks: list[list[tuple[float, float, float, float, float]]] = [[] for _ in range(count)]

    def advance(k: int) -> bool:
        me, work, program, moved = stages[k], works[k], programs[k], False
        while me.position < len(program):
            code, peer, message = program[me.position]
            if code == _RECV:
                if message not in arrivals:
                    return moved
                issued, arrival = arrivals.pop(message)
                if arrival > me.clock:
                    me.bubble += max(0.0, min(issued, arrival) - me.clock)
                    me.p2p += arrival - max(issued, me.clock)
                    me.clock = arrival
            elif code == _SEND:
                boundary = works[min(k, peer)]
                link = boundary.act_link
                assert link is not None  # a neighbour exists where the schedule sends
                lane = k * count + level[min(k, peer)]
                start = max(me.clock, out_free.get(lane, 0.0))
                end = start + link.beta * (boundary.act_bytes + HEADER_BYTES)
                out_free[lane] = end
                arrivals[message] = (me.clock, end + link.alpha)
                me.pending = max(me.pending, me.clock, end - link.beta * SEND_BUFFER_BYTES)
            elif code == _WAIT_SENDS:
                if me.pending > me.clock:
                    me.p2p += me.pending - me.clock
                    me.clock = me.pending
            elif code == _UPDATE:
                if me.reduce_done > me.clock:
                    me.allreduce += me.reduce_done - me.clock
                    me.clock = me.reduce_done
                me.clock += work.update_s
                me.busy += work.update_s
                marks[k].append((me.clock, me.busy, me.bubble, me.p2p, me.allreduce))
            else:
                if code == _LAUNCH:
                    me.reduce_done = me.clock + work.reduce_s
                seconds = (
                    work.forward_s
                    if code == _FORWARD
                    else work.weights_s
                    if code == _WEIGHTS
                    else work.backward_s
                )
                me.clock += seconds
                me.busy += seconds
            me.position += 1
            moved = True
        return moved

    while not all(s.position == len(p) for s, p in zip(stages, programs, strict=True)):
        if not any([advance(k) for k in range(count)]):
            raise ValueError(f"the {schedule} programs deadlock on {count} stages")
    return marks


def stage_reduce_s(
    trace: Trace,
    bounds: Sequence[tuple[int, int]],
    stage: int,
    backward_s: float,
    cost: CostModel,
    strategy: str = "mgwfbp",
    compression: str | None = None,
) -> tuple[float, int]:
    """From the start of a stage's launching backward to the end of its gradients' all-reduce,
    and the buckets: DataParallel's plan (``strategy``) of the stage's tensors, made ready as a
    backward of ``backward_s`` reaches their layers.

    Args:
        trace: The model.
        bounds: Each stage's ``[start, end)`` layers, forward order.
        stage: The stage.
        backward_s: The launching backward's seconds.
        cost: The stage group's all-reduce.
        strategy: A planned DataParallel strategy that ends its all-reduces in backward.
        compression: ``"fp16"``/``"bf16"`` or None.

    Raises:
        UsageError: For a strategy that overlaps the next forward (a stage's update cannot wait).
    """
    chosen = strategy_named(strategy)
    if chosen.overlap is Overlap.FORWARD:
        raise UsageError(
            f"{strategy!r} overlaps the next forward; a stage's all-reduce ends before its "
            "update: use mgwfbp, fixed, wfbp, single or optimal"
        )
    memo = kept(trace)
    if "scales" not in memo:
        memo["scales"] = trace.pass_scales
    # Every schedule and replica of one cut asks for the same plans: price each once.
    key = ("stage reduce", tuple(bounds), stage, backward_s, cost, strategy, compression)
    if key not in memo:
        memo[key] = _plan_stage_reduce(trace, bounds, stage, backward_s, cost, chosen, compression)
    result: tuple[float, int] = memo[key]
    return result


def _plan_stage_reduce(
    trace: Trace,
    bounds: Sequence[tuple[int, int]],
    stage: int,
    backward_s: float,
    cost: CostModel,
    chosen: Strategy,
    compression: str | None,
) -> tuple[float, int]:
    """:func:`stage_reduce_s` without the memo."""
    _, scale = kept(trace)["scales"]
    own = _stage_layers(trace, tuple(bounds))[stage]
    total = math.fsum(trace.tensors[ix[0]].layer_backward_s * scale for _, ix in own)
    factor = backward_s / total if total > 0 else 0.0
    tensors, elapsed = [], 0.0
    for _, indices in own:
        elapsed += trace.tensors[indices[0]].layer_backward_s * scale * factor
        for index in indices:
            tensor = trace.tensors[index]
            tensors.append(ReadyTensor(tensor.name, tensor.nbytes, min(elapsed, backward_s)))
    if not tensors:
        return 0.0, 0
    plan = chosen.plan(
        wire_tensors(tensors, compression), cost, backward_s=backward_s, forward_s=0.0
    )
    return max(b.end_s for b in plan.buckets), len(plan.buckets)


def _works(
    trace: Trace,
    config: PipelineConfig,
    network: Network,
    layout: PipelineLayout,
    replica: int,
    costs: Sequence[StageCost],
    bounds: Sequence[tuple[int, int]],
) -> tuple[list[StageWork], int]:
    """Every stage's work in pipeline ``replica`` and the buckets per update."""
    works, buckets = [], 0
    params = [
        float(sum(trace.tensors[i].nbytes for _, ix in own for i in ix))
        for own in _stage_layers(trace, tuple(bounds))
    ]
    total = sum(params) or 1.0
    ranks = layout.pipeline_ranks(replica)
    for stage, cost in enumerate(costs):
        link = None
        if stage + 1 < config.stages:
            link = network.point_to_point(layout.same_node(ranks[stage], ranks[stage + 1]))
            if link is None:
                raise UsageError(
                    f"network {network.spec or network.describe()!r} prices all-reduces only; "
                    "pipelines need its links: give ring:RATE, two-level:..., or fitted:A,B@N"
                )
        reduce_s = 0.0
        if config.replicas > 1:
            _, per_node = layout.spread(layout.stage_ranks(stage))
            group = network.group_cost(config.replicas, per_node)
            reduce_s, mine = stage_reduce_s(
                trace,
                bounds,
                stage,
                cost.backward_s / config.pieces,
                group,
                config.strategy,
                config.compression,
            )
            buckets = max(buckets, mine)
        step = trace.step_s * params[stage] / total
        works.append(
            StageWork(
                forward_s=cost.forward_s / config.pieces,
                backward_s=cost.backward_s / config.pieces,
                update_s=step,
                weights_s=step,
                reduce_s=reduce_s,
                act_bytes=cost.output_bytes / config.pieces,
                act_link=link,
            )
        )
    return works, buckets


#: Work kept per trace (by identity: hashing a trace costs more than the work), the trace
#: itself held so that its identity stays its own; the last few traces only.
_KEPT: dict[int, tuple[Trace, dict[Hashable, Any]]] = {}
_KEEP_TRACES = 4


def kept(trace: Trace) -> dict[Hashable, Any]:
    """A memo for work on ``trace`` that the planner repeats at every worker count.

    Args:
        trace: The trace.
    """
    entry = _KEPT.get(id(trace))
    if entry is None or entry[0] is not trace:
        while len(_KEPT) >= _KEEP_TRACES:
            del _KEPT[next(iter(_KEPT))]
        entry = _KEPT[id(trace)] = (trace, {})
    return entry[1]


def _cut(
    trace: Trace, config: PipelineConfig, network: Network, layout: PipelineLayout
) -> tuple[tuple[tuple[int, int], ...], tuple[StageCost, ...]]:
    """The stages as the runtime cuts them by default, and their costs (kept).

    One replica: the traced layers' times balanced (:func:`interlace.sim.pipeline.trace_bounds`,
    ``plan_stages(by="time")``). Several: :func:`interlace.pipeline.cut.cut_stages`, each stage's
    compute per mini-batch plus its gradients' all-reduce on stage 0's replica group, the rule
    ``plan_stages(by="time+allreduce")`` runs on the measured blocks.
    """
    memo = kept(trace)
    stages, batch, replicas = config.stages, config.batch, config.replicas
    cost = None
    if replicas > 1:
        _, per_node = layout.spread(layout.stage_ranks(0))
        cost = network.group_cost(replicas, per_node)
    key = ("cut", stages, batch, replicas, cost)
    if key not in memo:
        if cost is None:
            bounds = tuple(trace_bounds(trace, stages))
        else:
            layers = _stage_layers(trace, ((0, len(trace.layers)),))[0][::-1]  # forward order
            blocks = stage_costs(trace, [(i, i + 1) for i in range(len(layers))], batch)
            bounds = tuple(
                cut_stages(
                    [c.forward_s + c.backward_s for c in blocks],
                    [float(sum(trace.tensors[i].nbytes for i in ix)) for _, ix in layers],
                    stages,
                    replicas=replicas,
                    cost=cost,
                )
            )
        memo[key] = bounds, tuple(stage_costs(trace, bounds, batch))
    return memo[key]  # type: ignore[no-any-return]


def _stage_layers(
    trace: Trace, bounds: tuple[tuple[int, int], ...]
) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]:
    """Each stage's layers in backward order, with their tensors' indices."""
    memo = kept(trace)
    key = ("layers", bounds)
    if key not in memo:
        layers = list(reversed(trace.layers))  # forward order
        memo[key] = tuple(
            tuple((name, tuple(ix)) for name, ix in reversed(layers[start:end]))
            for start, end in bounds
        )
    return memo[key]  # type: ignore[no-any-return]


def price_pipeline(
    trace: Trace,
    config: PipelineConfig,
    network: Network,
    gpus_per_node: int | None = None,
) -> PipelinePrice:
    """The steady-state mini-batch of ``config`` on ``network``.

    Stages are cut as the runtime cuts them by default: by the traced layers' times with one
    replica, by time plus each stage's all-reduce with several (``plan_stages(by="auto")``,
    :func:`interlace.pipeline.cut.cut_stages`); a stage's optimizer step, and a prediction or
    stash of its weights, take the trace's step in proportion to the stage's parameters. Every
    pipeline whose links cross nodes differently is walked; the slowest sets the pace (the
    stage all-reduces make the replicas wait for each other).

    Args:
        trace: A trace with activation sizes.
        config: The pipeline.
        network: Prices links and all-reduces.
        gpus_per_node: Ranks per node for the layout (default: the network's).

    Raises:
        UsageError: For a trace without activation sizes, too few layers, a bad schedule, or a
            network without point-to-point links.
    """
    if config.schedule not in SCHEDULE_TYPES:
        raise UsageError(
            f"unknown schedule {config.schedule!r}; choose from {', '.join(SCHEDULE_TYPES)}"
        )
    if config.stages < 2 or config.pieces < 1 or config.batch < config.pieces:
        raise UsageError(
            f"need >= 2 stages and 1 <= pieces <= batch, got {config.stages} stages, "
            f"{config.pieces} pieces of a batch of {config.batch}"
        )
    layout = PipelineLayout(config.stages, config.replicas, gpus_per_node or network.node_size)
    bounds, costs = _cut(trace, config, network, layout)
    # Pipelines whose boundaries cross nodes alike run alike: walk one of each.
    patterns: dict[tuple[bool, ...], int] = {}
    # The placement repeats every node's worth of ranks: the first few replicas show them all.
    for replica in range(
        1 if layout.gpus_per_node is None else min(config.replicas, layout.gpus_per_node)
    ):
        ranks = layout.pipeline_ranks(replica)
        pattern = tuple(layout.same_node(a, b) for a, b in itertools.pairwise(ranks))
        patterns.setdefault(pattern, replica)
    # A window of mini-batches past the fill and before the drain.
    if config.synchronous:
        block, low, high = 3, 1, 2
    else:
        # (a longer stream, 6S with the window S..5S, gives the same period on the shipped traces)
        block, low, high = 2 * config.stages + 2, config.stages, 2 * config.stages
    best: PipelinePrice | None = None
    for replica in patterns.values():
        works, buckets = _works(trace, config, network, layout, replica, costs, bounds)
        marks = walk_programs(works, config.schedule, pieces=config.pieces, block=block)
        span = high - low
        period = max((m[high][0] - m[low][0]) / span for m in marks)
        # The critical stage never waits on its neighbours' work: its least bubble, then busiest.
        critical = min(
            range(config.stages),
            key=lambda k: (
                round((marks[k][high][2] - marks[k][low][2]) / span, 12),
                -(marks[k][high][1] - marks[k][low][1]),
            ),
        )
        mark_hi, mark_lo = marks[critical][high], marks[critical][low]
        compute, _, p2p, allreduce = ((mark_hi[i] - mark_lo[i]) / span for i in range(1, 5))
        price = PipelinePrice(
            config,
            iteration_s=period,
            compute_s=compute,
            bubble_s=max(0.0, period - compute - p2p - allreduce),
            p2p_s=p2p,
            allreduce_s=allreduce,
            buckets=buckets,
            bounds=tuple(bounds),
        )
        if best is None or price.iteration_s > best.iteration_s:
            best = price
    assert best is not None
    return best
