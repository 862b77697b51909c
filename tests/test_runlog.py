"""The run folder: config, metrics CSV written as the run goes, and the curves picture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from interlace.runlog import (
    METRIC_COLUMNS,
    PERPLEXITY_COLUMNS,
    RunLog,
    new_run_dir,
    read_metrics,
)


def _row(epoch: int) -> dict[str, float]:
    return {
        "epoch": epoch,
        "train_loss": 1.0 / epoch,
        "test_loss": 1.5 / epoch,
        "test_accuracy": 0.5 + 0.1 * epoch,
        "samples_per_s": 1000.0 + epoch,
        "epoch_s": 0.25,
        "lr": 0.1 / epoch,
    }


def test_rows_are_on_disk_after_each_append(tmp_path: Path) -> None:
    log = RunLog(tmp_path / "run", {"model": "mlp", "epochs": 3})
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {
        "model": "mlp",
        "epochs": 3,
    }
    for epoch in (1, 2, 3):
        log.append(_row(epoch))
        # Re-read from disk each time: a crash after this epoch must not lose it.
        back = read_metrics(log.metrics_path)
        assert len(back) == epoch
        assert back[-1] == pytest.approx(_row(epoch), rel=1e-5)
    assert log.metrics_path.read_text().splitlines()[0] == ",".join(METRIC_COLUMNS)


def test_a_row_missing_a_column_is_refused(tmp_path: Path) -> None:
    log = RunLog(tmp_path, {})
    row = _row(1)
    del row["test_accuracy"]
    with pytest.raises(KeyError, match="test_accuracy"):
        log.append(row)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    log = RunLog(tmp_path, {})
    for epoch in (1, 2):
        log.append(_row(epoch))
    path = log.plot("demo")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5_000


def test_new_run_dir_never_reuses_a_folder(tmp_path: Path) -> None:
    first = new_run_dir(tmp_path, "mlp-digits")
    second = new_run_dir(tmp_path, "mlp-digits")
    assert first != second
    assert first.is_dir() and second.is_dir()


def test_a_language_models_log_keeps_its_perplexity_columns_across_a_resume(
    tmp_path: Path,
) -> None:
    columns = (*METRIC_COLUMNS, *PERPLEXITY_COLUMNS)
    log = RunLog(tmp_path, {}, columns)
    for epoch in (1, 2):
        log.append({**_row(epoch), "train_perplexity": 9.0 / epoch, "test_perplexity": 8.0})
    with pytest.raises(KeyError, match="train_perplexity"):
        log.append(_row(3))
    assert log.plot("lm", reference=("unigram 25", 25.0)).read_bytes()[:4] == b"\x89PNG"
    resumed = RunLog.resume(tmp_path, before_epoch=2)
    assert resumed.columns == columns
    assert [row["train_perplexity"] for row in read_metrics(resumed.metrics_path)] == [9.0]
