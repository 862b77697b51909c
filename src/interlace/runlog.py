"""A run folder: the configuration, per-epoch metrics as CSV, and a loss/accuracy picture.

Every training run leaves one folder that is enough to see what happened and to redo it:
``config.json`` (every option and the environment that matters), ``metrics.csv`` (one row per
epoch, appended as the run goes so a crash keeps what was measured) and ``curves.png``.
"""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

METRIC_COLUMNS = (
    "epoch",
    "train_loss",
    "test_loss",
    "test_accuracy",
    "samples_per_s",
    "epoch_s",
    "lr",
)
#: The columns a language model's run adds: ``exp`` of the mean loss per token.
PERPLEXITY_COLUMNS = ("train_perplexity", "test_perplexity")


def new_run_dir(root: str | Path, label: str) -> Path:
    """Create and return a fresh folder ``root/<label>-<timestamp>`` (suffixed if taken).

    Args:
        root: the folder of run folders (made if missing).
        label: the new folder's name before its timestamp.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{label}-{stamp}"
    path = base
    suffix = 1
    while path.exists():
        suffix += 1
        path = base.with_name(f"{base.name}-{suffix}")
    path.mkdir(parents=True)
    return path


class RunLog:
    """Writes one run's configuration, metrics and curves into ``path``.

    Args:
        path: the run folder (made if missing).
        config: written at once as ``config.json``.
        columns: the metrics' columns (default :data:`METRIC_COLUMNS`; a language model's run
            adds :data:`PERPLEXITY_COLUMNS`).
    """

    def __init__(
        self,
        path: str | Path,
        config: Mapping[str, Any],
        columns: Sequence[str] = METRIC_COLUMNS,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.columns = tuple(columns)
        self.rows: list[dict[str, float]] = []
        (self.path / "config.json").write_text(json.dumps(dict(config), indent=2, default=str))
        self._write_rows()

    @classmethod
    def resume(cls, path: str | Path, before_epoch: int) -> RunLog:
        """Continue the run folder ``path``: its config stays, its metrics up to an epoch.

        Rows of epoch ``before_epoch`` and later (recorded after the checkpoint the run resumes
        from) are dropped, since the resumed run records them again.

        Args:
            path: an existing run folder.
            before_epoch: the first epoch the resumed run trains.
        """
        log = cls.__new__(cls)
        log.path = Path(path)
        metrics = log.metrics_path
        rows = read_metrics(metrics) if metrics.exists() else []
        log.columns = METRIC_COLUMNS
        if metrics.exists():
            with metrics.open(newline="") as handle:
                log.columns = tuple(next(csv.reader(handle), METRIC_COLUMNS))
        log.rows = [row for row in rows if row["epoch"] < before_epoch]
        log._write_rows()
        return log

    def _write_rows(self) -> None:
        with self.metrics_path.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(self.columns)
            for row in self.rows:
                writer.writerow([_format(row[column]) for column in self.columns])

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.csv"

    @property
    def curves_path(self) -> Path:
        return self.path / "curves.png"

    def append(self, row: Mapping[str, float]) -> None:
        """Record one epoch; the CSV is flushed at once so a crash keeps every finished epoch.

        Args:
            row: a value for every column of the log (:attr:`columns`).

        Raises:
            KeyError: when a column is missing.
        """
        missing = [column for column in self.columns if column not in row]
        if missing:
            raise KeyError(f"metrics row lacks {missing}")
        clean = {column: float(row[column]) for column in self.columns}
        self.rows.append(clean)
        with self.metrics_path.open("a", newline="") as handle:
            csv.writer(handle).writerow([_format(clean[column]) for column in self.columns])

    def plot(self, title: str = "", reference: tuple[str, float] | None = None) -> Path:
        """Draw loss and test accuracy (or perplexity) against epochs into ``curves.png``.

        Args:
            title: the figure's title.
            reference: a labelled level drawn across the perplexity panel (a baseline).
        """
        plot_curves(self.rows, self.curves_path, title, reference)
        return self.curves_path


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Read a ``metrics.csv`` back as a list of rows of floats.

    Args:
        path: the ``metrics.csv`` file.
    """
    with Path(path).open(newline="") as handle:
        return [{key: float(value) for key, value in row.items()} for row in csv.DictReader(handle)]


def plot_curves(
    rows: Sequence[Mapping[str, float]],
    path: str | Path,
    title: str = "",
    reference: tuple[str, float] | None = None,
) -> None:
    """Loss (train and test) and test accuracy per epoch, side by side, as a PNG.

    Rows with perplexities (:data:`PERPLEXITY_COLUMNS`) show train and test perplexity instead
    of the accuracy.

    Args:
        rows: the epochs' metrics, as :meth:`RunLog.append` takes them.
        path: the PNG to write.
        title: the figure's title.
        reference: a labelled level drawn as a dashed line across the perplexity panel.
    """
    import matplotlib  # noqa: PLC0415 - heavy import, only when curves are drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after the backend is set

    epochs = [row["epoch"] for row in rows]
    figure, (loss_axes, accuracy_axes) = plt.subplots(
        1, 2, figsize=(10, 4), constrained_layout=True
    )
    loss_axes.plot(epochs, [row["train_loss"] for row in rows], marker="o", label="train")
    loss_axes.plot(epochs, [row["test_loss"] for row in rows], marker="o", label="test")
    loss_axes.set_xlabel("epoch")
    loss_axes.set_ylabel("cross-entropy loss")
    loss_axes.set_yscale("log")
    loss_axes.legend()
    loss_axes.grid(alpha=0.3)
    if rows and all(column in rows[0] for column in PERPLEXITY_COLUMNS):
        for column, label in zip(PERPLEXITY_COLUMNS, ("train", "test"), strict=True):
            accuracy_axes.plot(epochs, [row[column] for row in rows], marker="o", label=label)
        if reference is not None:
            accuracy_axes.axhline(reference[1], color="gray", linestyle="--", label=reference[0])
        accuracy_axes.set_ylabel("perplexity")
        accuracy_axes.set_yscale("log")
        accuracy_axes.legend()
    else:
        accuracy_axes.plot(
            epochs, [100.0 * row["test_accuracy"] for row in rows], marker="o", color="tab:green"
        )
        accuracy_axes.set_ylabel("test accuracy (%)")
        accuracy_axes.set_ylim(0, 100)
    accuracy_axes.set_xlabel("epoch")
    accuracy_axes.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _format(value: float) -> str:
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.6g}"
