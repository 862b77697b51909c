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
        ("warmup_steps", -1, "--warmup-steps"),
        ("clip_grad_norm", 0.0, "--clip-grad-norm"),
        ("clip_grad_norm", math.inf, "--clip-grad-norm"),
        ("precision", "fp16", "--precision"),
        ("seq_len", 16, "--seq-len applies to text data"),
        ("data_file", "notes.txt", "--data-file is the text file of --data text"),
        ("data", "text", "add --data-file PATH"),
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


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"data": "pydoc-topics"}, "the language-model job (--data pydoc-topics) trains data par"),
        ({"optimizer": "adamw"}, "--optimizer adamw trains data parallel"),
        ({"clip_grad_norm": 1.0}, "--clip-grad-norm and --precision bf16 apply to --parallel data"),
        ({"precision": "bf16"}, "--clip-grad-norm and --precision bf16 apply to --parallel data"),
    ],
)
def test_a_pipeline_refuses_what_it_cannot_train(changes: dict[str, object], needle: str) -> None:
    config = TrainConfig(parallel="pipeline", **changes)  # type: ignore[arg-type]
    with pytest.raises(UsageError) as info:
        config.validate()
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_an_adamw_run_records_no_momentum_and_only_the_text_settings_given() -> None:
    config = TrainConfig(model="gpt", data="pydoc-topics", optimizer="adamw", seq_len=64)
    config.validate()
    record = applicable_settings(config)
    assert "momentum" not in record and record["seq_len"] == 64
    assert "data_file" not in record and "clip_grad_norm" not in record
    assert record["precision"] == "fp32"
