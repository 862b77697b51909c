"""K-FAC strategies in the simulator: one D-KFAC or SPD-KFAC iteration from a trace.

Gradient and factor all-reduces share one link, replayed by :func:`interlace.sim.replay.replay`;
decompositions are placed by the runtime's own placement objects (:mod:`interlace.kfac.placements`)
and priced here. What each cost is taken from is in docs/notes/sim.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from interlace.comm.cost import CostModel
from interlace.errors import UsageError
from interlace.kfac.enums import PlacementChoice
from interlace.kfac.placements import (
    LBP,
    Greedy,
    Placement,
    placement_from,
    placement_or_auto,
)
from interlace.sim.kfac_costs import KfacCosts
from interlace.sim.kfac_phases import (
    KfacBreakdown,
    LinkPhase,
    Passes,
    SimLayer,
    factor_messages,
    factor_seconds,
    gradient_messages,
    gradient_plan,
    link_phase,
    passes_phase,
    precondition_phase,
    sim_layers,
)
from interlace.sim.kfac_stage import Stage, decomposition_stage
from interlace.sim.memo import kept
from interlace.sim.simulation import SimResult
from interlace.sim.trace import Trace
from interlace.timeline import Event, Timeline

__all__ = [
    "KFAC_STRATEGIES",
    "PHASES",
    "KfacBreakdown",
    "KfacResult",
    "KfacStrategy",
    "check_trace",
    "kfac_strategy_named",
    "simulate_kfac",
]


@dataclass(frozen=True)
class KfacStrategy:
    """A K-FAC strategy: how factors are all-reduced and how decompositions are placed.

    Args:
        name: The name ``--strategy`` and the JSON rows use.
        pipelined: Factors computed in the passes and all-reduced in merged buckets as they
            become ready (SPD-KFAC); otherwise computed after backward and all-reduced in one
            message.
        placement: The runtime's placement object (or its name): :class:`Greedy`, a layer's
            two decompositions on one rank by n^3 (D-KFAC); :class:`LBP`, SPD-KFAC's
            load-balancing placement of single factors; ``"auto"``, chosen per simulated world
            size as the runtime chooses it (:func:`~interlace.kfac.placements.auto_placement`);
            or any other.
        description: One line for people.
        factors_in_passes: Factors computed in the passes (``A`` after its layer's forward,
            ``G`` before its layer's backward) even when sent in bulk, as interlace's hooks do
            (None: only when ``pipelined``).
        bulk_packed: Bulk factor all-reduces send packed upper triangles (kfac-pytorch's
            ``symmetry_aware``); otherwise whole ``n x n`` factors (interlace's default).
        bulk_cap_bytes: Bulk factors go in the runtime's buckets of this cap
            (:func:`~interlace.kfac.fusion.bulk_groups`; 0: a bucket per factor); None: one
            message.
        factor_group: Pipelined factor all-reduces run on a process group of their own (a
            second queue beside the gradients', sharing the wire), as interlace's do; otherwise
            gradients and factors share one serial queue.
        presence_bytes: Bytes per layer of the all-reduce before bulk factors with which the
            ranks agree which layers have factors (interlace's ``step()``: three int32 flags);
            0: none.
    """

    name: str
    pipelined: bool
    placement: Placement | PlacementChoice
    description: str
    factors_in_passes: bool | None = None
    bulk_packed: bool = True
    bulk_cap_bytes: int | None = None
    factor_group: bool = False
    presence_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", placement_or_auto(self.placement))

    def placement_on(self, workers: int) -> Placement:
        """The placement the runtime runs on ``workers`` ranks (COMM-OPT, as simulated).

        Args:
            workers: The simulated world size.
        """
        return placement_from(self.placement, ranks=workers, comm_opt=True)

    @property
    def computes_in_passes(self) -> bool:
        """Whether the factors are computed inside forward and backward."""
        return self.pipelined if self.factors_in_passes is None else self.factors_in_passes


#: Every K-FAC strategy by name (what ``--strategy`` takes besides the data-parallel ones).
KFAC_STRATEGIES: dict[str, KfacStrategy] = {
    "dkfac": KfacStrategy(
        "dkfac",
        False,
        Greedy(),
        "D-KFAC: factors after backward, one bulk all-reduce, greedy placement per layer",
    ),
    "dkfac-pipelined": KfacStrategy(
        "dkfac-pipelined",
        True,
        Greedy(),
        "D-KFAC with SPD-KFAC's pipelined factor all-reduces in merged buckets",
    ),
    "dkfac-lbp": KfacStrategy(
        "dkfac-lbp", False, LBP(), "D-KFAC with SPD-KFAC's load-balancing placement"
    ),
    "spd": KfacStrategy(
        "spd",
        True,
        LBP(),
        "SPD-KFAC: pipelined factor all-reduces in merged buckets, load-balancing placement",
    ),
}

#: The phases of a K-FAC iteration, in order; they add up to the iteration time.
PHASES: tuple[str, ...] = tuple(f.name for f in fields(KfacBreakdown))


def kfac_strategy_named(name: str) -> KfacStrategy:
    """The :data:`KFAC_STRATEGIES` entry ``name``; a clear error naming the choices otherwise.

    Args:
        name: A key of :data:`KFAC_STRATEGIES`.

    Raises:
        UsageError: For an unknown name.
    """
    if name in KFAC_STRATEGIES:
        return KFAC_STRATEGIES[name]
    raise UsageError(f"unknown K-FAC strategy {name!r}; choose from {', '.join(KFAC_STRATEGIES)}")


# ---------------------------------------------------------------------- the trace


def check_trace(trace: Trace, source: str = "") -> None:
    """Refuse a trace without K-FAC factor sizes, or whose factors name layers it lacks.

    Args:
        trace: The trace to check.
        source: Where the trace came from, for the message (default: its model's name).

    Raises:
        UsageError: Naming what is missing and how to make a trace that has it.
    """
    where = source or f"the trace of {trace.model}"
    if not trace.factors:
        raise UsageError(
            f"K-FAC strategies ({', '.join(KFAC_STRATEGIES)}) need a trace with K-FAC factor "
            f"sizes, and {where} has none; make one with `interlace profile --model MODEL "
            "--trace-out T` (its traces list every Linear and Conv2d layer's factor sizes)"
        )
    known = {tensor.layer for tensor in trace.tensors}
    missing = [factor.layer for factor in trace.factors if factor.layer not in known]
    if missing:
        raise UsageError(
            f"{where}: K-FAC factors of layer(s) {', '.join(missing[:5])} name no layer with "
            "gradient tensors in the trace"
        )
    names = [factor.layer for factor in trace.factors]
    if len(set(names)) != len(names):
        raise UsageError(f"{where}: a layer has K-FAC factor sizes twice")


# ---------------------------------------------------------------------- the result


@dataclass(frozen=True)
class KfacResult(SimResult):
    """One K-FAC strategy on one trace at one worker count.

    ``plan`` and ``replay`` are the shared link's (gradient and factor buckets together, times
    from the start of forward); ``extra`` holds the phases (``<phase>_s``, :data:`PHASES`), the
    bucket counts, the decompositions broadcast and kept local, and ``single_worker_s``.

    Args:
        total_s: The iteration.
        kinds: What each bucket of ``plan`` carries: ``"gradient"`` or ``"factor"``.
        owners: Each placed item's owner (None: decomposed on every rank): a layer for a
            colocated placement (greedy), a factor (each layer's ``A`` then ``G``) otherwise.
        events: The timeline's events.
        breakdown: Seconds per phase.
    """

    total_s: float = 0.0
    kinds: tuple[str, ...] = ()
    owners: tuple[int | None, ...] = ()
    events: tuple[Event, ...] = field(default=(), compare=False)
    breakdown: KfacBreakdown = field(default_factory=KfacBreakdown)

    @property
    def iteration_s(self) -> float:
        return self.total_s

    @property
    def phases(self) -> dict[str, float]:
        """Seconds per phase of :data:`PHASES` (:attr:`breakdown`); they add up to
        :attr:`iteration_s`."""
        return self.breakdown.as_dict()

    def timeline(self, process: str = "simulated") -> Timeline:
        """The iteration on the compute lane (forward, backward, factors, the last rank's
        decompositions, preconditioning, the step), the shared link's all-reduces and that
        rank's broadcasts; same renderer as every other strategy.

        Args:
            process: The process name the events are drawn under.
        """
        title = f"{self.model or 'trace'}, {self.strategy}, {self.workers} workers, simulated" + (
            f" ({self.network})" if self.network else ""
        )
        return Timeline(
            (replace(event, process=process) for event in self.events),
            title=title,
        )


def _decomposition_stage(
    trace: Trace,
    layers: Sequence[SimLayer],
    chosen: KfacStrategy,
    workers: int,
    costs: KfacCosts,
    broadcast: CostModel,
) -> Stage:
    """:func:`~interlace.sim.kfac_stage.decomposition_stage` of ``layers``, kept per trace: a
    sweep asks for the same placement again (modes sharing a placement at one worker count)."""
    names = tuple((layer.name, layer.a_dim, layer.g_dim) for layer in layers)
    diagonal = tuple(layer.a_diagonal for layer in layers)
    placement = chosen.placement_on(workers)
    key = ("decomposition", names, diagonal, placement, workers, costs, broadcast)
    memo = kept(trace)
    try:
        stage: Stage = memo[key]
    except KeyError:
        stage = memo[key] = decomposition_stage(
            list(names),
            placement=placement,
            workers=workers,
            costs=costs,
            broadcast=broadcast,
            a_diagonal=list(diagonal),
        )
    return stage


# ---------------------------------------------------------------------- the simulation


def simulate_kfac(
    trace: Trace,
    strategy: str | KfacStrategy,
    cost: CostModel,
    workers: int,
    *,
    costs: KfacCosts | None = None,
    per_layer: bool = False,
    network: str = "",
    broadcast_cost: CostModel | None = None,
    timing_cost: CostModel | None = None,
    gradient_buckets: Sequence[Sequence[str]] | None = None,
    factor_buckets: Sequence[Sequence[str]] | None = None,
) -> KfacResult:
    """One K-FAC iteration of ``trace`` on ``workers`` ranks whose all-reduces cost ``cost``.

    The phases run in order (:mod:`interlace.sim.kfac_phases`): the passes with the factors
    computed in them, the gradient and factor buckets on the link, the decomposition stage,
    preconditioning and the step; :attr:`KfacResult.breakdown` holds each one's seconds. The
    model is described in docs/notes/sim.md.

    Args:
        trace: The model's iteration, with K-FAC factor sizes.
        strategy: A :class:`KfacStrategy` or a key of :data:`KFAC_STRATEGIES`.
        cost: Plans the gradient and factor buckets, and prices every all-reduce unless
            ``timing_cost`` is given.
        workers: The ranks the decompositions are placed on (>= 1).
        costs: Prices what the trace lacks (default :class:`~interlace.sim.kfac_costs.KfacCosts`).
        per_layer: Send a layer's gradients as one message.
        network: The network's description, recorded in the result.
        broadcast_cost: Prices a decomposition's broadcast (default ``cost``).
        timing_cost: Prices the all-reduces on the link (default ``cost``): the runtime plans
            with one model and its all-reduces may take another's time.
        gradient_buckets: Names per gradient bucket (tensors, or layers with ``per_layer``), in
            launch order: the bucketing a run used (DataParallel keeps whichever candidate plan
            it measured fastest) instead of MG-WFBP's plan on ``cost``.
        factor_buckets: Pipelined factor names (``"LAYER.A"``, ``"LAYER.G"``) per bucket, in
            launch order: the buckets a run kept after its trials
            (``Pipelined(tune_steps=)``) instead of the merge rule's plan on ``cost``.

    Raises:
        ValueError: If ``workers`` is below 1, or for gradient or factor buckets naming what
            the trace does not send.
        UsageError: For an unknown strategy or a trace without factor sizes.
    """
    chosen = strategy if isinstance(strategy, KfacStrategy) else kfac_strategy_named(strategy)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    costs = KfacCosts() if costs is None else costs
    check_trace(trace)
    layers = sim_layers(trace)
    timing = cost if timing_cost is None else timing_cost
    factor_s, factor_total = factor_seconds(layers, costs)
    size = costs.element_bytes
    passes = passes_phase(
        trace, layers, factor_s, in_passes=chosen.computes_in_passes, element_bytes=size
    )
    gradients = gradient_messages(trace, passes, per_layer=per_layer)
    planned = gradient_plan(gradients, passes, cost, gradient_buckets)
    factors = factor_messages(
        passes,
        layers,
        planned,
        pipelined=chosen.pipelined,
        in_passes=chosen.computes_in_passes,
        bulk_packed=chosen.bulk_packed,
        bulk_cap_bytes=chosen.bulk_cap_bytes,
        factor_total=factor_total + costs.host_hooks_s,
        cost=cost,
        timing=timing,
        element_bytes=size,
        buckets=factor_buckets,
        presence_bytes=chosen.presence_bytes * len(layers),
    )
    link = link_phase(
        gradients,
        planned[0].groups,
        factors,
        compute_end=passes.clock,
        timing=timing,
        name=chosen.name,
        factor_queue=chosen.pipelined and chosen.factor_group,
    )
    stage = _decomposition_stage(trace, layers, chosen, workers, costs, broadcast_cost or cost)
    breakdown = KfacBreakdown(
        buffer_comm=math.fsum(timing.time(nbytes) for nbytes in trace.broadcast_bytes),
        forward_backward=trace.forward_s + trace.backward_s,
        factor_compute=factor_total,
        gradient_comm=link.gradient_comm,
        factor_comm=link.factor_comm,
        decomposition=stage.decomposition_s,
        decomposition_comm=stage.makespan_s - stage.decomposition_s,
        precondition=precondition_phase(layers, costs),
        step=trace.step_s,
        host=costs.host_hooks_s + costs.host_step_s,
    )
    return KfacResult(
        strategy=chosen.name,
        workers=workers,
        cost=cost,
        plan=link.plan,
        replay=link.replayed,
        model=trace.model,
        network=network,
        extra=_extra(breakdown, link, stage, layers, costs, workers, factors.presence),
        total_s=breakdown.buffer_comm
        + link.drained
        + stage.makespan_s
        + breakdown.precondition
        + breakdown.step
        + costs.host_step_s,
        kinds=link.kinds,
        owners=tuple(stage.owners),
        events=tuple(_events(breakdown, passes, link, stage, costs.host_step_s)),
        breakdown=breakdown,
    )


def _extra(
    breakdown: KfacBreakdown,
    link: LinkPhase,
    stage: Stage,
    layers: Sequence[SimLayer],
    costs: KfacCosts,
    workers: int,
    presence: bool,
) -> dict[str, float]:
    """The result's ``extra``: the phases, bucket counts (the agreement on which layers have
    factors is no factor bucket), broadcasts and one worker's time."""
    every_decomposition = math.fsum(
        costs.decomposition_s(layer.a_dim, layer.a_diagonal) + costs.decomposition_s(layer.g_dim)
        for layer in layers
    )
    gradient_count = link.kinds.count("gradient")
    extra: dict[str, float] = {
        f"{phase}_s": seconds for phase, seconds in breakdown.as_dict().items()
    }
    extra.update(
        gradient_buckets=gradient_count,
        factor_buckets=len(link.kinds) - gradient_count - int(presence),
        broadcasts=stage.broadcasts if workers > 1 else 0,
        local_factors=stage.local_factors,
        single_worker_s=breakdown.forward_backward
        + breakdown.factor_compute
        + every_decomposition
        + breakdown.precondition
        + breakdown.step
        + breakdown.host,
    )
    return extra


def _events(
    breakdown: KfacBreakdown, passes: Passes, link: LinkPhase, stage: Stage, host_step_s: float
) -> list[Event]:
    """The timeline from the start of the iteration: buffers, the compute stream, the link's
    all-reduces, the last rank's decomposition stage, preconditioning, ``step()``'s host work
    and the optimizer step."""
    process = "simulated"
    pre = breakdown.buffer_comm
    events: list[Event] = []
    if pre > 0:
        events.append(Event("broadcast buffers", "comm", 0.0, pre, "all-reduce", process))
    for name, category, start, end in passes.events:
        events.append(Event(name, category, pre + start, pre + end, "compute", process))
    for number, (comm, kind) in enumerate(zip(link.replayed.comms, link.kinds, strict=True)):
        events.append(
            Event(
                f"{kind} bucket {number} ({comm.nbytes / 1e6:.2f} MB)",
                "comm",
                pre + comm.start_s,
                pre + comm.end_s,
                "all-reduce",
                process,
                {"bytes": comm.nbytes, "messages": len(comm.indices)},
            )
        )
    origin = pre + link.drained
    for name, category, start, end in stage.events:
        lane = "broadcast" if category == "comm" else "compute"
        events.append(Event(name, category, origin + start, origin + end, lane, process))
    clock = origin + stage.makespan_s
    for name, category, seconds in (
        ("preconditioning", "precondition", breakdown.precondition),
        ("host work of step()", "other", host_step_s),
        ("optimizer step", "optimizer", breakdown.step),
    ):
        if seconds > 0:
            events.append(Event(name, category, clock, clock + seconds, "compute", process))
        clock += seconds
    return events
