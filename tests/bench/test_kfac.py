"""``interlace bench kfac``: tiny runs on loopback (breakdown, ``--ablation``, ``--compare``),
its arguments and its bad input."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from interlace import cli
from interlace.bench.kfac import (
    DEFAULT_ABLATION_MODELS,
    DEFAULT_MODELS,
    add_arguments,
    config_from_args,
)
from interlace.bench.kfac_rank import KFAC_PASSES, MEMORY_STEPS
from interlace.bench.kfac_report import (
    COLUMNS,
    AblationRow,
    KfacRow,
    format_ablation_table,
    format_h2h_table,
    format_table,
)
from interlace.sim.trace import ActivationTrace, FactorTrace, TensorTrace, Trace

MODES = ("dkfac", "pipelined", "lbp", "spd")


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
            "--batch-size",
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
    assert "MEM-OPT" not in out
    (row,) = json.loads(rows_path.read_text())
    assert format_table([KfacRow(**row)]) in out
    assert (row["model"], row["ranks"], row["link"]) == ("mlp", 2, "loopback")
    assert row["layers"] == 13 and row["grad_worker_fraction"] == 0.5
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
        (["--batch-size", "0", "--no-netem"], "--batch-size must be >= 1"),
        (["--model", "mlp", "--models", "vgg11", "--no-netem"], "--model and --models"),
        (["--compute", "emulated:nosuchtrace", "--no-netem"], "no shipped trace has that name"),
        (["--compute", "emulated:resnet20-cpu", "--dilation", "0"], "dilation must be"),
        (["--compute", "emulated:resnet20-cpu", "--dilation", "-2"], "dilation must be"),
        (["--compute", "emulated:resnet20-cpu", "--model", "mlp"], "leave out --model"),
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


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_ablation_parsing_and_models() -> None:
    config = config_from_args(_parse("--ablation"))
    assert config.placement == "greedy" and config.factor_update_steps == 1
    assert config.inv_update_steps == 1 and config.link == "1gbit"
    assert config.models == DEFAULT_ABLATION_MODELS
    assert config.modes == MODES and config.memory_modes == ()
    assert DEFAULT_ABLATION_MODELS == ("resnet20", "resnet56", "vgg11", "transformer")
    assert config_from_args(_parse("--ablation", "--models", "resnet20,transformer")).models == (
        "resnet20",
        "transformer",
    )
    assert config_from_args(_parse("--ablation", "--model", "pkg.mod:build")).models == (
        "pkg.mod:build",
    )
    memory = config_from_args(_parse("--ablation", "--memory", "spd,kfac-pytorch,dkfac"))
    assert memory.memory_modes == ("dkfac", "spd")  # the peer runs only with --compare
    # Without --ablation the defaults (and the greedy placement) are what they were.
    plain = config_from_args(_parse())
    assert plain.models == DEFAULT_MODELS and plain.placement == "greedy"
    assert config_from_args(_parse("--factor-update-steps", "3")).factor_update_steps == 3


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
            "--batch-size",
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
    assert format_ablation_table([AblationRow(**row) for row in rows]) in out
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


def test_compare_and_memory_refuse_what_they_cannot_measure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv, message in (
        (["--memory", "dkfac"], "add --ablation"),
        (["--ablation", "--memory", "dkfac,nonsense"], "unknown mode 'nonsense'"),
    ):
        args = ["bench", "kfac", "--no-netem", *argv]
        if "--compare" in argv:
            args.insert(2, "--ablation")
        with pytest.raises(SystemExit) as stopped:
            cli.main(args)
        assert stopped.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_compare_runs_kfac_pytorch_beside_the_modes_with_its_phases_and_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # kfac-pytorch is optional (not on PyPI): without it there is nothing to compare with. Its
    # backward hooks reject the mlp's in-place ReLU, so a small ResNet runs here.
    pytest.importorskip("kfac.preconditioner")
    rows_path = tmp_path / "rows.json"
    status = cli.main(
        [
            "bench", "kfac", "--ablation", "--compare", "kfac-pytorch", "--no-netem",
            "-n", "2", "--model", "resnet20", "--input-shape", "3,8,8", "--batch-size", "4",
            "--iters", "4", "--warmup", "1", "--inv-update-steps", "2",
            "--memory", "dkfac,kfac-pytorch",
            "--json", str(rows_path),
        ]
    )  # fmt: skip
    assert status == 0
    rows = {row["mode"]: row for row in json.loads(rows_path.read_text())}
    assert set(rows) == {*MODES, "kfac-pytorch"}
    peer = rows["kfac-pytorch"]
    assert peer["iteration_s"] > 0 and peer["speedup_vs_dkfac"] > 0
    assert peer["cycle_speedup_vs_peer"] == pytest.approx(1.0)
    # Its phases are timed from outside: factors in its hooks, their all-reduce, decompositions.
    for phase in ("factor_compute", "factor_comm", "decomposition", "precondition"):
        assert peer["cycle_phases_s"][phase] > 0, phase
    for mode in ("dkfac", "kfac-pytorch"):
        assert rows[mode]["peak_rss_mb"] > rows[mode]["added_rss_mb"] >= 0
        # Peak RSS climbs over the first steps: each contender is measured after as many.
        assert rows[mode]["memory_steps"] >= MEMORY_STEPS
    assert rows["kfac-pytorch"]["memory_steps"] >= rows["dkfac"]["memory_steps"]
    assert rows["spd"]["peak_rss_mb"] is None
    out = capsys.readouterr().out
    assert format_h2h_table([AblationRow(**row) for row in rows.values()]) in out


# ================================================================================ emulated


def tiny_factor_trace(path: Path) -> Path:
    """Two linear layers (6 -> 5 -> 3) with their factor sizes, 1 ms a pass each."""
    ms = 1e-3
    tensors = (
        TensorTrace("fc1.weight", "fc1", 15, 60, ms, ms),
        TensorTrace("fc1.bias", "fc1", 3, 12, ms, ms),
        TensorTrace("fc0.weight", "fc0", 30, 120, ms, ms),
        TensorTrace("fc0.bias", "fc0", 5, 20, ms, ms),
    )
    trace = Trace(
        "tiny",
        tensors,
        forward_s=2 * ms,
        backward_s=2 * ms,
        factors=(FactorTrace("fc0", 7, 5), FactorTrace("fc1", 6, 3)),
        activations=(ActivationTrace("fc0", (5,)), ActivationTrace("fc1", (3,))),
        batch_size=4,
    )
    return trace.save(path)


@pytest.mark.slow
def test_a_tiny_emulated_run_on_two_ranks_says_its_compute_and_undilates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tiny_factor_trace(tmp_path / "tiny.json")
    rows_path = tmp_path / "rows.json"
    argv = ["bench", "kfac", "--no-netem", "-n", "2", "--batch", "4", "--iters", "2"]
    argv += ["--warmup", "1", "--compute", f"emulated:{trace}", "--dilation", "3"]
    status = cli.main([*argv, "--json", str(rows_path)])
    assert status == 0
    out = capsys.readouterr().out
    assert f"compute emulated:{trace} D=3" in out
    (row,) = json.loads(rows_path.read_text())
    assert row["compute"] == f"emulated:{trace} D=3" and row["layers"] == 2
    # Undilated: forward and backward take 4 ms of device time, at D=3 12 ms of wall time.
    assert 4.0 <= row["phases_ms"]["forward_backward"] < 12.0
    assert row["phases_ms"]["decomposition"] > 0
