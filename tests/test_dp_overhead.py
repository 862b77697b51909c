"""benchmarks/dp_overhead.py: the command runs on 1 and 2 ranks and prints one row per
contender and rank count (the shape, not the timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "dp_overhead.py"


@pytest.mark.slow  # three wrappers plan on 1 and then 2 ranks: about 20 s on 2 cores
def test_tiny_run_prints_a_row_per_contender_and_rank_count(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    tiny = ["--ranks", "1,2", "--rounds", "1", "--steps", "2", "--warmup", "0"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *tiny, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    assert header == [
        "ranks",
        "contender",
        "buckets",
        "wall ms/step",
        "wall p25-p75",
        "wall vs DDP",
        "CPU ms/step",
        "CPU p25-p75",
        "CPU vs DDP",
    ]
    body = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[2:]]
    assert [(cells[0], cells[1]) for cells in body] == [
        (str(ranks), kind) for ranks in (1, 2) for kind in ("ddp", "default", "overlap")
    ]
    assert [(cells[5], cells[8]) for cells in body if cells[1] == "ddp"] == [("1.00x", "1.00x")] * 2
    # One rank: DataParallel takes the shortcut (no buckets); DDP keeps its reducer's.
    assert [cells[2] for cells in body if cells[0] == "1"] == ["1", "0", "0"]
    assert all(int(cells[2]) >= 1 for cells in body if cells[0] == "2")
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6
    for row in rows:
        assert row["steps"] == 2
        for clock in ("wall", "cpu"):
            low, mid, high = (row[f"{clock}_{q}_ms"] for q in ("p25", "median", "p75"))
            assert 0 < low <= mid <= high


def test_bad_rank_counts_are_refused_in_one_line() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--ranks", "0,2"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")},
        check=False,
    )
    assert done.returncode == 2
    assert "--ranks wants counts >= 1" in done.stderr
