"""Data-parallel training: a run that learns, records and reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from interlace import launch
from interlace.runlog import read_metrics
from interlace.train import TrainConfig, TrainResult, train_rank


def test_two_ranks_learn_digits_and_write_the_run_folder(tmp_path: Path) -> None:
    config = TrainConfig(
        model="mlp",
        data="digits",
        epochs=3,
        batch_size=32,
        lr=0.01,
        warmup_epochs=0,
        progress=False,
    )
    run_dir = tmp_path / "run"
    result = launch.run(train_rank, 2, args=(config, str(run_dir)), timeout=180).check()

    first, second = result.values
    assert isinstance(first, TrainResult)
    # Both ranks report the same all-reduced numbers; only rank 0 owns the folder.
    assert first.final_test_accuracy == second.final_test_accuracy
    assert first.run_dir == str(run_dir) and second.run_dir is None
    # A 12-layer MLP sees 3 epochs of digits: far better than chance (10%).
    assert first.final_test_accuracy > 0.5

    rows = read_metrics(run_dir / "metrics.csv")
    assert [row["epoch"] for row in rows] == [1, 2, 3]
    assert all(0.0 <= row["test_accuracy"] <= 1.0 for row in rows)
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert all(row["samples_per_s"] > 0 for row in rows)
    assert rows[-1]["test_accuracy"] == pytest.approx(first.final_test_accuracy, rel=1e-5)
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert '"world_size": 2' in (run_dir / "config.json").read_text()
