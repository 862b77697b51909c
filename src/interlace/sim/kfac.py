"""K-FAC strategies in the simulator: one D-KFAC or SPD-KFAC iteration from a trace.

Gradient and factor all-reduces share one link, replayed by :func:`interlace.sim.replay.replay`;
decompositions are placed by the runtime's own placement objects (:mod:`interlace.kfac.placements`)
and priced here. What each cost is taken from is in docs/notes/sim.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from interlace.comm.cost import CostModel
from interlace.comm.plan import Bucketing, ReadyTensor, schedule
from interlace.comm.strategies import PLANNED_STRATEGIES
from interlace.errors import UsageError
from interlace.kfac.enums import PlacementChoice
from interlace.kfac.fusion import make_groups
from interlace.kfac.placements import (
    LBP,
    Greedy,
    Placement,
    placement_from,
    placement_or_auto,
)
from interlace.kfac.sizes import packed_size
from interlace.sim.kfac_costs import KfacCosts
from interlace.sim.kfac_link import bulk_messages, named_groups, play_link
from interlace.sim.kfac_stage import decomposition_stage
from interlace.sim.replay import replay
from interlace.sim.simulation import SimResult
from interlace.sim.trace import Trace
from interlace.timeline import Event, Timeline

__all__ = [
    "KFAC_STRATEGIES",
    "PHASES",
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
    """

    name: str
    pipelined: bool
    placement: Placement | PlacementChoice
    description: str
    factors_in_passes: bool | None = None
    bulk_packed: bool = True
    bulk_cap_bytes: int | None = None
    factor_group: bool = False

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
PHASES: tuple[str, ...] = (
    "buffer_comm",
    "forward_backward",
    "factor_compute",
    "gradient_comm",
    "factor_comm",
    "decomposition",
    "decomposition_comm",
    "precondition",
    "step",
)


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


# ---------------------------------------------------------------------- the trace's layers


@dataclass(frozen=True)
class _Layer:
    """A preconditioned layer: its factor sizes and its own compute times from the trace."""

    name: str
    a_dim: int
    g_dim: int
    forward_s: float
    backward_s: float


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


def _layers(trace: Trace) -> list[_Layer]:
    """The preconditioned layers in the trace's factor order (the runtime's module order)."""
    check_trace(trace)
    forward: dict[str, float] = {}
    backward: dict[str, float] = {}
    for layer, indices in trace.layers:
        tensor = trace.tensors[indices[0]]
        forward.setdefault(layer, tensor.layer_forward_s)
        backward.setdefault(layer, tensor.layer_backward_s)
    return [
        _Layer(f.layer, max(f.a_dim, 1), max(f.g_dim, 1), forward[f.layer], backward[f.layer])
        for f in trace.factors
    ]


def _packed_bytes(dim: int, element_bytes: int) -> int:
    return packed_size(dim) * element_bytes


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
    """

    total_s: float = 0.0
    kinds: tuple[str, ...] = ()
    owners: tuple[int | None, ...] = ()
    events: tuple[Event, ...] = field(default=(), compare=False)

    @property
    def iteration_s(self) -> float:
        return self.total_s

    @property
    def phases(self) -> dict[str, float]:
        """Seconds per phase of :data:`PHASES`; they add up to :attr:`iteration_s`."""
        return {phase: self.extra[f"{phase}_s"] for phase in PHASES}

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


# ---------------------------------------------------------------------- the simulation


@dataclass
class _Compute:
    """The compute stream being laid out: events and the clock (seconds from forward start)."""

    clock: float = 0.0
    events: list[tuple[str, str, float, float]] = field(default_factory=list)

    def run(self, name: str, category: str, seconds: float) -> float:
        start = self.clock
        self.clock += seconds
        if seconds > 0:
            self.events.append((name, category, start, self.clock))
        return self.clock


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

    The model (what each stage costs and how the stages follow each other) is described in
    docs/notes/sim.md.

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
    layers = _layers(trace)
    by_name = {layer.name: layer for layer in layers}
    timing = cost if timing_cost is None else timing_cost
    both = {
        layer.name: costs.layer_factors_s(
            layer.name, layer.a_dim, layer.g_dim, layer.forward_s, layer.backward_s
        )
        for layer in layers
    }
    a_s = {name: pair[0] for name, pair in both.items()}
    g_s = {name: pair[1] for name, pair in both.items()}
    factor_total = math.fsum(a_s.values()) + math.fsum(g_s.values())
    size = costs.element_bytes

    # 1. The compute stream, times from the start of forward.
    compute = _Compute()
    factors: list[ReadyTensor] = []
    runs = trace.layers
    forward_order = list(dict.fromkeys(layer for layer, _ in reversed(runs)))
    in_passes = chosen.computes_in_passes
    if in_passes:
        own = {layer.name: layer.forward_s for layer in layers}
        for layer_name, indices in runs:
            own.setdefault(layer_name, trace.tensors[indices[0]].layer_forward_s)
        measured = math.fsum(own[layer] for layer in forward_order)
        for layer in forward_order:
            share = (
                own[layer] / measured if measured > 0 else 1.0 / len(forward_order)
            ) * trace.forward_s
            compute.run(layer, "forward", share)
            if layer in by_name:
                ready = compute.run(f"{layer} A", "factor", a_s[layer])
                factors.append(
                    ReadyTensor(f"{layer}.A", _packed_bytes(by_name[layer].a_dim, size), ready)
                )
    else:
        compute.run("forward", "forward", trace.forward_s)
    backward_start = compute.clock
    gradient_ready = [0.0] * len(trace.tensors)
    seen: set[str] = set()
    for layer, indices in runs:
        if in_passes and layer in by_name and layer not in seen:
            ready = compute.run(f"{layer} G", "factor", g_s[layer])
            factors.append(
                ReadyTensor(f"{layer}.G", _packed_bytes(by_name[layer].g_dim, size), ready)
            )
        seen.add(layer)
        ready = compute.run(layer, "backward", trace.tensors[indices[0]].layer_backward_s)
        for index in indices:
            gradient_ready[index] = ready
    compute.run(
        "backward (rest)", "backward", max(trace.backward_s - trace.layer_backward_total_s, 0.0)
    )
    passes_end = compute.clock

    # 2. Gradient and factor all-reduces on one serial link.
    if per_layer:
        gradients = [
            ReadyTensor(
                layer,
                sum(trace.tensors[i].nbytes for i in indices),
                gradient_ready[indices[-1]],
            )
            for layer, indices in runs
        ]
    else:
        gradients = [
            ReadyTensor(tensor.name, tensor.nbytes, gradient_ready[index])
            for index, tensor in enumerate(trace.tensors)
        ]
    relative = [replace(t, ready_s=t.ready_s - backward_start) for t in gradients]
    if gradient_buckets is None:
        gradient_plan = PLANNED_STRATEGIES["mgwfbp"].plan(
            relative, cost, backward_s=passes_end - backward_start, forward_s=backward_start
        )
    else:
        gradient_plan = schedule(
            named_groups(gradient_buckets, relative),
            relative,
            cost,
            backward_s=passes_end - backward_start,
            forward_s=backward_start,
            strategy="measured",
        )
    waited = 0.0
    if chosen.pipelined and factor_buckets is not None:
        factor_groups = named_groups(factor_buckets, factors, "factor")
    elif chosen.pipelined:
        factor_groups = make_groups(
            Bucketing.MERGED,
            [t.nbytes for t in factors],
            ready_s=[t.ready_s for t in factors],
            cost=cost,
        )
    else:
        # Backward returns once the gradients are averaged; factors not computed in the passes
        # are computed after that; then all are sent in bulk. Only gradients use the link until
        # then.
        gradients_end = replay(
            schedule(
                gradient_plan.groups,
                relative,
                timing,
                backward_s=passes_end - backward_start,
                forward_s=backward_start,
            )
        ).comm_end_s
        waited = max(backward_start + gradients_end - passes_end, 0.0)
        compute.clock += waited
        ready = compute.clock
        if not in_passes:
            ready = compute.run("factor computation", "factor", factor_total)
        factors, factor_groups = bulk_messages(
            [(layer.a_dim, layer.g_dim) for layer in layers],
            size,
            ready,
            packed=chosen.bulk_packed,
            cap_bytes=chosen.bulk_cap_bytes,
        )
    compute_end = compute.clock
    entries = sorted(
        [(t.ready_s, 0, i) for i, t in enumerate(gradients)]
        + [(t.ready_s, 1, i) for i, t in enumerate(factors)]
    )
    position = {(kind, i): number for number, (_, kind, i) in enumerate(entries)}
    messages = [(gradients if kind == 0 else factors)[i] for _, kind, i in entries]
    groups = [sorted(position[(0, i)] for i in group) for group in gradient_plan.groups]
    groups += [sorted(position[(1, i)] for i in group) for group in factor_groups]
    groups.sort(key=max)
    kinds = tuple("factor" if entries[group[0]][1] else "gradient" for group in groups)
    link, replayed = play_link(
        groups,
        messages,
        kinds=kinds,
        cost=timing,
        compute_end=compute_end,
        name=chosen.name,
        factor_queue=chosen.pipelined and chosen.factor_group,
    )
    drained = max(replayed.comm_end_s, compute_end)
    after = math.fsum(
        max(comm.end_s - max(comm.start_s, compute_end), 0.0)
        for comm, kind in zip(replayed.comms, kinds, strict=True)
        if kind == "gradient"
    )
    exposed = drained - compute_end
    gradient_comm = waited + min(after, exposed)
    factor_comm = exposed - min(after, exposed)

    # 3. Decompositions and their broadcasts.
    stage = decomposition_stage(
        [(layer.name, layer.a_dim, layer.g_dim) for layer in layers],
        placement=chosen.placement_on(workers),
        workers=workers,
        costs=costs,
        broadcast=broadcast_cost or cost,
    )

    # 4. Preconditioning and the step.
    precondition = math.fsum(costs.precondition_s(layer.a_dim, layer.g_dim) for layer in layers)
    pre = math.fsum(timing.time(nbytes) for nbytes in trace.broadcast_bytes)
    phases = {
        "buffer_comm": pre,
        "forward_backward": trace.forward_s + trace.backward_s,
        "factor_compute": factor_total,
        "gradient_comm": gradient_comm,
        "factor_comm": factor_comm,
        "decomposition": stage.decomposition_s,
        "decomposition_comm": stage.makespan_s - stage.decomposition_s,
        "precondition": precondition,
        "step": trace.step_s,
    }
    total = pre + drained + stage.makespan_s + precondition + trace.step_s
    every_decomposition = math.fsum(
        costs.decomposition_s(layer.a_dim) + costs.decomposition_s(layer.g_dim) for layer in layers
    )
    gradient_count = kinds.count("gradient")
    extra: dict[str, float] = {f"{phase}_s": seconds for phase, seconds in phases.items()}
    extra.update(
        gradient_buckets=gradient_count,
        factor_buckets=len(kinds) - gradient_count,
        broadcasts=stage.broadcasts if workers > 1 else 0,
        local_factors=stage.local_factors,
        single_worker_s=trace.forward_s
        + trace.backward_s
        + factor_total
        + every_decomposition
        + precondition
        + trace.step_s,
    )

    # The timeline, from the start of the iteration.
    events: list[Event] = []
    process = "simulated"
    if pre > 0:
        events.append(Event("broadcast buffers", "comm", 0.0, pre, "all-reduce", process))
    for name, category, start, end in compute.events:
        events.append(Event(name, category, pre + start, pre + end, "compute", process))
    for number, (comm, kind) in enumerate(zip(replayed.comms, kinds, strict=True)):
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
    origin = pre + drained
    for name, category, start, end in stage.events:
        lane = "broadcast" if category == "comm" else "compute"
        events.append(Event(name, category, origin + start, origin + end, lane, process))
    clock = origin + stage.makespan_s
    if precondition > 0:
        events.append(
            Event(
                "preconditioning", "precondition", clock, clock + precondition, "compute", process
            )
        )
    clock += precondition
    if trace.step_s > 0:
        events.append(
            Event("optimizer step", "optimizer", clock, clock + trace.step_s, "compute", process)
        )
    return KfacResult(
        strategy=chosen.name,
        workers=workers,
        cost=cost,
        plan=link,
        replay=replayed,
        model=trace.model,
        network=network,
        extra=extra,
        total_s=total,
        kinds=kinds,
        owners=tuple(stage.owners),
        events=tuple(events),
    )
