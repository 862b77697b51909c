"""K-FAC modes validated on emulated compute: interlace's modes measured on the emulated cluster
(the K-FAC ablation's rank code) against the simulator's prediction of each, one launch per
(trace, ranks, link). How a mode maps to the simulator: :func:`interlace.sim.kfac_runtime.
runtime_strategy`; the prediction's inputs: :meth:`EmulatedKFACModel.kfac_trace` and
:meth:`~EmulatedKFACModel.kfac_costs`, and the models fitted on the live group (undilated).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from interlace.bench.harness import undilated
from interlace.bench.kfac_rank import (
    ABLATION_MODES,
    HOST_DATA_PARALLEL,
    HOST_PASSES,
    HOST_STEP,
    AblationJob,
    measure_ablation_rank,
    mode_policies,
)
from interlace.bench.session import VALIDATION_NEEDS_ROOT, LaunchOptions, check_netem, shown_link
from interlace.comm.calibrate import fit_cost_model, fit_stream_cost_model, stream_sizes_up_to
from interlace.comm.cost import CostModel
from interlace.comm.links import parse_link
from interlace.emulate import Compute, undilate_cost
from interlace.emulate.kfac import EmulatedKFACModel
from interlace.errors import UsageError
from interlace.kfac.work_assignment import fit_broadcast_cost_model
from interlace.sim.kfac import KfacResult, simulate_kfac
from interlace.sim.kfac_costs import KfacCosts
from interlace.sim.kfac_runtime import runtime_strategy
from interlace.sim.trace import Trace, load_trace
from interlace.sim.validate import ValidationRow

PROG = "interlace simulate --validate (K-FAC)"
#: interlace's K-FAC modes validated by default: SPD-KFAC's ablation, all four of which the
#: simulator models (round-robin placement and the kfac-pytorch peer it does not).
DEFAULT_KFAC_MODES: tuple[str, ...] = tuple(ABLATION_MODES)
#: The measured forward, backward and hooks (the ablation's key, undilated).
KFAC_PASSES = "kfac_passes"


@dataclass(frozen=True)
class LiveCosts:
    """The cost models fitted on the live group, undilated (seconds as the target cluster's).

    Args:
        plan: All-reduces as DataParallel's planner fits them (one after a barrier); plans
            the gradient and factor buckets.
        stream: All-reduces issued back to back, as the bucket engine issues them; prices the
            link.
        broadcast: Broadcasts, as LBP fits them; places (LBP) and prices the decompositions'
            broadcasts.
    """

    plan: CostModel
    stream: CostModel
    broadcast: CostModel


def predict_modes(
    trace: Trace,
    costs: KfacCosts,
    modes: Sequence[str],
    live: LiveCosts,
    workers: int,
    *,
    gradient_buckets: Mapping[str, Sequence[Sequence[str]]] | None = None,
    factor_buckets: Mapping[str, Sequence[Sequence[str]]] | None = None,
    network: str = "",
    mode_costs: Mapping[str, KfacCosts] | None = None,
) -> dict[str, KfacResult]:
    """The simulator's iteration of each mode of :data:`ABLATION_MODES` (COMM-OPT, factors and
    decompositions every step, interlace's default bucket cap and packing).

    Args:
        trace: The iteration the emulated model runs (:meth:`EmulatedKFACModel.kfac_trace`).
        costs: The same device work (:meth:`EmulatedKFACModel.kfac_costs`).
        modes: Keys of :data:`ABLATION_MODES`.
        live: The undilated cost models fitted on the live group.
        workers: The ranks.
        gradient_buckets: Per mode, the gradient buckets its DataParallel ran with (tensor
            names in launch order; a mode left out is planned by MG-WFBP on ``live.plan``).
        factor_buckets: Per pipelined mode, the factor buckets it kept (``"LAYER.A"`` names
            in launch order; a mode left out is planned by the merge rule on ``live.plan``).
        network: Recorded in the results.
        mode_costs: Per mode, costs to use instead of ``costs`` (a mode left out takes
            ``costs``): :func:`host_costs`' host work, which differs between modes.

    Raises:
        UsageError: For a mode that is not an ablation mode.
    """
    results: dict[str, KfacResult] = {}
    for mode in modes:
        _check_mode(mode)
        results[mode] = simulate_kfac(
            trace,
            runtime_strategy(mode, *mode_policies(*ABLATION_MODES[mode], {})),
            live.plan,
            workers,
            costs=(mode_costs or {}).get(mode, costs),
            network=network,
            broadcast_cost=live.broadcast,
            timing_cost=live.stream,
            gradient_buckets=(gradient_buckets or {}).get(mode),
            factor_buckets=(factor_buckets or {}).get(mode),
        )
    return results


def host_costs(costs: KfacCosts, measured: Mapping[str, float]) -> KfacCosts:
    """``costs`` with a mode's measured host work (undilated): its hooks' (the K-FAC passes'
    host seconds beyond DataParallel's alone) and its ``step()``'s. The emulated device
    sleeps its time on the thread that does the host work, so the two do not overlap there,
    as they would on a GPU; a measurement without host times leaves ``costs`` as it is.

    Args:
        costs: The device work (:meth:`EmulatedKFACModel.kfac_costs`).
        measured: The mode's medians (:func:`~interlace.bench.kfac_rank.measure_ablation_rank`).
    """
    if HOST_STEP not in measured:
        return costs
    hooks = max(measured[HOST_PASSES] - measured[HOST_DATA_PARALLEL], 0.0)
    return replace(costs, host_hooks_s=hooks, host_step_s=measured[HOST_STEP])


def validate_kfac_rank(job: AblationJob) -> dict[str, Any]:
    """One rank of a K-FAC validation launch (collective): the cost models fitted on the live
    group, then ``job.modes`` measured side by side by the ablation's rank code, every LBP mode
    placing with the broadcast model fitted here (the one the prediction uses).

    Times come back dilated; the cost models as ``(a, b)``.

    Args:
        job: The emulated trace, the modes and the iterations.
    """
    plan = fit_cost_model(use_cache=False)
    trace = load_trace(job.compute.trace or job.model)
    factor_bytes = sum(4 * (f.a_dim**2 + f.g_dim**2) for f in trace.factors)
    stream = fit_stream_cost_model(sizes=stream_sizes_up_to(max(trace.total_bytes, factor_bytes)))
    broadcast = fit_broadcast_cost_model(None, 0)
    value = measure_ablation_rank(replace(job, broadcast_cost=broadcast))
    value["costs"] = {
        "plan": (plan.a, plan.b),
        "stream": (stream.a, stream.b),
        "broadcast": (broadcast.a, broadcast.b),
    }
    return value


def live_costs(value: Mapping[str, Any], dilation: float) -> LiveCosts:
    """The undilated cost models of a launch's value (:func:`validate_kfac_rank`).

    Args:
        value: Rank 0's value.
        dilation: The run's dilation.
    """
    fitted = {key: CostModel(*pair) for key, pair in value["costs"].items()}
    return LiveCosts(
        plan=undilate_cost(fitted["plan"], dilation),
        stream=undilate_cost(fitted["stream"], dilation),
        broadcast=undilate_cost(fitted["broadcast"], dilation),
    )


@dataclass(frozen=True)
class KfacMeasurement:
    """One launch's K-FAC modes measured on emulated compute, everything undilated.

    Args:
        compute: The emulated compute (trace and dilation).
        ranks: The ranks.
        link: The link as rows show it (target, and the rate it ran at).
        compute_method: ``"eigen"`` or ``"inverse"``.
        modes: The modes measured.
        live: The cost models fitted on the live group.
        medians: Per mode, the medians of the slowest rank's iteration and phases
            (:func:`~interlace.bench.kfac_rank.measure_ablation_rank`'s keys).
        placements: Per mode, each layer's ``[A owner, G owner]`` as the runtime placed them.
        factor_buckets: Per mode, the pipelined factor buckets (None: bulk).
        gradient_buckets: Per mode, the buckets its DataParallel kept (parameter names, in
            launch order).
        factor_bucket_names: Per pipelined mode, the factor buckets it kept (``"LAYER.A"``
            names, in launch order).
    """

    compute: Compute
    ranks: int
    link: str
    compute_method: str
    modes: tuple[str, ...]
    live: LiveCosts
    medians: dict[str, dict[str, float]]
    placements: dict[str, list[list[int | None]]]
    factor_buckets: dict[str, int | None]
    gradient_buckets: dict[str, list[list[str]]]
    factor_bucket_names: dict[str, list[list[str]]] = field(default_factory=dict)


def rows_from_measurement(
    measurement: KfacMeasurement, note: Callable[[str], None] | None = None
) -> list[ValidationRow]:
    """Each measured mode against the simulator's prediction of it (:func:`predict_modes`) on
    the emulated model's own trace and device costs, the mode's host work measured on the live
    ranks (:func:`host_costs`), the live cost models and the gradient buckets the mode's
    DataParallel kept; nothing is calibrated. Each mode's predicted and measured phases go to
    ``note``.

    Args:
        measurement: One launch's measurement.
        note: Where each mode's phases go (None: nowhere).
    """
    compute = measurement.compute
    assert compute.trace is not None
    model = EmulatedKFACModel(compute.trace, compute.dilation)
    costs = model.kfac_costs(measurement.compute_method)
    predicted = predict_modes(
        model.kfac_trace(),
        costs,
        measurement.modes,
        measurement.live,
        measurement.ranks,
        gradient_buckets=measurement.gradient_buckets,
        factor_buckets=measurement.factor_bucket_names,
        network=measurement.link,
        mode_costs={
            mode: host_costs(costs, measurement.medians[mode]) for mode in measurement.modes
        },
    )
    rows = []
    for mode in measurement.modes:
        result = predicted[mode]
        rows.append(
            ValidationRow.of(
                family="kfac",
                model=compute.name,
                strategy=mode,
                ranks=measurement.ranks,
                link=measurement.link,
                predicted_s=result.iteration_s,
                measured_s=measurement.medians[mode]["iteration"],
            )
        )
        if note is not None:
            note(describe_mode(mode, result, measurement))
    return rows


def kfac_validation_rows(
    compute: Compute,
    nprocs: int,
    link: str,
    modes: Sequence[str] = DEFAULT_KFAC_MODES,
    *,
    options: LaunchOptions | None = None,
    compute_method: str = "eigen",
) -> list[ValidationRow]:
    """Measure interlace's K-FAC ``modes`` on the emulated trace of ``compute`` (one launch of
    ``nprocs`` ranks on links of ``link`` / dilation), then :func:`rows_from_measurement`: one
    row per mode, predicted against measured (undilated seconds), ``family="kfac"``; each
    mode's phases go to the options' ``note``.

    The all-reduce and broadcast models are fitted on the live group, then the modes run side
    by side (:func:`validate_kfac_rank`), factors and decompositions every step,
    ``iters * rounds`` timed iterations each once every plan is final and ``warmup`` more; a
    mode's time is the median over them of the slowest rank's iteration.

    Args:
        compute: Emulated compute: the trace (with K-FAC factor sizes) and the dilation.
        nprocs: Ranks (>= 2).
        link: The target link (``"25gbit"``); the ranks run at its rate / dilation.
        modes: Keys of :data:`ABLATION_MODES`.
        options: The launch's counts, limits, cache folder and notes (None: the defaults).
        compute_method: ``"eigen"`` or ``"inverse"``.

    Raises:
        UsageError: For real compute, a trace without factor sizes, fewer than 2 ranks, an
            unknown mode, link or method, bad counts, or without root for the emulated cluster.
        LaunchFailedError: When the launch fails.
    """
    options = options or LaunchOptions()
    model = _check(compute, nprocs, link, modes, options, compute_method=compute_method)
    check_netem(VALIDATION_NEEDS_ROOT)
    job = AblationJob(
        model=compute.name,
        batch=model.trace.batch_size or 32,
        input_shape=(),
        iters=options.iters * options.rounds,
        warmup=options.warmup,
        compute=compute,
        compute_method=compute_method,
        modes=tuple(modes),
    )
    value = options.launch(
        validate_kfac_rank, job, nprocs=nprocs, link=link, compute=compute, prog=PROG
    )
    measurement = KfacMeasurement(
        compute=compute,
        ranks=nprocs,
        link=shown_link(link, compute),
        compute_method=compute_method,
        modes=tuple(modes),
        live=live_costs(value, compute.dilation),
        medians=undilated(value["medians"], compute.dilation),
        placements=value.get("factor_owners", {}),
        factor_buckets=value.get("factor_buckets", {}),
        gradient_buckets=value.get("gradient_buckets", {}),
        factor_bucket_names=value.get("factor_bucket_names", {}),
    )
    return rows_from_measurement(measurement, options.note)


def _check(
    compute: Compute,
    nprocs: int,
    link: str,
    modes: Sequence[str],
    options: LaunchOptions,
    *,
    compute_method: str,
) -> EmulatedKFACModel:
    """Refuse bad arguments with one line each; the emulated model otherwise."""
    if not compute.emulated or compute.trace is None:
        raise UsageError("K-FAC validation runs on emulated compute: give --compute emulated:TRACE")
    if nprocs < 2:
        raise UsageError(f"K-FAC validation needs -n >= 2 (nothing is sent on 1), got {nprocs}")
    options.check()
    if compute_method not in ("eigen", "inverse"):
        raise UsageError(f"compute method must be eigen or inverse, got {compute_method!r}")
    for mode in modes:
        _check_mode(mode)
    parse_link(link)
    try:
        return EmulatedKFACModel(compute.trace, compute.dilation)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _check_mode(mode: str) -> None:
    if mode not in ABLATION_MODES:
        raise UsageError(f"unknown K-FAC mode {mode!r}; choose from {', '.join(ABLATION_MODES)}")


def phase_pairs(
    result: KfacResult, measured: Mapping[str, float]
) -> list[tuple[str, float, float]]:
    """The iteration split the same way on both sides: ``(phase, predicted, measured)`` seconds.

    The runtime's modes compute factors in the passes, and backward returns once the gradients
    are averaged, so the passes are forward, backward, factors (with the hooks' host work) and
    the exposed gradient all-reduces (measured: ``kfac_passes``); ``step()`` holds the factor
    all-reduce's rest, the decompositions, their broadcasts, preconditioning and its host work;
    then the optimizer. Indented below ``step()``: its timed phases, predicted without host
    work, measured with it (each the slowest rank's median, so they need not add up); last,
    the host work the prediction was given.

    Args:
        result: The prediction.
        measured: The mode's measured medians (undilated).
    """
    phases = result.breakdown
    hooks = step_host = 0.0
    if HOST_STEP in measured:
        hooks = max(measured[HOST_PASSES] - measured[HOST_DATA_PARALLEL], 0.0)
        step_host = measured[HOST_STEP]
    passes = phases.forward_backward + phases.factor_compute + phases.gradient_comm + hooks
    step = (
        phases.factor_comm
        + phases.decomposition
        + phases.decomposition_comm
        + phases.precondition
        + step_host
    )
    pairs = [
        ("passes", passes, measured[KFAC_PASSES]),
        ("step()", step, measured["iteration"] - measured[KFAC_PASSES] - measured["optimizer"]),
        ("  factor_comm", phases.factor_comm, measured["factor_comm"]),
        ("  decomposition", phases.decomposition, measured["decomposition"]),
        ("  decomposition_comm", phases.decomposition_comm, measured["decomposition_comm"]),
        (
            "  precondition",
            phases.precondition,
            measured["precondition"] + measured.get("precondition_comm", 0.0),
        ),
        ("optimizer", phases.step + phases.buffer_comm, measured["optimizer"]),
        ("host: hooks", hooks, hooks),
        ("host: step()", step_host, step_host),
    ]
    return pairs


def describe_mode(mode: str, result: KfacResult, measurement: KfacMeasurement) -> str:
    """A mode's predicted and measured iteration, then one line per phase of
    :func:`phase_pairs` (ms, predicted / measured / difference), its buckets
    (predicted/measured), and how many of the runtime's owners the simulator predicted.

    Args:
        mode: The mode.
        result: Its prediction.
        measurement: The launch it was measured in.
    """
    measured = measurement.medians[mode]
    placed = ""
    owners = measurement.placements.get(mode)
    if owners is not None:
        # A colocated placement (greedy) places layers (both factors on one rank), LBP factors.
        if mode_policies(*ABLATION_MODES[mode], {})[1].colocated:
            runtime = [pair[0] for pair in owners]
        else:
            runtime = [owner for pair in owners for owner in pair]
        same = sum(a == b for a, b in zip(runtime, result.owners, strict=False))
        placed = f"; owners {same}/{len(result.owners)} as predicted"
    factor = measurement.factor_buckets.get(mode)
    gradient = len(measurement.gradient_buckets.get(mode, []))
    error = (result.iteration_s - measured["iteration"]) / measured["iteration"]
    lines = [
        f"{mode}: predicted {result.iteration_s * 1e3:.2f} ms, measured "
        f"{measured['iteration'] * 1e3:.2f} ms ({error * 100:+.1f}%); gradient buckets "
        f"{int(result.extra['gradient_buckets'])}/{gradient}, factor buckets "
        f"{int(result.extra['factor_buckets'])}/{'-' if factor is None else factor}{placed}"
    ]
    lines.append(f"  {'phase (ms)':<21}{'predicted':>8} {'measured':>8} {'diff':>8}")
    for phase, predicted, seen in phase_pairs(result, measured):
        difference = (predicted - seen) * 1e3
        lines.append(f"  {phase:<21}{predicted * 1e3:8.2f} {seen * 1e3:8.2f} {difference:+8.2f}")
    return "\n".join(lines)
