"""``interlace train``'s K-FAC flags: one per ``interlace.KFAC`` keyword, checked and kept."""

from __future__ import annotations

import argparse
import inspect
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from interlace import KFAC, cli, launch
from interlace.distenv import DistContext
from interlace.errors import UsageError
from interlace.kfac import AssignmentStrategy, ComputeMethod, KFACPreconditioner
from interlace.launch import LaunchResult
from interlace.runlog import read_metrics
from interlace.train import TrainConfig, applicable_settings, make_kfac
from interlace.train.checkpoint import Position, latest_checkpoint, save_checkpoint
from interlace.train.command import add_arguments
from interlace.train.kfac_options import kfac_keywords, kfac_options

#: Keywords of KFACPreconditioner (KFAC's and the ones it maps) that ``interlace train``
#: deliberately has no flag for, and why.
NOT_EXPOSED = {
    "model": "the job builds it from --model (and wraps it for --strategy)",
    "process_group": "a live object: the job's default group, every rank of -n",
    "accumulation_steps": "interlace train runs one backward per optimizer step (no gradient "
    "accumulation); --kfac-accumulation-steps refuses anything but 1, saying so",
    "decomposition_cost": "a cost-model object; lbp measures it at start-up when not given",
    "broadcast_cost": "a cost-model object; lbp measures it at start-up when not given",
    "factor_cost": "a cost-model object; fusion merged fits it on the factor group",
    "grad_scaler": "a GradScaler or callable; interlace train has no mixed precision to scale",
}


def _keywords() -> set[str]:
    """Every keyword KFACPreconditioner takes: its own, and KFAC's through ``**options``."""
    own = inspect.signature(KFACPreconditioner).parameters
    named = {name for name, p in own.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    return named | set(inspect.signature(KFAC).parameters)


def test_every_kfac_keyword_is_a_flag_or_deliberately_not() -> None:
    exposed = {key for o in kfac_options(TrainConfig) for key in (o.keyword, *o.aliases)}
    keywords = _keywords()
    neither = sorted(keywords - exposed - set(NOT_EXPOSED))
    assert neither == [], f"add a kfac_option field to TrainConfig, or a reason here: {neither}"
    assert sorted(exposed & set(NOT_EXPOSED)) == []
    assert sorted(set(NOT_EXPOSED) - keywords) == [], "KFACPreconditioner no longer takes these"
    assert sorted(exposed - keywords) == []
    for option in kfac_options(TrainConfig):
        assert option.field == f"kfac_{option.keyword}"


def test_the_jobs_defaults_settle_as_kfacs_own() -> None:
    given = kfac_keywords(TrainConfig())
    # Not given, so that the library's defaults apply: the KL-clip's rate (the job's is the
    # SGD's scheduled one), and what kfac-pytorch's switches would otherwise contradict.
    for keyword in ("lr", "placement", "factor_comm", "bucket_cap_mb", "colocate_factors"):
        assert keyword not in given
    assert (given["inv_dtype"], given["loglevel"], given["skip_layers"]) == (
        torch.float32,
        logging.DEBUG,
        (),
    )
    # The job's K-FAC, built from these, is KFAC at its defaults (levenberg-marquardt damping
    # included, though KFACPreconditioner's own default is kfac-pytorch's fixed damping).
    assert KFACPreconditioner.check_options(4, **given) == KFAC.check_options(4)


def _kfac_actions() -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return {a.option_strings[0]: a for a in parser._actions if "--kfac" in str(a.option_strings)}


def test_every_kfac_flag_has_help_that_shows_its_default() -> None:
    actions = _kfac_actions()
    for option in kfac_options(TrainConfig):
        action = actions[option.flag]
        assert action.help and "(default" in action.help, option.flag
        assert action.default == option.default
    assert "(default: 25 MiB)" in str(actions["--kfac-bucket-cap-mb"].help)
    assert "(default: the SGD's current rate" in str(actions["--kfac-lr"].help)
    assert "--kfac-allreduce-bucket-cap-mb" in actions["--kfac-bucket-cap-mb"].option_strings


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[TrainConfig]:
    """Stand in for the launcher: the config of every job started (its run folder, written
    before the launch, lands in ``tmp_path``)."""
    monkeypatch.chdir(tmp_path)
    configs: list[TrainConfig] = []

    def fake_run(target: object, nprocs: int, **kwargs: Any) -> LaunchResult:
        configs.append(kwargs["args"][0])
        return LaunchResult(0, None, [], {}, 0.0, False)

    monkeypatch.setattr(launch, "run", fake_run)
    return configs


def _train(*flags: str) -> list[str]:
    return ["train", "--model", "mlp", "--optimizer", "kfac", "--out", "unused", *flags]


def test_the_flags_reach_kfac_as_its_keywords(launched: list[TrainConfig]) -> None:
    flags = [
        *("--kfac-lr", "0.05", "--kfac-skip-layers", "head, Conv2d"),
        *("--kfac-factor-dtype", "float64", "--kfac-inv-dtype", "torch.float64"),
        *("--kfac-allreduce-bucket-cap-mb", "0", "--kfac-placement", "round_robin"),
        *("--kfac-update-factors-in-hook", "--kfac-fusion", "merged"),
        *("--kfac-profile-steps", "5", "--kfac-tune-steps", "0"),
        *("--kfac-assignment-strategy", "COMPUTE"),
        *("--kfac-colocate-factors", "true", "--kfac-compute-eigenvalue-outer-product", "no"),
        *("--kfac-symmetry-aware", "--kfac-loglevel", "INFO", "--kfac-kl-clip", "0"),
        *("--kfac-grad-worker-fraction", "MEM_OPT", "--kfac-compute-method", "Inverse"),
        *("--kfac-damping-adaptation", "FIXED", "--kfac-factor-sync", "EVERY_UPDATE"),
        *("-n", "2"),
    ]
    assert cli.main(_train(*flags)) == 0
    (config,) = launched
    keywords = kfac_keywords(config)
    assert {key: keywords[key] for key in keywords if key not in ("damping", "factor_decay")} == {
        "factor_update_steps": 1,
        "inv_update_steps": 1,
        "kl_clip": None,  # 0 turns the clip off
        "damping_adaptation": "fixed",
        "lr": 0.05,
        "compute_method": "inverse",
        "grad_worker_fraction": "mem-opt",
        "skip_layers": ("head", "Conv2d"),
        # Not given: KFAC's own rule, so the job's layers are what they always were.
        "layer_rule": "interlace",
        "extra_layers": (),
        "factor_dtype": torch.float64,
        "inv_dtype": torch.float64,
        "bucket_cap_mb": 0.0,
        "placement": "round-robin",
        "factor_sync": "every-update",
        # --kfac-factor-comm not given: left out, KFAC's default (pipelined, as asked).
        "fusion": "merged",
        "profile_steps": 5,
        "tune_steps": 0,
        "g_normalization": "kfac-pytorch",
        "assignment_strategy": "compute",
        "colocate_factors": True,
        "compute_eigenvalue_outer_product": False,
        "symmetry_aware": True,
        "update_factors_in_hook": True,
        "loglevel": logging.INFO,
    }


def test_make_kfac_builds_kfac_with_the_options() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = TrainConfig(
        optimizer="kfac",
        kfac_skip_layers="2",
        kfac_inv_dtype="float64",
        kfac_factor_comm="pipelined",
        kfac_symmetry_aware=True,
        kfac_lr=0.05,
        kfac_placement="lbp",
        kfac_bucket_cap_mb=0.5,
        kfac_compute_method=ComputeMethod.INVERSE,  # the enum, as the Python API takes it
        kfac_assignment_strategy=AssignmentStrategy.COMPUTE,
    )
    config.validate()
    assert (config.kfac_compute_method, config.kfac_assignment_strategy) == ("inverse", "compute")
    with pytest.warns(UserWarning, match="leaves 1 module"):
        precond = make_kfac(config, model, optimizer)
    assert list(precond.skipped) == ["2"]
    assert precond.inv_dtype == torch.float64 and precond.compute_method.name == "inverse"
    assert (precond.factor_comm.name, precond.placement.name, precond.symmetry_aware) == (
        "pipelined",
        "lbp",
        True,
    )
    assert precond.bucket_bytes == 512 * 1024
    assert precond.lr == 0.05  # fixed: the KL-clip no longer follows the schedule


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--kfac-factor-comm", "eager"], "--kfac-factor-comm: expected one of bulk, pipelined"),
        (["--kfac-fusion", "all"], "--kfac-fusion"),
        (["--kfac-inv-dtype", "int8"], "--kfac-inv-dtype"),
        (["--kfac-symmetry-aware", "maybe"], "expected true or false"),
        (["--kfac-profile-steps", "0"], "--kfac-profile-steps must be an integer >= 1"),
        (["--kfac-profile-steps", "two"], "--kfac-profile-steps: expected an integer"),
        (["--kfac-bucket-cap-mb", "-1"], "--kfac-bucket-cap-mb must be a finite number >= 0"),
        (["--kfac-lr", "-0.1"], "--kfac-lr must be >= 0"),
        (["--kfac-grad-worker-fraction", "some"], "--kfac-grad-worker-fraction: expected"),
        (["--kfac-accumulation-steps", "4"], "one backward per optimizer step"),
        (
            ["--kfac-factor-comm", "bulk", "--kfac-update-factors-in-hook", "true"],
            "--kfac-update-factors-in-hook true means --kfac-factor-comm pipelined",
        ),
        (
            ["--kfac-placement", "greedy", "--kfac-colocate-factors", "false"],
            "--kfac-colocate-factors",
        ),
        (
            ["--kfac-placement", "lbp", "--kfac-grad-worker-fraction", "mem-opt", "-n", "2"],
            "--kfac-placement lbp needs --kfac-grad-worker-fraction 1 (COMM-OPT)",
        ),
        (
            ["--kfac-assignment-strategy", "memory", "--kfac-placement", "round-robin"],
            "--kfac-assignment-strategy memory balances greedy placement",
        ),
        (["--parallel", "pipeline"], "--parallel pipeline trains with SGD"),
    ],
)
def test_bad_values_are_one_line_naming_the_flag(
    flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(_train(*flags))
    assert stopped.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], lines


def test_kfac_flags_without_kfac_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["train", "--kfac-factor-comm", "pipelined", "--out", "unused"])
    assert "--kfac-factor-comm applies to --optimizer kfac" in capsys.readouterr().err


def test_config_json_holds_the_kfac_options_of_kfac_runs_only() -> None:
    kfac = applicable_settings(TrainConfig(optimizer="kfac", kfac_factor_comm="pipelined"))
    fields = {option.field for option in kfac_options(TrainConfig)}
    assert fields <= set(kfac) and kfac["kfac_factor_comm"] == "pipelined"
    assert json.loads(json.dumps(kfac)) == kfac  # plain data: dtypes and choices as strings
    assert not [key for key in applicable_settings(TrainConfig()) if key.startswith("kfac_")]


def _saved_kfac_run(folder: Path, **kfac: Any) -> Path:
    settings = TrainConfig(model="mlp", epochs=3, save_every="1ep", optimizer="kfac", **kfac)
    alone = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    save_checkpoint(folder, alone, Position(2, 0, 10), asdict(settings), {})
    assert latest_checkpoint(folder) is not None
    return folder


def test_resume_keeps_the_kfac_options(launched: list[TrainConfig], tmp_path: Path) -> None:
    run = _saved_kfac_run(tmp_path, kfac_factor_comm="pipelined", kfac_skip_layers="head")
    assert cli.main(["train", "--resume", str(run), "--kfac-factor-comm", "pipelined"]) == 0
    (config,) = launched
    assert (config.optimizer, config.kfac_factor_comm, config.kfac_skip_layers) == (
        "kfac",
        "pipelined",
        "head",
    )


def test_resume_refuses_other_kfac_options(
    launched: list[TrainConfig], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _saved_kfac_run(tmp_path, kfac_factor_comm="pipelined")
    with pytest.raises(SystemExit):
        cli.main(["train", "--resume", str(run), "--optimizer", "kfac", "--kfac-placement", "lbp"])
    assert "--kfac-placement lbp differs from the resumed run's None" in capsys.readouterr().err
    assert launched == []


def test_a_bad_config_names_the_flag_before_any_rank_starts() -> None:
    with pytest.raises(UsageError, match="--kfac-inv-dtype must be one of float32"):
        TrainConfig(optimizer="kfac", kfac_inv_dtype="float8").validate()


@pytest.mark.slow
def test_two_ranks_train_digits_with_pipelined_factors_and_lbp(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    status = cli.main(
        [
            *("train", "--model", "mlp", "--optimizer", "kfac", "--out", str(run_dir)),
            *("--kfac-factor-comm", "pipelined", "--kfac-placement", "lbp"),
            *("-n", "2", "--epochs", "1", "--max-steps-per-epoch", "8", "--batch-size", "16"),
            *("--no-progress", "--timeout", "180"),
        ]
    )
    assert status == 0
    # The run header is KFAC.describe()'s first line: the placement the flag asked for.
    header = "K-FAC (eigen, COMM-OPT) on 2 rank(s): 13 layers, lbp placement"
    assert header in capfd.readouterr().out
    recorded = json.loads((run_dir / "config.json").read_text())
    assert (recorded["kfac_factor_comm"], recorded["kfac_placement"]) == ("pipelined", "lbp")
    assert recorded["world_size"] == 2
    rows = read_metrics(run_dir / "metrics.csv")
    assert [row["epoch"] for row in rows] == [1]
    assert 0 < rows[0]["train_loss"] < 10
