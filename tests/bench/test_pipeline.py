"""``interlace bench pipeline``: its flags, its bad input, and one tiny run on loopback."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from interlace import cli
from interlace.bench.pipeline import (
    DEFAULT_LINK,
    DEFAULT_MODELS,
    add_arguments,
    config_from_args,
)
from interlace.bench.pipeline_rank import SCHEDULES
from interlace.bench.pipeline_report import Row, format_table
from interlace.comm.links import parse_link
from interlace.errors import UsageError
from interlace.sim.trace import ActivationTrace, TensorTrace, Trace


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_compare_every_schedule_on_a_slow_link() -> None:
    config = config_from_args(_parse())
    assert config.models == DEFAULT_MODELS
    assert config.schedules == SCHEDULES
    assert set(SCHEDULES) == {
        "gpipe",
        "1f1b",
        "naive",
        "pipedream",
        "spectrain",
        "spectrain-reuse",
        "dp",
        "torch-gpipe",
        "torch-1f1b",
    }
    assert config.link == DEFAULT_LINK == "100mbit"
    assert config.nprocs == 4 and config.batch % (config.nprocs * config.microbatches) == 0
    assert config.input_shape == (3, 32, 32)


def test_flags_are_resolved() -> None:
    config = config_from_args(
        _parse(
            "--model",
            "mlp",
            "--schedules",
            "torch-gpipe,spectrain,dp,spectrain",
            "--no-netem",
            "-n",
            "2",
            "--batch-size",
            "8",
            "--microbatches",
            "2",
            "--block",
            "3",
            "--iters",
            "2",
            "--warmup",
            "0",
            "--input-shape",
            "1x8x8",
        )
    )
    assert config.models == ("mlp",)
    assert config.schedules == ("spectrain", "dp", "torch-gpipe")  # table order, no duplicate
    assert config.link is None and config.link_text.startswith("loopback")
    assert (config.nprocs, config.batch, config.microbatches) == (2, 8, 2)
    assert (config.block, config.iters, config.warmup) == (3, 2, 0)
    assert config.input_shape == (1, 8, 8)
    assert config_from_args(_parse("--models", "vgg11, resnet20", "--link", "1gbit")).models == (
        "vgg11",
        "resnet20",
    )


def test_stages_cut_the_ranks_into_replicated_pipelines() -> None:
    config = config_from_args(_parse("-n", "8", "--stages", "4", "--no-netem"))
    assert (config.layout.stages, config.layout.replicas) == (4, 2)
    assert config.pipeline_job("mlp").stages == 4
    assert config_from_args(_parse("--no-netem")).layout.replicas == 1
    # Replicated, the default cut prices each stage's all-reduce (time with one replica).
    assert config.partition_by == "auto" and config.pipeline_job("mlp").stage_compression is None
    compressed = config_from_args(
        _parse("-n", "8", "--stages", "4", "--no-netem", "--stage-compression", "bf16")
    )
    assert compressed.pipeline_job("mlp").stage_compression == "bf16"


def test_more_stages_than_blocks_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(
            ["bench", "pipeline", "--no-netem", "--models", "mlp", "-n", "32", "--stages", "16"]
        )
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "too few for 16 stages" in err and len(err.strip().splitlines()) == 1


def test_the_model_is_built_for_the_given_shape_and_classes() -> None:
    config = config_from_args(_parse("--input-shape", "1,8,8", "--classes", "7"))
    assert (config.input_shape, config.num_classes) == ((1, 8, 8), 7)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["-n", "1"], "-n must be >= 2"),
        (["--batch-size", "62"], "equal data-parallel shards"),
        (["--batch-size", "20", "--microbatches", "8"], "equal micro-batches"),
        (["--block", "0"], "--block"),
        (["--iters", "0"], "--iters"),
        (["--warmup", "-1"], "--warmup"),
        (["--schedules", "gpipe,zerobubble"], "zerobubble"),
        (["--models", "nosuchnet"], "nosuchnet"),
        (["--model", "mlp", "--models", "vgg11"], "--model and --models"),
        (["--link", "1gbit", "--no-netem"], "--no-netem"),
        (["--link", "fast"], "fast"),
        (["--compute", "emulated:nosuchtrace"], "no shipped trace has that name"),
        (["--compute", "emulated:resnet20-cpu", "--dilation", "0"], "dilation must be"),
        (["--compute", "emulated:resnet20-cpu", "--dilation", "-1"], "dilation must be"),
        (["--compute", "emulated:resnet20-cpu", "--models", "mlp"], "leave out --model"),
        (["--compute", "real", "--dilation", "2"], "emulated compute only"),
        (["-n", "4", "--stages", "3"], "4 ranks cannot be cut into pipelines of 3 stages"),
        (["-n", "4", "--stages", "2", "--batch-size", "12"], "2 replica shards of 4"),
        (["-n", "4", "--stage-compression", "bf16"], "give --stages below -n"),
    ],
)
def test_bad_flags_are_usage_errors(argv: list[str], needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        config_from_args(_parse(*argv))


def test_bad_input_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(["bench", "pipeline", "--no-netem", "--models", "mlp", "-n", "16"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "too few for 16 stages" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_tiny_run_on_loopback_measures_every_schedule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows_path, png = tmp_path / "rows.json", tmp_path / "timeline.png"
    status = cli.main(
        [
            "bench",
            "pipeline",
            "--no-netem",
            "-n",
            "2",
            "--models",
            "mlp",
            "--input-shape",
            "1,8,8",
            "--batch-size",
            "8",
            "--microbatches",
            "2",
            "--block",
            "2",
            "--iters",
            "1",
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
    assert "2 ranks = 2 pipeline stages on loopback" in out
    rows = json.loads(rows_path.read_text())
    # The printed table is the JSON rows' own.
    assert format_table([Row(**{**row, "regime": None}) for row in rows]) in out
    assert [row["schedule"] for row in rows] == list(SCHEDULES)
    for row in rows:
        assert row["model"] == "mlp" and row["samples_per_s"] > 0
        assert row["regime"]["boundary_bytes"] and row["regime"]["gradient_bytes"] > 0
        assert row["mean_loss"] is not None and row["mean_loss"] > 0
        assert row["cpu_s_per_minibatch"] > 0 and row["cores_busy"] > 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    trace = json.loads(png.with_suffix(".json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "F0" in names and "B0" in names


def test_emulated_compute_runs_the_trace_on_dilated_links() -> None:
    config = config_from_args(_parse("--compute", "emulated:resnet20-cpu", "--dilation", "4"))
    assert config.models == ("resnet20-cpu",)
    assert config.link == DEFAULT_LINK and config.compute.dilation == 4.0
    assert parse_link(str(config.launch_link)) == pytest.approx(parse_link(DEFAULT_LINK) / 4)
    assert config_from_args(_parse()).launch_link == DEFAULT_LINK


@pytest.mark.slow
def test_a_tiny_emulated_run_on_two_ranks_says_its_compute(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ms = 1e-3
    trace = Trace(
        "tiny",
        (
            TensorTrace("fc1.weight", "fc1", 15, 60, ms, ms),
            TensorTrace("fc0.weight", "fc0", 30, 120, ms, ms),
        ),
        forward_s=2 * ms,
        backward_s=2 * ms,
        activations=(ActivationTrace("fc0", (5,)), ActivationTrace("fc1", (3,))),
        batch_size=4,
    ).save(tmp_path / "tiny.json")
    rows_path = tmp_path / "rows.json"
    argv = ["bench", "pipeline", "--no-netem", "-n", "2", "--batch", "4", "--microbatches", "2"]
    argv += ["--block", "2", "--iters", "1", "--warmup", "1", "--input-shape", "6"]
    argv += ["--schedules", "spectrain,dp,torch-gpipe", "--compute", f"emulated:{trace}"]
    status = cli.main([*argv, "--dilation", "2", "--json", str(rows_path)])
    assert status == 0
    assert f"compute emulated:{trace} D=2" in capsys.readouterr().out
    rows = json.loads(rows_path.read_text())
    assert [row["schedule"] for row in rows] == ["spectrain", "dp", "torch-gpipe"]
    for row in rows:
        assert row["compute"] == f"emulated:{trace} D=2"
        # 4 ms of undilated device time per mini-batch of 4, shared by at most 2 devices.
        assert 0 < row["samples_per_s"] <= 2 * 4 / (4 * ms)
        assert row["regime"]["boundary_bytes"] == [4 * 5 * 4]


@pytest.mark.slow
def test_a_tiny_replicated_run_measures_interlace_and_torch_with_ddp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows_path = tmp_path / "rows.json"
    argv = ["bench", "pipeline", "--no-netem", "-n", "4", "--stages", "2", "--models", "mlp"]
    argv += ["--input-shape", "1,8,8", "--batch-size", "16", "--microbatches", "2"]
    argv += ["--block", "2", "--iters", "1", "--warmup", "1", "--json", str(rows_path)]
    argv += ["--schedules", "spectrain,gpipe,dp,torch-gpipe", "--stage-compression", "bf16"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "pipeline layout: 2 stages x 2 replicas" in out
    rows = {row["schedule"]: row for row in json.loads(rows_path.read_text())}
    assert set(rows) == {"spectrain", "gpipe", "dp", "torch-gpipe"}
    assert rows["torch-gpipe"]["description"].endswith("+ DDP per stage")
    assert rows["spectrain"]["description"].endswith("MG-WFBP buckets sent as bf16")
    assert "+ all-reduce" in rows["spectrain"]["regime"]["plan"]  # cut by time+allreduce
    for row in rows.values():
        assert row["stages"] == 2 and row["ranks"] == 4 and row["samples_per_s"] > 0
    # What a prediction of the rows needs: the run's stage cut and the all-reduce costs the
    # contenders fitted on the live ranks (each replicated stage on its group, dp on all).
    regime = rows["spectrain"]["regime"]
    assert len(regime["bounds"]) == 2
    for fitted in ("spectrain", "gpipe", "dp"):
        costs = regime["allreduce_costs"][fitted]
        assert len(costs) == 4 and all(a >= 0 and b > 0 for a, b in costs)
    assert "torch-gpipe" not in regime["allreduce_costs"]
