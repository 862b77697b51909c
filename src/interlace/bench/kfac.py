"""``interlace bench kfac``: where a distributed K-FAC iteration spends its time, per model.

The breakdown times one configuration phase by phase; ``--ablation`` times SPD-KFAC's modes
side by side (:mod:`interlace.bench.kfac_rank`) and prints their rows
(:mod:`interlace.bench.kfac_report`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from interlace.bench.harness import (
    DEFAULT_INPUT_SHAPE,
    NUM_CLASSES,
    LaunchFailedError,
    add_timeout_arguments,
    check_netem,
    default_batch,
    launch_on_ranks,
    parse_names,
)
from interlace.bench.kfac_rank import (
    ABLATION_MODES,
    KFAC_PYTORCH_MODE,
    MEMORY_STEPS,
    AblationJob,
    KfacJob,
    measure_ablation_rank,
    measure_memory_rank,
    measure_rank,
)
from interlace.bench.kfac_report import (
    COLUMNS,
    AblationRow,
    KfacRow,
    ablation_rows,
    format_ablation_header,
    format_ablation_table,
    format_h2h_table,
    format_table,
    plot_ablation,
)
from interlace.cliutil import (
    add_deprecated_alias,
    add_model_shape_arguments,
    add_nprocs_argument,
    collective_timeout_of,
)
from interlace.comm.links import parse_link
from interlace.emulate.compute import Compute, add_compute_arguments, compute_from_args
from interlace.emulate.device import dilate_link
from interlace.errors import OptionError, UsageError
from interlace.kfac.options import check_placement
from interlace.kfac.placements import placement_from
from interlace.kfac.worker_groups import worker_count
from interlace.timeline import Event, Timeline
from interlace.zoo import build_model

PROG = "interlace bench kfac"
#: The mlp is left out by default: on 3x32x32 inputs its first layer's A factor is 3073 x 3073,
#: whose eigendecomposition alone takes seconds on a CPU (ask for it with --models mlp).
DEFAULT_MODELS: tuple[str, ...] = ("resnet20", "resnet32", "transformer")
DEFAULT_LINK = "1gbit"
DEFAULT_NPROCS = 4
DEFAULT_ITERS = 10
DEFAULT_WARMUP = 3
DEFAULT_TIMEOUT_S = 900.0
COMPARE_CHOICES = (KFAC_PYTORCH_MODE,)
#: How to get kfac-pytorch, which is not on PyPI.
KFAC_PYTORCH_INSTALL = "pip install git+https://github.com/gpauloski/kfac-pytorch"
DEFAULT_ABLATION_MODELS: tuple[str, ...] = ("resnet20", "resnet56", "vgg11", "transformer")


def _flag(option: str) -> str:
    """A K-FAC keyword as this command's flag: ``grad_worker_fraction``, ``--grad-worker-fraction``.

    Args:
        option: The keyword.
    """
    return "--" + option.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``interlace bench kfac``.

    Args:
        parser: The parser (or subcommand parser) to add them to.
    """
    parser.add_argument(
        "--models",
        help="comma-separated zoo names or package.module:callable "
        f"(default {','.join(DEFAULT_MODELS)}; with --ablation "
        f"{','.join(DEFAULT_ABLATION_MODELS)})",
    )
    parser.add_argument("--model", help="one model (zoo name or package.module:callable)")
    add_nprocs_argument(parser, default=DEFAULT_NPROCS, help_text="ranks")
    parser.add_argument(
        "--link", default=DEFAULT_LINK, help=f"emulated link per rank (default {DEFAULT_LINK})"
    )
    parser.add_argument(
        "--no-netem", action="store_true", help="plain loopback instead of the emulated cluster"
    )
    parser.add_argument(
        "--batch-size", type=int, help="per-rank batch (default: per model, as bench dp)"
    )
    add_deprecated_alias(parser, "--batch", "--batch-size", "batch_size", type=int)
    add_model_shape_arguments(parser, input_shape=DEFAULT_INPUT_SHAPE, classes=NUM_CLASSES)
    parser.add_argument("--iters", type=int, default=DEFAULT_ITERS, help="timed iterations")
    parser.add_argument(
        "--warmup", type=int, default=DEFAULT_WARMUP, help="untimed iterations before timing"
    )
    parser.add_argument(
        "--compute-method",
        choices=("eigen", "inverse"),
        default="eigen",
        help="how each factor is decomposed for preconditioning: eigendecomposition or inverse",
    )
    parser.add_argument(
        "--grad-worker-fraction",
        type=float,
        default=1.0,
        help="1 = COMM-OPT (default), 1/N = MEM-OPT, between = HYBRID",
    )
    parser.add_argument(
        "--factor-update-steps",
        type=int,
        default=1,
        help="all-reduce and fold the factors every K steps (default 1, so factor "
        "communication is in every iteration)",
    )
    parser.add_argument(
        "--inv-update-steps",
        type=int,
        default=1,
        help="decompose every K steps (default 1, so every phase shows in every iteration)",
    )
    parser.add_argument(
        "--placement",
        choices=("greedy", "round-robin", "lbp"),
        help="where decompositions are computed (default greedy, SC20/KAISA; not with "
        "--ablation, whose modes set it)",
    )
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="SPD-KFAC's ablation: the modes "
        + ", ".join(
            f"{mode} ({comm}, {fusion} fusion, {placement})"
            for mode, (comm, fusion, placement) in ABLATION_MODES.items()
        )
        + " side by side in one launch per model, with their speed-ups over dkfac",
    )
    parser.add_argument(
        "--compare",
        choices=COMPARE_CHOICES,
        help="with --ablation, also run kfac-pytorch's KFACPreconditioner (its defaults, the "
        f"same update intervals) side by side; needs it installed: {KFAC_PYTORCH_INSTALL}",
    )
    parser.add_argument(
        "--memory",
        nargs="?",
        const="all",
        metavar="MODES",
        help="with --ablation, also measure peak RSS per rank of every mode (or of the "
        "comma-separated MODES): one more launch per mode, the mode alone in fresh processes",
    )
    parser.add_argument("--seed", type=int, default=0, help="model and data seed")
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument(
        "--png",
        metavar="PATH",
        help="timeline of the first model's last iteration (PNG); with --ablation, bars of "
        "every mode's iteration time stacked by phase",
    )
    add_timeout_arguments(parser, DEFAULT_TIMEOUT_S)
    add_compute_arguments(parser)


def models_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """``--model``, else ``--models``, else the defaults (the ablation's with ``--ablation``).

    Args:
        args: The parsed flags (see :func:`add_arguments`).

    Raises:
        UsageError: When both ``--model`` and ``--models`` are given.
    """
    if args.model and args.models:
        raise UsageError("--model and --models contradict each other; give one of them")
    if args.model:
        return (args.model,)
    if args.models:
        return parse_names(args.models, None, "models", "model")
    return DEFAULT_ABLATION_MODELS if args.ablation else DEFAULT_MODELS


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; the exit status.

    Args:
        args: The parsed flags (see :func:`add_arguments`).
    """
    compute = compute_from_args(args)
    if compute.emulated and (args.model or args.models):
        raise UsageError(
            "--compute emulated:TRACE runs the trace's model; leave out --model/--models"
        )
    models = (str(compute.trace),) if compute.emulated else models_from_args(args)
    if args.nprocs < 1:
        raise UsageError(f"-n must be >= 1, got {args.nprocs}")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    collective_timeout_of(args.collective_timeout)
    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be >= 1 and --warmup >= 0")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.ablation:
        if args.placement is not None:
            raise UsageError("--placement is set by each --ablation mode; leave it out")
        if args.grad_worker_fraction != 1:
            raise UsageError("--ablation runs COMM-OPT (lbp needs it): --grad-worker-fraction 1")
        if args.nprocs < 2:
            raise UsageError(f"--ablation needs -n >= 2 (nothing is sent on {args.nprocs})")
    if args.memory and not args.ablation:
        raise UsageError("--memory measures the modes of --ablation; add --ablation")
    if args.memory and args.memory != "all":
        parse_names(args.memory, (*ABLATION_MODES, *COMPARE_CHOICES), "memory", "mode")
    if args.compare is not None:
        if not args.ablation:
            raise UsageError("--compare runs beside the modes of --ablation; add --ablation")
        check_kfac_pytorch()
    try:
        check_placement(placement_from(args.placement or "greedy"), args.grad_worker_fraction)
    except OptionError as error:
        raise UsageError(error.spelt(_flag, lambda name, value: f"{_flag(name)} {value}")) from None
    if args.inv_update_steps < 1:
        raise UsageError(f"--inv-update-steps must be >= 1, got {args.inv_update_steps}")
    if args.factor_update_steps < 1:
        raise UsageError(f"--factor-update-steps must be >= 1, got {args.factor_update_steps}")
    try:
        worker_count(args.grad_worker_fraction, args.nprocs)
    except ValueError as exc:
        raise UsageError(f"--grad-worker-fraction: {exc}") from None
    # A bad model or size is one line here, not a traceback per rank (a trace is no zoo model).
    for model in () if compute.emulated else models:
        build_model(model, tuple(args.input_shape), args.classes)
    link: str | None = None
    if not args.no_netem:
        parse_link(args.link)
        check_netem()
        # Emulated compute runs D times slower, and so must its links.
        link = dilate_link(args.link, compute.dilation) if compute.emulated else args.link
    args.link_text = args.link if link is not None else "loopback"
    if args.ablation:
        return _run_ablation(args, models, link, compute)
    return _run_breakdown(args, models, link, compute)


def undilated(medians: dict[str, Any], dilation: float) -> dict[str, Any]:
    """Every time in a launch's medians (nested by mode or not) divided by ``dilation``.

    Args:
        medians: Seconds by key, or by mode and key.
        dilation: The run's dilation (1 for real compute).
    """
    return {
        key: undilated(value, dilation) if isinstance(value, dict) else value / dilation
        for key, value in medians.items()
    }


def check_kfac_pytorch() -> None:
    """Raise :class:`UsageError`, saying how to install it, unless kfac-pytorch is importable."""
    try:
        found = importlib.util.find_spec("kfac.preconditioner") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise UsageError(
            "--compare kfac-pytorch needs kfac-pytorch, which is not installed (it is not on "
            f"PyPI): {KFAC_PYTORCH_INSTALL}, then run again"
        )


def _launch(
    fn: Any, job: Any, args: argparse.Namespace, link: str | None, note: Callable[[str], None]
) -> Any:
    """Rank 0's value of ``fn(job)`` on the ranks, or the failure as a string (the shared
    launcher's retry rule: :func:`interlace.bench.harness.launch_on_ranks`)."""
    try:
        return launch_on_ranks(
            fn,
            job,
            nprocs=args.nprocs,
            link=link,
            timeout_s=args.timeout,
            collective_timeout_s=collective_timeout_of(args.collective_timeout),
            note=note,
            prog=PROG,
        )
    except LaunchFailedError as exc:
        return str(exc)


def _run_ablation(
    args: argparse.Namespace, models: Sequence[str], link: str | None, compute: Compute
) -> int:
    rows: list[AblationRow] = []
    failures: list[str] = []
    link_text = args.link_text
    with tqdm(total=len(models), unit="model", desc=PROG, dynamic_ncols=True) as bar:
        for model in models:
            bar.set_postfix_str(model)
            job = AblationJob(
                model=model,
                batch=args.batch_size or default_batch(model),
                input_shape=tuple(args.input_shape),
                seed=args.seed,
                iters=args.iters,
                warmup=args.warmup,
                compute_method=args.compute_method,
                factor_update_steps=args.factor_update_steps,
                inv_update_steps=args.inv_update_steps,
                modes=tuple(ABLATION_MODES) + ((args.compare,) if args.compare else ()),
                num_classes=args.classes,
                compute=compute,
            )
            value = _launch(measure_ablation_rank, job, args, link, bar.write)
            bar.update(1)
            if isinstance(value, str):
                failures.append(f"{model}: {value}")
                bar.write(failures[-1])
                continue
            value["medians"] = undilated(value["medians"], compute.dilation)
            if args.memory:
                value["memory"] = _measure_memory(job, args, link, bar.write, failures)
            new_rows = ablation_rows(
                model,
                value,
                compute=compute.label(),
                ranks=args.nprocs,
                link=link_text,
                batch=job.batch,
                factor_update_steps=job.factor_update_steps,
                inv_update_steps=job.inv_update_steps,
                iters=job.iters,
            )
            rows += new_rows
            for line in format_ablation_table(new_rows).splitlines()[2:]:
                bar.write(line)
    header = format_ablation_header(
        rows,
        ranks=args.nprocs,
        link=link_text,
        compute_method=args.compute_method,
        iters=args.iters,
        compute=compute.label(),
    )
    print(f"\n{header}\n")
    print(format_ablation_table(rows))
    if args.compare is not None:
        print(
            f"\nAgainst {args.compare}: whole cycles of {args.inv_update_steps} iteration(s) "
            "(mean of each iteration's slowest rank; phases likewise) beside the per-step median"
            + (
                "; peak RSS of each mode alone in fresh processes, after its plans are final "
                f"and at least {MEMORY_STEPS} steps, and as many as any mode measured before it"
                if args.memory
                else ""
            )
            + ":\n"
        )
        print(format_h2h_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([row.to_dict() for row in rows], indent=1) + "\n")
        print(f"\nrows written to {args.json}")
    if args.png and rows:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        plot_ablation(
            rows,
            args.png,
            title=f"SPD-KFAC ablation: iteration time by phase, {args.nprocs} ranks on {link_text}",
        )
        print(f"chart written to {args.png}")
    for failure in failures:
        print(f"{PROG}: {failure}")
    return 1 if failures else 0


def _measure_memory(
    job: AblationJob,
    args: argparse.Namespace,
    link: str | None,
    note: Callable[[str], None],
    failures: list[str],
) -> dict[str, dict[str, float]]:
    """Each mode's peak RSS, one launch per mode (:func:`measure_memory_rank`); a failed
    launch is added to ``failures`` and leaves its mode out.

    Peak RSS climbs with the steps taken, so each launch takes at least as many steps as any
    launch before it; the modes run in ``job.modes`` order, the compared peer last."""
    memory: dict[str, dict[str, float]] = {}
    wanted = job.modes if args.memory == "all" else parse_names(args.memory, None, "memory", "mode")
    steps = MEMORY_STEPS
    for mode in (mode for mode in job.modes if mode in wanted):
        launch = replace(job, modes=(mode,), memory_steps=steps)
        value = _launch(measure_memory_rank, launch, args, link, note)
        if isinstance(value, str):
            failures.append(f"{job.model} {mode} memory: {value}")
            note(failures[-1])
            continue
        memory[mode] = value
        steps = max(steps, int(value["steps"]))
    return memory


def _run_breakdown(
    args: argparse.Namespace, models: Sequence[str], link: str | None, compute: Compute
) -> int:
    placement = args.placement or "greedy"
    rows: list[KfacRow] = []
    failures: list[str] = []
    events: list[dict[str, Any]] = []
    with tqdm(total=len(models), unit="model", desc=PROG, dynamic_ncols=True) as bar:
        for index, model in enumerate(models):
            bar.set_postfix_str(model)
            job = KfacJob(
                model=model,
                batch=args.batch_size or default_batch(model),
                input_shape=tuple(args.input_shape),
                seed=args.seed,
                iters=args.iters,
                warmup=args.warmup,
                compute_method=args.compute_method,
                grad_worker_fraction=args.grad_worker_fraction,
                inv_update_steps=args.inv_update_steps,
                timeline=bool(args.png) and index == 0,
                placement=placement,
                factor_update_steps=args.factor_update_steps,
                num_classes=args.classes,
                compute=compute,
            )
            value = _launch(measure_rank, job, args, link, bar.write)
            bar.update(1)
            if isinstance(value, str):
                failures.append(f"{model}: {value}")
                bar.write(failures[-1])
                continue
            medians = undilated(value["medians"], compute.dilation)
            rows.append(
                KfacRow(
                    model=model,
                    ranks=args.nprocs,
                    link=args.link_text,
                    compute=compute.label(),
                    batch=job.batch,
                    compute_method=job.compute_method,
                    grad_worker_fraction=job.grad_worker_fraction,
                    inv_update_steps=job.inv_update_steps,
                    placement=job.placement,
                    layers=value["layers"],
                    iteration_ms=medians["iteration"] * 1e3,
                    phases_ms={key: medians[key] * 1e3 for key, _ in COLUMNS},
                    factor_update_steps=job.factor_update_steps,
                )
            )
            if job.timeline:
                events = value["events"]
            bar.write(format_table(rows[-1:]).splitlines()[-1])
    print(
        f"\nK-FAC phase breakdown ({args.compute_method}, grad_worker_fraction "
        f"{args.grad_worker_fraction:g}, {placement} placement, "
        + (
            f"factors every {args.factor_update_steps} steps, "
            if args.factor_update_steps != 1
            else ""
        )
        + f"decompositions every {args.inv_update_steps} step(s)), "
        f"{args.nprocs} ranks on {args.link_text}, compute {compute.label()}"
        + (f" (links at {link}, times undilated)" if compute.emulated and link else "")
        + "; per-rank batch per model "
        f"({', '.join(f'{r.model} {r.batch}' for r in rows)}); medians over {args.iters} "
        "iterations of the maximum over ranks:\n"
    )
    print(format_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([row.to_dict() for row in rows], indent=1) + "\n")
        print(f"\nrows written to {args.json}")
    if args.png and events:
        timeline = Timeline(
            [Event(**event) for event in events],
            title=f"{rows[0].model}: DataParallel + K-FAC, one iteration, "
            f"{args.nprocs} ranks on {link or 'loopback'}",
        )
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        timeline.to_png(args.png)
        chrome_trace = Path(args.png).with_suffix(".json")
        timeline.to_chrome_trace(chrome_trace)
        print(f"timeline written to {args.png} (Chrome trace: {chrome_trace})")
    for failure in failures:
        print(f"{PROG}: {failure}")
    return 1 if failures else 0
