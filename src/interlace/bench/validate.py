"""``interlace simulate --validate``: profile a model and measure its strategies on the emulated
cluster, one launch per (model, ranks, link), and compare with the simulator's predictions.

The comparison itself (rows, table, plot) is :mod:`interlace.sim.validate`.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from interlace.bench.dp_rank import MeasureJob, measure_rank
from interlace.bench.harness import (
    DEFAULT_INPUT_SHAPE,
    NUM_CLASSES,
    REAL_COMPUTE,
    Contender,
    default_batch,
    make_optimizer,
    max_over_ranks,
    steps_until,
    train_step,
)
from interlace.bench.session import (
    VALIDATION_NEEDS_ROOT,
    LaunchOptions,
    Session,
    check_netem,
    shown_link,
)
from interlace.bench.skeleton import check_limits, check_models, parse_names
from interlace.bench.tables import write_json
from interlace.bench.validate_kfac import kfac_validation_rows
from interlace.bench.validate_pipeline import pipeline_validation_rows
from interlace.comm.calibrate import fit_cost_model, fit_stream_cost_model, stream_sizes_up_to
from interlace.comm.links import parse_link
from interlace.comm.strategies import PLANNED_STRATEGIES, RUNTIME_STRATEGIES
from interlace.dp import DataParallel
from interlace.emulate import (
    Compute,
    EmulatedModel,
    compute_from_args,
    parse_compute,
    undilate_cost,
)
from interlace.errors import UsageError
from interlace.launch.rank import DEFAULT_COLLECTIVE_TIMEOUT_S
from interlace.profile import layer_forward_times
from interlace.sim.pipeline import PIPELINE_SCHEDULES
from interlace.sim.profiled import trace_from_plan
from interlace.sim.trace import load_trace
from interlace.sim.validate import (
    DEFAULT_LINKS,
    DEFAULT_MODELS,
    DEFAULT_RANKS,
    DEFAULT_STRATEGIES,
    FAMILIES,
    ValidateSample,
    ValidationRow,
    error_summary,
    format_prediction_table,
    format_run_summaries,
    format_summary,
    format_table,
    plot_validation,
    rows_from_sample,
)
from interlace.wrapping import wrap_model
from interlace.zoo import build_model

PROG = "interlace simulate --validate"
#: Profiling passes of the trace's DataParallel (after its warm-up pass).
PROFILE_STEPS = 5
#: Optimizer steps timed for the trace.
STEP_SAMPLES = 5


def validate_rank(job: MeasureJob) -> ValidateSample:
    """One rank of a validation launch: profile ``job.model`` into a trace, then measure every
    strategy with the contention probes (collective).

    A DataParallel with ``bucketing="single"`` trains until it has planned; its plan carries the
    profile it planned from and the cost model it fitted on the live group, and with the
    optimizer step timed apart that is the trace. The streamed cost model is fitted on
    all-reduces issued back to back; then the data-parallel benchmark's own rank code measures
    every strategy in round-robin blocks beside the plain module and the probes.

    Args:
        job: What to measure; its contention probes are always taken.
    """
    torch.manual_seed(job.seed)
    module = job.module()
    wrapper = wrap_model(module, "single", profile_steps=PROFILE_STEPS)
    assert isinstance(wrapper, DataParallel)
    optimizer = make_optimizer(module, wrapper.parameters())
    contender = Contender("single", wrapper, optimizer)
    batches = job.batches(dist.get_rank())
    steps_until(
        lambda _: wrapper.plan is not None,
        lambda step: train_step(contender, *batches[step % len(batches)]),
        "the profiling DataParallel",
        limit=50,
    )
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
    measurement = measure_rank(replace(job, probe_contention=True))
    return ValidateSample(trace, cost, stream_cost, measurement)


def validate_emulated_rank(job: MeasureJob) -> ValidateSample:
    """One rank of a validation launch on emulated compute (collective).

    The trace is the emulated model's own (its tensors named as the model's parameters), the
    cost models are fitted on the live group, and the strategies are measured without the
    contention probes: device time leaves the cores to communication, so nothing is
    calibrated. Every time comes back undilated.

    Args:
        job: What to measure; ``job.compute`` is emulated.
    """
    compute = job.compute
    module = job.module()
    assert isinstance(module, EmulatedModel)
    cost = undilate_cost(fit_cost_model(use_cache=False), compute.dilation)
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    stream_cost = undilate_cost(
        fit_stream_cost_model(sizes=stream_sizes_up_to(total)), compute.dilation
    )
    copy_in, copy_out = time_bucket_host_work(
        [p.numel() for p in module.parameters() if p.requires_grad]
    )
    measurement = measure_rank(replace(job, probe_contention=False, probe_stream=True)).undilated()
    trace = replace(module.named_trace(), workers=dist.get_world_size())
    return ValidateSample(
        trace,
        cost,
        stream_cost,
        measurement,
        host_s_per_byte=copy_in / compute.dilation,
        copy_out_s_per_byte=copy_out / compute.dilation,
    )


def time_bucket_host_work(numels: Sequence[int], repeats: int = 5) -> tuple[float, float]:
    """Host seconds per byte of DataParallel's bucket engine around its all-reduces, timed on
    every rank at once (collective): each gradient copied into its bucket and the bucket divided
    by the world size (in backward's hooks), and the averages copied back into the gradients
    (after the last all-reduce). On the CPU these passes over memory are real host work that
    device time does not cover, and the ranks run them on shared cores.

    Args:
        numels: The gradients' element counts (float32).
        repeats: Timed passes (after one untimed).

    Returns:
        ``(copy in and divide, copy out)``, seconds per byte, medians of the slowest rank's.
    """
    grads = [torch.ones(numel) for numel in numels]
    flat = torch.zeros(sum(numels))
    views = list(torch.split(flat, list(numels)))
    nbytes = flat.numel() * flat.element_size()
    ins, outs = [], []
    for index in range(repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        for view, grad in zip(views, grads, strict=True):
            view.copy_(grad)
        flat.div_(dist.get_world_size())
        copied = time.perf_counter()
        torch._foreach_copy_(grads, views)
        if index > 0:
            ins.append((copied - started) / nbytes)
            outs.append((time.perf_counter() - copied) / nbytes)
    return statistics.median(max_over_ranks(ins)), statistics.median(max_over_ranks(outs))


@dataclass(frozen=True)
class ValidateConfig:
    """Every launch of a validation run and what to write.

    Args:
        models: Zoo names or ``package.module:callable`` (real compute), or the labels of
            ``computes`` (emulated compute).
        ranks: Rank counts.
        links: Emulated link rates.
        strategies: Data-parallel strategies to predict and measure.
        iters: Timed iterations per strategy.
        warmup: Untimed iterations per strategy after planning.
        rounds: Round-robin blocks.
        batch_size: Per-rank batch (None: per model).
        timeout_s: Seconds allowed per launch.
        collective_timeout_s: Seconds any one collective may wait for its peers.
        json_path: Where the rows go as JSON (None: nowhere).
        trace_dir: Where each launch's profiled trace goes (None: nowhere).
        png_path: Where the predicted-against-measured plot goes (None: no plot).
        input_shape: The shape of one sample the models are built for.
        num_classes: The classes the models predict.
        compute: Real compute (profiled zoo models, contention calibrated) or an emulated
            trace (no calibration; ``links`` are the target's, run at rate / dilation).
        computes: With emulated compute, one per trace (``compute`` is the first).
        families: What to validate on emulated compute: ``dp`` strategies, ``kfac`` modes
            (traces with factor sizes), ``pipeline`` schedules (traces with activation sizes).
        repeat: How many times the whole set of launches runs.
    """

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
    input_shape: tuple[int, ...] = DEFAULT_INPUT_SHAPE
    num_classes: int = NUM_CLASSES
    compute: Compute = REAL_COMPUTE
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    computes: tuple[Compute, ...] = ()
    families: tuple[str, ...] = ("dp",)
    repeat: int = 1


@dataclass(frozen=True)
class _Launch:
    """One launch: a family's rows for one model, rank count and link, in one repetition."""

    family: str
    model: str
    compute: Compute
    nprocs: int
    link: str
    run: int

    def describe(self) -> str:
        return f"{self.family}, {self.model}, {self.nprocs} ranks, {self.link}"


def run_validation(config: ValidateConfig) -> int:
    """Every launch, the table, the summary; the exit status.

    Args:
        config: The launches and outputs.

    Raises:
        UsageError: Without root for the emulated cluster, or for an unknown link or model.
    """
    # A bad model or size is one line, wherever this runs (a trace names an emulated model).
    for model in () if config.compute.emulated else config.models:
        build_model(model, config.input_shape, config.num_classes)
    check_netem(VALIDATION_NEEDS_ROOT)
    for link in config.links:
        parse_link(link)
    rows: list[ValidationRow] = []
    launches = _launches(config)
    with Session(
        PROG,
        len(launches),
        timeout_s=config.timeout_s,
        collective_timeout_s=config.collective_timeout_s,
    ) as session:
        for launch in launches:
            new_rows = session.attempt(
                f"{launch.describe()}, run {launch.run}",
                functools.partial(_launch_rows, config, launch, session),
            )
            if new_rows is None:
                continue
            new_rows = [replace(row, run=launch.run) for row in new_rows]
            rows.extend(new_rows)
            session.note(
                f"{launch.describe()}: "
                + ", ".join(
                    f"{r.strategy} {r.predicted_s * 1e3:.1f}/{r.measured_s * 1e3:.1f} ms "
                    f"({r.error * 100:+.0f}%)"
                    for r in new_rows
                )
            )
    if rows:
        _print_rows(config, rows)
    if config.json_path:
        write_json(config.json_path, [row.to_dict() for row in rows])
    if rows and config.png_path:
        session.wrote(f"\npredicted against measured: {plot_validation(rows, config.png_path)}")
    return session.finish() or (0 if rows else 1)


def _launches(config: ValidateConfig) -> list[_Launch]:
    """The launches in run order: repetitions outermost, then models, ranks, links, families."""
    if not config.compute.emulated:
        computes = [(model, config.compute) for model in config.models]
    else:
        computes = list(zip(config.models, config.computes or (config.compute,), strict=True))
    families_of = {model: _families_of(config, compute) for model, compute in computes}
    launches: list[_Launch] = []
    for run in range(1, config.repeat + 1):
        for model, compute in computes:
            families = families_of[model]
            for nprocs in config.ranks:
                for link in config.links:
                    launches.extend(
                        _Launch(family, model, compute, nprocs, link, run) for family in families
                    )
    return launches


def _families_of(config: ValidateConfig, compute: Compute) -> list[str]:
    """The families a compute can be validated on: K-FAC needs factor sizes, the pipeline
    activation sizes (real compute: data-parallel strategies only)."""
    if not compute.emulated:
        return ["dp"]
    assert compute.trace is not None
    trace = load_trace(compute.trace)
    able = {"dp": True, "kfac": bool(trace.factors), "pipeline": bool(trace.activations)}
    return [family for family in config.families if able[family]]


def _launch_rows(config: ValidateConfig, launch: _Launch, session: Session) -> list[ValidationRow]:
    """Run one launch and turn what it measured into rows.

    Raises:
        LaunchFailedError: When a rank fails or the launch times out.
    """
    compute = launch.compute
    shown = shown_link(launch.link, compute)
    options = session.options(iters=config.iters, warmup=config.warmup, rounds=config.rounds)
    if launch.family == "kfac":
        rows = kfac_validation_rows(compute, launch.nprocs, launch.link, options=options)
        return [replace(row, model=launch.model, link=shown) for row in rows]
    if launch.family == "pipeline":
        rows = pipeline_validation_rows(
            launch.model, compute, launch.nprocs, launch.link, PIPELINE_SCHEDULES, options=options
        )
        return [replace(row, link=shown) for row in rows]
    job = MeasureJob(
        model=launch.model,
        batch=config.batch_size or default_batch(launch.model),
        input_shape=config.input_shape,
        iters=config.iters,
        warmup=config.warmup,
        num_classes=config.num_classes,
        compute=compute,
        strategies=config.strategies,
        rounds=config.rounds,
        probe_contention=not compute.emulated,
    )
    sample = options.launch(
        validate_emulated_rank if compute.emulated else validate_rank,
        job,
        nprocs=launch.nprocs,
        link=launch.link,
        compute=compute,
        prog=PROG,
    )
    if config.trace_dir:
        label = _label(launch.model)
        sample.trace.save(Path(config.trace_dir) / f"{label}-n{launch.nprocs}-{launch.link}.json")
    return rows_from_sample(sample, shown, config.strategies)


def _print_rows(config: ValidateConfig, rows: list[ValidationRow]) -> None:
    """The table and the summary: every family's rows on emulated compute, the calibrated
    data-parallel table on real compute."""
    if config.compute.emulated:
        computes = config.computes or (config.compute,)
        print(
            f"\ncompute: {', '.join(c.label() for c in computes)} "
            "(times undilated; no contention calibration)"
        )
        print(format_prediction_table(rows))
        print()
        print(format_run_summaries(rows))
        runs = len({row.run for row in rows})
        if runs > 1:
            medians = median_of_runs(rows)
            print(f"\neach row its median run of {runs} (the run with the median error):")
            print(format_prediction_table(medians))
            print()
            print(format_median_summary(medians, runs))
        return
    print(f"\ncompute: {config.compute.label()} (contention calibrated by the probes)")
    print(format_table(rows))
    print()
    print(format_summary(rows))


def median_of_runs(rows: Sequence[ValidationRow]) -> list[ValidationRow]:
    """One row per setting (family, model, ranks, link, strategy), in first-seen order: its
    median run, the run whose error is the median of the setting's runs' errors (the upper of
    the two middle ones for an even count), ``run`` 0.

    A run's prediction is calibrated on that run's own launch (its probes, its load), so a
    row keeps one run's prediction and measurement together rather than pairing medians taken
    apart.

    Args:
        rows: The rows of every run.
    """
    settings: dict[tuple[str, str, int, str, str], list[ValidationRow]] = {}
    for row in rows:
        key = (row.family, row.model, row.ranks, row.link, row.strategy)
        settings.setdefault(key, []).append(row)
    medians = []
    for runs in settings.values():
        ordered = sorted(runs, key=lambda r: r.error)
        medians.append(replace(ordered[len(ordered) // 2], run=0))
    return medians


def format_median_summary(medians: Sequence[ValidationRow], runs: int) -> str:
    """One line per family of :func:`median_of_runs`' rows: their error's median and maximum.

    Args:
        medians: Rows of :func:`median_of_runs`.
        runs: How many runs each row is the median of.
    """
    lines = []
    for family in dict.fromkeys(row.family for row in medians):
        part = [row for row in medians if row.family == family]
        median, worst = error_summary(part)
        lines.append(
            f"{family}, medians of {runs} runs: {len(part)} rows, |predicted - measured| / "
            f"measured median {median * 100:.1f}%, max {worst * 100:.1f}%"
        )
    return "\n".join(lines)


def _label(model: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in model)


def config_from_args(args: argparse.Namespace, png_path: Path | None) -> ValidateConfig:
    """Check ``--validate``'s flags.

    Args:
        args: ``interlace simulate``'s parsed flags.
        png_path: Where the plot goes (None: no plot), as
            :func:`interlace.sim.command.plot_path` resolves ``--png``.

    Raises:
        UsageError: Naming what is wrong.
    """
    computes = _computes_from_args(args)
    compute = computes[0]
    if compute.emulated and args.model:
        raise UsageError(
            "--model and --compute emulated:TRACE contradict each other: the trace is the model"
        )
    models = parse_names(args.model, None, "model", "model") if args.model else DEFAULT_MODELS
    if compute.emulated:
        models = tuple(c.name for c in computes)
    families = (
        parse_names(args.families, FAMILIES, "families", "family")
        if args.families
        else FAMILIES
        if compute.emulated
        else ("dp",)
    )
    if not compute.emulated and families != ("dp",):
        raise UsageError(
            "--families kfac,pipeline need --compute emulated:TRACE (real compute validates "
            "data-parallel strategies)"
        )
    if args.repeat < 1:
        raise UsageError(f"--repeat must be >= 1, got {args.repeat}")
    if not compute.emulated:
        check_models(models, "--model")
    strategies = (
        parse_names(
            args.strategy,
            tuple(s for s in PLANNED_STRATEGIES if s in RUNTIME_STRATEGIES),
            "strategy",
            "strategy",
        )
        if args.strategy
        else DEFAULT_STRATEGIES
    )
    collective_timeout_s = check_limits(
        args.nprocs,
        args.batch_size,
        args.timeout,
        args.collective_timeout,
        ranks_reason="data parallelism needs ranks",
    )
    LaunchOptions(iters=args.iters, warmup=args.warmup, rounds=args.rounds).check()
    ranks = (args.nprocs,) if args.nprocs is not None else DEFAULT_RANKS
    links = parse_names(args.link, None, "link", "link") if args.link else DEFAULT_LINKS
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
        collective_timeout_s=collective_timeout_s,
        json_path=args.json,
        trace_dir=args.trace_dir,
        png_path=None if png_path is None else str(png_path),
        input_shape=DEFAULT_INPUT_SHAPE if args.input_shape is None else tuple(args.input_shape),
        num_classes=NUM_CLASSES if args.classes is None else args.classes,
        compute=compute,
        computes=computes if compute.emulated else (),
        families=families,
        repeat=args.repeat,
    )


def _computes_from_args(args: argparse.Namespace) -> tuple[Compute, ...]:
    """``--compute``: ``real``, or ``emulated:`` with one or more comma-separated traces."""
    kind, _, traces = str(args.compute).partition(":")
    if kind.strip().lower() != "emulated" or "," not in traces:
        return (compute_from_args(args),)
    names = parse_names(traces, None, "compute", "trace")
    return tuple(parse_compute(f"emulated:{name}", args.dilation) for name in names)


def run(args: argparse.Namespace, png_path: Path | None) -> int:
    """``interlace simulate --validate`` with parsed ``args``; the exit status.

    With ``--compute real`` (the default) the zoo models are profiled and the replay is
    calibrated by the contention probes (CPU compute fights communication for the cores);
    with ``--compute emulated:TRACE`` the trace's device time is measured and nothing is
    calibrated. The flags' parser is :func:`interlace.emulate.add_compute_arguments`.

    Args:
        args: ``interlace simulate``'s parsed flags.
        png_path: Where the plot goes (None: no plot).
    """
    return run_validation(config_from_args(args, png_path))
