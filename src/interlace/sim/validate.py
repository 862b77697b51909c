"""Predicted against measured iteration times: the rows, their error, the table and the plot.

A :class:`ValidateSample` (a profiled trace, the fitted cost models and the measured strategies
with the contention probes, from :mod:`interlace.bench.validate`) becomes one
:class:`ValidationRow` per strategy (:func:`rows_from_sample`). docs/notes/sim.md says how.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import SLICE_CANDIDATES_BYTES, units_of
from interlace.errors import UsageError
from interlace.sim.contention import calibrate, fit_startup_overlap
from interlace.sim.replay import Contention
from interlace.sim.retime import with_totals
from interlace.sim.simulation import simulate
from interlace.sim.trace import Trace

DEFAULT_MODELS: tuple[str, ...] = ("mlp", "resnet20", "transformer")
DEFAULT_STRATEGIES: tuple[str, ...] = ("wfbp", "fixed", "single", "mgwfbp")
DEFAULT_RANKS: tuple[int, ...] = (2, 4)
DEFAULT_LINKS: tuple[str, ...] = ("200mbit", "1gbit")
DEFAULT_ITERS = 30
DEFAULT_WARMUP = 2
DEFAULT_ROUNDS = 5
#: What an emulated validation predicts and measures: data-parallel strategies, K-FAC modes and
#: pipeline schedules.
FAMILIES: tuple[str, ...] = ("dp", "kfac", "pipeline")
#: The error the validation is held to, drawn as a band on the plot.
ERROR_BAND = 0.20


@dataclass(frozen=True)
class ValidateSample:
    """What one validation launch brings back.

    Args:
        trace: The profiled trace.
        cost: What DataParallel planned with: ``a`` from one all-reduce after a barrier.
        stream_cost: ``a + b*M`` of all-reduces issued back to back, as the bucket engine
            issues them.
        measurement: The strategies and the plain module measured in round-robin blocks, with
            the contention probes (an :class:`interlace.bench.dp.Measurement`; read by its
            fields, so the simulator needs no measuring code).
        host_s_per_byte: Host seconds per gradient byte the runtime spends putting a bucket
            out (copying each gradient in, dividing), on the thread that runs backward.
        copy_out_s_per_byte: Host seconds per gradient byte of copying the averages back,
            after the last all-reduce.
    """

    trace: Trace
    cost: CostModel
    stream_cost: CostModel
    measurement: Any
    host_s_per_byte: float = 0.0
    copy_out_s_per_byte: float = 0.0


@dataclass(frozen=True)
class ValidationRow:
    """One strategy's predicted against measured iteration (times in seconds).

    Args:
        model: The model.
        strategy: The strategy.
        ranks: The ranks it ran on.
        link: The emulated link.
        predicted_s: The replay's iteration.
        measured_s: The measured median iteration.
        error: ``(predicted - measured) / measured``.
        predicted_uncontended_s: The naive prediction: the profiled trace as it is, the
            planner's cost model, no contention.
        compute_slowdown: The calibrated
            :attr:`~interlace.sim.replay.Contention.compute_slowdown`.
        compute_drift: Plain-module compute among the strategies over the profiled trace's.
        stream_a: The replay's start-up: the start-up probe's pace.
        stream_b: The replay's per-byte cost: the streamed fit's.
        predicted_buckets: Buckets of the replayed plan.
        measured_buckets: Buckets the run ended with (``"-"`` where not exported).
        comm_compute: One all-reduce of all gradients over the plain iteration's compute.
        cost_a: The planner's start-up.
        cost_b: The planner's per-byte cost.
        forward_s: The plain module's median forward in the same rounds (slowest rank).
        backward_s: Its backward.
        step_s: Its optimizer step.
        allreduce_s: One all-reduce of all gradients.
        overlapped_s: The iteration with that all-reduce alongside backward.
        predicted_allreduce_s: The replay's cost model's time for that all-reduce.
        transfer_rate: The calibrated :attr:`~interlace.sim.replay.Contention.transfer_rate`.
        startup_compute_slowdown: The calibrated
            :attr:`~interlace.sim.replay.Contention.startup_compute_slowdown`.
        startup_overlap: How far a start-up goes on behind the previous all-reduce's bytes
            (0 to 1).
        probes: Medians of the contention probes
            (:meth:`~interlace.sim.contention.ContentionSamples.medians`).
        family: What was predicted: ``"dp"`` (a data-parallel strategy), ``"kfac"`` (a K-FAC
            mode) or ``"pipeline"`` (a pipeline schedule).
        run: Which repetition of the whole validation the row comes from (1-based).
    """

    model: str
    strategy: str
    ranks: int
    link: str
    predicted_s: float
    measured_s: float
    error: float
    predicted_uncontended_s: float
    compute_slowdown: float
    compute_drift: float
    stream_a: float
    stream_b: float
    predicted_buckets: int
    measured_buckets: int | str
    comm_compute: float
    cost_a: float
    cost_b: float
    forward_s: float = 0.0
    backward_s: float = 0.0
    step_s: float = 0.0
    allreduce_s: float = 0.0
    overlapped_s: float = 0.0
    predicted_allreduce_s: float = 0.0
    transfer_rate: float = 1.0
    startup_compute_slowdown: float = 1.0
    startup_overlap: float = 0.0
    probes: dict[str, float] = field(default_factory=dict)
    family: str = "dp"
    run: int = 1

    @classmethod
    def of(
        cls,
        *,
        family: str,
        model: str,
        strategy: str,
        ranks: int,
        link: str,
        predicted_s: float,
        measured_s: float,
    ) -> ValidationRow:
        """A row with no data-parallel calibration: a prediction and its measurement.

        Args:
            family: ``"dp"``, ``"kfac"`` or ``"pipeline"``.
            model: The model or trace.
            strategy: The strategy, mode or schedule.
            ranks: The ranks it ran on.
            link: The link, as shown.
            predicted_s: The simulator's iteration.
            measured_s: The measured iteration (> 0).
        """
        return cls(
            model=model,
            strategy=strategy,
            ranks=ranks,
            link=link,
            predicted_s=predicted_s,
            measured_s=measured_s,
            error=(predicted_s - measured_s) / measured_s,
            predicted_uncontended_s=predicted_s,
            compute_slowdown=1.0,
            compute_drift=1.0,
            stream_a=0.0,
            stream_b=0.0,
            predicted_buckets=0,
            measured_buckets="-",
            comm_compute=0.0,
            cost_a=0.0,
            cost_b=0.0,
            family=family,
        )

    def to_dict(self) -> dict[str, Any]:
        """The row as a JSON object."""
        return asdict(self)


def rows_from_sample(
    sample: ValidateSample, link: str, strategies: Sequence[str]
) -> list[ValidationRow]:
    """Predicted (from the trace and cost model) against measured, per strategy.

    The contention probes calibrate the replay's start-up, contention and synchronisation
    (:func:`~interlace.sim.contention.calibrate`), and the trace takes its totals from the
    plain module timed in the same rounds as the strategies.

    Args:
        sample: One launch's trace, cost models and measurement.
        link: The emulated link, for the rows.
        strategies: The strategies measured, in row order.
    """
    measurement = sample.measurement
    forward = statistics.median(measurement.forward_s)
    backward = statistics.median(measurement.backward_s)
    step = statistics.median(measurement.step_s)
    allreduce = statistics.median(measurement.allreduce_s)
    overlapped = statistics.median(measurement.overlapped_s) if measurement.overlapped_s else 0.0
    timing = sample.stream_cost
    contention = Contention()
    sync = 0.0
    calibration = (
        calibrate(
            measurement.contention,
            forward_s=forward,
            backward_s=backward,
            step_s=step,
            allreduce_s=allreduce,
        )
        if measurement.contention is not None
        else None
    )
    # The machine is shared and its load drifts over a launch: the trace keeps its shape (each
    # layer's share, each tensor's ready time relative to backward) but takes its forward,
    # backward and step totals from the plain module timed in the same round-robin rounds as
    # the strategies, with no communication. `drift` says how far the load moved.
    profiled = sample.trace
    drift = (forward + backward + step) / (
        profiled.forward_s + profiled.backward_s + profiled.step_s
    )
    # The averages copied back into the gradients come after the last all-reduce, before the
    # step: priced as part of it.
    copy_out = sample.copy_out_s_per_byte * measurement.gradient_bytes
    trace = with_totals(profiled, forward, backward, step + copy_out)
    if calibration is not None:
        contention, sync = calibration.contention, calibration.sync_s
        # Start-ups as the probe, issued from backward's hooks in the same rounds, paid them
        # (the fit's, from one moment before the rounds and after a barrier, moves with load).
        timing = CostModel(calibration.startup_s, timing.b)
        overlap = fit_startup_overlap(measurement.contention, trace, timing, contention)
        if overlap is not None:
            contention = replace(contention, startup_overlap=overlap)
    if calibration is None and getattr(measurement, "stream_s", None):
        timing = rounds_cost(timing, measurement)
    probe_medians = measurement.contention.medians() if measurement.contention is not None else {}
    measured = {s.strategy: s for s in measurement.strategies}
    rows = []
    for strategy in strategies:
        samples = measured[strategy]
        # The buckets the run ended with (DataParallel may keep a candidate other than the cost
        # model's plan after measuring them); DDP's are its own and not exported.
        used = samples.bucket_tensors if samples.chosen_channels in (None, 1) else None
        result = simulate(
            trace,
            strategy,
            sample.cost,
            contention=contention,
            timing_cost=timing,
            buckets=used,
            sync_s=sync,
            slice_bytes=run_slice_bytes(trace, used, getattr(samples, "bucket_parts", None)),
            host_s_per_byte=sample.host_s_per_byte,
        )
        plain = simulate(sample.trace, strategy, sample.cost, buckets=used)
        measured_s = statistics.median(samples.iteration_s)
        rows.append(
            ValidationRow(
                model=measurement.model,
                strategy=strategy,
                ranks=measurement.ranks,
                link=link,
                predicted_s=result.iteration_s,
                measured_s=measured_s,
                error=(result.iteration_s - measured_s) / measured_s,
                predicted_uncontended_s=plain.iteration_s,
                compute_slowdown=contention.compute_slowdown,
                compute_drift=drift,
                stream_a=timing.a,
                stream_b=timing.b,
                predicted_buckets=result.buckets,
                measured_buckets="-" if samples.buckets is None else samples.buckets,
                comm_compute=allreduce / (forward + backward + step),
                cost_a=sample.cost.a,
                cost_b=sample.cost.b,
                forward_s=forward,
                backward_s=backward,
                step_s=step,
                allreduce_s=allreduce,
                overlapped_s=overlapped,
                predicted_allreduce_s=timing.time(measurement.gradient_bytes),
                transfer_rate=contention.transfer_rate,
                startup_compute_slowdown=contention.startup_compute_slowdown,
                startup_overlap=contention.startup_overlap,
                probes=probe_medians,
            )
        )
    return rows


def rounds_cost(timing: CostModel, measurement: Any) -> CostModel:
    """The replay's all-reduce cost from what the strategies' own rounds measured (on emulated
    compute, where nothing else is calibrated).

    Per byte: the all-reduce of all gradients alone, less the one-float all-reduce, both timed
    in every round's reference slot. At fast links gloo's reductions and copies on the shared
    cores set that pace, so it moves with the load, and the replay runs a bucket's all-reduce
    alone. Start-up: the job's own all-reduces issued from a plain backward's hooks, as
    per-tensor WFBP issues them (``stream_s``, from backward's start to the last one's end),
    less their bytes, per all-reduce. ``timing``'s terms stand where a probe is missing.

    Args:
        timing: The streamed cost model fitted before the rounds.
        measurement: The launch's measurement (``allreduce_s``, ``latency_s``, ``stream_s``,
            ``tensors`` and ``gradient_bytes``).
    """
    nbytes = float(measurement.gradient_bytes)
    per_byte = timing.b
    alone, latency = measurement.allreduce_s, getattr(measurement, "latency_s", None)
    if alone and latency and nbytes > 0:
        per_byte = max((statistics.median(alone) - statistics.median(latency)) / nbytes, 0.0)
    start_up = timing.a
    streams = getattr(measurement, "stream_s", None)
    if streams:
        count = max(int(measurement.tensors), 1)
        start_up = max((statistics.median(streams) - per_byte * nbytes) / count, 0.0)
    return CostModel(start_up, per_byte)


def run_slice_bytes(
    trace: Trace, buckets: Sequence[Sequence[str]] | None, parts: Sequence[int] | None
) -> float | None:
    """The slice size an overlap plan cut its buckets with, read back from how many slices
    each bucket went in: the first of no slicing and
    :data:`~interlace.comm.forward_plan.SLICE_CANDIDATES_BYTES` that cuts them so (None when
    none does, or nothing was recorded).

    Args:
        trace: The trace whose tensors the buckets name.
        buckets: Tensor names per bucket, as the run sent them.
        parts: Slices per bucket, in the same order.
    """
    if buckets is None or parts is None or len(parts) != len(buckets):
        return None
    size = {tensor.name: tensor.nbytes for tensor in trace.tensors}
    if any(name not in size for bucket in buckets for name in bucket):
        return None
    nbytes = [sum(size[name] for name in bucket) for bucket in buckets]
    for candidate in (None, *SLICE_CANDIDATES_BYTES):
        if [len(units) for units in units_of(nbytes, candidate)] == list(parts):
            return candidate
    return None


def error_summary(rows: Sequence[ValidationRow]) -> tuple[float, float]:
    """Median and maximum of ``|predicted - measured| / measured``.

    Args:
        rows: At least one row.
    """
    errors = [abs(row.error) for row in rows]
    return statistics.median(errors), max(errors)


def format_table(rows: Sequence[ValidationRow]) -> str:
    """The markdown table: one line per row, with the calibration beside each prediction.

    Args:
        rows: The rows to show, in order.
    """
    lines = [
        "| model | ranks | link | comm/compute | strategy | predicted ms | measured ms | error "
        "| naive ms (error) | a ms fit/probe | bytes rate | start-up overlap | compute slowdown "
        "start/bytes | drift | buckets pred/meas |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        plain_error = (row.predicted_uncontended_s - row.measured_s) / row.measured_s
        lines.append(
            f"| {row.model} | {row.ranks} | {row.link} | {row.comm_compute:.2f} | "
            f"{row.strategy} | {row.predicted_s * 1e3:.1f} | {row.measured_s * 1e3:.1f} | "
            f"{row.error * 100:+.1f}% | {row.predicted_uncontended_s * 1e3:.1f} "
            f"({plain_error * 100:+.1f}%) | {row.cost_a * 1e3:.2f}/{row.stream_a * 1e3:.2f} | "
            f"{row.transfer_rate:.2f} | {row.startup_overlap:.2f} | "
            f"{row.startup_compute_slowdown:.2f}/{row.compute_slowdown:.2f} | "
            f"{row.compute_drift:.2f} | "
            f"{row.predicted_buckets}/{row.measured_buckets} |"
        )
    return "\n".join(lines)


def format_prediction_table(rows: Sequence[ValidationRow]) -> str:
    """The markdown table of emulated-compute validation: family, setting, prediction, error.

    Args:
        rows: The rows to show, in order.
    """
    lines = [
        "| family | model | ranks | link | strategy | predicted ms | measured ms | error |",
        "|---|---|---:|---|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.family} | {row.model} | {row.ranks} | {row.link} | {row.strategy} | "
            f"{row.predicted_s * 1e3:.1f} | {row.measured_s * 1e3:.1f} | {row.error * 100:+.1f}% |"
        )
    return "\n".join(lines)


def format_summary(rows: Sequence[ValidationRow]) -> str:
    """One line: how many rows, and the error's median and maximum, naive beside calibrated.

    Args:
        rows: At least one row.
    """
    median, worst = error_summary(rows)
    plain = [abs(r.predicted_uncontended_s - r.measured_s) / r.measured_s for r in rows]
    models = len({r.model for r in rows})
    strategies = len({r.strategy for r in rows})
    links = len({r.link for r in rows})
    ranks = len({r.ranks for r in rows})
    return (
        f"{len(rows)} rows ({models} models x {strategies} strategies x {ranks} rank counts x "
        f"{links} links): |predicted - measured| / measured median {median * 100:.1f}%, max "
        f"{worst * 100:.1f}% (naive, with the planner's cost model and no contention: median "
        f"{statistics.median(plain) * 100:.1f}%, max {max(plain) * 100:.1f}%)"
    )


def format_run_summaries(rows: Sequence[ValidationRow]) -> str:
    """One line per repetition (and per family within it): rows, error median and maximum.

    Args:
        rows: At least one row.
    """
    lines = []
    for run in sorted({row.run for row in rows}):
        mine = [row for row in rows if row.run == run]
        median, worst = error_summary(mine)
        families = ", ".join(
            f"{family} {len(part)} rows {error_summary(part)[0] * 100:.1f}%/"
            f"{error_summary(part)[1] * 100:.1f}%"
            for family in dict.fromkeys(row.family for row in mine)
            for part in [[row for row in mine if row.family == family]]
        )
        lines.append(
            f"run {run}: {len(mine)} rows, |predicted - measured| / measured median "
            f"{median * 100:.1f}%, max {worst * 100:.1f}% ({families}; median/max)"
        )
    return "\n".join(lines)


def plot_validation(rows: Sequence[ValidationRow], path: str | Path) -> Path:
    """Predicted against measured iteration time (log-log), one marker per strategy and one
    colour per (ranks, link), with the line of exact prediction and the ±20% band.

    Args:
        rows: The rows to draw.
        path: Where the PNG goes (folders are made).

    Raises:
        UsageError: Without rows.
    """
    import matplotlib  # noqa: PLC0415 - heavy import, only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after choosing the Agg backend
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415 - as above

    if not rows:
        raise UsageError("no validation rows to plot")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    strategies = list(dict.fromkeys(row.strategy for row in rows))
    setups = sorted({(row.ranks, row.link) for row in rows})
    times = [t * 1e3 for row in rows for t in (row.predicted_s, row.measured_s)]
    low, high = min(times) / 1.3, max(times) * 1.3
    figure, axes = plt.subplots(figsize=(6.4, 5.6), dpi=120, layout="constrained")
    try:
        line = [low, high]
        axes.fill_between(
            line,
            [t * (1 - ERROR_BAND) for t in line],
            [t * (1 + ERROR_BAND) for t in line],
            color="0.9",
            label=f"within ±{ERROR_BAND:.0%}",
        )
        axes.plot(line, line, color="0.5", linewidth=1, label="predicted = measured")
        markers = "osD^vP*X"
        colours = plt.get_cmap("tab10")
        for index, strategy in enumerate(strategies):
            for number, setup in enumerate(setups):
                mine = [r for r in rows if r.strategy == strategy and (r.ranks, r.link) == setup]
                if not mine:
                    continue
                axes.scatter(
                    [r.measured_s * 1e3 for r in mine],
                    [r.predicted_s * 1e3 for r in mine],
                    marker=markers[index % len(markers)],
                    color=colours(number % 10),
                    s=28,
                    label=f"{strategy}, {setup[0]} ranks, {setup[1]}",
                )
        axes.set_xscale("log")
        axes.set_yscale("log")
        plain = FuncFormatter(lambda value, _position: f"{value:g}")
        for axis in (axes.xaxis, axes.yaxis):
            # Milliseconds as plain numbers on both major and minor ticks (not 3x10^1).
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(plain)
            axis.set_tick_params(which="minor", labelsize=7)
        axes.set_xlim(low, high)
        axes.set_ylim(low, high)
        axes.set_xlabel("measured iteration (ms)")
        axes.set_ylabel("predicted iteration (ms)")
        median, worst = error_summary(rows)
        models = ", ".join(dict.fromkeys(row.model for row in rows))
        axes.set_title(
            f"{models}: {len(rows)} rows, error median {median:.1%}, max {worst:.1%}",
            fontsize=10,
        )
        axes.grid(alpha=0.3, which="both")
        axes.legend(fontsize=6, ncols=2, loc="upper left")
        figure.savefig(path)
    finally:
        plt.close(figure)
    return path
