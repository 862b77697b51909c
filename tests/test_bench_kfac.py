"""``interlace bench kfac``: a tiny run on loopback, its bad input, and the ``--ablation`` mode
(its parsing, rows, table, header, JSON and chart from synthetic launches, and a tiny run)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from interlace import cli
from interlace.bench.kfac import (
    ABLATION_MODES,
    COLUMNS,
    DEFAULT_ABLATION_MODELS,
    DEFAULT_MODELS,
    KFAC_PASSES,
    AblationRow,
    KfacRow,
    _Contender,
    ablation_rows,
    factor_comm_share,
    format_ablation_header,
    format_ablation_table,
    format_table,
    models_from_args,
    plot_ablation,
)

MODES = ("dkfac", "pipelined", "lbp", "spd")


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
        (["--factor-update-steps", "0", "--no-netem"], "--factor-update-steps"),
        (["--ablation", "--placement", "lbp", "--no-netem"], "--placement"),
        (["--ablation", "--grad-worker-fraction", "0.5", "--no-netem"], "--grad-worker-fraction"),
        (["--ablation", "-n", "1", "--no-netem"], "-n >= 2"),
        (["--compare", "kfac-pytorch", "--no-netem"], "add --ablation"),
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


# ================================================================================ --ablation


def _parse(*argv: str) -> Any:
    return cli.build_parser().parse_args(["bench", "kfac", *argv])


def test_ablation_parsing_and_models() -> None:
    args = _parse("--ablation")
    assert args.ablation and args.placement is None and args.factor_update_steps == 1
    assert args.inv_update_steps == 1 and args.link == "1gbit"
    assert models_from_args(args) == DEFAULT_ABLATION_MODELS
    assert DEFAULT_ABLATION_MODELS == ("resnet20", "resnet56", "vgg11", "transformer")
    assert models_from_args(_parse("--ablation", "--models", "resnet20,transformer")) == (
        "resnet20",
        "transformer",
    )
    assert models_from_args(_parse("--ablation", "--model", "pkg.mod:build")) == ("pkg.mod:build",)
    # Without --ablation the defaults (and the greedy placement) are what they were.
    plain = _parse()
    assert not plain.ablation and models_from_args(plain) == DEFAULT_MODELS
    assert _parse("--factor-update-steps", "3").factor_update_steps == 3


def test_the_ablation_modes_are_spd_kfacs() -> None:
    assert tuple(ABLATION_MODES) == MODES
    assert ABLATION_MODES["dkfac"] == ("bulk", "none", "greedy")
    assert ABLATION_MODES["pipelined"] == ("pipelined", "merged", "greedy")
    assert ABLATION_MODES["lbp"] == ("bulk", "none", "lbp")
    assert ABLATION_MODES["spd"] == ("pipelined", "merged", "lbp")


def _contender(planning_done: bool, factor_comm: str, steps: int) -> _Contender:
    precond = SimpleNamespace(
        factor_comm=factor_comm, steps=steps, profile_steps=3, factor_update_steps=1
    )
    return _Contender("m", SimpleNamespace(planning_done=planning_done), None, precond)


def test_warm_up_waits_for_every_plan() -> None:
    assert not _contender(False, "bulk", 10).settled()
    assert _contender(True, "bulk", 1).settled()
    # Pipelined: one bulk factor step, then 3 profiled ones before the merged buckets exist.
    assert not _contender(True, "pipelined", 3).settled()
    assert _contender(True, "pipelined", 4).settled()


def _value(iterations: dict[str, float], factor_comm: float = 0.02) -> dict[str, Any]:
    medians = {}
    for mode, iteration in iterations.items():
        phases = {key: 0.001 * (index + 1) for index, (key, _) in enumerate(COLUMNS)}
        phases["factor_comm"] = factor_comm if mode == "dkfac" else 0.001
        phases[KFAC_PASSES[0]] = 0.05
        phases["iteration"] = iteration
        phases["passes"] = 0.0  # extra keys the rank may send are not rows' business
        medians[mode] = phases
    return {
        "medians": medians,
        "layers": 7,
        "factor_buckets": {"pipelined": 3, "spd": 2, "dkfac": None, "lbp": None},
        "local_factors": {"lbp": 5, "spd": 5, "dkfac": None, "pipelined": None},
    }


def _rows(model: str = "resnet20", **iterations: float) -> list[AblationRow]:
    times = iterations or {"dkfac": 0.2, "pipelined": 0.16, "lbp": 0.25, "spd": 0.1}
    return ablation_rows(
        model,
        _value(times),
        ranks=4,
        link="1gbit",
        batch=8,
        factor_update_steps=1,
        inv_update_steps=1,
        iters=10,
    )


def test_ablation_rows_have_speedups_against_dkfac_of_the_same_launch() -> None:
    rows = _rows()
    assert [row.mode for row in rows] == list(MODES)
    speedups = {row.mode: row.speedup_vs_dkfac for row in rows}
    assert speedups == pytest.approx({"dkfac": 1.0, "pipelined": 1.25, "lbp": 0.8, "spd": 2.0})
    by_mode = {row.mode: row for row in rows}
    assert (by_mode["spd"].factor_comm, by_mode["spd"].fusion, by_mode["spd"].placement) == (
        "pipelined",
        "merged",
        "lbp",
    )
    assert by_mode["pipelined"].factor_buckets == 3 and by_mode["dkfac"].factor_buckets is None
    assert by_mode["lbp"].local_factors == 5 and by_mode["pipelined"].local_factors is None
    assert set(by_mode["lbp"].phases_s) == {key for key, _ in COLUMNS} | {KFAC_PASSES[0]}
    # Without dkfac in the launch there is nothing to compare against.
    (alone,) = _rows(spd=0.1)
    assert alone.speedup_vs_dkfac is None


def test_ablation_json_rows_carry_the_required_keys() -> None:
    row = json.loads(json.dumps([row.to_dict() for row in _rows()]))[3]
    assert row["model"] == "resnet20" and row["mode"] == "spd"
    assert row["iteration_s"] == pytest.approx(0.1)
    assert row["speedup_vs_dkfac"] == pytest.approx(2.0)
    assert row["phases_s"]["factor_comm"] == pytest.approx(0.001)
    assert row["phases_s"]["forward_backward"] == pytest.approx(0.001)
    assert row["ranks"] == 4 and row["link"] == "1gbit" and row["factor_update_steps"] == 1


def test_the_ablation_table_has_one_line_per_model_and_mode() -> None:
    rows = _rows() + _rows("transformer", dkfac=0.1, spd=0.125)
    header, rule, *lines = format_ablation_table(rows).splitlines()
    width = 4 + len(COLUMNS) + 1
    assert header.count("|") == rule.count("|") == width + 1
    assert all(line.count("|") == width + 1 for line in lines)
    assert "vs dkfac" in header and "factor comm ms" in header and "fwd+bwd+hooks ms" in header
    assert len(lines) == 6
    assert lines[0].startswith("| resnet20 | dkfac | 200.0 | 1.00x | 1.0 | 2.0 |")
    assert lines[3].startswith("| resnet20 | spd | 100.0 | 2.00x |")
    assert lines[5].startswith("| transformer | spd | 125.0 | 0.80x |")
    assert lines[5].endswith("| 50.0 |")
    (orphan,) = format_ablation_table(_rows(spd=0.1)).splitlines()[2:]
    assert orphan.startswith("| resnet20 | spd | 100.0 | - |")


def test_the_ablation_header_states_the_regime() -> None:
    rows = _rows() + _rows("transformer", dkfac=0.1, spd=0.125)
    header = format_ablation_header(rows, ranks=4, link="1gbit", compute_method="eigen", iters=10)
    assert "4 ranks on 1gbit" in header and "resnet20 8, transformer 8" in header
    assert "every 1 step(s)" in header and "medians over 10 iterations" in header
    # dkfac's factor comm is 20 ms of 200 ms (10%) and of 100 ms (20%).
    assert factor_comm_share(rows) == pytest.approx({"resnet20": 0.1, "transformer": 0.2})
    assert "resnet20 10% (20.0 of 200.0 ms)" in header
    assert "transformer 20% (20.0 of 100.0 ms)" in header
    for mode in MODES:
        assert f"{mode} = " in header


def test_the_ablation_chart_is_a_png(tmp_path: Path) -> None:
    png = tmp_path / "ablation.png"
    plot_ablation(_rows() + _rows("transformer", dkfac=0.1, spd=0.5), png)
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no rows"):
        plot_ablation([], tmp_path / "empty.png")


@pytest.mark.slow
def test_a_tiny_ablation_on_loopback_measures_the_four_modes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows_path, png = tmp_path / "rows.json", tmp_path / "ablation.png"
    status = cli.main(
        [
            "bench",
            "kfac",
            "--ablation",
            "--no-netem",
            "-n",
            "2",
            "--model",
            "mlp",
            "--input-shape",
            "1,8,8",
            "--batch",
            "8",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--json",
            str(rows_path),
            "--png",
            str(png),
        ]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert "SPD-KFAC ablation: 2 ranks on loopback" in out
    assert "Factor comm share of dkfac's iteration: mlp" in out
    rows = json.loads(rows_path.read_text())
    assert [(row["model"], row["mode"]) for row in rows] == [("mlp", mode) for mode in MODES]
    by_mode = {row["mode"]: row for row in rows}
    for row in rows:
        assert row["iteration_s"] > 0 and row["speedup_vs_dkfac"] > 0
        assert row["layers"] == 13 and row["ranks"] == 2
        assert set(row["phases_s"]) == {key for key, _ in COLUMNS} | {KFAC_PASSES[0]}
        assert row["phases_s"]["decomposition"] > 0 and row["phases_s"]["factor_compute"] > 0
        assert f"| mlp | {row['mode']} |" in out
    assert by_mode["dkfac"]["speedup_vs_dkfac"] == 1.0
    # The pipelined modes ran on their merged buckets; the LBP modes on one shared placement.
    assert by_mode["pipelined"]["factor_buckets"] >= 1 and by_mode["spd"]["factor_buckets"] >= 1
    assert by_mode["dkfac"]["factor_buckets"] is None
    assert by_mode["lbp"]["local_factors"] == by_mode["spd"]["local_factors"] is not None
    assert by_mode["pipelined"]["local_factors"] is None
    # Bulk modes wait for the whole factor all-reduce in step(); the others launched it earlier.
    assert by_mode["dkfac"]["phases_s"]["factor_comm"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_compare_without_kfac_pytorch_says_how_to_install_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def no_kfac(name: str, *args: object) -> object:
        if name.split(".", maxsplit=1)[0] == "kfac":
            return None
        return real_find_spec(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", no_kfac)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["bench", "kfac", "--ablation", "--compare", "kfac-pytorch", "--no-netem"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "not on PyPI" in err and "gpauloski/kfac-pytorch" in err


#: A stand-in with kfac-pytorch's import path and constructor, so the wiring of --compare runs
#: here (kfac-pytorch itself is not installable from PyPI). It preconditions with interlace's
#: K-FAC; the test checks the plumbing, not kfac-pytorch's speed.
_STAND_IN = """
from interlace.kfac import KFAC


class KFACPreconditioner:
    def __init__(self, model, *, factor_update_steps, inv_update_steps, lr, compute_method):
        self._layers = {"stand-in": None}
        self.precond = KFAC(
            model,
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            lr=lr,
            compute_method=compute_method,
        )

    def step(self):
        self.precond.step()
"""


@pytest.mark.slow
def test_compare_runs_the_peer_beside_the_modes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "peer" / "kfac"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "preconditioner.py").write_text(_STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path / "peer"))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'peer'}:{os.environ.get('PYTHONPATH', '')}")
    rows_path = tmp_path / "rows.json"
    status = cli.main(
        [
            "bench", "kfac", "--ablation", "--compare", "kfac-pytorch", "--no-netem",
            "-n", "2", "--model", "mlp", "--input-shape", "1,8,8", "--batch", "8",
            "--iters", "2", "--warmup", "1", "--json", str(rows_path),
        ]
    )  # fmt: skip
    assert status == 0
    rows = {row["mode"]: row for row in json.loads(rows_path.read_text())}
    assert set(rows) == {*MODES, "kfac-pytorch"}
    peer = rows["kfac-pytorch"]
    assert peer["iteration_s"] > 0 and peer["speedup_vs_dkfac"] > 0
    # It keeps no phase timings: only the passes every mode shares are filled in.
    assert set(peer["phases_s"]) == {"forward_backward", "gradient_comm"}
    assert "| mlp | kfac-pytorch |" in capsys.readouterr().out
