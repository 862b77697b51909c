"""The training job with ``--optimizer kfac``: K-FAC before the job's SGD, CLI to run folder."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from interlace import cli, launch
from interlace.errors import UsageError
from interlace.launch import LaunchResult
from interlace.runlog import read_metrics
from interlace.train import TrainConfig, WarmupCosine, make_kfac, train_rank
from interlace.train.config import default_kfac_kl_clip


@pytest.mark.slow
def test_two_rank_kfac_run_learns_digits_and_records_its_optimizer(tmp_path: Path) -> None:
    config = TrainConfig(model="mlp", data="digits", epochs=2, optimizer="kfac", progress=False)
    run_dir = tmp_path / "run"
    printed = io.StringIO()
    result = launch.run(
        train_rank, 2, args=(config, str(run_dir)), timeout=180, output=printed
    ).check()

    first, second = result.values
    assert first.final_test_accuracy == second.final_test_accuracy
    # Chance is 10%; K-FAC on this 12-layer MLP is past 85% after two epochs (SGD at the same
    # lr 0.1 is still near chance, so this is K-FAC's doing).
    assert first.final_test_accuracy > 0.6
    rows = read_metrics(run_dir / "metrics.csv")
    assert [row["epoch"] for row in rows] == [1, 2]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    recorded = json.loads((run_dir / "config.json").read_text())
    assert recorded["optimizer"] == "kfac"
    assert recorded["kfac_damping"] == 0.001 and recorded["kfac_inv_update_steps"] == 1
    # The clip left to its default is recorded as the one that ran (a small global batch's).
    assert recorded["kfac_kl_clip"] == default_kfac_kl_clip(2 * config.batch_size) == 0.001
    # The run header names the preconditioner: the first line of KFAC.describe().
    assert "K-FAC (eigen, COMM-OPT) on 2 rank(s): 13 layers" in printed.getvalue()


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("optimizer", "adam", "--optimizer"),
        ("kfac_factor_update_steps", 0, "--kfac-factor-update-steps"),
        ("kfac_inv_update_steps", 0, "--kfac-inv-update-steps"),
        ("kfac_damping", -0.1, "--kfac-damping"),
        ("kfac_damping", float("nan"), "--kfac-damping"),
        ("kfac_factor_decay", 1.0, "--kfac-factor-decay"),
        ("kfac_kl_clip", -0.001, "--kfac-kl-clip"),
        ("kfac_compute_method", "cholesky", "--kfac-compute-method"),
        ("kfac_grad_worker_fraction", -0.5, "--kfac-grad-worker-fraction"),
        ("kfac_grad_worker_fraction", 1.5, "--kfac-grad-worker-fraction"),
        ("kfac_grad_worker_fraction", "half", "--kfac-grad-worker-fraction"),
    ],
)
def test_bad_kfac_settings_name_their_flag(field: str, value: object, flag: str) -> None:
    config = TrainConfig(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=flag):
        config.validate()


def test_kfac_defaults_are_kfac_pytorchs_and_validate() -> None:
    config = TrainConfig(optimizer="kfac")
    config.validate()
    assert (
        config.kfac_factor_update_steps,
        config.kfac_inv_update_steps,
        config.kfac_damping,
        config.kfac_factor_decay,
        config.kfac_kl_clip,
        config.kfac_compute_method,
        config.kfac_grad_worker_fraction,
    ) == (1, 1, 0.001, 0.95, None, "eigen", 1.0)  # the KL-clip: by global batch, see below


def _sgd_with_schedule(model: nn.Module) -> tuple[torch.optim.SGD, Any]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(20, 5))
    return optimizer, schedule


def test_kfac_clip_follows_the_scheduled_learning_rate() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer, schedule = _sgd_with_schedule(model)
    precond = make_kfac(TrainConfig(optimizer="kfac", kfac_kl_clip=0.0), model, optimizer)
    assert precond.kl_clip is None  # 0 turns the clip off
    for _ in range(7):
        loss = nn.functional.cross_entropy(model(torch.randn(5, 4)), torch.randint(0, 3, (5,)))
        optimizer.zero_grad()
        loss.backward()
        precond.step()
        optimizer.step()
        schedule.step()
        # K-FAC's KL-clip sees the rate the warm-up + cosine schedule set, not the peak.
        assert precond.lr == pytest.approx(optimizer.param_groups[0]["lr"])
    assert precond.lr != pytest.approx(0.1)


def test_the_kl_clip_not_given_follows_the_global_batch() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer, _ = _sgd_with_schedule(model)

    def clip(world_size: int, **given: Any) -> float | None:
        config = TrainConfig(optimizer="kfac", **given)
        return make_kfac(config, model, optimizer, world_size).kl_clip

    # The large-batch race's setting from a global batch of 1,024; KFAC's 0.001 below it.
    assert default_kfac_kl_clip(1024) == 0.01 and default_kfac_kl_clip(1023) == 0.001
    assert clip(4, batch_size=256) == 0.01  # the race's 4 x 256
    assert clip(4, batch_size=25) == 0.001  # the batch-100 race's 4 x 25
    assert clip(1, batch_size=1024) == 0.01
    # Given, it is kept at any batch; 0 still turns the clip off.
    assert clip(4, batch_size=256, kfac_kl_clip=0.001) == 0.001
    assert clip(4, batch_size=25, kfac_kl_clip=0.01) == 0.01
    assert clip(4, batch_size=256, kfac_kl_clip=0.0) is None
    assert TrainConfig().kfac_kl_clip is None
    shown = " ".join(_subcommand_help("train").split())
    assert "(default: 0.01 at a global batch of 1,024 or more, else 0.001)" in shown


def _subcommand_help(command: str) -> str:
    """``interlace <command> --help``'s text."""
    out = io.StringIO()
    parser = cli.build_parser()
    with pytest.raises(SystemExit), contextlib.redirect_stdout(out):
        parser.parse_args([command, "--help"])
    return out.getvalue()


def test_a_worker_fraction_is_rounded_to_whole_workers_as_kfac_pytorch_does() -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    optimizer, _ = _sgd_with_schedule(model)
    # Half of one rank is one worker (kfac-pytorch rounds the same way), with a warning.
    config = TrainConfig(optimizer="kfac", kfac_grad_worker_fraction=0.5)
    config.validate()
    with pytest.warns(UserWarning, match="rounded to 1 gradient worker"):
        precond = make_kfac(config, model, optimizer)
    assert precond.grad_worker_fraction == 1.0


def test_cli_passes_every_kfac_flag_to_the_job(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # the run folder is written before the (stood-in) launch
    launched: list[TrainConfig] = []

    def fake_run(target: object, nprocs: int, **kwargs: Any) -> LaunchResult:
        launched.append(kwargs["args"][0])
        return LaunchResult(0, None, [], {}, 0.0, False)

    monkeypatch.setattr(launch, "run", fake_run)
    status = cli.main(
        [
            "train",
            "--model",
            "mlp",
            "-n",
            "4",
            "--optimizer",
            "kfac",
            "--kfac-factor-update-steps",
            "2",
            "--kfac-inv-update-steps",
            "10",
            "--kfac-damping",
            "0.003",
            "--kfac-factor-decay",
            "0.9",
            "--kfac-kl-clip",
            "0.01",
            "--kfac-compute-method",
            "inverse",
            "--kfac-grad-worker-fraction",
            "0.5",
            "--out",
            "unused",
        ]
    )
    assert status == 0
    (config,) = launched
    assert config.optimizer == "kfac"
    assert config.kfac_factor_update_steps == 2
    assert config.kfac_inv_update_steps == 10
    assert config.kfac_damping == 0.003
    assert config.kfac_factor_decay == 0.9
    assert config.kfac_kl_clip == 0.01
    assert config.kfac_compute_method == "inverse"
    assert config.kfac_grad_worker_fraction == 0.5


def test_cli_defaults_to_sgd_with_kfac_pytorchs_settings() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["train"])
    assert isinstance(args, argparse.Namespace)
    assert args.optimizer == "sgd"
    defaults = TrainConfig()
    for name in (
        "kfac_factor_update_steps",
        "kfac_inv_update_steps",
        "kfac_damping",
        "kfac_factor_decay",
        "kfac_kl_clip",
        "kfac_compute_method",
        "kfac_grad_worker_fraction",
    ):
        assert getattr(args, name) == getattr(defaults, name)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--optimizer", "adam"], "--optimizer"),
        (["--optimizer", "kfac", "--kfac-damping", "-1"], "--kfac-damping"),
        (["--optimizer", "kfac", "--kfac-inv-update-steps", "0"], "--kfac-inv-update-steps"),
        (["--optimizer", "kfac", "--kfac-compute-method", "qr"], "--kfac-compute-method"),
        # Half of 3 ranks rounds to 2 gradient workers, which do not divide the 3 ranks into
        # equal groups: refused before any rank starts, as KFAC would refuse it on every rank.
        (["--optimizer", "kfac", "-n", "3", "--kfac-grad-worker-fraction", "0.5"], "--kfac-grad"),
    ],
)
def test_bad_kfac_flags_are_one_line_and_status_2(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(["train", *args])
    assert stopped.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "error" in lines[0]
