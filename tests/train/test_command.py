"""``interlace train``'s flags: torchrun's names, defaults in the help, and ``--resume``."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from interlace import cli, launch
from interlace.distenv import DistContext
from interlace.launch import LaunchResult
from interlace.train import TrainConfig
from interlace.train.checkpoint import Position, latest_checkpoint, save_checkpoint
from interlace.train.command import add_arguments


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, tuple[Any, ...]]]:
    """Stand in for the launcher: record ``(nprocs, args)`` of every job started."""
    calls: list[tuple[int, tuple[Any, ...]]] = []

    def fake_run(target: object, nprocs: int, **kwargs: Any) -> LaunchResult:
        calls.append((nprocs, kwargs["args"]))
        return LaunchResult(0, None, [], {}, 0.0, False)

    monkeypatch.setattr(launch, "run", fake_run)
    return calls


def test_nproc_per_node_is_the_rank_count(
    launched: list[tuple[int, tuple[Any, ...]]], tmp_path: Path
) -> None:
    assert (
        cli.main(["train", "--model", "mlp", "--nproc-per-node", "3", "--out", str(tmp_path)]) == 0
    )
    assert launched[0][0] == 3


def test_every_option_has_help_and_the_main_ones_show_their_default() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, default_epochs=12, default_nprocs=4)
    missing = [a.option_strings for a in parser._actions if not a.help]
    assert missing == []
    text = parser.format_help()
    for default in ("(default resnet20)", "(default digits)", "(default 12)", "(default 4"):
        assert default in text


def _saved_run(folder: Path, world_size: int = 2, epoch: int = 2, **config: Any) -> Path:
    """A run folder whose checkpoint says ``world_size`` ranks saved ``config`` at ``epoch``."""
    settings = TrainConfig(model="mlp", epochs=3, save_every="1ep", **config)
    alone = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    save_checkpoint(folder, alone, Position(epoch, 0, 10), asdict(settings), {})
    path = latest_checkpoint(folder)
    assert path is not None
    payload = torch.load(path, weights_only=True)
    payload["world_size"] = world_size
    torch.save(payload, path)
    return folder


def test_resume_takes_the_runs_settings_and_size(
    launched: list[tuple[int, tuple[Any, ...]]], tmp_path: Path
) -> None:
    run = _saved_run(tmp_path, lr=0.05)
    # Flags equal to the saved ones, and --save-every, may be given again.
    assert cli.main(["train", "--resume", str(run), "--lr", "0.05", "--save-every", "5"]) == 0
    (nprocs, (config, run_dir, resume)) = launched[0]
    assert nprocs == 2 and run_dir == str(run) and resume is True
    assert (config.model, config.lr, config.epochs, config.save_every) == ("mlp", 0.05, 3, "5")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--model", "vgg11"], "--model vgg11 differs from the resumed run's mlp"),
        (["--epochs", "9"], "--epochs 9 differs"),
        (["-n", "4"], "trained by 2 rank(s)"),
        (["--out", "elsewhere"], "drop --out"),
    ],
)
def test_resume_refuses_flags_that_change_the_run(
    flags: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _saved_run(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["train", "--resume", str(run), *flags])
    assert stopped.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0]


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda folder: folder, "holds no checkpoint"),
        (lambda folder: _saved_run(folder, epoch=4), "finished all its 3 epochs"),
    ],
)
def test_resume_refuses_a_run_with_nothing_to_continue(
    make: Any, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make(tmp_path)
    with pytest.raises(SystemExit):
        cli.main(["train", "--resume", str(run)])
    assert needle in capsys.readouterr().err


def test_replan_is_allowed_on_resume_and_reaches_the_ranks(
    launched: list[tuple[int, tuple[Any, ...]]], tmp_path: Path
) -> None:
    run = _saved_run(tmp_path)
    assert cli.main(["train", "--resume", str(run), "--replan"]) == 0
    assert cli.main(["train", "--resume", str(run)]) == 0
    (_, (replanned, _, _)), (_, (kept, _, _)) = launched
    assert replanned.replan is True and kept.replan is False


@pytest.mark.parametrize(
    ("saved", "flags", "needle"),
    [
        (None, ["--model", "mlp", "--replan"], "--replan applies with --resume"),
        ({"parallel": "pipeline"}, [], "this run has none to plan (--parallel pipeline"),
        ({"strategy": "ddp"}, [], "--strategy ddp"),
        ({"deterministic": True}, [], "this run is --deterministic"),
    ],
)
def test_replan_is_refused_where_there_is_no_measured_plan(
    saved: dict[str, Any] | None,
    flags: list[str],
    needle: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    resume = [] if saved is None else ["--resume", str(_saved_run(tmp_path, **saved)), "--replan"]
    with pytest.raises(SystemExit) as stopped:
        cli.main(["train", *resume, *flags])
    assert stopped.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0]


def test_the_help_lists_every_strategy_the_parser_accepts() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    action = next(a for a in parser._actions if "--strategy" in a.option_strings)
    assert action.choices  # the parser itself holds the accepted values
    text = " ".join(parser.format_help().split())
    for name in action.choices:
        assert f"{name}: " in text, name
    for name in ("overlap", "ddp-100mb"):
        assert name in action.choices


def test_adamw_gets_its_own_default_rate(
    launched: list[tuple[int, tuple[Any, ...]]], tmp_path: Path
) -> None:
    common = ["train", "--model", "gpt", "--data", "pydoc-topics", "--out", str(tmp_path)]
    assert cli.main([*common, "--optimizer", "adamw"]) == 0
    assert cli.main([*common, "--lr", "0.01"]) == 0
    (_, (adamw, _, _)), (_, (sgd, _, _)) = launched
    assert (adamw.optimizer, adamw.lr, sgd.lr) == ("adamw", 1e-3, 0.01)


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--data", "text", "--data-file", "{missing}"], ("{missing}", "does not exist")),
        (["--data", "text", "--data-file", "{empty}"], ("{empty}", "is empty")),
        (["--data", "pydoc-topics", "--seq-len", "256"], ("256", "context of 128")),
        (["--data", "pydoc-topics", "--parallel", "pipeline"], ("drop --parallel pipeline",)),
    ],
)
def test_the_language_models_bad_inputs_are_one_line_errors(
    flags: list[str],
    needles: tuple[str, ...],
    launched: list[tuple[int, tuple[Any, ...]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    paths = {"missing": str(tmp_path / "missing.txt"), "empty": str(tmp_path / "empty.txt")}
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(SystemExit) as stopped:
        cli.main(["train", "--model", "gpt", *(flag.format(**paths) for flag in flags)])
    assert stopped.value.code == 2 and launched == []
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1
    for needle in needles:
        assert needle.format(**paths) in lines[0]
