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
from interlace.cliutil import collective_timeout_of
from interlace.comm.calibrate import fit_cost_model, fit_stream_cost_model
from interlace.comm.cost import CostModel
from interlace.comm.links import parse_link
from interlace.comm.strategies import PLANNED_STRATEGIES, RUNTIME_STRATEGIES
from interlace.dp import DataParallel
from interlace.emulate import (
    Compute,
    EmulatedModel,
    add_compute_arguments,
    compute_from_args,
    dilate_rate,
)
from interlace.errors import UsageError
from interlace.launch import netem
from interlace.launch.rank import DEFAULT_COLLECTIVE_TIMEOUT_S
from interlace.profile import layer_forward_times
from interlace.sim.profiled import trace_from_plan
from interlace.sim.validate import (
    DEFAULT_LINKS,
    DEFAULT_MODELS,
    DEFAULT_RANKS,
    DEFAULT_STRATEGIES,
    ValidateSample,
    ValidationRow,
    format_summary,
    format_table,
    plot_validation,
    rows_from_sample,
)
from interlace.strategies import wrap_model
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
    cost = _undilated_cost(fit_cost_model(use_cache=False), compute.dilation)
    stream_cost = _undilated_cost(fit_stream_cost_model(), compute.dilation)
    measurement = undilated(measure_rank(replace(job, probe_contention=False)))
    trace = replace(module.named_trace(), workers=dist.get_world_size())
    return ValidateSample(trace, cost, stream_cost, measurement)


def _undilated_cost(cost: CostModel, dilation: float) -> CostModel:
    """``cost`` fitted on the dilated cluster, as the undilated cluster's (``a`` and ``b`` / D;
    the concurrency terms are dropped: validation plans on one channel)."""
    return CostModel(cost.a / dilation, cost.b / dilation)


@dataclass(frozen=True)
class ValidateConfig:
    """Every launch of a validation run and what to write.

    Args:
        models: Zoo names or ``package.module:callable``.
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


def run_validation(config: ValidateConfig) -> int:
    """Every (model, ranks, link) launch, the table, the summary; the exit status.

    Args:
        config: The launches and outputs.

    Raises:
        UsageError: Without root for the emulated cluster, or for an unknown link or model.
    """
    # A bad model or size is one line, wherever this runs (a trace names an emulated model).
    for model in () if config.compute.emulated else config.models:
        build_model(model, config.input_shape, config.num_classes)
    try:
        netem.check_available()
    except netem.NetemUnavailableError as exc:
        raise UsageError(
            f"{exc}; validation measures on the emulated cluster and needs root"
        ) from exc
    for link in config.links:
        parse_link(link)
    emulated = config.compute.emulated
    rank_code = validate_emulated_rank if emulated else validate_rank

    cache_dir = tempfile.mkdtemp(prefix="interlace-validate-")
    rows: list[ValidationRow] = []
    failures: list[str] = []
    launches = [(m, n, link) for m in config.models for n in config.ranks for link in config.links]
    try:
        with tqdm(total=len(launches), unit="launch", desc=PROG, dynamic_ncols=True) as bar:
            for model, nprocs, link in launches:
                bar.set_postfix_str(f"{model}, {nprocs} ranks, {link}")
                batch = config.batch_size or DEFAULT_BATCH.get(model, FALLBACK_BATCH)
                job = MeasureJob(
                    model,
                    batch,
                    config.input_shape,
                    config.strategies,
                    config.iters,
                    config.warmup,
                    config.rounds,
                    probe_contention=not emulated,
                    num_classes=config.num_classes,
                    compute=config.compute,
                )
                bench = _bench_config(config, nprocs)
                run_link = (
                    format_rate(dilate_rate(link, config.compute.dilation)) if emulated else link
                )
                try:
                    sample = launch_on_ranks(
                        rank_code,
                        job,
                        nprocs=bench.nprocs,
                        link=run_link,
                        timeout_s=bench.timeout_s,
                        collective_timeout_s=bench.collective_timeout_s,
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
                shown = f"{link} (emulated at {run_link})" if emulated else link
                new_rows = rows_from_sample(sample, shown, config.strategies)
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
        print(
            f"\ncompute: {config.compute.label()}"
            + (
                " (times undilated; no contention calibration)"
                if emulated
                else " (contention calibrated by the probes)"
            )
        )
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
    compute = compute_from_args(args)
    if compute.emulated and args.model:
        raise UsageError(
            "--model and --compute emulated:TRACE contradict each other: the trace is the model"
        )
    models = parse_names(args.model, None, "model", "model") if args.model else DEFAULT_MODELS
    if compute.emulated:
        assert compute.trace is not None
        path = Path(compute.trace)
        models = (path.stem if path.is_file() else compute.trace,)
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
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--compute`` and ``--dilation`` for ``interlace simulate --validate``.

    With ``--compute real`` (the default) the zoo models are profiled and the replay is
    calibrated by the contention probes (CPU compute fights communication for the cores);
    with ``--compute emulated:TRACE`` the trace's device time is measured and nothing is
    calibrated.

    Args:
        parser: ``interlace simulate``'s parser.
    """
    add_compute_arguments(parser)


def run(args: argparse.Namespace, png_path: Path | None) -> int:
    """``interlace simulate --validate`` with parsed ``args``; the exit status.

    Args:
        args: ``interlace simulate``'s parsed flags.
        png_path: Where the plot goes (None: no plot).
    """
    return run_validation(config_from_args(args, png_path))
