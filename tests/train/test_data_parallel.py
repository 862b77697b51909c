"""Data-parallel training: a run that learns, records and reports."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

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


def _language_model(**changes: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "model": "gpt",
        "data": "pydoc-topics",
        "seq_len": 32,
        "epochs": 2,
        "batch_size": 4,
        "max_steps_per_epoch": 4,
        "optimizer": "adamw",
        "lr": 3e-3,
        "warmup_steps": 2,
        "clip_grad_norm": 1.0,
        "progress": False,
    }
    base.update(changes)
    return TrainConfig(**base)


def _train_each(configs: list[TrainConfig], root: str) -> list[TrainResult]:
    context = init_distributed()
    results = [
        train_data_parallel(config, context, f"{root}/{index}")
        for index, config in enumerate(configs)
    ]
    dist.destroy_process_group()
    return results


def test_two_ranks_train_the_language_model_with_adamw_bf16_and_kfac(tmp_path: Path) -> None:
    configs = [
        _language_model(precision="bf16"),
        _language_model(optimizer="kfac", lr=0.05, strategy="overlap"),
    ]
    result = launch.run(_train_each, 2, args=(configs, str(tmp_path)), timeout=240).check()
    first, _ = result.values
    for index, outcome in enumerate(first):
        assert outcome.final_test_perplexity is not None and outcome.unigram_perplexity
        rows = read_metrics(tmp_path / str(index) / "metrics.csv")
        assert [row["epoch"] for row in rows] == [1, 2]
        for row in rows:
            assert row["test_perplexity"] == pytest.approx(math.exp(row["test_loss"]), rel=1e-5)
            assert row["train_perplexity"] == pytest.approx(math.exp(row["train_loss"]), rel=1e-5)
        # Eight steps from random bytes (perplexity 256): on the way down, AdamW the faster
        # (K-FAC's KL-clip keeps its first steps small).
        assert rows[-1]["test_perplexity"] < (100 if index == 0 else 200)
        assert outcome.final_test_perplexity == pytest.approx(rows[-1]["test_perplexity"], rel=1e-5)
    # The unigram baseline is the corpus's, whatever the model: the same in both runs.
    assert first[0].unigram_perplexity == pytest.approx(25.706, abs=1e-3)
    assert first[1].unigram_perplexity == first[0].unigram_perplexity
    recorded = json.loads((tmp_path / "0" / "config.json").read_text())
    assert recorded["precision"] == "bf16" and "momentum" not in recorded


def test_overlap_and_ddp_give_the_same_language_model_losses(tmp_path: Path) -> None:
    # Four ranks: an all-reduce of more than two adds in an order its bucket layout sets, and
    # --deterministic gives the overlap DDP's buckets.
    configs = [
        _language_model(strategy=strategy, deterministic=True, seq_len=16, max_steps_per_epoch=3)
        for strategy in ("overlap", "ddp")
    ]
    launch.run(_train_each, 4, args=(configs, str(tmp_path)), timeout=240).check()
    overlap, ddp = (read_metrics(tmp_path / run / "metrics.csv") for run in ("0", "1"))
    for a, b in zip(overlap, ddp, strict=True):
        for column in ("train_loss", "test_loss"):
            assert a[column] == pytest.approx(b[column], rel=1e-6), column
