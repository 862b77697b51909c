"""``interlace bench kfac``: a tiny run on loopback, and its bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from interlace import cli
from interlace.bench.kfac import COLUMNS, KfacRow, format_table


def test_the_table_has_one_column_per_phase() -> None:
    row = KfacRow(
        model="m",
        ranks=2,
        link="loopback",
        batch=4,
        compute_method="eigen",
        grad_worker_fraction=1.0,
        inv_update_steps=1,
        placement="greedy",
        layers=3,
        iteration_ms=12.5,
        phases_ms={key: float(index) for index, (key, _) in enumerate(COLUMNS)},
    )
    header, rule, line = format_table([row]).splitlines()
    assert header.count("|") == rule.count("|") == line.count("|") == 4 + len(COLUMNS) + 1
    assert "decomp comm ms" in header and "factor comm ms" in header
    assert line.startswith("| m | 2 | loopback | 12.5 | 0.0 | 1.0 |")


@pytest.mark.slow
def test_a_tiny_run_on_loopback_writes_rows_and_a_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows_path, png = tmp_path / "rows.json", tmp_path / "timeline.png"
    status = cli.main(
        [
            "bench",
            "kfac",
            "--no-netem",
            "-n",
            "2",
            "--models",
            "mlp",
            "--input-shape",
            "1,8,8",
            "--batch",
            "8",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--grad-worker-fraction",
            "0.5",
            "--json",
            str(rows_path),
            "--png",
            str(png),
        ]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert "| mlp | 2 | loopback |" in out and "MEM-OPT" not in out
    (row,) = json.loads(rows_path.read_text())
    assert row["model"] == "mlp" and row["layers"] == 13 and row["grad_worker_fraction"] == 0.5
    phases = row["phases_ms"]
    assert set(phases) == {key for key, _ in COLUMNS}
    # MEM-OPT on 2 ranks broadcasts preconditioned gradients; every rank decomposes something.
    assert phases["decomposition"] > 0 and phases["precondition"] > 0
    assert phases["precondition_comm"] > 0 and phases["factor_comm"] > 0
    assert row["iteration_ms"] >= phases["forward_backward"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    trace = json.loads(png.with_suffix(".json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "decompositions" in names and "factor all-reduce" in names


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--grad-worker-fraction", "0.3", "--no-netem"], "--grad-worker-fraction"),
        (["--inv-update-steps", "0", "--no-netem"], "--inv-update-steps"),
        (["--iters", "0", "--no-netem"], "--iters"),
        (["--placement", "lbp", "--grad-worker-fraction", "0.5", "--no-netem"], "--placement"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(["bench", "kfac", *argv])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1
