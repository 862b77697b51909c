"""The phases of a simulated K-FAC iteration, one function each: the passes with the factors
computed in them, the gradient and factor buckets on the link, preconditioning, and the per-phase
breakdown they add up to. :func:`interlace.sim.kfac.simulate_kfac` runs them in order."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from interlace.comm.cost import CostModel
from interlace.comm.plan import Bucketing, Plan, ReadyTensor
from interlace.comm.pricing import schedule
from interlace.comm.strategies import PLANNED_STRATEGIES
from interlace.kfac.fusion import make_groups
from interlace.kfac.sizes import factor_numel
from interlace.sim.kfac_costs import KfacCosts
from interlace.sim.kfac_link import bulk_messages, named_groups, play_link
from interlace.sim.replay import Replay, replay
from interlace.sim.trace import Trace

__all__ = [
    "FactorMessages",
    "KfacBreakdown",
    "LinkPhase",
    "Passes",
    "SimLayer",
    "factor_messages",
    "factor_seconds",
    "gradient_messages",
    "gradient_plan",
    "link_phase",
    "passes_phase",
    "precondition_phase",
    "sim_layers",
]


@dataclass(frozen=True)
class KfacBreakdown:
    """Seconds per phase of one simulated K-FAC iteration; they add up to the iteration.

    Args:
        buffer_comm: Buffers broadcast before forward.
        forward_backward: The trace's forward and backward.
        factor_compute: Computing every layer's ``A`` and ``G``.
        gradient_comm: Gradient all-reduces not hidden behind compute.
        factor_comm: Factor all-reduces not hidden behind compute (after the gradients').
        decomposition: The busiest rank's decompositions.
        decomposition_comm: The rest of the decomposition stage: broadcasts not hidden behind
            decompositions.
        precondition: Preconditioning every layer's gradient.
        step: The optimizer step.
        host: Host work the device does not overlap (the factor hooks' and ``step()``'s:
            :attr:`KfacCosts.host_hooks_s`, :attr:`KfacCosts.host_step_s`).
    """

    buffer_comm: float = 0.0
    forward_backward: float = 0.0
    factor_compute: float = 0.0
    gradient_comm: float = 0.0
    factor_comm: float = 0.0
    decomposition: float = 0.0
    decomposition_comm: float = 0.0
    precondition: float = 0.0
    step: float = 0.0
    host: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """Seconds per phase, in order."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}

    @property
    def total_s(self) -> float:
        """The iteration: every phase added up."""
        return math.fsum(self.as_dict().values())


@dataclass(frozen=True)
class SimLayer:
    """A preconditioned layer: its factor sizes and its own compute times from the trace.

    Args:
        name: The layer.
        a_dim: ``A``'s side.
        g_dim: ``G``'s side.
        forward_s: The layer's own forward.
        backward_s: The layer's own backward.
        a_diagonal: ``A`` is kept as its diagonal.
    """

    name: str
    a_dim: int
    g_dim: int
    forward_s: float
    backward_s: float
    a_diagonal: bool = False


def sim_layers(trace: Trace) -> list[SimLayer]:
    """The preconditioned layers in the trace's factor order (the runtime's module order).

    Args:
        trace: A trace with factor sizes (checked by the caller).
    """
    forward: dict[str, float] = {}
    backward: dict[str, float] = {}
    for layer, indices in trace.layers:
        tensor = trace.tensors[indices[0]]
        forward.setdefault(layer, tensor.layer_forward_s)
        backward.setdefault(layer, tensor.layer_backward_s)
    return [
        SimLayer(
            f.layer,
            max(f.a_dim, 1),
            max(f.g_dim, 1),
            forward[f.layer],
            backward[f.layer],
            f.a_diagonal,
        )
        for f in trace.factors
    ]


def factor_seconds(
    layers: Sequence[SimLayer], costs: KfacCosts
) -> tuple[dict[str, tuple[float, float]], float]:
    """Per layer, the seconds of its ``A`` and ``G`` on the compute stream (device work, and
    the hooks' host work spread by each factor's numbers), and the device work alone summed.

    Args:
        layers: The preconditioned layers.
        costs: Prices each factor and gives the hooks' host work.
    """
    device = {
        layer.name: costs.layer_factors_s(
            layer.name, layer.a_dim, layer.g_dim, layer.forward_s, layer.backward_s
        )
        for layer in layers
    }
    total = math.fsum(a for a, _ in device.values()) + math.fsum(g for _, g in device.values())
    numbers = {
        layer.name: (
            float(layer.a_dim if layer.a_diagonal else layer.a_dim**2),
            float(layer.g_dim**2),
        )
        for layer in layers
    }
    every = math.fsum(a + g for a, g in numbers.values())
    share = costs.host_hooks_s / every if every > 0 else 0.0
    timed = {
        name: (a + share * numbers[name][0], g + share * numbers[name][1])
        for name, (a, g) in device.items()
    }
    return timed, total


# ---------------------------------------------------------------------- forward and backward


@dataclass
class Passes:
    """The compute stream: its events and clock (seconds from forward start), the factors made
    in the passes and each gradient's ready time.

    Args:
        clock: Where the compute stream is.
        events: ``(name, category, start, end)`` of every compute span.
        factors: Factors computed in the passes, in ready order (their all-reduces' messages).
        gradient_ready: Each trace tensor's ready time.
        backward_start: When backward starts.
        end: When the passes end.
    """

    clock: float = 0.0
    events: list[tuple[str, str, float, float]] = field(default_factory=list)
    factors: list[ReadyTensor] = field(default_factory=list)
    gradient_ready: list[float] = field(default_factory=list)
    backward_start: float = 0.0
    end: float = 0.0

    def run(self, name: str, category: str, seconds: float) -> float:
        """Run ``seconds`` of compute; its end.

        Args:
            name: What runs.
            category: Its kind (``"forward"``, ``"factor"``...).
            seconds: How long.
        """
        start = self.clock
        self.clock += seconds
        if seconds > 0:
            self.events.append((name, category, start, self.clock))
        return self.clock


def _message_bytes(layer: SimLayer, which: str, element_bytes: int) -> int:
    """A pipelined factor's bytes: the runtime's size rule, packed."""
    if which == "A":
        return factor_numel(layer.a_dim, diagonal=layer.a_diagonal) * element_bytes
    return factor_numel(layer.g_dim) * element_bytes


def passes_phase(
    trace: Trace,
    layers: Sequence[SimLayer],
    factor_s: dict[str, tuple[float, float]],
    *,
    in_passes: bool,
    element_bytes: int,
) -> Passes:
    """Forward and backward on the compute stream, with each layer's ``A`` after its forward and
    ``G`` before its backward when ``in_passes``.

    Args:
        trace: The iteration.
        layers: The preconditioned layers.
        factor_s: Per layer, seconds of its ``A`` and ``G``.
        in_passes: Factors computed inside the passes.
        element_bytes: Bytes per number sent.
    """
    by_name = {layer.name: layer for layer in layers}
    passes = Passes(gradient_ready=[0.0] * len(trace.tensors))
    runs = trace.layers
    forward_order = list(dict.fromkeys(layer for layer, _ in reversed(runs)))
    if in_passes:
        own = {layer.name: layer.forward_s for layer in layers}
        for layer_name, indices in runs:
            own.setdefault(layer_name, trace.tensors[indices[0]].layer_forward_s)
        measured = math.fsum(own[layer] for layer in forward_order)
        for layer in forward_order:
            share = own[layer] / measured if measured > 0 else 1.0 / len(forward_order)
            passes.run(layer, "forward", share * trace.forward_s)
            if layer in by_name:
                ready = passes.run(f"{layer} A", "factor", factor_s[layer][0])
                nbytes = _message_bytes(by_name[layer], "A", element_bytes)
                passes.factors.append(ReadyTensor(f"{layer}.A", nbytes, ready))
    else:
        passes.run("forward", "forward", trace.forward_s)
    passes.backward_start = passes.clock
    seen: set[str] = set()
    for layer, indices in runs:
        if in_passes and layer in by_name and layer not in seen:
            ready = passes.run(f"{layer} G", "factor", factor_s[layer][1])
            nbytes = _message_bytes(by_name[layer], "G", element_bytes)
            passes.factors.append(ReadyTensor(f"{layer}.G", nbytes, ready))
        seen.add(layer)
        ready = passes.run(layer, "backward", trace.tensors[indices[0]].layer_backward_s)
        for index in indices:
            passes.gradient_ready[index] = ready
    rest = max(trace.backward_s - trace.layer_backward_total_s, 0.0)
    passes.run("backward (rest)", "backward", rest)
    passes.end = passes.clock
    return passes


# ---------------------------------------------------------------------- gradient communication


def gradient_messages(trace: Trace, passes: Passes, *, per_layer: bool) -> list[ReadyTensor]:
    """The gradients as the link sees them, ready times from the start of forward.

    Args:
        trace: The iteration.
        passes: The compute stream.
        per_layer: A layer's gradients as one message.
    """
    if per_layer:
        return [
            ReadyTensor(
                layer,
                sum(trace.tensors[i].nbytes for i in indices),
                passes.gradient_ready[indices[-1]],
            )
            for layer, indices in trace.layers
        ]
    return [
        ReadyTensor(tensor.name, tensor.nbytes, passes.gradient_ready[index])
        for index, tensor in enumerate(trace.tensors)
    ]


def gradient_plan(
    gradients: Sequence[ReadyTensor],
    passes: Passes,
    cost: CostModel,
    buckets: Sequence[Sequence[str]] | None,
) -> tuple[Plan, list[ReadyTensor]]:
    """The gradient buckets (MG-WFBP's plan on ``cost``, or the run's ``buckets``) and the
    gradients with ready times from the start of backward.

    Args:
        gradients: From :func:`gradient_messages`.
        passes: The compute stream.
        cost: Plans the buckets.
        buckets: Names per bucket in launch order (None: MG-WFBP plans).
    """
    start = passes.backward_start
    relative = [replace(t, ready_s=t.ready_s - start) for t in gradients]
    if buckets is None:
        plan = PLANNED_STRATEGIES["mgwfbp"].plan(
            relative, cost, backward_s=passes.end - start, forward_s=start
        )
        return plan, relative
    plan = schedule(
        named_groups(buckets, relative),
        relative,
        cost,
        backward_s=passes.end - start,
        forward_s=start,
        strategy="measured",
    )
    return plan, relative


# ---------------------------------------------------------------------- factor communication


@dataclass(frozen=True)
class FactorMessages:
    """The factor all-reduces: their messages, buckets, and the wait for the gradients before
    bulk factors (which the compute stream spends).

    Args:
        factors: The messages, in ready order.
        groups: The buckets, as indices into ``factors``, in launch order.
        waited: Seconds the compute stream waited for the gradients' all-reduces.
        presence: The first message is the agreement on which layers have factors, not a
            factor bucket.
    """

    factors: list[ReadyTensor]
    groups: list[list[int]]
    waited: float = 0.0
    presence: bool = False


def factor_messages(
    passes: Passes,
    layers: Sequence[SimLayer],
    gradients: tuple[Plan, list[ReadyTensor]],
    *,
    pipelined: bool,
    in_passes: bool,
    bulk_packed: bool,
    bulk_cap_bytes: int | None,
    factor_total: float,
    cost: CostModel,
    timing: CostModel,
    element_bytes: int,
    buckets: Sequence[Sequence[str]] | None,
    presence_bytes: int = 0,
) -> FactorMessages:
    """Pipelined factors in merged buckets (or the run's ``buckets``); or bulk factors, sent
    once backward has returned with averaged gradients (the compute stream waits for them,
    then computes the factors not computed in the passes).

    Args:
        passes: The compute stream (its clock moves on for bulk factors).
        layers: The preconditioned layers.
        gradients: :func:`gradient_plan`'s plan and gradients.
        pipelined: Factors all-reduced as they become ready.
        in_passes: Factors were computed in the passes.
        bulk_packed: Bulk factors as packed upper triangles.
        bulk_cap_bytes: The bulk buckets' cap (None: one message).
        factor_total: Seconds of every factor's computation (host work of the hooks included).
        cost: Plans merged buckets.
        timing: Prices the gradients' all-reduces.
        element_bytes: Bytes per number.
        buckets: Pipelined factor names per bucket (None: the merge rule plans).
        presence_bytes: Bulk factors follow one all-reduce of this many bytes, with which the
            ranks agree which layers have factors (interlace's ``step()``; 0: none).
    """
    if pipelined and buckets is not None:
        return FactorMessages(passes.factors, named_groups(buckets, passes.factors, "factor"))
    if pipelined:
        groups = make_groups(
            Bucketing.MERGED,
            [t.nbytes for t in passes.factors],
            ready_s=[t.ready_s for t in passes.factors],
            cost=cost,
        )
        return FactorMessages(passes.factors, groups)
    plan, relative = gradients
    start = passes.backward_start
    # Only gradients use the link until backward returns.
    gradients_end = replay(
        schedule(plan.groups, relative, timing, backward_s=passes.end - start, forward_s=start)
    ).comm_end_s
    waited = max(start + gradients_end - passes.end, 0.0)
    passes.clock += waited
    ready = passes.clock
    if not in_passes:
        ready = passes.run("factor computation", "factor", factor_total)
    factors, groups = bulk_messages(
        [(layer.a_dim, layer.g_dim) for layer in layers],
        element_bytes,
        ready,
        packed=bulk_packed,
        cap_bytes=bulk_cap_bytes,
        a_diagonal=[layer.a_diagonal for layer in layers],
    )
    if presence_bytes > 0:
        factors = [ReadyTensor("factor presence", presence_bytes, ready), *factors]
        groups = [[0]] + [[index + 1 for index in group] for group in groups]
    return FactorMessages(factors, groups, waited, presence=presence_bytes > 0)


@dataclass(frozen=True)
class LinkPhase:
    """The gradient and factor buckets played on the link, and what of them is exposed.

    Args:
        plan: The link's plan (times from the start of forward).
        replayed: Its replay.
        kinds: Each bucket's ``"gradient"`` or ``"factor"``.
        drained: When both compute and the link are done.
        gradient_comm: Exposed gradient communication (the bulk wait included).
        factor_comm: Exposed factor communication.
    """

    plan: Plan
    replayed: Replay
    kinds: tuple[str, ...]
    drained: float
    gradient_comm: float
    factor_comm: float


def link_phase(
    gradients: Sequence[ReadyTensor],
    gradient_groups: Sequence[Sequence[int]],
    factors: FactorMessages,
    *,
    compute_end: float,
    timing: CostModel,
    name: str,
    factor_queue: bool,
) -> LinkPhase:
    """Gradient and factor buckets, merged in ready order, played on one queue (or two with
    ``factor_queue``); the link's time after the compute stream is split into gradient and
    factor communication, gradients first.

    Args:
        gradients: The gradients, ready times from forward start.
        gradient_groups: Their buckets.
        factors: The factor messages and buckets.
        compute_end: When the compute stream ends.
        timing: Prices each all-reduce.
        name: The plan's strategy name.
        factor_queue: Factors on a queue of their own.
    """
    entries = sorted(
        [(t.ready_s, 0, i) for i, t in enumerate(gradients)]
        + [(t.ready_s, 1, i) for i, t in enumerate(factors.factors)]
    )
    position = {(kind, i): number for number, (_, kind, i) in enumerate(entries)}
    messages = [(gradients if kind == 0 else factors.factors)[i] for _, kind, i in entries]
    groups = [sorted(position[(0, i)] for i in group) for group in gradient_groups]
    groups += [sorted(position[(1, i)] for i in group) for group in factors.groups]
    groups.sort(key=max)
    kinds = tuple("factor" if entries[group[0]][1] else "gradient" for group in groups)
    plan, replayed = play_link(
        groups,
        messages,
        kinds=kinds,
        cost=timing,
        compute_end=compute_end,
        name=name,
        factor_queue=factor_queue,
    )
    drained = max(replayed.comm_end_s, compute_end)
    after = math.fsum(
        max(comm.end_s - max(comm.start_s, compute_end), 0.0)
        for comm, kind in zip(replayed.comms, kinds, strict=True)
        if kind == "gradient"
    )
    exposed = drained - compute_end
    hidden_gradients = min(after, exposed)
    return LinkPhase(
        plan,
        replayed,
        kinds,
        drained,
        factors.waited + hidden_gradients,
        exposed - hidden_gradients,
    )


# ---------------------------------------------------------------------- preconditioning


def precondition_phase(layers: Sequence[SimLayer], costs: KfacCosts) -> float:
    """Seconds to precondition every layer's gradient, one layer after another.

    Args:
        layers: The preconditioned layers.
        costs: Prices each layer.
    """
    return math.fsum(costs.precondition_s(layer.a_dim, layer.g_dim) for layer in layers)
