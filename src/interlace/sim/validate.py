"""``interlace simulate --validate``: predicted against measured iteration times, per strategy.

For each (model, ranks, link) one launch on the emulated cluster does, in order:

1. **profile**: an :class:`interlace.DataParallel` with ``bucketing="single"`` trains until it
   has planned; its plan carries the profile it planned from (per-tensor ready times, forward
   and backward, the slowest rank's medians with communication held to the end of backward) and
   the all-reduce cost model it fitted on the live group. With the optimizer step timed apart,
   that is the :class:`~interlace.sim.trace.Trace` ``interlace profile --trace-out`` writes.
2. **network**: ``a + b*M`` fitted on all-reduces issued back to back, as the bucket engine
   issues them (:func:`interlace.comm.calibrate.fit_stream_cost_model`); the replay keeps its
   per-byte ``b`` (its start-up comes from the probes below).
3. **measure**: the data-parallel benchmark's own rank code
   (:func:`interlace.bench.dp_rank.measure_rank`) runs every strategy for real, in round-robin
   blocks, and in the same rounds times the plain module's forward, backward and step, one
   all-reduce of all gradients, and the contention probes.

Each strategy's prediction is :func:`interlace.sim.engine.simulate`: planned exactly as
DataParallel plans (the trace, the fitted cost model), replayed with the calibrated start-up,
per-byte cost, contention and synchronisation, and compared with the strategy's measured median
iteration.

What this machine does to an iteration is modelled from probes of the plain module taken in the
same rounds as the strategies (:mod:`interlace.sim.contention`), never from a strategy being
predicted, and said in every row:

* **start-ups**: ranks outnumber cores, so an all-reduce issued from backward's hooks waits for
  every peer's communication thread to be scheduled, several times the 4-byte one after a
  barrier that DataParallel's planner fits ``a`` on, and by an amount that moves between
  launches. The replay prices every all-reduce's start-up with the pace of a stream of small
  all-reduces issued from the plain module's gradient hooks, in back-to-back iterations run as
  a block of their own in every round, as a strategy's are. The planner still plans with its
  own ``a`` (that is what runs).
* **contention**: compute slows while start-ups or bytes are in flight, and bytes progress
  slower beside backward than alone (:class:`~interlace.sim.engine.Contention`, from the same
  stream's backward and from backward with one all-reduce of all gradients alongside); gloo's
  two worker threads let a start-up run behind the previous all-reduce's bytes, as far as the
  cores allow: how far is found by replaying a stream of alternately small and 128 KB
  all-reduces from the same hooks (:func:`~interlace.sim.contention.fit_startup_overlap`).
* **synchronisation**: the plain iteration with its all-reduce, run back to back as strategies
  run, against its pieces timed apart after barriers.
* **load drift**: the machine is shared and its load moves within minutes; the trace keeps its
  shape but takes its forward, backward and step totals from the plain module timed in the same
  rounds as the strategies (:func:`~interlace.sim.trace.with_totals`).

Rows also show the naive prediction: the profiled trace as it is, the planner's cost model, no
contention.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from interlace.comm.cost import CostModel
from interlace.errors import UsageError
from interlace.sim.contention import calibrate, fit_startup_overlap
from interlace.sim.engine import Contention, simulate
from interlace.sim.trace import Trace, with_totals

PROG = "interlace simulate --validate"

DEFAULT_MODELS: tuple[str, ...] = ("mlp", "resnet20", "transformer")
DEFAULT_STRATEGIES: tuple[str, ...] = ("wfbp", "fixed", "single", "mgwfbp")
DEFAULT_RANKS: tuple[int, ...] = (2, 4)
DEFAULT_LINKS: tuple[str, ...] = ("200mbit", "1gbit")
DEFAULT_ITERS = 30
DEFAULT_WARMUP = 2
DEFAULT_ROUNDS = 5
DEFAULT_PNG = "simulate/validation.png"
#: The error the validation is held to, drawn as a band on the plot.
ERROR_BAND = 0.20
#: Profiling passes of the trace's DataParallel (after its warm-up pass).
PROFILE_STEPS = 5
#: Optimizer steps timed for the trace.
STEP_SAMPLES = 5


@dataclass(frozen=True)
class ValidateJob:
    """What one launch profiles and measures."""

    model: str
    batch: int
    input_shape: tuple[int, ...]
    strategies: tuple[str, ...]
    iters: int
    warmup: int
    rounds: int
    seed: int = 0


@dataclass(frozen=True)
class ValidateSample:
    """What one launch brings back: the trace, the fitted cost model, and the measurement."""

    trace: Trace
    #: What DataParallel planned with: ``a`` from one all-reduce after a barrier.
    cost: CostModel
    #: ``a + b*M`` of all-reduces issued back to back, as the bucket engine issues them.
    stream_cost: CostModel
    measurement: Any  # interlace.bench.dp_rank.Measurement (kept untyped: it imports torch lazily)


@dataclass(frozen=True)
class ValidationRow:
    model: str
    strategy: str
    ranks: int
    link: str
    predicted_s: float
    measured_s: float
    error: float
    #: Prediction with no contention model (compute unaffected by communication).
    predicted_uncontended_s: float
    #: The calibrated :class:`~interlace.sim.engine.Contention`.
    compute_slowdown: float
    #: Plain-module compute among the strategies over the profiled trace's compute.
    compute_drift: float
    #: The replay's cost model: the start-up probe's pace and the streamed fit's per-byte term.
    stream_a: float
    stream_b: float
    predicted_buckets: int
    measured_buckets: int | str
    comm_compute: float
    cost_a: float
    cost_b: float
    #: The plain module's medians in the same rounds (slowest rank): forward, backward, step,
    #: one all-reduce of all gradients, and the iteration with that all-reduce alongside backward.
    forward_s: float = 0.0
    backward_s: float = 0.0
    step_s: float = 0.0
    allreduce_s: float = 0.0
    overlapped_s: float = 0.0
    #: The replay's cost model's time for one all-reduce of all gradients.
    predicted_allreduce_s: float = 0.0
    transfer_rate: float = 1.0
    startup_compute_slowdown: float = 1.0
    #: How far a start-up goes on behind the previous all-reduce's bytes (0 to 1).
    startup_overlap: float = 0.0
    #: Medians of the contention probes (:class:`~interlace.sim.contention.ContentionSamples`).
    probes: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rows_from_sample(
    sample: ValidateSample, link: str, strategies: Sequence[str]
) -> list[ValidationRow]:
    """Predicted (from the trace and cost model) against measured, per strategy."""
    measurement = sample.measurement
    forward = statistics.median(measurement.forward_s)
    backward = statistics.median(measurement.backward_s)
    step = statistics.median(measurement.step_s)
    allreduce = statistics.median(measurement.allreduce_s)
    overlapped = statistics.median(measurement.overlapped_s)
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
    trace = with_totals(profiled, forward, backward, step)
    if calibration is not None:
        contention, sync = calibration.contention, calibration.sync_s
        # Start-ups as the probe, issued from backward's hooks in the same rounds, paid them
        # (the fit's, from one moment before the rounds and after a barrier, moves with load).
        timing = CostModel(calibration.startup_s, timing.b)
        overlap = fit_startup_overlap(measurement.contention, trace, timing, contention)
        if overlap is not None:
            contention = replace(contention, startup_overlap=overlap)
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


def error_summary(rows: Sequence[ValidationRow]) -> tuple[float, float]:
    """Median and maximum of ``|predicted - measured| / measured``."""
    errors = [abs(row.error) for row in rows]
    return statistics.median(errors), max(errors)


def format_table(rows: Sequence[ValidationRow]) -> str:
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


def format_summary(rows: Sequence[ValidationRow]) -> str:
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


def plot_validation(rows: Sequence[ValidationRow], path: str | Path) -> Path:
    """Predicted against measured iteration time (log-log), one marker per strategy and one
    colour per (ranks, link), with the line of exact prediction and the ±20% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

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


# ================================================================================ rank side


def validate_rank(job: ValidateJob) -> ValidateSample:
    """Profile ``job.model`` into a trace, then measure every strategy (see the module doc)."""
    import time

    import torch
    import torch.distributed as dist

    from interlace.bench.dp_rank import MeasureJob, measure_rank
    from interlace.bench.harness import Contender, max_over_ranks, synthetic_batches, train_step
    from interlace.comm.calibrate import fit_stream_cost_model
    from interlace.dp import DataParallel
    from interlace.profile import layer_forward_times, trace_from_plan
    from interlace.strategies import wrap_model
    from interlace.zoo import build_model

    rank = dist.get_rank()
    torch.manual_seed(job.seed)
    module = build_model(job.model, job.input_shape, 10)
    wrapper = wrap_model(module, "single", profile_steps=PROFILE_STEPS)
    assert isinstance(wrapper, DataParallel)
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.01, momentum=0.9)
    contender = Contender("single", wrapper, optimizer)
    batches = synthetic_batches(job.batch, job.input_shape, job.seed, rank)
    count = 0
    while wrapper.plan is None:
        if count > 50:
            raise RuntimeError("the profiling DataParallel never planned")
        train_step(contender, *batches[count % len(batches)])
        count += 1
    steps = []
    for index in range(STEP_SAMPLES):
        inputs, targets = batches[index % len(batches)]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(wrapper(inputs), targets).backward()
        started = time.perf_counter()
        optimizer.step()
        steps.append(time.perf_counter() - started)
    step_s = statistics.median(max_over_ranks(steps))
    plan = wrapper.plan
    cost = wrapper.cost_model
    assert plan is not None and cost is not None
    trace = trace_from_plan(
        plan,
        module,
        job.model,
        step_s=step_s,
        layer_forward_s=layer_forward_times(module, batches[0][0]),
        workers=dist.get_world_size(),
        source=f"validation profile, {dist.get_world_size()} ranks",
    )
    stream_cost = fit_stream_cost_model()
    measurement = measure_rank(
        MeasureJob(
            job.model,
            job.batch,
            job.input_shape,
            job.strategies,
            job.iters,
            job.warmup,
            job.rounds,
            job.seed,
            probe_contention=True,
        )
    )
    return ValidateSample(trace, cost, stream_cost, measurement)


# ================================================================================ the command


@dataclass(frozen=True)
class ValidateConfig:
    models: tuple[str, ...]
    ranks: tuple[int, ...]
    links: tuple[str, ...]
    strategies: tuple[str, ...]
    iters: int
    warmup: int
    rounds: int
    batch_size: int | None
    timeout_s: float
    json_path: str | None
    trace_dir: str | None
    png_path: str | None = None


def run_validation(config: ValidateConfig) -> int:
    """Every (model, ranks, link) launch, the table, the summary; the exit status."""
    from tqdm import tqdm

    from interlace import netem
    from interlace.bench.harness import (
        DEFAULT_BATCH,
        DEFAULT_INPUT_SHAPE,
        FALLBACK_BATCH,
        LaunchFailedError,
        launch_on_ranks,
    )

    try:
        netem.check_available()
    except netem.NetemUnavailableError as exc:
        raise UsageError(
            f"{exc}; validation measures on the emulated cluster and needs root"
        ) from exc
    for link in config.links:
        netem.parse_link(link)
    from interlace.zoo import build_model

    for model in config.models:
        build_model(model, DEFAULT_INPUT_SHAPE, 10)

    cache_dir = tempfile.mkdtemp(prefix="interlace-validate-")
    rows: list[ValidationRow] = []
    failures: list[str] = []
    launches = [(m, n, link) for m in config.models for n in config.ranks for link in config.links]
    try:
        with tqdm(total=len(launches), unit="launch", desc=PROG, dynamic_ncols=True) as bar:
            for model, nprocs, link in launches:
                bar.set_postfix_str(f"{model}, {nprocs} ranks, {link}")
                batch = config.batch_size or DEFAULT_BATCH.get(model, FALLBACK_BATCH)
                job = ValidateJob(
                    model,
                    batch,
                    DEFAULT_INPUT_SHAPE,
                    config.strategies,
                    config.iters,
                    config.warmup,
                    config.rounds,
                )
                bench = _bench_config(config, nprocs)
                try:
                    sample = launch_on_ranks(
                        validate_rank,
                        job,
                        nprocs=bench.nprocs,
                        link=link,
                        timeout_s=bench.timeout_s,
                        cache_dir=cache_dir,
                        note=bar.write,
                        prog="interlace bench dp",
                    )
                except LaunchFailedError as exc:
                    failures.append(f"{model}, {nprocs} ranks, {link}: {exc}")
                    bar.write(f"{PROG}: launch failed: {failures[-1]}")
                    bar.update(1)
                    continue
                if config.trace_dir:
                    sample.trace.save(
                        Path(config.trace_dir) / f"{_label(model)}-n{nprocs}-{link}.json"
                    )
                new_rows = rows_from_sample(sample, link, config.strategies)
                rows.extend(new_rows)
                bar.write(
                    f"{model}, {nprocs} ranks, {link}: "
                    + ", ".join(
                        f"{r.strategy} {r.predicted_s * 1e3:.0f}/{r.measured_s * 1e3:.0f} ms "
                        f"({r.error * 100:+.0f}%)"
                        for r in new_rows
                    )
                )
                bar.update(1)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    if rows:
        print()
        print(format_table(rows))
        print()
        print(format_summary(rows))
    if config.json_path:
        path = Path(config.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([row.to_dict() for row in rows], indent=1) + "\n")
    if rows and config.png_path:
        print(f"\npredicted against measured: {plot_validation(rows, config.png_path)}")
    if failures:
        print(f"\n{PROG}: {len(failures)} launch(es) failed:", file=sys.stderr)
        for message in failures:
            print(f"  {message.splitlines()[0]}", file=sys.stderr)
        return 1
    return 0 if rows else 1


def _bench_config(config: ValidateConfig, nprocs: int) -> Any:
    from interlace.bench.dp import BenchConfig
    from interlace.bench.harness import DEFAULT_INPUT_SHAPE

    return BenchConfig(
        models=config.models,
        strategies=config.strategies,
        ratios=(),
        nprocs=nprocs,
        iters=config.iters,
        warmup=config.warmup,
        rounds=config.rounds,
        input_shape=DEFAULT_INPUT_SHAPE,
        batch_size=config.batch_size,
        link=None,
        netem=True,
        timeout_s=config.timeout_s,
        ref_link="1gbit",
        min_link="20mbit",
        max_link="2.5gbit",
        seed=0,
        json_path=None,
        png_path=None,
    )


def _label(model: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in model)


def config_from_args(args: argparse.Namespace) -> ValidateConfig:
    """Check ``--validate``'s flags; a UsageError names what is wrong."""
    from interlace.bench.harness import parse_names
    from interlace.sim.engine import STRATEGIES
    from interlace.strategies import STRATEGIES as RUNNABLE
    from interlace.zoo import MODEL_NAMES

    models = parse_names(args.model, None, "model", "model") if args.model else DEFAULT_MODELS
    for model in models:
        if ":" not in model and model not in MODEL_NAMES:
            raise UsageError(
                f"--model: unknown model {model!r}; choose from {', '.join(MODEL_NAMES)} or give "
                "package.module:callable"
            )
    strategies = (
        parse_names(
            args.strategy, tuple(s for s in STRATEGIES if s in RUNNABLE), "strategy", "strategy"
        )
        if args.strategy
        else DEFAULT_STRATEGIES
    )
    if args.nprocs is not None and args.nprocs < 2:
        raise UsageError(f"-n must be >= 2 (data parallelism needs ranks), got {args.nprocs}")
    ranks = (args.nprocs,) if args.nprocs is not None else DEFAULT_RANKS
    links = parse_names(args.link, None, "link", "link") if args.link else DEFAULT_LINKS
    if args.iters < 1 or args.rounds < 1 or args.warmup < 0:
        raise UsageError("--iters and --rounds must be >= 1, --warmup >= 0")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    from interlace.sim.command import plot_path

    png = plot_path(args)
    return ValidateConfig(
        models=models,
        ranks=ranks,
        links=links,
        strategies=strategies,
        iters=args.iters,
        warmup=args.warmup,
        rounds=args.rounds,
        batch_size=args.batch_size,
        timeout_s=float(args.timeout),
        json_path=args.json,
        trace_dir=args.trace_dir,
        png_path=None if png is None else str(png),
    )
