"""`interlace simulate` and `interlace profile --trace-out` as a user meets them."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from interlace.sim.command import add_arguments, plot_path
from interlace.sim.trace import load_trace


def interlace(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "interlace", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_simulate_prints_the_table_and_writes_rows_and_plots(tmp_path: Path) -> None:
    rows_path, png = tmp_path / "rows.json", tmp_path / "out" / "scaling.png"
    done = interlace(
        "simulate",
        "--trace",
        "googlenet-k80",
        "--network",
        "osu:10gbe",
        "--workers",
        "4,64,2048",
        "--json",
        str(rows_path),
        "--png",
        str(png),
        "--timelines",
        "64",
    )
    assert done.returncode == 0, done.stderr
    assert "| workers |" in done.stdout
    assert "MG-WFBP at 64 workers:" in done.stdout
    assert "paper 1.78x" in done.stdout
    assert "ok: MG-WFBP <= min(WFBP, SyncEASGD)" in done.stdout
    rows = json.loads(rows_path.read_text())
    assert {(row["workers"], row["strategy"]) for row in rows} >= {
        (w, s) for w in (4, 64, 2048) for s in ("single", "wfbp", "fixed", "mgwfbp")
    }
    for row in rows:
        assert row["iteration_s"] > 0 and row["buckets"] >= 1
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert (png.parent / "timeline-mgwfbp-64w.png").read_bytes()[:4] == b"\x89PNG"
    assert (png.parent / "timeline-mgwfbp-64w.json").exists()


def test_a_malformed_trace_is_one_line_with_file_and_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad_4workers.log"
    trace.write_text(
        "I0 distributed.cpp:112] [0, 10, 5.0, 0, 0]\nI0 distributed.cpp:112] [1, 2, five, 0, 0]\n"
    )
    done = interlace("simulate", "--trace", str(trace), "--png", "none")
    assert done.returncode == 2
    assert done.stderr.startswith(f"interlace simulate: error: {trace}:2: ")
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (bytes(range(128, 256)) * 4, "not a text file; a trace is an interlace-trace JSON file"),
        (
            b'{"format": "interlace-trace"}\n{"format": "interlace-trace"}\n',
            ":2: more after the JSON object; a trace file holds one JSON object",
        ),
    ],
)
def test_a_file_that_is_not_one_trace_is_one_line_saying_what_a_trace_is(
    tmp_path: Path, content: bytes, message: str
) -> None:
    trace = tmp_path / "trace.json"
    trace.write_bytes(content)
    done = interlace("simulate", "--trace", str(trace), "--png", "none")
    assert done.returncode == 2
    assert done.stderr.startswith(f"interlace simulate: error: {trace}")
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--network", "ring"), "--network 'ring'"),
        (("--workers", "4,x"), "--workers"),
        (("--strategy", "nope"), "unknown strategy 'nope'"),
        (("--preset", "nope"), "unknown preset 'nope'; choose from mgwfbp-paper"),
        (("--trace-iteration", "3"), "no iteration 3; the log has 1"),
        (("--forward-per-backward", "-1"), "forward per backward must be a number >= 0"),
    ],
)
def test_bad_flags_are_one_line(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    trace = tmp_path / "ok_2workers.log"
    trace.write_text(
        "I0 distributed.cpp:112] [0, 10, 5.0, 0, 0]\nI0 distributed.cpp:112] [1, 2, 5.0, 0, 0]\n"
    )
    done = interlace("simulate", "--trace", str(trace), "--png", "none", *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_compression_prices_the_data_parallel_strategies_in_half_the_bytes() -> None:
    common = ("simulate", "--trace", "resnet50-h200", "--workers", "4", "--png", "none")
    common += ("--network", "fitted:1e-4,5e-10", "--strategies", "single")
    plain = interlace(*common)
    compressed = interlace(*common, "--compression", "bf16")
    assert plain.returncode == compressed.returncode == 0, compressed.stderr
    assert "gradients sent as bf16" in compressed.stdout

    def single_ms(stdout: str) -> float:
        row = next(line for line in stdout.splitlines() if "| single |" in line)
        return float(row.split("|")[4])

    # One all-reduce of 102.2 MB after backward at 0.5 ns/B: 25.6 ms less in half the bytes.
    assert single_ms(plain.stdout) - single_ms(compressed.stdout) == pytest.approx(25.6, abs=0.2)
    refused = interlace(*common[:-2], "--strategies", "dkfac", "--compression", "bf16")
    assert refused.returncode == 2 and "--compression prices data-parallel" in refused.stderr


def test_simulate_needs_a_trace_or_validate() -> None:
    done = interlace("simulate")
    assert done.returncode == 2
    assert "--trace" in done.stderr


def test_profile_writes_a_trace_the_simulator_reads(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    done = interlace(
        "profile",
        "--model",
        "mlp",
        "--data",
        "digits",
        "-n",
        "2",
        "--strategy",
        "single",
        "--iters",
        "2",
        "--warmup",
        "2",
        "--batch-size",
        "16",
        "--out",
        str(tmp_path / "profile"),
        "--trace-out",
        str(out),
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    trace = load_trace(out)
    assert trace.model == "mlp"
    assert len(trace.tensors) == 26  # 13 Linear layers, weight and bias each
    assert len(trace.factors) == 13
    assert trace.workers == 2
    assert trace.backward_s > 0 and trace.forward_s > 0 and trace.step_s > 0
    simulated = interlace(
        "simulate",
        "--trace",
        str(out),
        "--workers",
        "2,4",
        "--network",
        "ring:1gbit",
        "--png",
        "none",
    )
    assert simulated.returncode == 0, simulated.stderr
    assert "| 4 |" in simulated.stdout


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), "simulate/scaling.png"),
        (("--validate",), "simulate/validation.png"),
        (("--png", "out/v.png", "--validate"), "out/v.png"),
        (("--png", "NONE"), None),
    ],
)
def test_the_plot_goes_where_png_says_or_to_the_modes_default(
    flags: tuple[str, ...], expected: str | None
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    chosen = plot_path(parser.parse_args(list(flags)))
    assert chosen == (None if expected is None else Path(expected))
