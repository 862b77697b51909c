"""The planner: every configuration the simulator can price for one model on one cluster, ranked.

Data parallelism per strategy and option, K-FAC per mode (as data parallelism) and replicated
pipelines per stages x replicas and schedule, all at the same global batch (the trace's batch
per GPU), each with its iteration, throughput, the term that bounds it, its memory per GPU and
the ``interlace train`` flags that run it. Assumptions are in docs/plan.md.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from interlace.errors import UsageError
from interlace.pipeline.schedule import SCHEDULE_TYPES, SCHEDULES, Op, Schedule
from interlace.sim.kfac import simulate_kfac
from interlace.sim.network import Network
from interlace.sim.pipeline_price import PipelineConfig, kept, price_pipeline
from interlace.sim.simulation import simulate
from interlace.sim.trace import Trace

#: Data-parallel options the planner prices: ``(strategy, compression)``; ``/k=K`` is K channels.
DP_OPTIONS: tuple[tuple[str, str | None], ...] = (
    ("mgwfbp", None),
    ("fixed", None),
    ("wfbp", None),
    ("single", None),
    ("optimal", None),
    ("overlap", None),
    ("mgwfbp/k=2", None),
    ("mgwfbp", "fp16"),
    ("overlap", "fp16"),
)
#: K-FAC modes: ``(--kfac-factor-comm, --kfac-fusion, --kfac-placement)`` of each simulated one.
KFAC_FLAGS: dict[str, tuple[str, str, str]] = {
    "dkfac": ("bulk", "none", "greedy"),
    "dkfac-pipelined": ("pipelined", "merged", "greedy"),
    "dkfac-lbp": ("bulk", "none", "lbp"),
    "spd": ("pipelined", "merged", "lbp"),
}
#: The most stages the planner tries (powers of two that divide the workers).
MAX_STAGES = 16
#: The families, in the order tables list them.
FAMILIES: tuple[str, ...] = ("data", "kfac", "pipeline")
#: Bytes of a float32.
_FLOAT = 4
#: Data sets of ``interlace train`` by one sample's shape.
_DATA_BY_SHAPE: dict[tuple[int, ...], str] = {
    (3, 224, 224): "synthetic-imagenet",
    (3, 32, 32): "synthetic-cifar10",
}


@dataclass(frozen=True)
class Candidate:
    """One priced configuration.

    Args:
        family: ``data``, ``kfac`` or ``pipeline``.
        name: What it is (strategy and options, K-FAC mode, or ``schedule SxR``).
        workers: GPUs.
        iteration_s: Seconds per iteration (every GPU's batch once).
        global_batch: Samples per iteration over all GPUs.
        terms: The iteration by term (compute, all-reduce, pipeline bubble, p2p, ...).
        flags: The ``interlace train`` flags that run it.
        asynchronous: An asynchronous pipeline (weights a few updates stale or predicted: its
            numbers are not a synchronous run's).
        memory_bytes: Estimated peak bytes per GPU (None: not estimated).
        memory_note: How the estimate is incomplete, if it is.
    """

    family: str
    name: str
    workers: int
    iteration_s: float
    global_batch: int
    terms: dict[str, float]
    flags: str
    asynchronous: bool = False
    memory_bytes: float | None = None
    memory_note: str = ""

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.global_batch / self.iteration_s

    @property
    def bound(self) -> str:
        """The term that bounds it: the largest."""
        return max(self.terms, key=lambda term: self.terms[term])


@dataclass
class PlanResult:
    """The ranked configurations at one worker count.

    Args:
        workers: GPUs.
        candidates: Fastest first (those over the memory limit left out).
        left_out: One line per family or configuration left out, and why.
    """

    workers: int
    candidates: list[Candidate]
    left_out: list[str] = field(default_factory=list)

    def why(self) -> str:
        """One line: why the first choice wins."""
        if not self.candidates:
            return "nothing to rank"
        best = self.candidates[0]
        terms = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in best.terms.items() if v > 0)
        line = f"{best.family} {best.name} wins, bounded by {best.bound} ({terms} ms)"
        if len(self.candidates) > 1:
            runner = self.candidates[1]
            line += (
                f"; {best.throughput / runner.throughput:.2f}x the next, {runner.family} "
                f"{runner.name} (bounded by {runner.bound})"
            )
        return line


def model_flags(trace: Trace) -> tuple[str, str]:
    """The ``--model``/``--data`` flags of the traced model, and a note when there are none
    (a Caffe log is no zoo model).

    Args:
        trace: The trace.
    """
    match = re.search(r"--model (\S+)", trace.source)
    if match is None:
        return "", f"{trace.model} is not a zoo model: flags only"
    data = _DATA_BY_SHAPE.get(tuple(trace.input_shape))
    model = f"--model {match[1]}" + (f" --data {data}" if data else "")
    return model, ""


def _train(model: str, workers: int, batch: int, rest: str) -> str:
    head = f"interlace train {model} " if model else ""
    return f"{head}-n {workers} --batch-size {batch} {rest}".strip()


def _batch(trace: Trace) -> int:
    return trace.batch_size or 32


def _activation_bytes(trace: Trace, start: int = 0, end: int | None = None) -> float:
    """Bytes per sample of the traced layers' outputs in ``[start, end)`` (forward order)."""
    memo = kept(trace)
    if "activations" not in memo:
        sizes = {a.layer: a.numel for a in trace.activations}
        memo["activations"] = [sizes.get(name, 0) * _FLOAT for name, _ in reversed(trace.layers)]
    return float(sum(memo["activations"][start:end]))


def _dp_memory(trace: Trace, extra: float = 0.0) -> tuple[float, str]:
    """Weights, gradients, a momentum buffer, the comm buffers (4 x the parameters) and the
    activations of one batch."""
    memory = 4.0 * trace.total_bytes + extra
    if not trace.activations:
        return memory, "activations not traced"
    return memory + _activation_bytes(trace) * _batch(trace), ""


def data_parallel(trace: Trace, network: Network, workers: int, model: str) -> list[Candidate]:
    """Every :data:`DP_OPTIONS` configuration at ``workers``.

    Args:
        trace: The model.
        network: Prices the all-reduce.
        workers: GPUs.
        model: The train line's ``--model``/``--data`` flags ("": none).
    """
    cost = network.cost(workers)
    batch = _batch(trace)
    memory, note = _dp_memory(trace)
    found = []
    for strategy, compression in DP_OPTIONS:
        result = simulate(trace, strategy, cost, workers=workers, compression=compression)
        compute = trace.forward_s + trace.backward_s + trace.step_s
        base, _, channels = strategy.partition("/k=")
        flags = f"--strategy {base}" + (f" --channels {channels}" if channels else "")
        flags += f" --compression {compression}" if compression else ""
        name = strategy + (f" {compression}" if compression else "")
        found.append(
            Candidate(
                "data",
                name,
                workers,
                result.iteration_s,
                batch * workers,
                {"compute": compute, "all-reduce": max(0.0, result.iteration_s - compute)},
                _train(model, workers, batch, flags),
                memory_bytes=memory,
                memory_note=note,
            )
        )
    return found


def kfac(trace: Trace, network: Network, workers: int, model: str) -> list[Candidate]:
    """Every K-FAC mode at ``workers``, as data parallelism.

    Args:
        trace: A trace with K-FAC factor sizes.
        network: Prices the all-reduces.
        workers: GPUs.
        model: The train line's ``--model``/``--data`` flags.
    """
    cost = network.cost(workers)
    batch = _batch(trace)
    factors = sum(f.a_dim**2 + f.g_dim**2 for f in trace.factors) * _FLOAT
    memory, note = _dp_memory(trace, 2.0 * factors)  # the factors and their decompositions
    found = []
    for mode, (comm, fusion, placement) in KFAC_FLAGS.items():
        result = simulate_kfac(trace, mode, cost, workers)
        phases = {k[:-2]: v for k, v in result.extra.items() if k.endswith("_s")}
        terms = {
            "compute": phases.get("forward_backward", 0.0) + phases.get("step", 0.0),
            "K-FAC compute": sum(
                phases.get(p, 0.0) for p in ("factor_compute", "decomposition", "precondition")
            ),
            "all-reduce": sum(
                phases.get(p, 0.0)
                for p in ("buffer_comm", "gradient_comm", "factor_comm", "decomposition_comm")
            ),
        }
        flags = (
            f"--optimizer kfac --kfac-factor-comm {comm} --kfac-fusion {fusion} "
            f"--kfac-placement {placement}"
        )
        found.append(
            Candidate(
                "kfac",
                mode,
                workers,
                result.iteration_s,
                batch * workers,
                terms,
                _train(model, workers, batch, flags),
                memory_bytes=memory,
                memory_note=note,
            )
        )
    return found


def stage_choices(trace: Trace, workers: int) -> list[int]:
    """The stage counts tried: powers of two from 2 that divide ``workers``, up to
    :data:`MAX_STAGES` and the traced layers.

    Args:
        trace: The model.
        workers: GPUs.
    """
    memo = kept(trace)
    if "layers" not in memo:
        memo["layers"] = len(trace.layers)
    stages, found = 2, []
    while stages <= min(MAX_STAGES, workers, memo["layers"]):
        if workers % stages == 0:
            found.append(stages)
        stages *= 2
    return found


@functools.lru_cache(maxsize=256)
def _schedule(name: str, stages: int, units: int) -> Schedule:
    return SCHEDULE_TYPES[name](stages, units)


def pipeline_memory(
    trace: Trace, config: PipelineConfig, bounds: tuple[tuple[int, int], ...]
) -> float:
    """Peak bytes on the fullest stage: weights, gradients and momentum (3 x its parameters),
    a copy per weight version it keeps (a prediction; PipeDream's stashes), and the activations
    of the pieces in flight (only the stage's input for those it recomputes).

    Args:
        trace: The model.
        config: The pipeline.
        bounds: Each stage's layers.
    """
    key = ("memory", config.schedule, config.stages, config.batch, config.pieces, bounds)
    memo = kept(trace)
    if key not in memo:
        memo[key] = _pipeline_memory(trace, config, bounds)
    return float(memo[key])


def _pipeline_memory(
    trace: Trace, config: PipelineConfig, bounds: tuple[tuple[int, int], ...]
) -> float:
    samples = config.batch / config.pieces
    memo = kept(trace)
    if "parameter prefix" not in memo:
        prefix = [0]  # integer bytes: the sums are exact in any grouping
        for _, ix in reversed(trace.layers):  # forward order
            prefix.append(prefix[-1] + sum(trace.tensors[i].nbytes for i in ix))
        memo["parameter prefix"] = prefix
    prefix = memo["parameter prefix"]
    peak = 0.0
    shapes = _in_flight(config.schedule, config.stages, config.pieces)
    for (start, end), (most, versions, reuses) in zip(bounds, shapes, strict=True):
        params = prefix[end] - prefix[start]
        full = _activation_bytes(trace, start, end) * samples
        if reuses:
            activations = full * most
        else:
            own_input = _activation_bytes(trace, start - 1, start) if start else 0.0
            activations = own_input * samples * most + full
        peak = max(peak, (3 + versions) * params + activations)
    return peak


@functools.lru_cache(maxsize=256)
def _in_flight(name: str, stages: int, pieces: int) -> tuple[tuple[int, int, bool], ...]:
    """Per stage of schedule ``name``: the most pieces in flight, the weight versions it keeps
    and whether its backwards reuse the forward's graph (the same for every model)."""
    kind = SCHEDULE_TYPES[name]
    units = pieces if kind.synchronous else stages + 1
    schedule = _schedule(name, stages, units)
    found = []
    for stage in range(stages):
        in_flight = most = versions = 0
        for action in schedule.program(stage, 1 if kind.synchronous else pieces):
            if action.op is Op.FORWARD:
                in_flight += 1
                most = max(most, in_flight)
            elif action.op is Op.BACKWARD:
                in_flight -= 1
            elif action.op in (Op.PREDICT, Op.STASH):
                versions = max(versions, 1 if action.op is Op.PREDICT else most)
        found.append((most, versions, schedule.reuses_forward_graph(stage)))
    return tuple(found)


def schedule_flags(kind: type[Schedule]) -> str:
    """``interlace train``'s flags for a schedule class: ``--schedule`` takes the schedules of
    :data:`~interlace.pipeline.schedule.SCHEDULES`; a class derived from one of them is
    SpecTrain's backward on the forward's prediction (``--spectrain-backward reuse``).

    Args:
        kind: A schedule class.
    """
    own: type[Schedule] = next(
        c for c in kind.__mro__ if issubclass(c, Schedule) and c.name in SCHEDULES
    )
    flags = f"--schedule {own.name}"
    return flags if own is kind else flags + " --spectrain-backward reuse"


def pipelines(
    trace: Trace, network: Network, workers: int, model: str, gpus_per_node: int | None
) -> list[Candidate]:
    """Every stages x replicas and schedule at ``workers``.

    Args:
        trace: A trace with activation sizes.
        network: Prices links and all-reduces.
        workers: GPUs.
        model: The train line's ``--model``/``--data`` flags.
        gpus_per_node: Ranks per node for the layout (default: the network's).
    """
    batch = _batch(trace)
    found = []
    for stages in stage_choices(trace, workers):
        replicas = workers // stages
        for schedule, kind in SCHEDULE_TYPES.items():
            pieces = stages if kind.synchronous else 1
            config = PipelineConfig(stages, replicas, schedule, batch * stages, pieces)
            price = price_pipeline(trace, config, network, gpus_per_node)
            memory = pipeline_memory(trace, config, price.bounds)
            flags = f"--parallel pipeline --stages {stages} {schedule_flags(kind)}"
            flags += f" --microbatches {pieces}" if kind.synchronous else f" --chunks {pieces}"
            if replicas > 1:
                flags += f" --strategy {config.strategy}"
            found.append(
                Candidate(
                    "pipeline",
                    f"{schedule} {stages}x{replicas}",
                    workers,
                    price.iteration_s,
                    config.batch * replicas,
                    price.terms(),
                    _train(model, workers, config.batch, flags),
                    asynchronous=not kind.synchronous,
                    memory_bytes=memory,
                )
            )
    return found


def family_reason(trace: Trace, family: str) -> str | None:
    """Why ``family`` cannot be priced on ``trace``, or None when it can.

    Args:
        trace: The trace.
        family: One of :data:`FAMILIES`.
    """
    if family == "kfac" and not trace.factors:
        return "kfac left out: the trace has no K-FAC factor sizes (interlace profile --trace-out)"
    if family == "pipeline":
        if not trace.activations:
            return (
                "pipeline left out: the trace has no activation sizes "
                "(record one with interlace trace or interlace profile --trace-out)"
            )
        if len(trace.layers) < 2:
            return "pipeline left out: the trace has fewer than 2 layers to cut into stages"
    return None


def plan(
    trace: Trace,
    network: Network,
    workers: int,
    *,
    families: Sequence[str] = FAMILIES,
    gpus_per_node: int | None = None,
    gpu_memory_bytes: float | None = None,
) -> PlanResult:
    """Rank every configuration of ``families`` on ``workers`` GPUs, fastest first.

    Args:
        trace: The model's iteration.
        network: The cluster's network.
        workers: GPUs (>= 1).
        families: Which of :data:`FAMILIES` to price.
        gpus_per_node: GPUs per node (must divide ``workers``; default the network's).
        gpu_memory_bytes: Leave out configurations estimated above this per GPU.

    Raises:
        UsageError: For a bad worker count, node size or family.
    """
    if workers < 1:
        raise UsageError(f"--workers: worker counts must be positive integers, got {workers}")
    per_node = gpus_per_node or network.node_size
    if per_node is not None and workers > per_node and workers % per_node:
        raise UsageError(
            f"--gpus-per-node {per_node} does not divide {workers} workers; give a worker count "
            f"that is a multiple of {per_node}"
        )
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise UsageError(f"unknown family {unknown[0]!r}; choose from {', '.join(FAMILIES)}")
    model, note = model_flags(trace)
    result = PlanResult(workers, [], [note] if note else [])
    found: list[Candidate] = []
    for family in families:
        reason = family_reason(trace, family)
        if reason is not None:
            result.left_out.append(reason)
        elif family == "data":
            found += data_parallel(trace, network, workers, model)
        elif family == "kfac":
            found += kfac(trace, network, workers, model)
        elif workers < 2:
            result.left_out.append("pipeline left out: one worker has no stages to share")
        elif network.point_to_point() is None:
            result.left_out.append(
                f"pipeline left out: --network {network.spec!r} prices all-reduces only (no "
                "point-to-point link); give ring:RATE, two-level:G:INTRA:INTER or fitted:A,B@N"
            )
        else:
            found += pipelines(trace, network, workers, model, gpus_per_node)
    if gpu_memory_bytes is not None:
        over = [
            c for c in found if c.memory_bytes is not None and c.memory_bytes > gpu_memory_bytes
        ]
        if over:
            result.left_out.append(
                f"{len(over)} configuration(s) over {gpu_memory_bytes / 2**30:g} GiB per GPU "
                f"left out (e.g. {over[0].family} {over[0].name}, "
                f"{over[0].memory_bytes / 2**30:.1f} GiB)"  # type: ignore[operator]
            )
        found = [c for c in found if c not in over]
    result.candidates = sorted(found, key=lambda c: c.iteration_s * 1.0 / c.global_batch)
    return result
