"""The `interlace` command as a user meets it: subprocesses, exit statuses, what is printed."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from interlace import cli
from interlace.cliutil import DefaultsHelpFormatter, add_model_shape_arguments
from interlace.train.config import TrainConfig
from interlace.zoo import MODEL_NAMES, build_model, load_data, summarize_model


def interlace(
    *args: str, cwd: Path | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "interlace", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        check=False,
    )


#: The zoo's models for images, those for sequences (MNIST-1D) and those for token ids.
SEQUENCE_MODELS = ("mlp1d", "cnn1d", "resnet1d")
TOKEN_MODELS = ("gpt",)
IMAGE_MODELS = tuple(
    name for name in MODEL_NAMES if name not in SEQUENCE_MODELS and name not in TOKEN_MODELS
)


def test_models_lists_the_zoo_with_its_counts() -> None:
    done = interlace("models", "--data", "digits")
    assert done.returncode == 0, done.stderr
    bundle = load_data("digits")
    for name in IMAGE_MODELS:
        summary = summarize_model(name, build_model(name, bundle.input_shape, bundle.num_classes))
        line = next(row for row in done.stdout.splitlines() if row.startswith(f"| {name} "))
        assert f"{summary.params:,}" in line
        assert f" {summary.tensors} " in line
    # The sequence models are named below the table, not built for images.
    assert done.stdout.rstrip().endswith(
        f"made for other data than 1x8x8: {', '.join((*SEQUENCE_MODELS, *TOKEN_MODELS))}"
    )


def test_models_for_sequences_lists_the_1d_models() -> None:
    done = interlace("models", "--data", "mnist1d")
    assert done.returncode == 0, done.stderr
    for name in SEQUENCE_MODELS:
        assert any(row.startswith(f"| {name} ") for row in done.stdout.splitlines())


def test_models_accepts_a_users_callable(tmp_path: Path) -> None:
    (tmp_path / "my_models.py").write_text(
        "import torch\n"
        "def tiny(input_shape, num_classes):\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(),\n"
        "        torch.nn.Linear(int(torch.tensor(input_shape).prod()), num_classes))\n"
    )
    done = interlace(
        "models",
        "--model",
        "my_models:tiny",
        "--input-shape",
        "3,4,4",
        "--classes",
        "5",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    # 48 inputs x 5 classes + 5 biases, in two tensors.
    assert "| my_models:tiny" in done.stdout and "245" in done.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["train", "--model", "no-such-model", "--epochs", "1"], "no-such-model"),
        (["train", "--data", "/no/such/folder", "--epochs", "1"], "/no/such/folder"),
        (["train", "-n", "0"], "-n must be >= 1"),
        (["train", "--link", "fast"], "fast"),
        (["train", "--epochs", "0"], "--epochs"),
        (["train", "--strategy", "fastest"], "fastest"),
        (["train", "--bucket-cap-mb", "0"], "--bucket-cap-mb"),
        (["train", "--input-shape", "three"], "three"),
        (["train", "--channels", "zero"], "--channels must be 'auto' or an integer"),
        (["train", "--compression", "fp8"], "fp8"),
        (["train", "--strategy", "ddp", "--channels", "2"], "one channel"),
        (["launch", "-n", "0", "--", "python", "x.py"], "0"),
        (["launch", "-n", "2", "--link", "fast", "--", "python", "x.py"], "fast"),
        (["launch", "-n", "2", "--", "python", "no_such_script.py"], "no_such_script.py"),
        (["no-such-command"], "no-such-command"),
    ],
)
def test_bad_input_is_one_clear_line_and_status_2(args: list[str], needle: str) -> None:
    done = interlace(*args, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert needle in lines[0] and "error" in lines[0]


@pytest.mark.parametrize(
    ("strategy", "options"),
    [("ddp", []), ("mgwfbp", []), ("mgwfbp", ["--channels", "auto", "--compression", "fp16"])],
)
def test_train_runs_end_to_end_on_two_ranks(
    tmp_path: Path, strategy: str, options: list[str]
) -> None:
    done = interlace(
        "train",
        *options,
        "--model",
        "mlp",
        "--data",
        "digits",
        "-n",
        "2",
        "--epochs",
        "2",
        "--strategy",
        strategy,
        "--runs-dir",
        str(tmp_path),
        "--no-progress",
    )
    assert done.returncode == 0, done.stderr
    assert "final test accuracy:" in done.stdout
    assert f"strategy {strategy}" in done.stdout
    assert "epoch   2/2" in done.stdout
    if options:
        assert "channels auto, compression fp16" in done.stdout
        # The kept count once the trials end, or word that they had not ended yet.
        assert "communication plan: channels='auto' kept" in done.stdout or (
            "communication plan: still on trial" in done.stdout
        )
    (run,) = list(tmp_path.iterdir())
    assert (run / "metrics.csv").exists() and (run / "curves.png").exists()


def test_models_table_columns_line_up_with_the_separator_row() -> None:
    done = interlace("models", "--data", "digits")
    assert done.returncode == 0, done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(IMAGE_MODELS)
    pipes = {tuple(i for i, char in enumerate(line) if char == "|") for line in table}
    assert len(pipes) == 1, "\n".join(table)
    assert set(table[1]) <= {"|", "-", ":"}


def test_models_with_a_bad_model_prints_only_the_error() -> None:
    done = interlace("models", "--model", "mlp", "--model", "nosuch")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("interlace models: error: unknown model 'nosuch'")
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_closed_stdout_ends_quietly_without_a_traceback() -> None:
    # `interlace models | head -4`: the reader is gone before the table is written.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "interlace", "models"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 1
    assert done.stderr == ""


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "dp", "--no-such-flag"],
        ["bench", "kfac", "-n", "two"],
        ["simulate", "--workers"],
        ["models", "--no-such-flag"],
        ["profile", "--no-such-flag"],
    ],
)
def test_a_subcommands_usage_error_points_to_its_own_help(args: list[str]) -> None:
    done = interlace(*args, timeout=60)
    assert done.returncode == 2
    command = " ".join(["interlace", *args[: 2 if args[0] == "bench" else 1]])
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"{command}: error: ")
    assert line.endswith(f"(see '{command} --help')")


def test_a_subcommands_bad_value_names_the_subcommand() -> None:
    done = interlace("bench", "dp", "--no-netem", "--iters", "0", timeout=60)
    assert done.returncode == 2
    assert done.stderr == "interlace bench dp: error: --iters must be >= 1, got 0\n"


def test_version() -> None:
    done = interlace("--version")
    assert done.returncode == 0 and done.stdout.startswith("interlace ")


def test_help_and_the_launcher_import_no_torch() -> None:
    # Each subcommand imports its torch-using module only when it is parsed.
    code = (
        "import sys\n"
        "from interlace import cli\n"
        "for argv in (['--help'], ['launch', '--help']):\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "usage: interlace" in done.stdout
    assert done.stdout.splitlines()[-1] == "torch imported: False"


#: Every command that builds a model from --model, as typed before that option.
MODEL_COMMANDS = [
    ["train"],
    ["profile"],
    ["bench", "dp", "--no-netem"],
    ["bench", "kfac", "--no-netem"],
    ["bench", "pipeline", "--no-netem"],
    ["simulate", "--validate"],
    ["models"],
]


@pytest.mark.parametrize("command", MODEL_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_model_command_builds_its_model_with_the_given_shape_and_classes(
    command: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The user's callable reports what it was called with, as a usage error, so nothing launches.
    (tmp_path / "shape_probe.py").write_text(
        "from interlace.errors import UsageError\n"
        "def built(input_shape, num_classes):\n"
        "    raise UsageError(f'built for {tuple(input_shape)} in {num_classes} classes')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    argv = [*command, "--model", "shape_probe:built", "--input-shape", "2,5,5", "--classes", "7"]
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2
    assert "built for (2, 5, 5) in 7 classes" in capsys.readouterr().err


@pytest.mark.parametrize("command", MODEL_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_input_shape_and_classes_are_one_shared_definition(command: list[str]) -> None:
    parser = cli.subcommand_parsers()[" ".join(w for w in command if not w.startswith("-"))]
    reference = argparse.ArgumentParser()
    add_model_shape_arguments(reference)
    for flag in ("--input-shape", "--classes"):
        ours, theirs = _action(parser, flag), _action(reference, flag)
        assert (ours.type, ours.metavar) == (theirs.type, theirs.metavar)
        assert ours.help is not None and theirs.help is not None
        assert ours.help.startswith(theirs.help)
    with pytest.raises(SystemExit):
        parser.parse_args(["--classes", "0"])


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


#: Spellings retired in favour of the one every command uses; still accepted, never shown.
RETIRED = {"--batch": "--batch-size", "--steps": "--iters"}


def test_no_command_shows_a_retired_spelling() -> None:
    for name, parser in cli.subcommand_parsers().items():
        shown = {
            flag
            for action in parser._actions
            if action.help != argparse.SUPPRESS
            for flag in action.option_strings
        }
        assert not shown & set(RETIRED), name
        assert not {"--batch", "--steps"} & set(parser.format_help().split()), name


@pytest.mark.parametrize(
    ("command", "old", "dest"),
    [
        ("bench kfac", "--batch", "batch_size"),
        ("bench pipeline", "--batch", "batch_size"),
        ("profile", "--steps", "steps"),
    ],
)
def test_a_retired_spelling_still_works_with_a_note(
    command: str, old: str, dest: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = cli.subcommand_parsers()[command]
    assert getattr(parser.parse_args([old, "16"]), dest) == 16
    assert f"{old} is deprecated; use {RETIRED[old]}" in capsys.readouterr().err
    assert getattr(parser.parse_args([RETIRED[old], "24"]), dest) == 24
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "command", ["launch", "profile", "bench dp", "bench kfac", "bench pipeline", "simulate"]
)
def test_every_command_that_starts_ranks_spells_their_count_alike(command: str) -> None:
    parser = cli.subcommand_parsers()[command]
    (action,) = (a for a in parser._actions if "-n" in a.option_strings)
    assert set(action.option_strings) == {"-n", "--nprocs", "--nproc-per-node"}
    extra = ["--", "true"] if command == "launch" else []
    for flag in ("-n", "--nprocs", "--nproc-per-node"):
        assert parser.parse_args([flag, "3", *extra]).nprocs == 3


@pytest.mark.parametrize("command", ["bench dp", "bench kfac", "bench pipeline"])
def test_every_benchmark_takes_model_or_models_and_batch_size(command: str) -> None:
    parser = cli.subcommand_parsers()[command]
    args = parser.parse_args(["--model", "mlp", "--batch-size", "8"])
    assert (args.model, args.batch_size) == ("mlp", 8)
    assert parser.parse_args(["--models", "mlp,vgg11"]).models == "mlp,vgg11"


def test_every_option_of_every_command_has_help_and_shows_its_default() -> None:
    for name, parser in cli.subcommand_parsers().items():
        assert issubclass(parser.formatter_class, DefaultsHelpFormatter), name
        for action in parser._actions:
            if action.option_strings and action.help != argparse.SUPPRESS:
                assert action.help, f"interlace {name} {action.option_strings[-1]} has no help"


def test_top_level_help_describes_train_and_what_demo_runs() -> None:
    text = " ".join(cli.build_parser().format_help().split())
    assert "data parallelism" in text and "pipeline parallelism" in text
    defaults = TrainConfig()
    demo = cli.subcommand_parsers()["demo"].parse_args([])
    expected = (
        f"{defaults.model} on the embedded {defaults.data} data, {demo.default_nprocs} ranks, "
        f"{demo.epochs} epochs"
    )
    assert expected in text


class _LaunchedError(Exception):
    """Raised by the stand-in launcher: the job a command would start, not started."""


#: Every command that launches ranks with a bounded job, as typed before its timeouts.
LAUNCHING_COMMANDS = [
    ["train", "--model", "mlp", "-n", "2"],
    ["profile", "--model", "mlp", "--data", "digits", "-n", "2"],
    ["bench", "dp", "--no-netem", "--models", "mlp", "-n", "2", "--input-shape", "1,8,8"],
    ["bench", "kfac", "--no-netem", "--models", "mlp", "-n", "2", "--input-shape", "1,8,8"],
    ["bench", "pipeline", "--no-netem", "--models", "mlp", "-n", "2", "--input-shape", "1,8,8"],
    ["simulate", "--validate", "--model", "mlp", "-n", "2", "--link", "1gbit"],
]


def _first_launch(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """The keyword arguments of the first ``launch.run`` that ``interlace ARGV`` makes."""
    from interlace import launch  # noqa: PLC0415 - the module the commands call through
    from interlace.launch import netem  # noqa: PLC0415

    def fake_run(*args: object, **kwargs: object) -> None:
        raise _LaunchedError(kwargs)

    monkeypatch.setattr(launch, "run", fake_run)
    monkeypatch.setattr(netem, "check_available", lambda: None)  # simulate --validate needs it
    with pytest.raises(_LaunchedError) as launched:
        cli.main(argv)
    kwargs: dict[str, object] = launched.value.args[0]
    return kwargs


@pytest.mark.parametrize("command", LAUNCHING_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_launching_command_passes_its_collective_timeout_to_the_launcher(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("INTERLACE_COLLECTIVE_TIMEOUT", raising=False)
    asked = _first_launch([*command, "--timeout", "77", "--collective-timeout", "42"], monkeypatch)
    # --timeout stays the bound on the whole job; --collective-timeout bounds one collective.
    assert (asked["timeout"], asked["collective_timeout"]) == (77.0, 42.0)
    monkeypatch.delenv("INTERLACE_COLLECTIVE_TIMEOUT", raising=False)
    default = _first_launch([*command, "--timeout", "77"], monkeypatch)
    assert (default["timeout"], default["collective_timeout"]) == (77.0, 300.0)


@pytest.mark.parametrize("command", LAUNCHING_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_a_bad_collective_timeout_is_one_line(
    command: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        _first_launch([*command, "--collective-timeout", "0"], monkeypatch)
    assert stopped.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--collective-timeout must be > 0 seconds, got 0" in lines[0]


@pytest.mark.parametrize(
    "command",
    ["launch", "train", "profile", "bench dp", "bench kfac", "bench pipeline", "simulate"],
)
def test_every_command_that_starts_ranks_documents_the_collective_timeouts_default(
    command: str,
) -> None:
    parser = cli.subcommand_parsers()[command]
    action = _action(parser, "--collective-timeout")
    assert action.help is not None and "$INTERLACE_COLLECTIVE_TIMEOUT or 300" in action.help
