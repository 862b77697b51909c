"""``interlace simulate --validate``: profile a model and measure its strategies on the emulated
cluster, one launch per (model, ranks, link), and compare with the simulator's predictions.

The comparison itself (rows, table, plot) is :mod:`interlace.sim.validate`.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from interlace.bench.dp import BenchConfig
from interlace.bench.dp_rank import REAL_COMPUTE, MeasureJob, build_module, measure_rank
from interlace.bench.dp_report import format_rate, undilated
from interlace.bench.harness import (
    DEFAULT_BATCH,
    DEFAULT_INPUT_SHAPE,
    FALLBACK_BATCH,
    NUM_CLASSES,
    Contender,
    LaunchFailedError,
    launch_on_ranks,
    max_over_ranks,
    parse_names,
    synthetic_batches,
    train_step,
)
from interlace.bench.launch_options import LaunchOptions
from interlace.bench.validate_kfac import kfac_validation_rows
from interlace.bench.validate_pipeline import pipeline_validation_rows
from interlace.cliutil import collective_timeout_of
from interlace.comm.calibrate import fit_cost_model, fit_stream_cost_model, stream_sizes_up_to
from interlace.comm.links import parse_link
from interlace.comm.strategies import PLANNED_STRATEGIES, RUNTIME_STRATEGIES
from interlace.dp import DataParallel
from interlace.emulate import (
    Compute,
    EmulatedModel,
    compute_from_args,
    dilate_rate,
    parse_compute,
    undilate_cost,
)
from interlace.errors import UsageError
from interlace.launch import netem
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
    format_prediction_table,
    format_run_summaries,
    format_summary,
    format_table,
    plot_validation,
    rows_from_sample,
)
from interlace.wrapping import wrap_model
from interlace.zoo import MODEL_NAMES, build_model

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
    rank = dist.get_rank()
    torch.manual_seed(job.seed)
    module = build_model(job.model, job.input_shape, job.num_classes)
    wrapper = wrap_model(module, "single", profile_steps=PROFILE_STEPS)
    assert isinstance(wrapper, DataParallel)
    optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.01, momentum=0.9)
    contender = Contender("single", wrapper, optimizer)
    batches = synthetic_batches(
        job.batch, job.input_shape, job.seed, rank, num_classes=job.num_classes
    )
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
    module = build_module(job.model, job.input_shape, compute)
    assert isinstance(module, EmulatedModel)
    cost = undilate_cost(fit_cost_model(use_cache=False), compute.dilation)
    total = sum(p.numel() * p.element_size() for p in module.parameters())
    stream_cost = undilate_cost(
        fit_stream_cost_model(sizes=stream_sizes_up_to(total)), compute.dilation
    )
    measurement = undilated(measure_rank(replace(job, probe_contention=False)))
    trace = replace(module.named_trace(), workers=dist.get_world_size())
    return ValidateSample(trace, cost, stream_cost, measurement)


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
    netem.require("validation measures on the emulated cluster and needs root")
    for link in config.links:
        parse_link(link)
    cache_dir = tempfile.mkdtemp(prefix="interlace-validate-")
    rows: list[ValidationRow] = []
    failures: list[str] = []
    launches = _launches(config)
    try:
        with tqdm(total=len(launches), unit="launch", desc=PROG, dynamic_ncols=True) as bar:
            for launch in launches:
                bar.set_postfix_str(launch.describe() + f", run {launch.run}")
                try:
                    new_rows = _launch_rows(config, launch, cache_dir, bar.write)
                except LaunchFailedError as exc:
                    failures.append(f"{launch.describe()}: {exc}")
                    bar.write(f"{PROG}: launch failed: {failures[-1]}")
                    bar.update(1)
                    continue
                new_rows = [replace(row, run=launch.run) for row in new_rows]
                rows.extend(new_rows)
                bar.write(
                    f"{launch.describe()}: "
                    + ", ".join(
                        f"{r.strategy} {r.predicted_s * 1e3:.1f}/{r.measured_s * 1e3:.1f} ms "
                        f"({r.error * 100:+.0f}%)"
                        for r in new_rows
                    )
                )
                bar.update(1)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    if rows:
        _print_rows(config, rows)
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


def _launch_rows(
    config: ValidateConfig, launch: _Launch, cache_dir: str, note: Callable[[str], None]
) -> list[ValidationRow]:
    """Run one launch and turn what it measured into rows.

    Raises:
        LaunchFailedError: When a rank fails or the launch times out.
    """
    compute = launch.compute
    shown = launch.link
    run_link = launch.link
    if compute.emulated:
        run_link = format_rate(dilate_rate(launch.link, compute.dilation))
        shown = f"{launch.link} (emulated at {run_link})"
    options = LaunchOptions(
        iters=config.iters,
        warmup=config.warmup,
        rounds=config.rounds,
        timeout_s=config.timeout_s,
        collective_timeout_s=config.collective_timeout_s,
        cache_dir=cache_dir,
        note=note,
    )
    if launch.family == "kfac":
        rows = kfac_validation_rows(compute, launch.nprocs, launch.link, options=options)
        return [replace(row, model=launch.model, link=shown) for row in rows]
    if launch.family == "pipeline":
        rows = pipeline_validation_rows(
            launch.model, compute, launch.nprocs, launch.link, PIPELINE_SCHEDULES, options=options
        )
        return [replace(row, link=shown) for row in rows]
    batch = config.batch_size or DEFAULT_BATCH.get(launch.model, FALLBACK_BATCH)
    job = MeasureJob(
        launch.model,
        batch,
        config.input_shape,
        config.strategies,
        config.iters,
        config.warmup,
        config.rounds,
        probe_contention=not compute.emulated,
        num_classes=config.num_classes,
        compute=compute,
    )
    bench = _bench_config(config, launch.nprocs)
    sample = launch_on_ranks(
        validate_emulated_rank if compute.emulated else validate_rank,
        job,
        nprocs=bench.nprocs,
        link=run_link,
        timeout_s=bench.timeout_s,
        collective_timeout_s=bench.collective_timeout_s,
        cache_dir=cache_dir,
        note=note,
        prog="interlace bench dp",
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
        return
    print(f"\ncompute: {config.compute.label()} (contention calibrated by the probes)")
    print(format_table(rows))
    print()
    print(format_summary(rows))


def _bench_config(config: ValidateConfig, nprocs: int) -> Any:
    return BenchConfig(
        models=config.models,
        strategies=config.strategies,
        ratios=(),
        nprocs=nprocs,
        iters=config.iters,
        warmup=config.warmup,
        rounds=config.rounds,
        input_shape=config.input_shape,
        num_classes=config.num_classes,
        batch_size=config.batch_size,
        link=None,
        netem=True,
        timeout_s=config.timeout_s,
        collective_timeout_s=config.collective_timeout_s,
        ref_link="1gbit",
        min_link="20mbit",
        max_link="2.5gbit",
        seed=0,
        json_path=None,
        png_path=None,
    )


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
    for model in () if compute.emulated else models:
        if ":" not in model and model not in MODEL_NAMES:
            raise UsageError(
                f"--model: unknown model {model!r}; choose from {', '.join(MODEL_NAMES)} or give "
                "package.module:callable"
            )
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
        collective_timeout_s=collective_timeout_of(args.collective_timeout),
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
