"""``interlace bench dp``: strategy variants, a tiny real run, and bad input."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from interlace.bench import dp, dp_rank, dp_report
from interlace.errors import UsageError
from interlace.sim.trace import TensorTrace, Trace


def test_channel_and_compression_variants_are_named_and_parsed_back() -> None:
    labels = dp.expand_variants(["ddp", "mgwfbp"], "1,auto", "none,fp16")
    assert labels == (
        "ddp",
        "ddp/fp16",
        "mgwfbp",
        "mgwfbp/k=auto",
        "mgwfbp/fp16",
        "mgwfbp/k=auto/fp16",
    )
    assert dp_rank.parse_variant("mgwfbp/k=auto/fp16") == ("mgwfbp", "auto", "fp16")
    assert dp_rank.parse_variant("wfbp/k=3") == ("wfbp", 3, None)
    assert dp_rank.parse_variant("ddp") == ("ddp", 1, None)


def test_variants_named_in_strategies_run_as_named() -> None:
    # Plain names are expanded with --channels and --compression; variants are not.
    labels = dp.expand_variants(
        ["ddp", "ddp-50mb/bf16", "overlap/k=auto/bf16", "mgwfbp/bf16"], "1", "none"
    )
    assert labels == ("ddp", "ddp-50mb/bf16", "overlap/k=auto/bf16", "mgwfbp/bf16")


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ("nope/bf16", "unknown strategy 'nope' in 'nope/bf16'"),
        ("ddp/k=2/bf16", "ddp sends on one channel; drop /k= from 'ddp/k=2/bf16'"),
        ("fsdp2/bf16", "fsdp2 runs uncompressed; drop /bf16"),
        ("mgwfbp/fp8", "--compression: unknown 'fp8'"),
        ("mgwfbp/k=x", "cannot read 'mgwfbp/k=x'"),
    ],
)
def test_a_bad_variant_is_one_clear_error(variant: str, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        dp.expand_variants([variant], "1", "none")


# ---------------------------------------------------------------------------- a real run


def test_a_tiny_run_on_loopback_writes_rows_table_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    json_path, png_path = tmp_path / "rows.json", tmp_path / "speedups.png"
    status = dp.main(
        [
            "--no-netem",
            "-n",
            "2",
            "--models",
            "mlp",
            "--strategies",
            "ddp,single,mgwfbp",
            "--channels",
            "1,2",
            "--input-shape",
            "1,8,8",
            "--batch-size",
            "16",
            "--iters",
            "4",
            "--warmup",
            "1",
            "--rounds",
            "2",
            "--timeout",
            "120",
            "--json",
            str(json_path),
            "--png",
            str(png_path),
        ]
    )
    assert status == 0
    rows = json.loads(json_path.read_text())
    assert [row["strategy"] for row in rows] == [
        "ddp",
        "single",
        "single/k=2",
        "mgwfbp",
        "mgwfbp/k=2",
    ]
    for row in rows:
        assert row["model"] == "mlp" and row["link"] == "loopback" and row["ratio"] is None
        assert row["ranks"] == 2 and row["batch"] == 16 and row["samples"] == 4
        assert row["iteration_s"] > 0 and row["allreduce_s"] > 0 and row["comm_compute"] > 0
        # By construction the bound covers all of compute and the whole all-reduce.
        assert row["bound_s"] >= row["compute_s"] - 1e-12
        assert row["bound_s"] >= row["allreduce_s"] - 1e-12
        assert row["time_over_bound"] == pytest.approx(row["iteration_s"] / row["bound_s"])
        assert row["contended_bound_s"] > 0
        assert row["iteration_p25_s"] <= row["iteration_s"] <= row["iteration_p75_s"]
    by_name = {row["strategy"]: row for row in rows}
    assert by_name["ddp"]["speedup_vs_ddp"] == 1.0
    assert by_name["single"]["buckets"] == 1
    assert isinstance(by_name["mgwfbp"]["buckets"], int) and by_name["mgwfbp"]["buckets"] >= 1
    # The plan its trials kept: the merge rule's own (start-up as fitted or scaled), or one of
    # the fixed-size candidates (DDP's buckets, even buckets) when that measured fastest.
    assert by_name["mgwfbp"]["plan"].startswith(("merged plan", "fixed plan"))
    assert "kept" in by_name["mgwfbp"]["tuning"]
    assert by_name["mgwfbp"]["cost_b"] is not None
    two = by_name["mgwfbp/k=2"]
    assert (two["base_strategy"], two["channels"], two["chosen_channels"]) == ("mgwfbp", "2", 2)
    assert two["speedup_vs_one_channel"] == pytest.approx(
        by_name["mgwfbp"]["iteration_s"] / two["iteration_s"]
    )
    assert by_name["mgwfbp"]["speedup_vs_one_channel"] is None
    out = capsys.readouterr().out
    # The printed table is the JSON rows' own.
    assert dp_report.format_table([dp_report.Row(**row) for row in rows]) in out
    assert "maximum over ranks per iteration" in out
    assert png_path.read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--models", "resnet1000"], "unknown model 'resnet1000'"),
        (["--strategies", "ddp,fastest"], "unknown strategy 'fastest'"),
        (["--ratios", "1,0"], "must be > 0"),
        (["--ratios", "-2"], "must be > 0"),
        (["--ratios", "one"], "not a number"),
        (["-n", "1"], "-n must be >= 2"),
        (["--iters", "0"], "--iters must be >= 1"),
        (["--link", "1gbit", "--no-netem"], "contradict"),
        (["--link", "fast"], "unknown link rate"),
        (["--channels", "1,0"], "--channels must be 'auto' or an integer >= 1"),
        (["--compression", "fp8"], "unknown 'fp8'"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert dp.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("interlace bench dp: error:")


@pytest.mark.parametrize(
    "argv", [["--iters", "many"], ["--input-shape", "3,0,32"], ["--classes", "0"]]
)
def test_a_malformed_flag_is_an_argparse_error_with_status_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        dp.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"interlace bench dp: error: argument {argv[0]}")
    assert len(err.strip().splitlines()) == 1


def test_run_raises_usage_error_for_the_lead_cli() -> None:
    parser = argparse.ArgumentParser()
    dp.add_arguments(parser)
    with pytest.raises(UsageError, match="unknown model"):
        dp.run(parser.parse_args(["--models", "nope"]))


def test_model_shape_and_classes_reach_the_config() -> None:
    parser = argparse.ArgumentParser()
    dp.add_arguments(parser)
    config = dp.config_from_args(
        parser.parse_args(["--model", "mlp", "--input-shape", "1,8,8", "--classes", "7"])
    )
    assert (config.models, config.input_shape, config.num_classes) == (("mlp",), (1, 8, 8), 7)
    with pytest.raises(UsageError, match="--model and --models"):
        dp.config_from_args(parser.parse_args(["--model", "mlp", "--models", "vgg11"]))


# ---------------------------------------------------------------------------- emulated compute


def _small_trace_file(path: Path) -> Path:
    """A four-layer trace of a few ms per layer, saved as an interlace-trace file."""
    tensors = []
    for index in range(4):
        layer = f"block{3 - index}"
        for name, numel in (("bias", 16), ("weight", 4096 * (index + 1))):
            tensors.append(TensorTrace(f"{layer}.{name}", layer, numel, 4 * numel, 1e-3, 2e-3))
    return Trace("toy", tuple(tensors), forward_s=4e-3, backward_s=8e-3, step_s=1e-3).save(path)


def test_an_emulated_run_reports_undilated_times_the_compute_and_the_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _small_trace_file(tmp_path / "toy.json")
    json_path = tmp_path / "rows.json"
    dilation = 3.0
    argv = ["--no-netem", "-n", "2", "--strategies", "ddp,wfbp", "--compute"]
    argv += [f"emulated:{trace}", "--dilation", f"{dilation:g}", "--iters", "3"]
    argv += ["--warmup", "1", "--rounds", "1", "--timeout", "600", "--json", str(json_path)]
    assert dp.main(argv) == 0
    rows = json.loads(json_path.read_text())
    assert [row["strategy"] for row in rows] == [
        "ddp",
        "wfbp",
        dp_report.BOUND_ROW,
        dp_report.OVERLAP_BOUND_ROW,
    ]
    label = f"emulated:{trace} D=3"
    # Every layer's forward and backward sleep its traced time x 3; divided by 3 again, no
    # iteration can be shorter than the trace's forward + backward + step (15 ms).
    traced_s = 4 * (1e-3 + 2e-3) + 1e-3
    for row in rows:
        assert row["compute"] == label and row["model"] == "toy"
        assert row["startup_s"] > 0 and row["per_byte_s"] >= 0
    ddp, wfbp, bound, ahead = rows
    for row in (ddp, wfbp):
        assert row["iteration_s"] >= traced_s and row["samples"] == 3
        # Far below the dilated time: the times were divided by the dilation.
        assert row["iteration_s"] < dilation * traced_s + 1.0
        # The ranks' own CPU (hooks, copies, gloo) took some share of the cores, not more.
        assert 0 < row["host_cpu_share"] <= 1
    assert bound["host_cpu_share"] is None and ahead["host_cpu_share"] is None
    # The bound row: the trace's forward + max(backward, all-reduce) + the measured step.
    expected = 4e-3 + max(8e-3, bound["allreduce_s"]) + bound["step_s"]
    assert bound["iteration_s"] == pytest.approx(expected)
    assert bound["speedup_vs_ddp"] == pytest.approx(ddp["iteration_s"] / bound["iteration_s"])
    # The overlap bound: max(forward + backward, all-reduce) + the measured step.
    expected = max(12e-3, ahead["allreduce_s"]) + ahead["step_s"]
    assert ahead["iteration_s"] == pytest.approx(expected)
    assert ddp["overlap_bound_s"] == pytest.approx(expected)
    assert ddp["time_over_overlap_bound"] == pytest.approx(ddp["iteration_s"] / expected)
    out = capsys.readouterr().out
    assert label in out and "all-reduce a + b*M (undilated)" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--compute", "emulated:no-such-trace", "--link", "1gbit"], "no shipped trace"),
        (["--compute", "emulated:googlenet-k80", "--dilation", "0", "--link", "1gbit"], "> 0"),
        (["--compute", "emulated:googlenet-k80", "--dilation", "-2", "--no-netem"], "> 0"),
        (["--compute", "real", "--dilation", "4"], "emulated compute only"),
        (["--compute", "emulated:googlenet-k80"], "needs --link"),
        (["--compute", "emulated:googlenet-k80", "--models", "mlp", "--no-netem"], "contradict"),
        (["--network", "osu:nowhere", "--no-netem"], "does not exist"),
    ],
)
def test_bad_compute_input_is_one_line_and_status_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert dp.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("interlace bench dp: error:")


def test_the_emulated_link_runs_at_the_target_rate_over_the_dilation() -> None:
    parser = argparse.ArgumentParser()
    dp.add_arguments(parser)
    args = ["--compute", "emulated:googlenet-k80", "--dilation", "4", "--link", "10gbit"]
    config = dp.config_from_args(parser.parse_args([*args, "--network", "osu:10gbe"]))
    assert config.models == ("googlenet-k80",)
    context = dp.launch_context(config)
    assert (context.link, context.emulated_link) == ("10gbit", "2.5gbit")
    assert context.target is not None and context.target.b > 0


def test_a_clip_reaches_every_strategy_s_job_and_the_conditions() -> None:
    parser = argparse.ArgumentParser()
    dp.add_arguments(parser)
    argv = ["--compute", "emulated:gpt-cpu", "--dilation", "16", "--link", "25gbit"]
    config = dp.config_from_args(parser.parse_args([*argv, "--clip-grad-norm", "1"]))
    assert config.clip_grad_norm == 1.0 and config.models == ("gpt-cpu",)
    job = config.job(
        dp_rank.MeasureJob, "gpt-cpu", strategies=("ddp",), rounds=1, clip_grad_norm=1.0
    )
    assert job.clip_grad_norm == 1.0
    assert "clip_grad_norm_ to 1 + SGD step" in dp.describe_conditions(config)
    plain = dp.config_from_args(parser.parse_args(argv))
    assert plain.clip_grad_norm is None and "clip" not in dp.describe_conditions(plain)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_clip_that_is_not_a_positive_norm_is_one_line(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert dp.main(["--no-netem", "--clip-grad-norm", value]) == 2
    err = capsys.readouterr().err
    assert "--clip-grad-norm must be a finite number > 0" in err
