"""``interlace train --parallel pipeline``: the model cut over the ranks learns and reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from interlace import launch
from interlace.cli import main
from interlace.errors import UsageError
from interlace.runlog import read_metrics
from interlace.train import TrainConfig, TrainResult, train_rank


@pytest.mark.parametrize(("schedule", "chunks"), [("gpipe", 1), ("spectrain", 1), ("spectrain", 4)])
def test_a_pipelined_resnet_learns_digits(tmp_path: Path, schedule: str, chunks: int) -> None:
    config = TrainConfig(
        model="resnet20",
        data="digits",
        epochs=2,
        batch_size=32,
        parallel="pipeline",
        schedule=schedule,
        chunks=chunks,
        partition_by="params",
        progress=False,
    )
    run_dir = tmp_path / "run"
    result = launch.run(train_rank, 3, args=(config, str(run_dir)), timeout=180).check()
    values = result.values
    assert all(isinstance(v, TrainResult) for v in values)
    # Every stage reports the numbers the last stage measured.
    assert len({v.final_test_accuracy for v in values}) == 1
    assert values[0].run_dir == str(run_dir) and values[1].run_dir is None
    # Two epochs of digits are far better than chance (10%) on any schedule.
    assert values[0].final_test_accuracy > 0.5
    rows = read_metrics(run_dir / "metrics.csv")
    assert [row["epoch"] for row in rows] == [1, 2]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert all(row["samples_per_s"] > 0 for row in rows)
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"
    recorded = json.loads((run_dir / "config.json").read_text())
    assert recorded["schedule"] == schedule and "strategy" not in recorded


@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"parallel": "tensor"}, "--parallel"),
        ({"parallel": "pipeline", "schedule": "zigzag"}, "--schedule"),
        ({"parallel": "pipeline", "microbatches": 0}, "--microbatches"),
        ({"parallel": "pipeline", "schedule": "gpipe", "batch_size": 2}, "micro-batches"),
        ({"parallel": "pipeline", "partition_by": "luck"}, "--partition-by"),
        ({"parallel": "pipeline", "chunks": 0}, "--chunks"),
        ({"parallel": "pipeline", "schedule": "gpipe", "chunks": 2}, "--microbatches"),
        ({"parallel": "pipeline", "schedule": "naive", "batch_size": 2, "chunks": 4}, "chunks"),
    ],
)
def test_bad_pipeline_settings_name_their_flag(changes: dict[str, object], flag: str) -> None:
    config = TrainConfig(**changes)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=flag):
        config.validate()


def test_cli_rejects_an_unknown_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--parallel", "pipeline", "--schedule", "zigzag"])
    assert exit_info.value.code == 2
    assert "zigzag" in capsys.readouterr().err
