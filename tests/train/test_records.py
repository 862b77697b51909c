"""The records every training job keeps: the checkpoint resumed, the run folder and its header."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from interlace.distenv import DistContext
from interlace.train import RunRecords, TrainConfig, open_run_log
from interlace.train.checkpoint import Position

ALONE = DistContext(0, 1, 0, torch.device("cpu"), "gloo")


def test_a_fresh_run_starts_at_the_first_step_and_prints_its_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = TrainConfig(model="mlp", save_every="2ep", progress=False)
    records = RunRecords(config, ALONE, str(tmp_path / "run"), resume=False)
    assert records.resumed is None and records.start == Position(1, 0, 0)
    assert records.saves is not None and records.saves.epochs and records.saves.count == 2
    log = records.open_log("n1", None, lambda path: f"training into {path}")
    assert log is not None and log.path == tmp_path / "run"
    assert capsys.readouterr().out.splitlines() == [f"training into {tmp_path / 'run'}"]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["model"] == "mlp"


def test_a_resumed_run_continues_from_its_last_save(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = TrainConfig(model="mlp", save_every="3", progress=False)
    first = RunRecords(config, ALONE, str(tmp_path / "run"), resume=False)
    first.open_log("n1", None, lambda path: "first")
    first.save(Position(1, 3, 3), {"weights": torch.arange(4)})

    again = RunRecords(config, ALONE, str(tmp_path / "run"), resume=True)
    assert again.resumed is not None and again.start == Position(1, 3, 3)
    assert torch.equal(again.resumed.state["weights"], torch.arange(4))
    capsys.readouterr()
    again.open_log("n1", None, lambda path: "second")
    header, resuming = capsys.readouterr().out.splitlines()
    assert header == "second" and resuming.startswith("resuming from ")
    bar = again.progress_bar(10)
    assert bar.n == 3 and bar.disable  # starts at the saved step; no terminal, no bar
    bar.close()


def test_a_generated_data_set_s_arguments_are_recorded_in_config_json(tmp_path: Path) -> None:
    context = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    source = {"generator": "mnist1d.data.make_dataset", "seed": 42, "num_samples": 5000}
    config = TrainConfig(data="mnist1d")
    log = open_run_log(config, context, str(tmp_path / "run"), "n1", data_source=source)
    assert log is not None
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["data_source"] == source and record["data"] == "mnist1d"
    fixed = open_run_log(TrainConfig(), context, str(tmp_path / "fixed"), "n1")
    assert fixed is not None
    assert "data_source" not in json.loads((tmp_path / "fixed" / "config.json").read_text())
