"""K-FAC strategies in the simulator: one D-KFAC or SPD-KFAC iteration from a trace.

A K-FAC iteration (PAPERS.md sections 3 and 4) is the data-parallel iteration plus five K-FAC
stages: computing each layer's Kronecker factors ``A`` (from its input) and ``G`` (from its
output gradient), all-reducing them, decomposing them on the ranks the placement chose,
broadcasting the decompositions, and preconditioning every gradient. The strategies:

* ``dkfac`` (D-KFAC, SC20 / KAISA COMM-OPT): forward and backward with the gradient all-reduces
  planned by MG-WFBP (:data:`~interlace.sim.engine.STRATEGIES` ``"mgwfbp"``) and overlapped with
  backward; once backward has returned with averaged gradients (as with DDP, or Horovod's
  ``synchronize()`` before kfac-pytorch's ``step()``) every factor is computed, then all factors
  go in ONE all-reduce of their packed upper triangles
  (:func:`~interlace.kfac.packing.packed_size`); each layer's two decompositions are made on the
  rank :func:`~interlace.kfac.placement.greedy_placement` gives it (``n^3`` costs, as the
  runtime), which broadcasts both in one message; then preconditioning.
* ``spd`` (SPD-KFAC): ``A`` is computed right after its layer's forward and ``G`` right before
  its layer's backward (when the gradient of the layer's output is complete, as the runtime's
  tensor hook does), each all-reduce launched as soon as its factor is ready, in buckets that
  :func:`~interlace.kfac.fusion.make_groups` ``("merged", ...)`` forms from the factors' ready
  times, exactly as ``KFAC(factor_comm="pipelined", fusion="merged")``; decompositions placed
  factor by factor by :func:`~interlace.kfac.placement.lbp_placement`, which may decompose a
  factor on every rank when that is cheaper than broadcasting it.
* ``dkfac-pipelined`` and ``dkfac-lbp``: SPD-KFAC's ablation, each with one of its two changes.

What the simulator takes from where:

* **Compute** of forward, backward and the optimizer step: the trace. Layers run one after
  another on one compute stream, forward in the reverse of the trace's backward order; forward
  time not attributed to a layer (activations, pooling) is spread over the layers in proportion
  to their own forward times.
* **Factor computation** is not in the trace; it is priced relative to the layer's own measured
  time: computing ``A`` (a_dim x a_dim, from the ``rows x a_dim`` unfolded input) costs
  ``a_dim / g_dim`` times the layer's forward (``rows x a_dim`` by ``a_dim x g_dim``), and ``G``
  costs ``g_dim / (2 a_dim)`` times its backward (two such products), both times
  :attr:`KfacCosts.factor_scale` (default 1: as efficient as the layer's own products).
* **Decomposition** of an ``n x n`` factor: a :class:`~interlace.kfac.costs.DecompositionCostModel`
  ``c0 + c2 n^2 + c3 n^3``; the default (:data:`DEFAULT_DECOMPOSITION`) is a round-number model
  of a GPU-class device's symmetric eigensolver (cuSOLVER ``syevd``, float32, V100 / A100 class:
  about 0.5 ms at small sizes, 11 ms at 1024, 64 ms at 2048), for orders of magnitude only. Pass
  one fitted on the device the trace comes from (:meth:`KfacCosts.measure` fits one here).
* **Preconditioning** of a ``g x a`` weight (bias column included): ``4 g a (g + a)`` flops for
  ``eigen`` (``Qg^T V Qa`` and back: four products), ``2 g a (g + a)`` for ``inverse``, at
  :attr:`KfacCosts.gemm_flops` (default 10 TFLOP/s), plus a per-layer overhead (kernel launches);
  every rank preconditions every layer (COMM-OPT). The optimizer step follows.
* **Communication**: every all-reduce and broadcast is priced by the
  :class:`~interlace.comm.cost.CostModel` of the network at the simulated worker count; compute
  and communication do not slow each other (a GPU: no
  :class:`~interlace.sim.engine.Contention`). Factors travel as float32 packed upper triangles;
  decompositions as :func:`~interlace.kfac.costs.decomposition_numel` float32 numbers, a
  broadcast priced by the all-reduce model (the convention of :mod:`interlace.kfac.costs`:
  a broadcast moves no more data than an all-reduce; pass ``broadcast_cost`` to price it apart).

The timeline, stage by stage:

1. Buffer broadcasts, then forward and backward on the compute stream (with ``A`` and ``G``
   inside the passes when pipelined; when not, every factor once the gradients are averaged).
2. Gradient and factor all-reduces share the network as **one serial communication resource**:
   each bucket starts once its last tensor is ready and the link is free, first ready first
   (gradients before factors on a tie). Gradient buckets are planned by the data-parallel
   planner and factor buckets by the factor planner, each unaware of the other, as the runtime
   plans them; the combined queue is priced by :func:`~interlace.comm.plan.schedule` and
   replayed by :func:`~interlace.sim.engine.replay`, the same engine the data-parallel strategies
   run on.
3. The decomposition stage starts once compute has ended and the link has drained; it lasts
   :func:`~interlace.kfac.placement.predicted_makespan` of the placement: owners decompose their
   factors in :func:`~interlace.kfac.placement.schedule_order` and each sends every result as
   soon as it is ready, sends of *different* owners overlapping (one send channel per rank, the
   placement model's assumption; the runtime's LBP, whose broadcasts share one process group,
   does not realise that overlap yet), local factors decomposed on every rank.
4. Preconditioning, then the optimizer step.

The phase breakdown (:data:`PHASES`) adds up to the iteration: ``buffer_comm`` (the buffer
broadcasts a data-parallel wrapper makes before forward, from the trace's ``broadcast_bytes``),
``forward_backward`` (as the trace has them), ``factor_compute``, exposed
communication split by what the compute stream waits for into ``gradient_comm`` (D-KFAC's wait
for the averaged gradients, and gradient buckets still on the link once compute has ended) and
``factor_comm``, ``decomposition`` (the busiest rank's decompositions, local ones included),
``decomposition_comm`` (the rest of the decomposition stage: broadcasts not hidden behind
decompositions), ``precondition`` and ``step``.

SPD-KFAC is usually, not always, faster than D-KFAC under this model:

* With free start-ups (``a = 0``) pipelining never slows an iteration down: every message is
  ready in SPD-KFAC no later than its D-KFAC counterpart plus the factor computation that D-KFAC
  does after backward, the link carries the same bytes, and on a work-conserving serial link the
  drain time is the latest ``ready + bytes still to come``. With start-ups, pipelining sends more
  buckets, and their start-ups can cost more than the overlap gains (``tests/test_sim_kfac.py``
  has a two-layer case).
* LBP is never slower than placing single factors greedily (it tries that placement), but it
  can be slower than D-KFAC's greedy placement of whole layers, which balances differently and
  sends a layer's two decompositions in one message, paying one start-up instead of two.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from interlace.comm.cost import CostModel
from interlace.comm.plan import ReadyTensor, schedule
from interlace.errors import UsageError
from interlace.sim.engine import STRATEGIES, SimResult, replay
from interlace.timeline import Event, Timeline

if TYPE_CHECKING:
    from interlace.kfac.costs import DecompositionCostModel
    from interlace.sim.experiments import ScalingRow
    from interlace.sim.trace import Trace

__all__ = [
    "DEFAULT_DECOMPOSITION",
    "KFAC_STRATEGIES",
    "PHASES",
    "KfacCosts",
    "KfacResult",
    "KfacStrategy",
    "check_trace",
    "format_phase_table",
    "kfac_strategy_named",
    "parse_kfac_costs",
    "simulate_kfac",
]


@dataclass(frozen=True)
class KfacStrategy:
    """A K-FAC strategy: how factors are all-reduced and how decompositions are placed."""

    name: str
    #: Factors computed in the passes and all-reduced in merged buckets as they become ready
    #: (SPD-KFAC); otherwise computed after backward and all-reduced in one message.
    pipelined: bool
    #: ``"greedy"``: a layer's two decompositions on one rank by n^3 (D-KFAC); ``"lbp"``:
    #: SPD-KFAC's load-balancing placement of single factors.
    placement: str
    description: str


#: Every K-FAC strategy by name (what ``--strategy`` takes besides the data-parallel ones).
KFAC_STRATEGIES: dict[str, KfacStrategy] = {
    "dkfac": KfacStrategy(
        "dkfac",
        False,
        "greedy",
        "D-KFAC: factors after backward, one bulk all-reduce, greedy placement per layer",
    ),
    "dkfac-pipelined": KfacStrategy(
        "dkfac-pipelined",
        True,
        "greedy",
        "D-KFAC with SPD-KFAC's pipelined factor all-reduces in merged buckets",
    ),
    "dkfac-lbp": KfacStrategy(
        "dkfac-lbp", False, "lbp", "D-KFAC with SPD-KFAC's load-balancing placement"
    ),
    "spd": KfacStrategy(
        "spd",
        True,
        "lbp",
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

#: ``(c3, c2, c0)`` of the default decomposition model, seconds for an ``n x n`` factor: a
#: round-number model of a GPU-class eigensolver (see the module docstring).
DEFAULT_DECOMPOSITION: tuple[float, float, float] = (5e-12, 5e-9, 5e-4)
#: Default rate of the preconditioning products, flop/s (GPU-class, float32).
DEFAULT_GEMM_FLOPS = 10e12
#: Default fixed cost of preconditioning one layer, seconds (its kernel launches).
DEFAULT_PRECONDITION_OVERHEAD_S = 20e-6

_METHODS = ("eigen", "inverse")


@dataclass(frozen=True)
class KfacCosts:
    """The costs a trace does not hold, as explicit models (see the module docstring)."""

    #: Factor computation relative to the layer's own products (1: equally efficient).
    factor_scale: float = 1.0
    #: Seconds to decompose an ``n x n`` factor; None: :data:`DEFAULT_DECOMPOSITION`.
    decomposition: DecompositionCostModel | None = None
    #: Flop/s of the preconditioning products.
    gemm_flops: float = DEFAULT_GEMM_FLOPS
    #: Seconds per preconditioned layer on top of its products.
    precondition_overhead_s: float = DEFAULT_PRECONDITION_OVERHEAD_S
    #: ``"eigen"`` (eigenvectors and eigenvalues sent, four products to precondition) or
    #: ``"inverse"`` (the inverse sent, two products).
    compute_method: str = "eigen"
    #: Bytes per number of factors and decompositions on the wire (float32).
    element_bytes: int = 4
    #: Where the numbers come from, for the printed description.
    source: str = "defaults for a GPU-class device"

    def __post_init__(self) -> None:
        for name, value in (
            ("factor_scale", self.factor_scale),
            ("precondition_overhead_s", self.precondition_overhead_s),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if not (math.isfinite(self.gemm_flops) and self.gemm_flops > 0):
            raise ValueError(f"gemm_flops must be finite and > 0, got {self.gemm_flops}")
        if self.compute_method not in _METHODS:
            raise ValueError(f"compute_method must be one of {_METHODS}, got {self.compute_method}")
        if self.element_bytes < 1:
            raise ValueError(f"element_bytes must be >= 1, got {self.element_bytes}")

    def decomposition_model(self) -> DecompositionCostModel:
        from interlace.kfac.costs import DecompositionCostModel

        if self.decomposition is not None:
            return self.decomposition
        c3, c2, c0 = DEFAULT_DECOMPOSITION
        return DecompositionCostModel(c3=c3, c2=c2, c0=c0)

    def a_compute_s(self, a_dim: int, g_dim: int, layer_forward_s: float) -> float:
        """Seconds to compute ``A``: ``a_dim / g_dim`` of the layer's forward, scaled."""
        return self.factor_scale * layer_forward_s * a_dim / max(g_dim, 1)

    def g_compute_s(self, a_dim: int, g_dim: int, layer_backward_s: float) -> float:
        """Seconds to compute ``G``: ``g_dim / (2 a_dim)`` of the layer's backward, scaled."""
        return self.factor_scale * layer_backward_s * g_dim / (2 * max(a_dim, 1))

    def precondition_s(self, a_dim: int, g_dim: int) -> float:
        """Seconds to precondition a ``g_dim x a_dim`` weight's gradient."""
        products = 4 if self.compute_method == "eigen" else 2
        flops = products * a_dim * g_dim * (a_dim + g_dim)
        return self.precondition_overhead_s + flops / self.gemm_flops

    def describe(self) -> str:
        model = self.decomposition_model()
        return (
            f"K-FAC costs ({self.source}): factors {self.factor_scale:g} x the layer's own "
            f"products; {self.compute_method} decomposition {model.c0 * 1e3:.3g} ms + "
            f"{model.c2:.3g} n^2 + {model.c3:.3g} n^3 s; preconditioning at "
            f"{self.gemm_flops / 1e12:.3g} TFLOP/s + {self.precondition_overhead_s * 1e6:.3g} us "
            "per layer; broadcasts priced by the all-reduce model"
        )

    @classmethod
    def measure(cls, device: str = "cpu", compute_method: str = "eigen") -> KfacCosts:
        """Costs fitted on ``device`` here: the decomposition model
        (:meth:`DecompositionCostModel.measure`), the rate of a 512 x 512 float32 product and
        the time of four 8 x 8 ones (the per-layer overhead). For a trace profiled here."""
        import torch

        from interlace.kfac.costs import DecompositionCostModel

        decomposition = DecompositionCostModel.measure(compute_method, device)

        def timed(size: int, repeats: int) -> float:
            left = torch.randn(size, size, device=device)
            right = torch.randn(size, size, device=device)
            samples = []
            for _ in range(repeats + 1):
                if left.device.type == "cuda":
                    torch.cuda.synchronize(left.device)
                started = time.perf_counter()
                for _ in range(4):
                    torch.mm(left, right)
                if left.device.type == "cuda":
                    torch.cuda.synchronize(left.device)
                samples.append(time.perf_counter() - started)
            return statistics.median(samples[1:])

        big = 512
        return cls(
            decomposition=decomposition,
            gemm_flops=4 * 2 * big**3 / timed(big, 3),
            precondition_overhead_s=timed(8, 5),
            compute_method=compute_method,
            source=f"measured on this machine's {device}",
        )


_COST_KEYS = ("factor_scale", "c3", "c2", "c0", "gemm_flops", "precondition_overhead")
KFAC_COSTS_HELP = (
    "gpu (default: a GPU-class device), measure (fit on this machine's CPU), and/or "
    "KEY=VALUE overrides, comma-separated; keys: " + ", ".join(_COST_KEYS) + " (seconds, flop/s)"
)


def parse_kfac_costs(text: str | None) -> KfacCosts:
    """``--kfac-costs``: ``gpu`` or ``measure``, then ``KEY=VALUE`` overrides (see
    :data:`KFAC_COSTS_HELP`), e.g. ``measure,factor_scale=2`` or ``c3=1e-11,c0=1e-3``."""
    from interlace.kfac.costs import DecompositionCostModel

    preset = "gpu"
    values: dict[str, float] = {}
    for token in (text or "").split(","):
        part = token.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            if key not in ("gpu", "measure"):
                raise UsageError(f"--kfac-costs: unknown preset {key!r}; {KFAC_COSTS_HELP}")
            preset = key
            continue
        if key not in _COST_KEYS:
            raise UsageError(f"--kfac-costs: unknown key {key!r}; {KFAC_COSTS_HELP}")
        try:
            number = float(value)
        except ValueError:
            raise UsageError(f"--kfac-costs: {key}={value!r} is not a number") from None
        if not (math.isfinite(number) and number >= 0):
            raise UsageError(f"--kfac-costs: {key} must be finite and >= 0, got {number}")
        values[key] = number
    costs = KfacCosts.measure() if preset == "measure" else KfacCosts()
    model = costs.decomposition_model()
    decomposition = DecompositionCostModel(
        c3=values.get("c3", model.c3), c2=values.get("c2", model.c2), c0=values.get("c0", model.c0)
    )
    try:
        return replace(
            costs,
            factor_scale=values.get("factor_scale", costs.factor_scale),
            decomposition=decomposition,
            gemm_flops=values.get("gemm_flops", costs.gemm_flops),
            precondition_overhead_s=values.get(
                "precondition_overhead", costs.precondition_overhead_s
            ),
            source=costs.source
            + (", with " + ", ".join(f"{k}={v:g}" for k, v in values.items()) if values else ""),
        )
    except ValueError as error:
        raise UsageError(f"--kfac-costs: {error}") from None


def kfac_strategy_named(name: str) -> KfacStrategy:
    """The :data:`KFAC_STRATEGIES` entry ``name``; a clear error naming the choices otherwise."""
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
    """Refuse a trace without K-FAC factor sizes, or whose factors name layers it lacks."""
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
    from interlace.kfac.packing import packed_size

    return packed_size(dim) * element_bytes


# ---------------------------------------------------------------------- the result


@dataclass(frozen=True)
class KfacResult(SimResult):
    """One K-FAC strategy on one trace at one worker count.

    ``plan`` and ``replay`` are the shared link's (gradient and factor buckets together, times
    from the start of forward); ``extra`` holds the phases (``<phase>_s``, :data:`PHASES`), the
    bucket counts, the decompositions broadcast and kept local, and ``single_worker_s``.
    """

    total_s: float = 0.0
    #: What each bucket of ``plan`` carries: ``"gradient"`` or ``"factor"``.
    kinds: tuple[str, ...] = ()
    #: Each placed item's owner (None: decomposed on every rank): a layer for greedy, a factor
    #: (each layer's ``A`` then ``G``) for LBP.
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
        rank's broadcasts; same renderer as every other strategy."""
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
) -> KfacResult:
    """One K-FAC iteration of ``trace`` on ``workers`` ranks whose all-reduces cost ``cost``.

    ``costs`` prices what the trace lacks (default :class:`KfacCosts`); ``broadcast_cost``
    prices a decomposition's broadcast (default ``cost``); ``per_layer`` sends a layer's
    gradients as one message. See the module docstring for the model.
    """
    from interlace.kfac.fusion import make_groups

    chosen = strategy if isinstance(strategy, KfacStrategy) else kfac_strategy_named(strategy)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    costs = KfacCosts() if costs is None else costs
    layers = _layers(trace)
    by_name = {layer.name: layer for layer in layers}
    a_s = {
        layer.name: costs.a_compute_s(layer.a_dim, layer.g_dim, layer.forward_s) for layer in layers
    }
    g_s = {
        layer.name: costs.g_compute_s(layer.a_dim, layer.g_dim, layer.backward_s)
        for layer in layers
    }
    factor_total = math.fsum(a_s.values()) + math.fsum(g_s.values())
    size = costs.element_bytes

    # 1. The compute stream, times from the start of forward.
    compute = _Compute()
    factors: list[ReadyTensor] = []
    runs = trace.layers
    forward_order = list(dict.fromkeys(layer for layer, _ in reversed(runs)))
    if chosen.pipelined:
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
        if chosen.pipelined and layer in by_name and layer not in seen:
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
    gradient_plan = STRATEGIES["mgwfbp"].plan(
        [replace(t, ready_s=t.ready_s - backward_start) for t in gradients],
        cost,
        backward_s=passes_end - backward_start,
        forward_s=backward_start,
    )
    waited = 0.0
    if chosen.pipelined:
        factor_groups = make_groups(
            "merged", [t.nbytes for t in factors], ready_s=[t.ready_s for t in factors], cost=cost
        )
    else:
        # Backward returns once the gradients are averaged; factors are computed after that,
        # then sent in one message. Only gradients use the link until then.
        waited = max(backward_start + gradient_plan.comm_end_s - passes_end, 0.0)
        compute.clock += waited
        ready = compute.run("factor computation", "factor", factor_total)
        packed = sum(
            _packed_bytes(layer.a_dim, size) + _packed_bytes(layer.g_dim, size) for layer in layers
        )
        factors.append(ReadyTensor("factors (all layers)", packed, ready))
        factor_groups = [[0]]
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
    link = schedule(
        groups, messages, cost, backward_s=compute_end, forward_s=0.0, strategy=chosen.name
    )
    replayed = replay(link)
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
    stage = _decomposition_stage(chosen, layers, workers, costs, broadcast_cost or cost)

    # 4. Preconditioning and the step.
    precondition = math.fsum(costs.precondition_s(layer.a_dim, layer.g_dim) for layer in layers)
    pre = math.fsum(cost.time(nbytes) for nbytes in trace.broadcast_bytes)
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
    model = costs.decomposition_model()
    every_decomposition = math.fsum(
        model.time(layer.a_dim) + model.time(layer.g_dim) for layer in layers
    )
    gradient_buckets = kinds.count("gradient")
    extra: dict[str, float] = {f"{phase}_s": seconds for phase, seconds in phases.items()}
    extra.update(
        gradient_buckets=gradient_buckets,
        factor_buckets=len(kinds) - gradient_buckets,
        broadcasts=sum(owner is not None for owner in stage.owners) if workers > 1 else 0,
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


@dataclass(frozen=True)
class _Stage:
    """The decomposition stage: its length, its compute part, the owners and what to draw."""

    makespan_s: float
    decomposition_s: float
    owners: list[int | None]
    local_factors: int
    events: list[tuple[str, str, float, float]]


def _decomposition_stage(
    strategy: KfacStrategy,
    layers: Sequence[_Layer],
    workers: int,
    costs: KfacCosts,
    broadcast: CostModel,
) -> _Stage:
    """Place the decompositions and price the stage with
    :func:`~interlace.kfac.placement.predicted_makespan`.

    Greedy places layers: each is one item (both decompositions, one broadcast of both), passed
    to the placement model as an item whose ``dim`` is the layer's index and priced by lookup.
    LBP places single factors, each layer's ``A`` then ``G`` (the runtime's order).
    """
    from interlace.kfac.costs import decomposition_numel
    from interlace.kfac.placement import (
        FactorItem,
        decomposition_cost,
        greedy_placement,
        lbp_placement,
        predicted_makespan,
        schedule_order,
    )

    model = costs.decomposition_model()
    method, size = costs.compute_method, costs.element_bytes
    names: list[str]
    items: list[FactorItem]
    decompose: Callable[[int], float]
    send: Callable[[int], float]
    owners: list[int | None]
    if strategy.placement == "greedy":
        names = [layer.name for layer in layers]
        seconds = [model.time(layer.a_dim) + model.time(layer.g_dim) for layer in layers]
        sent = [
            broadcast.time(
                (
                    decomposition_numel(method, layer.a_dim)
                    + decomposition_numel(method, layer.g_dim)
                )
                * size
            )
            for layer in layers
        ]
        items = [FactorItem(index) for index in range(len(layers))]

        def decompose(index: int) -> float:
            return seconds[index]

        def send(index: int) -> float:
            return sent[index]

        owners = list(
            greedy_placement(
                [decomposition_cost(layer.a_dim, layer.g_dim) for layer in layers], workers
            )
        )
    else:
        names = [f"{layer.name}.{which}" for layer in layers for which in ("A", "G")]
        items = [FactorItem(dim) for layer in layers for dim in (layer.a_dim, layer.g_dim)]

        def decompose(dim: int) -> float:
            return model.time(dim)

        def send(dim: int) -> float:
            return broadcast.time(decomposition_numel(method, dim) * size)

        owners = lbp_placement(items, workers, decompose, send)
    makespan = predicted_makespan(items, owners, workers, decompose, send)
    work = [decompose(item.dim) for item in items]
    transfer = [send(item.dim) if workers > 1 else 0.0 for item in items]
    local = math.fsum(w for w, owner in zip(work, owners, strict=True) if owner is None)
    loads: dict[int, float] = {}
    for w, owner in zip(work, owners, strict=True):
        if owner is not None:
            loads[owner] = loads.get(owner, 0.0) + w
    decomposition = min(max(loads.values(), default=0.0) + local, makespan)
    # Draw the rank that finishes last: its decompositions in the placement's order, each
    # broadcast as soon as it is made and its previous one is done, then the local ones.
    order = schedule_order(items, owners, workers, decompose, send)
    finish: dict[int, float] = {}
    for rank in loads:
        clock = sending = 0.0
        for index in order:
            if owners[index] == rank:
                clock += work[index]
                sending = max(sending, clock) + transfer[index]
        finish[rank] = max(clock + local, sending)
    idle_rank = next((r for r in range(workers) if r not in loads), None)
    last = max(finish, key=lambda r: (finish[r], -r), default=None)
    if last is None or (idle_rank is not None and local > finish[last]):
        last = idle_rank
    events: list[tuple[str, str, float, float]] = []
    clock = sending = 0.0
    for index in order:
        if owners[index] is not None and owners[index] == last:
            events.append(
                (f"decompose {names[index]}", "decomposition", clock, clock + work[index])
            )
            clock += work[index]
            if transfer[index] > 0:
                start = max(sending, clock)
                sending = start + transfer[index]
                events.append((f"broadcast {names[index]} (rank {last})", "comm", start, sending))
    for index in order:
        if owners[index] is None and work[index] > 0:
            events.append(
                (f"decompose {names[index]} (local)", "decomposition", clock, clock + work[index])
            )
            clock += work[index]
    return _Stage(
        makespan_s=makespan,
        decomposition_s=decomposition,
        owners=owners,
        local_factors=sum(owner is None for owner in owners) if strategy.placement == "lbp" else 0,
        events=events,
    )


# ---------------------------------------------------------------------- the table


#: Column headings of :data:`PHASES` in :func:`format_phase_table`.
_HEADINGS = {
    "buffer_comm": "buffers",
    "forward_backward": "fwd+bwd",
    "factor_compute": "factor",
    "gradient_comm": "grad comm",
    "factor_comm": "factor comm",
    "decomposition": "decomp",
    "decomposition_comm": "decomp comm",
    "precondition": "precond",
    "step": "step",
}


def format_phase_table(rows: Sequence[ScalingRow]) -> str | None:
    """The K-FAC rows' phases in milliseconds, with each row's speed-up over ``dkfac`` at the
    same worker count; None without K-FAC rows."""
    mine = [row for row in rows if row.strategy in KFAC_STRATEGIES]
    if not mine:
        return None
    baseline = {row.workers: row.iteration_s for row in mine if row.strategy == "dkfac"}
    lines = [
        "| workers | strategy | iteration ms | vs dkfac | "
        + " | ".join(_HEADINGS[phase] for phase in PHASES)
        + " | grad/factor buckets | broadcasts | local |",
        "|---:|---|---:|---:|" + "---:|" * len(PHASES) + "---:|---:|---:|",
    ]
    for row in mine:
        base = baseline.get(row.workers)
        versus = "-" if base is None else f"{base / row.iteration_s:.2f}x"
        cells = " | ".join(f"{row.extra[f'{phase}_s'] * 1e3:.1f}" for phase in PHASES)
        lines.append(
            f"| {row.workers} | {row.strategy} | {row.iteration_s * 1e3:.1f} | {versus} | "
            f"{cells} | {int(row.extra['gradient_buckets'])}/{int(row.extra['factor_buckets'])} "
            f"| {int(row.extra['broadcasts'])} | {int(row.extra['local_factors'])} |"
        )
    return "\n".join(lines)
