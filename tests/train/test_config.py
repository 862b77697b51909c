"""The training config and schedule: impossible settings name their flag; warm-up then cosine."""

from __future__ import annotations

import math

import pytest

from interlace.errors import UsageError
from interlace.train import TrainConfig, WarmupCosine, applicable_settings, run_label


def test_schedule_warms_up_linearly_then_follows_a_cosine() -> None:
    total, warmup = 100, 10
    schedule = WarmupCosine(total, warmup)
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


@pytest.mark.parametrize(
    ("spec", "label"),
    [
        ("resnet20", "resnet20"),
        ("my_models:tiny", "my_models.tiny"),
        ("/data/cifar-10-batches-py/", "cifar-10-batches-py"),
        ("a b*c", "a_b_c"),
        ("/", "run"),
    ],
)
def test_run_label_is_a_folder_safe_short_form(spec: str, label: str) -> None:
    assert run_label(spec) == label


def test_a_plain_data_parallel_run_records_no_pipeline_or_kfac_setting() -> None:
    recorded = applicable_settings(TrainConfig())
    assert "strategy" in recorded and "channels" in recorded
    assert not {"schedule", "microbatches", "chunks", "spectrain_backward", "partition_by"} & set(
        recorded
    )
    assert not [key for key in recorded if key.startswith("kfac_")]


def test_a_kfac_run_records_its_kfac_settings() -> None:
    recorded = applicable_settings(TrainConfig(optimizer="kfac", kfac_damping=0.01))
    assert recorded["kfac_damping"] == 0.01
    assert {f"kfac_{name}" for name in ("inv_update_steps", "factor_decay", "kl_clip")} <= set(
        recorded
    )


@pytest.mark.parametrize(
    ("schedule", "present", "absent"),
    [
        ("gpipe", {"schedule", "microbatches", "partition_by"}, {"chunks", "spectrain_backward"}),
        ("spectrain", {"schedule", "chunks", "spectrain_backward"}, {"microbatches"}),
        ("pipedream", {"schedule", "chunks"}, {"microbatches", "spectrain_backward"}),
    ],
)
def test_a_pipelined_run_records_its_schedules_settings(
    schedule: str, present: set[str], absent: set[str]
) -> None:
    recorded = applicable_settings(TrainConfig(parallel="pipeline", schedule=schedule))
    assert present <= set(recorded)
    assert not (absent | {"strategy", "bucket_cap_mb", "channels", "compression"}) & set(recorded)
    assert not [key for key in recorded if key.startswith("kfac_")]


def test_deterministic_runs_need_a_channel_count() -> None:
    with pytest.raises(UsageError, match="--deterministic"):
        TrainConfig(deterministic=True, channels="auto").validate()
    TrainConfig(deterministic=True, channels=2).validate()
