"""``interlace bench kfac``'s rows: the breakdown table and the ablation's rows, table,
header, JSON and chart, from synthetic launches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from interlace.bench.kfac_rank import KFAC_PASSES
from interlace.bench.kfac_report import (
    COLUMNS,
    AblationRow,
    KfacRow,
    ablation_rows,
    factor_comm_share,
    format_ablation_header,
    format_ablation_table,
    format_h2h_table,
    format_table,
    h2h_verdicts,
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
    assert header.split(" | ")[4:] == [f"{title} ms" for _, title in COLUMNS[:-1]] + ["step ms |"]
    assert "decomp comm ms" in header and "factor comm ms" in header


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
    assert "vs dkfac" in header and "factor comm ms" in header
    assert header.endswith("| fwd+bwd+hooks ms |")
    assert len(lines) == len(rows) == 6
    assert [(row.model, row.mode, row.speedup_vs_dkfac) for row in rows[3:]] == [
        ("resnet20", "spd", pytest.approx(2.0)),
        ("transformer", "dkfac", pytest.approx(1.0)),
        ("transformer", "spd", pytest.approx(0.8)),
    ]
    assert rows[5].phases_s[KFAC_PASSES[0]] == pytest.approx(0.05)
    (orphan,) = _rows(spd=0.1)
    assert orphan.speedup_vs_dkfac is None
    assert len(format_ablation_table([orphan]).splitlines()) == 3


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


def _h2h_rows(link: str = "200mbit", inv: int = 10) -> list[AblationRow]:
    """A launch against kfac-pytorch: per mode a median step and a whole-cycle mean whose
    decomposition share is known, and each mode's peak RSS."""
    medians: dict[str, dict[str, float]] = {}
    steps = {"dkfac": 0.5, "pipelined": 0.4, "lbp": 0.45, "spd": 0.35, "kfac-pytorch": 0.5}
    for mode, step in steps.items():
        phases = {key: 0.0 for key, _ in COLUMNS}
        phases[KFAC_PASSES[0]] = 0.1
        phases["iteration"] = step
        # One decomposition step in ten costs 1 s more: 0.1 s on the cycle's mean.
        phases["cycle_iteration"] = step + 0.1 * (2.0 if mode == "kfac-pytorch" else 1.0)
        phases["cycle_decomposition"] = phases["cycle_iteration"] - step
        medians[mode] = phases
    value = {
        "medians": medians,
        "layers": 4,
        "memory": {
            mode: {"peak_rss_mb": 500.0 + 10 * index, "added_rss_mb": 10.0 * index}
            for index, mode in enumerate(steps)
        },
    }
    return ablation_rows(
        "resnet20",
        value,
        ranks=4,
        link=link,
        batch=8,
        factor_update_steps=1,
        inv_update_steps=inv,
        iters=20,
    )


def test_rows_against_kfac_pytorch_carry_both_speedups_cycle_phases_and_memory() -> None:
    by_mode = {row.mode: row for row in _h2h_rows()}
    peer, spd = by_mode["kfac-pytorch"], by_mode["spd"]
    assert peer.cycle_speedup_vs_peer == pytest.approx(1.0)
    assert spd.cycle_speedup_vs_peer == pytest.approx(0.7 / 0.45)
    assert spd.speedup_vs_peer == pytest.approx(0.5 / 0.35)
    assert spd.cycle_phases_s["decomposition"] == pytest.approx(0.1)
    # The median of a step without a decomposition shows none of it.
    assert spd.phases_s["decomposition"] == 0.0
    assert peer.peak_rss_mb == pytest.approx(540.0) and peer.added_rss_mb == pytest.approx(40.0)
    assert by_mode["dkfac"].peak_rss_mb == pytest.approx(500.0)


def test_the_h2h_table_puts_cycles_beside_medians() -> None:
    rows = _h2h_rows()
    header, rule, *lines = format_h2h_table(rows).splitlines()
    assert header.count("|") == rule.count("|") == lines[0].count("|")
    assert "whole-cycle ms" in header and "median ms" in header and "peak RSS MiB" in header
    assert len(lines) == len(rows)
    spd = next(row for row in rows if row.mode == "spd")
    assert (spd.cycle_iteration_s, spd.iteration_s) == pytest.approx((0.45, 0.35))
    assert spd.peak_rss_mb == pytest.approx(530.0)


def test_verdicts_name_the_fastest_mode_and_the_default_against_kfac_pytorch() -> None:
    rows = _h2h_rows() + _h2h_rows(link="1gbit", inv=1)
    verdicts = h2h_verdicts(rows)
    assert [(v["link"], v["inv_update_steps"]) for v in verdicts] == [("200mbit", 10), ("1gbit", 1)]
    first = verdicts[0]
    assert first["fastest_mode"] == "spd"
    assert first["fastest_cycle_speedup"] == pytest.approx(0.7 / 0.45)
    assert first["fastest_median_speedup"] == pytest.approx(0.5 / 0.35)
    # The default is the spd mode (KFAC's defaults on the ablation's 4 ranks) ...
    assert first["default_cycle_speedup"] == pytest.approx(0.7 / 0.45)
    assert first["default_rss_ratio"] == pytest.approx(530.0 / 540.0)
    # ... unless another is named.
    named = h2h_verdicts(rows, default_mode="pipelined")[0]
    assert named["default_cycle_speedup"] == pytest.approx(0.7 / 0.5)
    assert named["default_rss_ratio"] == pytest.approx(510.0 / 540.0)
    # A launch without kfac-pytorch has no verdict.
    assert h2h_verdicts(_rows()) == []
