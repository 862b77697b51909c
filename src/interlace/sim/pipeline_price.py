"""Replicated pipelines priced fast: ``S`` stages x ``R`` replicas on a flat or two-level network.

Each stage's program is :func:`interlace.sim.pipeline.stage_programs`' (what the runtime runs),
walked by :mod:`interlace.sim.pipeline_walk`, the fast engine of the one pipeline model. A
replicated stage averages its gradients where :func:`interlace.pipeline.layout.averaging_points`
says, in DataParallel's bucket plan for the stage's tensors, priced on the stage group's
all-reduce cost (:meth:`interlace.sim.network.Network.group_cost`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import Overlap
from interlace.comm.plan import ReadyTensor
from interlace.comm.strategies import Strategy
from interlace.errors import UsageError
from interlace.pipeline.cut import cut_stages
from interlace.pipeline.layout import PipelineLayout
from interlace.pipeline.schedule import SCHEDULE_TYPES
from interlace.sim.memo import kept
from interlace.sim.network import Link, Network
from interlace.sim.pipeline import StageCost, stage_costs, trace_bounds
from interlace.sim.pipeline_walk import (
    StageWork,
    walk_block_s,
    walk_programs,
    walk_works,
)
from interlace.sim.simulation import strategy_named, wire_tensors
from interlace.sim.trace import Trace

__all__ = [
    "PipelineConfig",
    "PipelinePrice",
    "StageWork",
    "kept",
    "price_block",
    "price_pipeline",
    "priced_stages",
    "stage_reduce_s",
    "walk_block_s",
    "walk_programs",
    "walk_works",
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


def priced_stages(
    trace: Trace,
    config: PipelineConfig,
    network: Network,
    layout: PipelineLayout,
    replica: int,
    costs: Sequence[StageCost],
    bounds: Sequence[tuple[int, int]],
) -> tuple[list[StageCost], list[Link | None], int]:
    """Every stage of pipeline ``replica`` as both engines price it: its costs with the host's
    optimizer step, prediction and stash (the trace's step in proportion to the stage's
    parameters) and its all-reduce over the replicas; the link to the next stage; the buckets
    per update.

    Args:
        trace: The model.
        config: The pipeline (``strategy``: the stage all-reduce's plan).
        network: Prices links and all-reduces.
        layout: The ranks as stages x replicas.
        replica: The pipeline.
        costs: Each stage's device time and boundary bytes (:func:`~interlace.sim.pipeline.
            stage_costs`).
        bounds: Each stage's ``[start, end)`` layers.

    Raises:
        UsageError: For a network without point-to-point links.
    """
    priced, links, buckets = [], [], 0
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
        host = replace(cost.host, update_s=step, predict_s=step, copy_s=step)
        priced.append(replace(cost, host=host, reduce_s=reduce_s))
        links.append(link)
    return priced, links, buckets


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
    priced, links, buckets = priced_stages(trace, config, network, layout, replica, costs, bounds)
    return walk_works(priced, links, config.pieces), buckets


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


def price_block(
    trace: Trace,
    config: PipelineConfig,
    network: Network,
    block: int,
    bounds: Sequence[tuple[int, int]] | None = None,
) -> float:
    """Seconds per mini-batch of one block of ``block`` mini-batches from a barrier, as
    ``interlace bench pipeline`` times it (an asynchronous stream fills and drains once per
    block), walked on the planner's fast path: the first pipeline's placement.

    Args:
        trace: A trace with activation sizes.
        config: The pipeline (``batch``: one pipeline's mini-batch).
        network: Prices links and all-reduces.
        block: Mini-batches in the block.
        bounds: The run's stages (default: balanced as :func:`price_pipeline` cuts them).
    """
    layout = PipelineLayout(config.stages, config.replicas, network.node_size)
    if bounds is None:
        cut, costs = _cut(trace, config, network, layout)
    else:
        cut, costs = tuple(bounds), tuple(stage_costs(trace, bounds, config.batch))
    works, _ = _works(trace, config, network, layout, 0, costs, cut)
    return walk_block_s(works, config.schedule, pieces=config.pieces, block=block) / block
