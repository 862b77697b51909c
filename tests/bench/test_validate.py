"""`interlace simulate --validate`: profile, measure and predict on the emulated cluster."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from interlace import cli


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
