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

import math
from collections.abc import Sequence
from dataclasses import dataclass

from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import Overlap
from interlace.comm.plan import ReadyTensor
from interlace.errors import UsageError
from interlace.pipeline.block import HEADER_BYTES, block_plan, piece_of
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
        compute_s: The busiest stage's computing, per mini-batch.
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
    kind = SCHEDULE_TYPES[schedule]
    plan = block_plan(kind, block, microbatches=pieces, chunks=pieces)
    count = len(works)
    program = kind(count, plan.units)
    programs = [
        [(step, a) for step in range(plan.steps) for a in program.program(k, plan.pieces)]
        for k in range(count)
    ]
    launches = [
        {p.backward for p in averaging_points(program.program(k, plan.pieces))}
        for k in range(count)
    ]
    lengths = [len(program.program(k, plan.pieces)) for k in range(count)]
    stages = [_Stage() for _ in range(count)]
    arrivals: dict[tuple[object, ...], tuple[float, float]] = {}  # key -> (issued, arrival)
    out_free: dict[tuple[int, Link], float] = {}
    marks: list[list[tuple[float, float, float, float, float]]] = [[] for _ in range(count)]

    def send(k: int, to: int, key: tuple[object, ...], nbytes: float, link: Link) -> None:
        me = stages[k]
        lane = (k, link)  # a rank's sends on one level share its outgoing link
        start = max(me.clock, out_free.get(lane, 0.0))
        end = start + link.beta * (nbytes + HEADER_BYTES)
        out_free[lane] = end
        arrivals[key] = (me.clock, end + link.alpha)
        me.pending = max(me.pending, me.clock, end - link.beta * SEND_BUFFER_BYTES)

    def advance(k: int) -> bool:
        me, work, moved = stages[k], works[k], False
        while me.position < len(programs[k]):
            step, action = programs[k][me.position]
            op = action.op
            if op in (Op.RECV_ACT, Op.RECV_GRAD):
                key = (op is Op.RECV_ACT, step, action.batch, piece_of(action), k)
                if key not in arrivals:
                    return moved
                issued, arrival = arrivals.pop(key)
                if arrival > me.clock:
                    me.bubble += max(0.0, min(issued, arrival) - me.clock)
                    me.p2p += arrival - max(issued, me.clock)
                    me.clock = arrival
            elif op in (Op.SEND_ACT, Op.SEND_GRAD):
                forward = op is Op.SEND_ACT
                to = k + 1 if forward else k - 1
                boundary = works[min(k, to)]
                assert boundary.act_link is not None  # a neighbour exists where the schedule sends
                key = (forward, step, action.batch, piece_of(action), to)
                send(k, to, key, boundary.act_bytes, boundary.act_link)
            elif op is Op.WAIT_SENDS:
                if me.pending > me.clock:
                    me.p2p += me.pending - me.clock
                    me.clock = me.pending
            elif op is Op.UPDATE:
                if me.reduce_done > me.clock:
                    me.allreduce += me.reduce_done - me.clock
                    me.clock = me.reduce_done
                me.clock += work.update_s
                me.busy += work.update_s
                marks[k].append((me.clock, me.busy, me.bubble, me.p2p, me.allreduce))
            else:
                seconds = {
                    Op.FORWARD: work.forward_s,
                    Op.RECOMPUTE: work.forward_s,
                    Op.BACKWARD: work.backward_s,
                    Op.PREDICT: work.weights_s,
                    Op.STASH: work.weights_s,
                }.get(op, 0.0)
                if op is Op.BACKWARD and me.position % lengths[k] in launches[k]:
                    me.reduce_done = me.clock + work.reduce_s
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
    layers = list(reversed(trace.layers))  # forward order
    start, end = bounds[stage]
    _, scale = trace.pass_scales
    own = [(name, indices) for name, indices in reversed(layers[start:end])]  # backward order
    total = math.fsum(trace.tensors[ix[0]].layer_backward_s * scale for _, ix in own)
    factor = backward_s / total if total > 0 else 0.0
    tensors, elapsed = [], 0.0
    for _, indices in own:
        elapsed += trace.tensors[indices[0]].layer_backward_s * scale * factor
        for index in indices:
            tensor = trace.tensors[index]
            tensors.append(ReadyTensor(tensor.name, tensor.nbytes, elapsed))
    if not tensors:
        return 0.0, 0
    plan = chosen.plan(wire_tensors(tensors, compression), cost, backward_s=backward_s, forward_s=0.0)
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
    params = [0.0] * config.stages
    layers = list(reversed(trace.layers))
    for stage, (start, end) in enumerate(bounds):
        params[stage] = sum(trace.tensors[i].nbytes for _, ix in layers[start:end] for i in ix)
    total = sum(params) or 1.0
    for stage, cost in enumerate(costs):
        ranks = layout.pipeline_ranks(replica)
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
            nodes, per_node = layout.spread(layout.stage_ranks(stage))
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


def price_pipeline(
    trace: Trace,
    config: PipelineConfig,
    network: Network,
    gpus_per_node: int | None = None,
) -> PipelinePrice:
    """The steady-state mini-batch of ``config`` on ``network``.

    Stages are balanced by the traced layers' times (:func:`interlace.sim.pipeline.trace_bounds`,
    the runtime's ``plan_stages(by="time")``); a stage's optimizer step, and a prediction or
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
    bounds = trace_bounds(trace, config.stages)
    costs = stage_costs(trace, bounds, config.batch)
    layout = PipelineLayout(config.stages, config.replicas, gpus_per_node or network.node_size)
    # Pipelines whose boundaries cross nodes alike run alike: walk one of each.
    patterns: dict[tuple[bool, ...], int] = {}
    for replica in range(config.replicas):
        ranks = layout.pipeline_ranks(replica)
        pattern = tuple(layout.same_node(a, b) for a, b in zip(ranks, ranks[1:], strict=False))
        patterns.setdefault(pattern, replica)
    # A window of mini-batches past the fill and before the drain.
    if config.synchronous:
        block, low, high = 3, 1, 2
    else:
        block, low, high = 3 * config.stages, config.stages, 2 * config.stages
    best: PipelinePrice | None = None
    for replica in patterns.values():
        works, buckets = _works(trace, config, network, layout, replica, costs, bounds)
        marks = walk_programs(works, config.schedule, pieces=config.pieces, block=block)
        span = high - low
        period = max((m[high][0] - m[low][0]) / span for m in marks)
        busiest = max(range(config.stages), key=lambda k: marks[k][high][1] - marks[k][low][1])
        mark_hi, mark_lo = marks[busiest][high], marks[busiest][low]
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
