"""`interlace simulate --validate`: profile, measure and predict on the emulated cluster."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from interlace import cli
from interlace.bench.validate import format_median_summary, median_of_runs
from interlace.sim.trace import TensorTrace, Trace
from interlace.sim.validate import ValidationRow


def interlace(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "interlace", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


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


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("-n", "1"), "-n must be >= 2"),
        (("--trace", "t.json"), "drop --trace"),
        (("--model", "nope"), "unknown model 'nope'"),
        (("--strategy", "dkfac"), "unknown strategy 'dkfac'"),
    ],
)
def test_bad_validation_flags_are_one_line(
    flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(["simulate", "--validate", *flags])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert message in err


@pytest.mark.netns
def test_an_emulated_validation_predicts_without_contention_calibration(tmp_path: Path) -> None:
    tensors = []
    for index in range(4):
        layer = f"block{3 - index}"
        for name, numel in (("bias", 16), ("weight", 8192 * (index + 1))):
            tensors.append(TensorTrace(f"{layer}.{name}", layer, numel, 4 * numel, 1e-3, 3e-3))
    trace = Trace("toy", tuple(tensors), forward_s=4e-3, backward_s=12e-3).save(tmp_path / "t.json")
    rows_path = tmp_path / "validation.json"
    done = interlace(
        "simulate",
        "--validate",
        "--compute",
        f"emulated:{trace}",
        "--dilation",
        "2",
        "-n",
        "2",
        "--link",
        "1gbit",
        "--strategy",
        "single,mgwfbp,overlap",
        "--iters",
        "3",
        "--warmup",
        "0",
        "--rounds",
        "1",
        "--json",
        str(rows_path),
        "--png",
        "none",
        timeout=280,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(rows_path.read_text())
    assert [row["strategy"] for row in rows] == ["single", "mgwfbp", "overlap"]
    for row in rows:
        # The start-up is what the rounds' stream of the job's all-reduces paid.
        assert row["stream_a"] > 0
        assert (row["model"], row["ranks"]) == ("t", 2)
        assert row["link"] == "1gbit (emulated at 500mbit)"
        # Undilated: no iteration is shorter than the trace's forward and backward (16 ms),
        # nor near twice that plus the communication, as on the dilated clock.
        assert 16e-3 <= row["measured_s"] < 0.2 and row["predicted_s"] >= 16e-3
        # Nothing was calibrated: no probes, no slowdown, the prediction is the plain replay.
        assert row["probes"] == {} and row["compute_slowdown"] == 1.0
        assert row["transfer_rate"] == 1.0
    assert "no contention calibration" in done.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--compute", "emulated:no-such-trace"), "no shipped trace"),
        (("--compute", "emulated:googlenet-k80", "--dilation", "0"), "> 0"),
        (("--compute", "emulated:googlenet-k80", "--model", "mlp"), "contradict"),
        (("--compute", "emulated:resnet20-h200,nope"), "emulated:nope: no shipped trace"),
        (("--families", "kfac"), "need --compute emulated:TRACE"),
        (("--compute", "emulated:resnet20-h200", "--families", "dp,lbfgs"), "unknown family"),
        (("--compute", "emulated:resnet20-h200", "--repeat", "0"), "--repeat must be >= 1"),
    ],
)
def test_bad_emulated_validation_flags_are_one_line(
    flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(["simulate", "--validate", *flags])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_each_setting_is_the_median_of_its_runs_predicted_and_measured_apart() -> None:
    def row(strategy: str, predicted: float, measured: float, run: int) -> ValidationRow:
        made = ValidationRow.of(
            family="kfac",
            model="m",
            strategy=strategy,
            ranks=4,
            link="25gbit",
            predicted_s=predicted,
            measured_s=measured,
        )
        return ValidationRow(**{**made.to_dict(), "run": run})

    rows = [
        row("dkfac", 10.0, 11.0, 1),
        row("spd", 8.0, 8.0, 1),
        row("dkfac", 12.0, 10.0, 2),
        row("spd", 9.0, 10.0, 2),
        row("dkfac", 11.0, 30.0, 3),
        row("spd", 7.0, 9.0, 3),
    ]
    medians = median_of_runs(rows)
    # dkfac's errors: -1/11, +1/5, -19/30, so run 1; spd's: 0, -1/10, -2/9, so run 2.
    assert [(r.strategy, r.predicted_s, r.measured_s, r.run) for r in medians] == [
        ("dkfac", 10.0, 11.0, 0),
        ("spd", 9.0, 10.0, 0),
    ]
    assert medians[1].error == pytest.approx(-1 / 10)
    assert format_median_summary(medians, 3) == (
        "kfac, medians of 3 runs: 2 rows, |predicted - measured| / measured median 9.5%, max 10.0%"
    )
    two = median_of_runs([row("dkfac", 10.0, 11.0, 1), row("dkfac", 12.0, 10.0, 2)])
    assert (two[0].predicted_s, two[0].measured_s) == (12.0, 10.0)  # the upper middle error
