"""The main training job: data-parallel training that learns, records and reports."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from interlace import launch
from interlace.errors import UsageError
from interlace.runlog import read_metrics
from interlace.train import TrainConfig, TrainResult, _Schedule, train_rank


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


def test_schedule_warms_up_linearly_then_follows_a_cosine() -> None:
    total, warmup = 100, 10
    schedule = _Schedule(total, warmup)
    assert [schedule(step) for step in range(warmup)] == pytest.approx(
        [(step + 1) / (warmup + 1) for step in range(warmup)]
    )
    for step in (10, 35, 60, 99):
        expected = 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
        assert schedule(step) == pytest.approx(expected)
    assert schedule(warmup) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("epochs", 0, "--epochs"),
        ("batch_size", 0, "--batch-size"),
        ("lr", -0.1, "--lr"),
        ("momentum", 1.0, "--momentum"),
        ("max_steps_per_epoch", 0, "--max-steps-per-epoch"),
    ],
)
def test_impossible_settings_name_their_flag(field: str, value: float, flag: str) -> None:
    config = TrainConfig(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=flag):
        config.validate()
