"""Data-parallel training: a run that learns, records and reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from interlace import launch
from interlace.distenv import init_distributed
from interlace.runlog import read_metrics
from interlace.train import TrainConfig, TrainResult, train_data_parallel, train_rank
from interlace.train.checkpoint import latest_checkpoint, read_header


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
    recorded = json.loads((run_dir / "config.json").read_text())
    assert recorded["world_size"] == 2
    # Only settings that apply: no pipeline schedule, no K-FAC options for plain SGD.
    assert "schedule" not in recorded and not [k for k in recorded if k.startswith("kfac_")]


def _train_twice(config: TrainConfig, root: str) -> list[TrainResult]:
    context = init_distributed()
    results = [train_data_parallel(config, context, f"{root}/{run}") for run in ("a", "b")]
    dist.destroy_process_group()
    return results


def test_deterministic_runs_of_one_seed_give_the_same_numbers(tmp_path: Path) -> None:
    # Three ranks: an all-reduce of more than two adds in an order set by the bucket layout.
    config = TrainConfig(
        model="mlp",
        data="digits",
        epochs=2,
        batch_size=16,
        max_steps_per_epoch=10,
        deterministic=True,
        save_every="1ep",
        progress=False,
    )
    result = launch.run(_train_twice, 3, args=(config, str(tmp_path)), timeout=240).check()
    for first, second in result.values:
        assert first.final_train_loss == second.final_train_loss
        assert first.final_test_accuracy == second.final_test_accuracy
    a, b = (read_header(latest_checkpoint(tmp_path / run) or Path()) for run in ("a", "b"))
    for rank_a, rank_b in zip(a["ranks"], b["ranks"], strict=True):
        for name, weight in rank_a["model"].items():
            assert torch.equal(weight, rank_b["model"][name]), name
    recorded = json.loads((tmp_path / "a" / "config.json").read_text())
    assert recorded["deterministic"] is True
