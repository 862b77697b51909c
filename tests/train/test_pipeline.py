"""``interlace train --parallel pipeline``: the model cut over the ranks learns and reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from interlace import launch
from interlace.cli import main
from interlace.distenv import finish_distributed, init_distributed
from interlace.errors import UsageError
from interlace.runlog import read_metrics
from interlace.train import TrainConfig, TrainResult, train_pipeline

#: (schedule, chunks) of the runs that must learn.
RUNS = (("gpipe", 1), ("spectrain", 1), ("spectrain", 4))


def _config(schedule: str, chunks: int) -> TrainConfig:
    return TrainConfig(
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


def _train_each(root: str) -> list[TrainResult]:
    """One rank of every run in ``RUNS``, one after another in one process group (starting
    ranks costs more than a run); a run that fails is named in the error."""
    context = init_distributed()
    results = []
    try:
        for schedule, chunks in RUNS:
            config = _config(schedule, chunks)
            config.validate()
            try:
                results.append(train_pipeline(config, context, f"{root}/{schedule}-{chunks}"))
            except Exception as error:
                raise RuntimeError(f"the {schedule} run with {chunks} chunk(s) failed") from error
    finally:
        finish_distributed()
    return results


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[TrainResult]]]:
    """The runs' folder and each run's results by rank, from one 3-rank launch."""
    root = tmp_path_factory.mktemp("runs")
    values = launch.run(_train_each, 3, args=(str(root),), timeout=400).check().values
    return root, [[ranks[index] for ranks in values] for index in range(len(RUNS))]


@pytest.mark.timeout(460)  # the first sets up the shared launch
@pytest.mark.parametrize(("schedule", "chunks"), RUNS)
def test_a_pipelined_resnet_learns_digits(
    schedule: str, chunks: int, three_ranks: tuple[Path, list[list[TrainResult]]]
) -> None:
    root, runs = three_ranks
    run_dir = root / f"{schedule}-{chunks}"
    values = runs[RUNS.index((schedule, chunks))]
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
        ({"parallel": "pipeline", "stages": 0}, "--stages must be >= 1"),
        ({"stages": 2}, "--stages applies to --parallel pipeline"),
        ({"parallel": "pipeline", "stages": 2, "strategy": "ddp"}, "--strategy ddp"),
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


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["-n", "4", "--stages", "3"], "4 ranks cannot be cut into pipelines of 3 stages"),
        (["-n", "4", "--stages", "2", "--batch-size", "33"], "2 equal replica shards"),
        (["-n", "40", "--stages", "40"], "40 pipeline stages but the model has 11 blocks"),
    ],
)
def test_replicated_pipelines_refuse_layouts_that_do_not_fit_in_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--parallel", "pipeline", "--data", "digits", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def _train_replicated(root: str) -> TrainResult:
    context = init_distributed()
    try:
        config = TrainConfig(
            model="resnet20",
            data="digits",
            epochs=1,
            batch_size=32,
            parallel="pipeline",
            schedule="spectrain",
            stages=2,
            strategy="fixed",
            max_steps_per_epoch=12,
            progress=False,
        )
        config.validate()
        return train_pipeline(config, context, f"{root}/replicated")
    finally:
        finish_distributed()


@pytest.mark.timeout(300)
def test_two_stages_by_two_replicas_train_and_record_their_layout(tmp_path: Path) -> None:
    values = launch.run(_train_replicated, 4, args=(str(tmp_path),), timeout=240).check().values
    assert values[0].run_dir == str(tmp_path / "replicated")
    rows = read_metrics(tmp_path / "replicated" / "metrics.csv")
    assert rows[0]["samples_per_s"] > 0
    recorded = json.loads((tmp_path / "replicated" / "config.json").read_text())
    assert recorded["stages"] == 2 and recorded["strategy"] == "fixed"
    # Replicated, the default cut prices each stage's all-reduce (a cost model fitted first).
    assert recorded["partition_by"] == "auto"
