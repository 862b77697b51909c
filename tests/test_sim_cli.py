"""`interlace simulate` and `interlace profile --trace-out` as a user meets them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from interlace.errors import UsageError
from interlace.sim.trace import load_trace
from interlace.sim.validate import ValidationRow, plot_validation

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
GOOGLENET = TRACES / "googlenet_k80_8workers.log"
needs_traces = pytest.mark.skipif(not GOOGLENET.exists(), reason=f"{GOOGLENET} not present")


def interlace(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "interlace", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@needs_traces
def test_simulate_prints_the_table_and_writes_rows_and_plots(tmp_path: Path) -> None:
    rows_path, png = tmp_path / "rows.json", tmp_path / "out" / "scaling.png"
    done = interlace(
        "simulate",
        "--trace",
        str(GOOGLENET),
        "--network",
        f"osu:{TRACES}",
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
    ("args", "message"),
    [
        (("--network", "ring"), "--network 'ring'"),
        (("--workers", "4,x"), "--workers"),
        (("--strategy", "nope"), "unknown strategy 'nope'"),
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
        "--steps",
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


@pytest.mark.netns
def test_tiny_validation_gives_finite_rows(tmp_path: Path) -> None:
    rows_path = tmp_path / "validation.json"
    done = interlace(
        "simulate",
        "--validate",
        "--model",
        "mlp",
        "-n",
        "2",
        "--link",
        "1gbit",
        "--strategy",
        "single,mgwfbp",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--rounds",
        "1",
        "--batch-size",
        "32",
        "--json",
        str(rows_path),
        "--png",
        str(tmp_path / "validation.png"),
        timeout=280,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "validation.png").read_bytes()[:4] == b"\x89PNG"
    rows = json.loads(rows_path.read_text())
    assert [row["strategy"] for row in rows] == ["single", "mgwfbp"]
    for row in rows:
        assert (row["model"], row["ranks"], row["link"]) == ("mlp", 2, "1gbit")
        assert math.isfinite(row["predicted_s"]) and row["predicted_s"] > 0
        assert math.isfinite(row["measured_s"]) and row["measured_s"] > 0
        # The contention probes ran beside the strategies and calibrated the replay.
        assert row["probes"]["stream_count"] == 26  # the mlp's gradient tensors
        assert row["probes"]["stream_done_s"] > 0 and row["stream_a"] > 0
        assert 0.0 <= row["transfer_rate"] <= 1.0
        # The overlap probe ran too and set how far a start-up runs behind bytes.
        assert row["probes"]["mixed_done_s"] > 0
        assert 0.0 <= row["startup_overlap"] <= 1.0
        assert row["compute_slowdown"] >= 1.0 and row["startup_compute_slowdown"] >= 1.0
    assert "median" in done.stdout


def test_the_validation_plot_draws_every_row(tmp_path: Path) -> None:
    import matplotlib.image

    def row(strategy: str, ranks: int, predicted: float, measured: float) -> ValidationRow:
        error = (predicted - measured) / measured
        return ValidationRow(
            model="mlp",
            strategy=strategy,
            ranks=ranks,
            link="1gbit",
            predicted_s=predicted,
            measured_s=measured,
            error=error,
            predicted_uncontended_s=predicted,
            compute_slowdown=1.0,
            compute_drift=1.0,
            stream_a=0.001,
            stream_b=1e-8,
            predicted_buckets=1,
            measured_buckets=1,
            comm_compute=0.5,
            cost_a=0.0001,
            cost_b=1e-8,
        )

    rows = [row("wfbp", 2, 0.05, 0.06), row("single", 4, 0.2, 0.19), row("mgwfbp", 2, 0.03, 0.03)]
    path = plot_validation(rows, tmp_path / "out" / "validation.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width > 400 and height > 400
    with pytest.raises(UsageError, match="no validation rows"):
        plot_validation([], tmp_path / "empty.png")


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
    import argparse

    from interlace.sim.command import add_arguments, plot_path

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    chosen = plot_path(parser.parse_args(list(flags)))
    assert chosen == (None if expected is None else Path(expected))
