import argparse

import pytest

from interlace.emulate import (
    DEFAULT_DILATION,
    ComputeKind,
    add_compute_arguments,
    compute_from_args,
    parse_compute,
)
from interlace.errors import UsageError


def test_real_compute_is_the_default() -> None:
    parser = argparse.ArgumentParser()
    add_compute_arguments(parser)
    compute = compute_from_args(parser.parse_args([]))
    assert compute.kind is ComputeKind.REAL
    assert not compute.emulated
    assert compute.label() == "real"


def test_emulated_shipped_trace_takes_the_default_dilation() -> None:
    compute = parse_compute("emulated:googlenet-k80")
    assert compute.emulated
    assert compute.trace == "googlenet-k80"
    assert compute.dilation == DEFAULT_DILATION
    assert compute.label() == f"emulated:googlenet-k80 D={DEFAULT_DILATION:g}"


def test_emulated_with_dilation_flag() -> None:
    parser = argparse.ArgumentParser()
    add_compute_arguments(parser)
    args = parser.parse_args(["--compute", "emulated:googlenet-k80", "--dilation", "8"])
    assert compute_from_args(args).dilation == 8.0


def test_emulated_trace_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.json"
    path.write_text("{}")
    assert parse_compute(f"emulated:{path}").trace == str(path)
    assert parse_compute(f"emulated:{path}").name == "t"


def test_a_compute_is_named_by_its_trace() -> None:
    assert parse_compute("emulated:googlenet-k80").name == "googlenet-k80"
    assert parse_compute("real").name == "real"


@pytest.mark.parametrize(
    ("text", "dilation", "message"),
    [
        ("emulated:nosuch", None, "no shipped trace has that name"),
        ("gpu", None, "must be 'real' or 'emulated:TRACE'"),
        ("emulated:", None, "must be 'real' or 'emulated:TRACE'"),
        ("emulated:googlenet-k80", 0.0, "dilation must be"),
        ("emulated:googlenet-k80", -2.0, "dilation must be"),
        ("real", 4.0, "applies to emulated compute only"),
    ],
)
def test_bad_compute_is_one_clear_error(text: str, dilation: float | None, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_compute(text, dilation)
