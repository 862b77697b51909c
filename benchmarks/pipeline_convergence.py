"""Does weight prediction cancel the staleness of an asynchronous pipeline? Digits, 4 stages.

``python benchmarks/pipeline_convergence.py --json docs/pipeline/convergence.json --png
docs/pipeline/convergence.png``; prints each schedule's final test accuracy per seed and its gap
to GPipe (or to ``dp``, data parallelism on the same ranks at the same global batch and rate),
and draws the test-accuracy curves (see docs/notes/bench.md). ``--stages S`` runs replicated
pipelines of ``S`` stages.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from interlace import launch
from interlace.runlog import read_metrics
from interlace.train import PIPELINE_SCHEDULES, TrainConfig, train_rank

DEFAULT_SCHEDULES = ("gpipe", "spectrain", "pipedream", "naive")
#: Data parallelism over the same ranks, each at 1/-n of the global batch (MG-WFBP buckets).
DATA_PARALLEL = "dp"


def main() -> int:
    """Parse the flags, run every (schedule, seed), print the table, write the files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--nprocs", type=int, default=4, help="ranks (default 4)")
    parser.add_argument(
        "--stages", type=int, help="stages per pipeline, -n / --stages replicas (default -n)"
    )
    parser.add_argument("--model", default="resnet20", help="zoo model (default resnet20)")
    parser.add_argument("--epochs", type=int, default=8, help="epochs per run (default 8)")
    parser.add_argument("--batch-size", type=int, default=32, help="mini-batch (default 32)")
    parser.add_argument("--lr", type=float, default=0.5, help="peak learning rate (default 0.5)")
    parser.add_argument(
        "--chunks",
        type=int,
        default=1,
        help="pieces each mini-batch travels in through the asynchronous schedules (default 1)",
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument(
        "--schedules",
        default=",".join(DEFAULT_SCHEDULES),
        help=f"comma-separated, of {', '.join(PIPELINE_SCHEDULES)} and {DATA_PARALLEL} "
        "(default all but 1f1b and dp)",
    )
    parser.add_argument("--json", help="write every run's rows here")
    parser.add_argument("--png", help="draw the test-accuracy curves here")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="interlace-pipeline-") as runs:
        jobs = [(seed, schedule) for seed in seeds for schedule in schedules]
        for seed, schedule in tqdm(jobs, desc="runs", unit="run"):
            config = _config(args, seed, schedule, runs)
            config.validate()
            run_dir = Path(runs) / f"{schedule}-seed{seed}"
            run_started = time.perf_counter()
            launch.run(
                train_rank, args.nprocs, args=(config, str(run_dir)), output=io.StringIO()
            ).check()
            metrics = read_metrics(run_dir / "metrics.csv")
            rows.append(
                {
                    "model": args.model,
                    "schedule": schedule,
                    "seed": seed,
                    "stages": None if schedule == DATA_PARALLEL else args.stages or args.nprocs,
                    "ranks": args.nprocs,
                    "lr": args.lr,
                    "batch_size": args.batch_size,
                    "chunks": 1 if schedule in ("gpipe", "1f1b", DATA_PARALLEL) else args.chunks,
                    "test_accuracy": [m["test_accuracy"] for m in metrics],
                    "final_test_accuracy": metrics[-1]["test_accuracy"],
                    "samples_per_s": metrics[-1]["samples_per_s"],
                    "run_s": time.perf_counter() - run_started,
                }
            )
    total_s = time.perf_counter() - started
    layout = f"{args.stages or args.nprocs} stages x {args.nprocs // (args.stages or args.nprocs)}"
    print(
        f"\n{args.model} on digits pipelined over {layout} replica(s), mini-batch "
        f"{args.batch_size} (asynchronous: {args.chunks} chunk(s)), {args.epochs} epochs, "
        f"SGD lr {args.lr:g} momentum 0.9 "
        f"wd 5e-4, warm-up + cosine; seeds {', '.join(map(str, seeds))}\n"
    )
    print(_table(rows, schedules, seeds))
    print(f"\n{len(rows)} runs in {total_s:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.png:
        _plot(rows, schedules, args.png, f"{args.model}, {layout} replica(s), digits")
    return 0


def _config(args: argparse.Namespace, seed: int, schedule: str, runs: str) -> TrainConfig:
    """One run's config: a pipeline schedule, or data parallelism at the same global batch."""
    if schedule == DATA_PARALLEL:
        return TrainConfig(
            model=args.model,
            data="digits",
            epochs=args.epochs,
            batch_size=args.batch_size // args.nprocs,
            lr=args.lr,
            seed=seed,
            progress=False,
            runs_dir=runs,
        )
    return TrainConfig(
        model=args.model,
        data="digits",
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=seed,
        parallel="pipeline",
        schedule=schedule,
        chunks=args.chunks,
        stages=args.stages,
        progress=False,
        runs_dir=runs,
    )


def _median_final(rows: list[dict[str, Any]], schedule: str) -> float:
    return float(
        statistics.median(r["final_test_accuracy"] for r in rows if r["schedule"] == schedule)
    )


def _table(rows: list[dict[str, Any]], schedules: list[str], seeds: list[int]) -> str:
    base = DATA_PARALLEL if DATA_PARALLEL in schedules else "gpipe"
    reference = _median_final(rows, base) if base in schedules else None
    header = "| schedule | " + " | ".join(f"seed {s}" for s in seeds) + f" | median | vs {base} |"
    lines = [header, "|---|" + "---:|" * (len(seeds) + 2)]
    for schedule in schedules:
        by_seed = {r["seed"]: r["final_test_accuracy"] for r in rows if r["schedule"] == schedule}
        median = _median_final(rows, schedule)
        gap = "" if reference is None else f"{100 * (median - reference):+.2f} pt"
        cells = " | ".join(f"{100 * by_seed[s]:.2f}%" for s in seeds)
        lines.append(f"| {schedule} | {cells} | {100 * median:.2f}% | {gap} |")
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], schedules: list[str], path: str, title: str) -> None:
    import matplotlib  # noqa: PLC0415 - heavy import, only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after choosing the Agg backend

    figure, axes = plt.subplots(figsize=(7, 4.2))
    colors = dict(zip(schedules, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for schedule in schedules:
        curves = [r["test_accuracy"] for r in rows if r["schedule"] == schedule]
        for index, curve in enumerate(curves):
            axes.plot(
                range(1, len(curve) + 1),
                [100 * a for a in curve],
                color=colors[schedule],
                alpha=0.85,
                label=schedule if index == 0 else None,
            )
    axes.set_xlabel("epoch")
    axes.set_ylabel("test accuracy (%)")
    axes.set_ylim(bottom=max(0.0, axes.get_ylim()[0]))
    axes.set_title(title + " (one line per seed)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
