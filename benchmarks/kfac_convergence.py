"""Does K-FAC reach a target accuracy in fewer epochs than SGD? Digits, resnet20 and mlp.

``python benchmarks/kfac_convergence.py --json docs/kfac/convergence.json --png
docs/kfac/convergence.png`` (about 7 minutes on 2 cores); prints epochs to the target per seed,
final accuracies and training time (see docs/notes/bench.md).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from interlace import launch
from interlace.runlog import read_metrics
from interlace.train import OPTIMIZERS, TrainConfig, train_rank

#: K-FAC settings chosen for this small problem (11 steps per epoch at 4 ranks x 32) on seed 0
#: from the grid in docs/kfac/convergence.md: decompositions every 10 steps (as kfac-pytorch's
#: examples) cost half as much as every step and reached 97% no later; damping 0.03 with a
#: KL-clip of 1e-4 reached 97% soonest of the settings that did not relapse mid-run on resnet20
#: (kfac-pytorch's 0.001-0.003 / 1e-3 fall back to 65-80% while lr is near its peak).
DEFAULT_DAMPING = 0.03
DEFAULT_INV_UPDATE_STEPS = 10
DEFAULT_FACTOR_UPDATE_STEPS = 1
DEFAULT_KL_CLIP = 0.0001
DEFAULT_FACTOR_DECAY = 0.95
DEFAULT_G_NORMALIZATION = "kfac-pytorch"


def main() -> int:
    """Parse the flags, run every (model, seed, optimiser), print the tables, write the files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--nprocs", type=int, default=4, help="ranks (default 4)")
    parser.add_argument(
        "--models", default="resnet20,mlp", help="comma-separated zoo models (default resnet20,mlp)"
    )
    parser.add_argument("--epochs", type=int, default=12, help="epochs per run (default 12)")
    parser.add_argument(
        "--strategy",
        default="mgwfbp",
        help="gradient averaging (default mgwfbp, the job's; its buckets follow measured times, "
        "so resnet20 runs of one seed differ slightly from run to run)",
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument(
        "--optimizers", default="sgd,kfac", help="comma-separated: sgd, kfac (default both)"
    )
    parser.add_argument(
        "--target", type=float, default=0.97, help="test accuracy to reach (default 0.97)"
    )
    parser.add_argument("--kfac-damping", type=float, default=DEFAULT_DAMPING)
    parser.add_argument("--kfac-inv-update-steps", type=int, default=DEFAULT_INV_UPDATE_STEPS)
    parser.add_argument("--kfac-factor-update-steps", type=int, default=DEFAULT_FACTOR_UPDATE_STEPS)
    parser.add_argument(
        "--kfac-kl-clip", type=float, default=DEFAULT_KL_CLIP, help="0 turns the clip off"
    )
    parser.add_argument("--kfac-factor-decay", type=float, default=DEFAULT_FACTOR_DECAY)
    parser.add_argument(
        "--kfac-g-normalization",
        choices=("kfac-pytorch", "per-example"),
        default=DEFAULT_G_NORMALIZATION,
    )
    parser.add_argument(
        "--lr", type=float, default=0.1, help="peak learning rate of both optimisers (0.1)"
    )
    parser.add_argument(
        "--weight-decay",
        type=float,
        default=TrainConfig().weight_decay,
        help="weight decay of both optimisers (default: the job's, 5e-4)",
    )
    parser.add_argument("--json", metavar="PATH", help="write one row per run as a JSON list")
    parser.add_argument("--png", metavar="PATH", help="draw test accuracy against epochs")
    args = parser.parse_args()
    models = [part.strip() for part in args.models.split(",") if part.strip()]
    seeds = [int(part) for part in args.seeds.split(",")]
    optimizers = [part.strip() for part in args.optimizers.split(",") if part.strip()]
    unknown = sorted(set(optimizers) - set(OPTIMIZERS))
    if unknown:
        parser.error(f"unknown --optimizers {', '.join(unknown)}; choose from sgd, kfac")

    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="interlace-kfac-convergence-") as runs:
        jobs = [(m, s, o) for m in models for s in seeds for o in optimizers]
        for model, seed, optimizer in tqdm(jobs, unit="run", desc="kfac convergence"):
            config = TrainConfig(
                model=model,
                data="digits",
                epochs=args.epochs,
                strategy=args.strategy,
                seed=seed,
                optimizer=optimizer,
                kfac_damping=args.kfac_damping,
                kfac_inv_update_steps=args.kfac_inv_update_steps,
                kfac_factor_update_steps=args.kfac_factor_update_steps,
                kfac_kl_clip=args.kfac_kl_clip,
                kfac_factor_decay=args.kfac_factor_decay,
                kfac_g_normalization=args.kfac_g_normalization,
                lr=args.lr,
                weight_decay=args.weight_decay,
                progress=False,
                runs_dir=runs,
            )
            config.validate()
            run_dir = Path(runs) / f"{model}-{optimizer}-seed{seed}"
            run_started = time.perf_counter()
            launch.run(
                train_rank, args.nprocs, args=(config, str(run_dir)), output=io.StringIO()
            ).check()
            run_s = time.perf_counter() - run_started
            rows.append(_row(config, args.nprocs, read_metrics(run_dir / "metrics.csv"), run_s))
    total_s = time.perf_counter() - started

    job = TrainConfig()  # the schedule both optimisers share: the job's defaults
    for row in rows:
        row["epochs_to_target"] = _epochs_to(row["test_accuracy"], args.target)
        row["target"] = args.target
    print(
        f"\ndigits, {args.nprocs} ranks x batch {job.batch_size}, {args.epochs} epochs, "
        f"{args.strategy}, SGD lr {args.lr:g} momentum {job.momentum:g} wd {args.weight_decay:g}, "
        f"{job.warmup_epochs:g} warm-up epoch(s) + cosine; K-FAC damping {args.kfac_damping}, "
        f"inv_update_steps {args.kfac_inv_update_steps}, factor_update_steps "
        f"{args.kfac_factor_update_steps}, kl_clip {args.kfac_kl_clip or 'off'}, factor_decay "
        f"{args.kfac_factor_decay}; seeds {', '.join(map(str, seeds))}\n"
    )
    print(_table(rows, models, optimizers, args.target))
    print(f"\n{len(rows)} runs in {total_s:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.png:
        _plot(rows, models, optimizers, args.target, args.png)
    return 0


def _row(
    config: TrainConfig, nprocs: int, metrics: list[dict[str, float]], run_s: float
) -> dict[str, Any]:
    """One run's record: its settings and its per-epoch curve (from metrics.csv)."""
    kfac = config.optimizer == "kfac"
    return {
        "model": config.model,
        "optimizer": config.optimizer,
        "seed": config.seed,
        "nprocs": nprocs,
        "strategy": config.strategy,
        "epochs": config.epochs,
        "batch_size": config.batch_size,
        "lr": config.lr,
        "momentum": config.momentum,
        "weight_decay": config.weight_decay,
        "warmup_epochs": config.warmup_epochs,
        "kfac": {
            "damping": config.kfac_damping,
            "inv_update_steps": config.kfac_inv_update_steps,
            "factor_update_steps": config.kfac_factor_update_steps,
            "kl_clip": config.kfac_kl_clip or None,
            "factor_decay": config.kfac_factor_decay,
            "compute_method": config.kfac_compute_method,
        }
        if kfac
        else None,
        "test_accuracy": [row["test_accuracy"] for row in metrics],
        "train_loss": [row["train_loss"] for row in metrics],
        "epoch_s": [row["epoch_s"] for row in metrics],
        "final_test_accuracy": metrics[-1]["test_accuracy"],
        "train_s": sum(row["epoch_s"] for row in metrics),
        "run_s": run_s,
    }


def _epochs_to(accuracies: list[float], target: float) -> int | None:
    """The first epoch (1-based) whose test accuracy is at least ``target``; None if none is."""
    return next((epoch for epoch, acc in enumerate(accuracies, 1) if acc >= target), None)


def _median_epochs(values: list[int | None]) -> float | None:
    """Median epochs to target, a run that never reached it counting as infinitely many.

    None when that median is itself "never": more than half the seeds did not reach it.
    """
    median = statistics.median(math.inf if v is None else float(v) for v in values)
    return None if math.isinf(median) else median


def _table(
    rows: list[dict[str, Any]], models: list[str], optimizers: list[str], target: float
) -> str:
    """The markdown table: per model and optimiser, epochs to target and final accuracy."""
    label = f"{100 * target:g}%"
    lines = [
        f"| model | optimizer | epochs to {label} per seed | median | final test acc per seed (%) "
        "| median (%) | training s per run (median) | s to "
        f"{label} (median) |",
        "|---|---|---|---:|---|---:|---:|---:|",
    ]
    for model in models:
        for optimizer in optimizers:
            runs = [r for r in rows if r["model"] == model and r["optimizer"] == optimizer]
            if not runs:
                continue
            reached = [r["epochs_to_target"] for r in runs]
            median = _median_epochs(reached)
            finals = [100 * r["final_test_accuracy"] for r in runs]
            seconds_to = [
                math.inf if e is None else sum(r["epoch_s"][:e])
                for r, e in zip(runs, reached, strict=True)
            ]
            median_s_to = statistics.median(seconds_to)
            lines.append(
                f"| {model} | {'K-FAC + SGD' if optimizer == 'kfac' else 'SGD'} | "
                + ", ".join("not reached" if e is None else str(e) for e in reached)
                + f" | {'not reached' if median is None else f'{median:g}'} | "
                + ", ".join(f"{a:.2f}" for a in finals)
                + f" | {statistics.median(finals):.2f} | "
                f"{statistics.median(r['train_s'] for r in runs):.1f} | "
                + ("not reached" if math.isinf(median_s_to) else f"{median_s_to:.1f}")
                + " |"
            )
    return "\n".join(lines)


def _plot(
    rows: list[dict[str, Any]], models: list[str], optimizers: list[str], target: float, path: str
) -> None:
    """Test accuracy against epochs: median over seeds with a min-max band, a column per model.

    The top row shows the whole climb; the bottom row zooms into 90-100%, where the target line
    is and where the curves' differences are a few test samples (one is 0.28% of digits' 359).
    """
    import matplotlib  # noqa: PLC0415 - heavy import, only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after choosing the Agg backend

    from kfac_race_plot import plot_spread  # noqa: PLC0415 - this script's folder, with matplotlib

    colors = {"sgd": "tab:blue", "kfac": "tab:orange"}
    names = {"sgd": "SGD + momentum", "kfac": "K-FAC + SGD + momentum"}
    figure, axes = plt.subplots(
        2,
        len(models),
        figsize=(5.5 * len(models), 7.0),
        squeeze=False,
        sharex="col",
        gridspec_kw={"height_ratios": [3, 2]},
    )
    seeds = sorted({r["seed"] for r in rows})
    for column, model in enumerate(models):
        for axis in axes[:, column]:
            for optimizer in optimizers:
                curves = [
                    r["test_accuracy"]
                    for r in rows
                    if r["model"] == model and r["optimizer"] == optimizer
                ]
                if not curves:
                    continue
                epochs = list(range(1, min(len(c) for c in curves) + 1))
                per_epoch = [[100 * c[e - 1] for c in curves] for e in epochs]
                plot_spread(
                    axis,
                    epochs,
                    per_epoch,
                    alpha=0.2,
                    color=colors[optimizer],
                    marker="o",
                    markersize=3,
                    label=names[optimizer],
                )
            axis.axhline(100 * target, color="black", linestyle="--", linewidth=1)
            axis.grid(alpha=0.3)
        top, zoom = axes[0, column], axes[1, column]
        top.set_title(f"{model} on digits")
        top.set_ylim(0, 101)
        top.text(1, 100 * target - 1, f"{100 * target:g}%", fontsize=8, va="top")
        zoom.set_ylim(90, 100)
        zoom.set_xlabel("epoch")
    axes[0, 0].set_ylabel("test accuracy (%)")
    axes[1, 0].set_ylabel("test accuracy (%), 90-100")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    figure.legend(
        handles,
        [
            f"{label}: median of seeds {', '.join(map(str, seeds))}, band min-max"
            for label in labels
        ],
        loc="lower center",
        ncol=len(labels),
        fontsize=9,
        frameon=False,
    )
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
