"""Command-line plumbing: lazily added flags, shapes, and what a failed job prints."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from interlace.cliutil import (
    OneLineArgumentParser,
    add_deprecated_alias,
    parse_shape,
    positive_int,
    report_failure,
)


def test_a_subcommand_adds_its_flags_only_when_it_is_used() -> None:
    added: list[str] = []

    def populate(parser: argparse.ArgumentParser) -> None:
        added.append("train")
        parser.add_argument("--epochs", type=int, default=3)

    parser = OneLineArgumentParser(prog="tool")
    commands = parser.add_subparsers(dest="command", parser_class=OneLineArgumentParser)
    commands.add_parser("train", populate=populate)
    commands.add_parser("other")
    assert "train" in parser.format_help() and added == []
    assert parser.parse_args(["other"]).command == "other" and added == []
    assert parser.parse_args(["train", "--epochs", "5"]).epochs == 5
    assert parser.parse_args(["train"]).epochs == 3
    assert added == ["train"]  # once, however often it parses


@pytest.mark.parametrize(
    ("text", "shape"), [("3,32,32", (3, 32, 32)), ("3x32x32", (3, 32, 32)), ("64", (64,))]
)
def test_shapes_are_read_with_commas_or_x(text: str, shape: tuple[int, ...]) -> None:
    assert parse_shape(text) == shape


@pytest.mark.parametrize("text", ["three", "", "3,0,2", "3,-1"])
def test_bad_shapes_are_argument_errors(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_shape(text)


@dataclass
class _Outcome:
    returncode: int
    timed_out: bool = False
    failed_rank: int | None = None
    tracebacks: dict[int, str] = field(default_factory=dict)


def test_a_failed_job_prints_its_timeout_or_the_ranks_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert report_failure("interlace train", _Outcome(0), 10.0) == 0
    assert capsys.readouterr().err == ""
    assert report_failure("interlace train", _Outcome(124, timed_out=True), 10.0) == 124
    assert capsys.readouterr().err == "interlace train: stopped after --timeout 10.0 s\n"
    failed = _Outcome(1, failed_rank=1, tracebacks={1: "Traceback ...\nValueError: bad\n"})
    assert report_failure("interlace train", failed, None) == 1
    assert capsys.readouterr().err == "Traceback ...\nValueError: bad\n"


def test_help_shows_each_default_once() -> None:
    parser = OneLineArgumentParser(prog="tool")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations")
    parser.add_argument("--link", default="1gbit", help="link rate (default 1gbit)")
    parser.add_argument("--shape", default=(3, 32, 32), help="input shape")
    parser.add_argument("--json", help="where rows go")
    parser.add_argument("--quick", action="store_true", help="a short run")
    text = " ".join(parser.format_help().split())
    assert "timed iterations (default 10)" in text
    assert text.count("default 1gbit") == 1
    assert "input shape (default 3,32,32)" in text
    assert "where rows go" in text and "a short run" in text
    assert "(default None)" not in text and "(default False)" not in text


def test_unrecognised_arguments_are_reported_by_the_subcommand(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = OneLineArgumentParser(prog="tool")
    commands = parser.add_subparsers(dest="command", parser_class=OneLineArgumentParser)
    commands.add_parser("run")
    with pytest.raises(SystemExit) as stopped:
        parser.parse_args(["run", "--fast"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        "tool run: error: unrecognized arguments: --fast (see 'tool run --help')\n"
    )
    assert vars(parser.parse_args(["run"])) == {"command": "run"}


def test_a_deprecated_alias_stores_where_the_option_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = OneLineArgumentParser(prog="tool")
    parser.add_argument("--batch-size", type=int, default=32, help="batch")
    add_deprecated_alias(parser, "--batch", "--batch-size", "batch_size", type=int)
    assert parser.parse_args([]).batch_size == 32
    assert capsys.readouterr().err == ""
    assert parser.parse_args(["--batch", "8"]).batch_size == 8
    assert capsys.readouterr().err == "tool: note: --batch is deprecated; use --batch-size\n"
    assert "--batch " not in parser.format_help()


@pytest.mark.parametrize("text", ["0", "-3", "two"])
def test_counts_below_one_are_argument_errors(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        positive_int(text)
