"""Plots of benchmarks/kfac_race.py: accuracy against epochs and wall-clock, seeds shaded."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

NAMES = {"sgd": "SGD", "kfac": "K-FAC"}


def plot_spread(
    axis: Any, x: Sequence[float], per_x: Sequence[Sequence[float]], *, alpha: float, **line: Any
) -> None:
    """The median of several seeds' values at each x as a line, their min-max as a band.

    Args:
        axis: the matplotlib axes to draw on.
        x: the x positions.
        per_x: the seeds' values at each x.
        alpha: the band's opacity.
        **line: ``Axes.plot`` keywords for the median line (``color`` colours the band too).
    """
    lows, highs = [min(v) for v in per_x], [max(v) for v in per_x]
    axis.fill_between(x, lows, highs, color=line.get("color"), alpha=alpha, linewidth=0)
    axis.plot(x, [statistics.median(v) for v in per_x], **line)


def plot_race(entry: dict[str, Any], runs: Sequence[dict[str, Any]], path: Path) -> None:
    """Test accuracy of both picked configurations against epochs and against wall-clock.

    Median over the seeds, the band their min-max. On the wall-clock panel an epoch's point
    stands at the seeds' median cumulative training time to the end of that epoch.

    Args:
        entry: the model's summary (``model``, ``target``, ``sgd``, ``kfac``).
        runs: every run's record.
        path: the PNG to write.
    """
    import matplotlib  # noqa: PLC0415 - heavy import, only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after choosing the Agg backend

    colors = {"sgd": "tab:blue", "kfac": "tab:orange"}
    figure, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for optimizer in ("sgd", "kfac"):
        row = entry[optimizer]
        curves = [
            r
            for r in runs
            if r["model"] == entry["model"]
            and r["optimizer"] == optimizer
            and r["config"] == row["config"]
            and r["seed"] in row["seeds"]
        ]
        length = min(len(r["test_accuracy"]) for r in curves)
        if length == 0:
            continue
        accuracy = [[100 * r["test_accuracy"][e] for r in curves] for e in range(length)]
        seconds = [
            statistics.median(sum(r["epoch_s"][: e + 1]) for r in curves) for e in range(length)
        ]
        label = f"{NAMES[optimizer]} ({row['config']})"
        for axis, x in ((by_epoch, list(range(1, length + 1))), (by_time, seconds)):
            plot_spread(
                axis,
                x,
                accuracy,
                alpha=0.25,
                color=colors[optimizer],
                marker="o",
                markersize=2.5,
                label=label,
            )
    for axis in (by_epoch, by_time):
        axis.axhline(100 * entry["target"], color="black", linestyle="--", linewidth=1)
        axis.grid(alpha=0.3)
    by_epoch.set_xlabel("epoch")
    by_time.set_xlabel("training wall-clock (s, median over seeds)")
    by_epoch.set_ylabel("test accuracy (%)")
    by_epoch.legend(loc="lower right", fontsize=8)
    seeds = ", ".join(map(str, entry["sgd"]["seeds"]))
    figure.suptitle(
        f"{entry['model']} on MNIST-1D: target {100 * entry['target']:g}% (dashed); median of "
        f"seeds {seeds}, band min-max",
        fontsize=10,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
