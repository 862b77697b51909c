"""The benchmarks' shared flags and config: defaults, checks and the job they make."""

from __future__ import annotations

import argparse
import math
import re

import pytest

from interlace.bench.harness import RankJob
from interlace.bench.skeleton import (
    BenchConfig,
    Flags,
    add_shared_arguments,
    parse_names,
    parse_ratios,
)
from interlace.comm.links import parse_link
from interlace.errors import UsageError

FLAGS = Flags(
    models=("mlp",),
    models_help="models",
    nprocs=2,
    nprocs_help="ranks",
    link="1gbit",
    link_help="link",
    batch=None,
    batch_help="batch",
    iters=5,
    iters_help="timed iterations",
    warmup=1,
    warmup_help="untimed iterations",
    timeout_s=60.0,
    png_help="chart",
)


def _config(*argv: str) -> BenchConfig:
    parser = argparse.ArgumentParser()
    add_shared_arguments(parser, FLAGS)
    return BenchConfig.from_args(parser.parse_args(list(argv)), FLAGS, ranks_reason="why")


def test_the_flags_defaults_fill_in_what_was_not_given() -> None:
    config = _config()
    assert (config.models, config.nprocs, config.link, config.netem) == (("mlp",), 2, "1gbit", True)
    assert (config.iters, config.warmup, config.timeout_s) == (5, 1, 60.0)
    assert config.batch_for("mlp") == 512 and config.launch_link == config.link_text == "1gbit"
    loopback = _config("--no-netem", "--iters", "3", "--batch-size", "16")
    assert (loopback.link, loopback.netem, loopback.link_text) == (None, False, "loopback")
    assert (loopback.iters, loopback.batch_for("mlp")) == (3, 16)
    assert _config("--models", "mlp, vgg11,mlp").models == ("mlp", "vgg11")
    assert (config.png_path, _config("--png", "out/a.png").png_path) == (None, "out/a.png")
    assert _config("--png", "none").png_path is None  # as interlace simulate spells "no plot"


def test_emulated_compute_names_the_trace_and_runs_the_link_dilated() -> None:
    config = _config("--compute", "emulated:googlenet-k80", "--dilation", "4")
    assert config.models == ("googlenet-k80",)
    assert parse_link(str(config.launch_link)) == pytest.approx(parse_link("1gbit") / 4)


def test_a_job_takes_the_shared_settings() -> None:
    job = _config("--input-shape", "1,8,8", "--classes", "7", "--seed", "3").job(RankJob, "mlp")
    assert (job.model, job.batch, job.input_shape, job.num_classes) == ("mlp", 512, (1, 8, 8), 7)
    assert (job.iters, job.warmup, job.seed, job.compute.emulated) == (5, 1, 3, False)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--models", "resnet1000"], "--models: unknown model 'resnet1000'"),
        (["--model", "mlp", "--models", "vgg11"], "--model and --models contradict"),
        (["--compute", "emulated:googlenet-k80", "--model", "mlp"], "leave out --model"),
        (["-n", "1"], "-n must be >= 2 (why), got 1"),
        (["--timeout", "0"], "--timeout must be > 0 seconds"),
        (["--collective-timeout", "-1"], "--collective-timeout must be > 0 seconds"),
        (["--link", "1gbit", "--no-netem"], "contradict"),
        (["--link", "fast"], "fast"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--iters", "0"], "--iters must be >= 1, got 0"),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    ],
)
def test_bad_shared_flags_are_usage_errors(argv: list[str], needle: str) -> None:
    with pytest.raises(UsageError, match=re.escape(needle)):
        _config(*argv)


def test_names_and_ratios_are_parsed() -> None:
    assert parse_names(" a, b ,a,", None, "models", "model") == ("a", "b")
    assert parse_names("ddp", ("ddp", "wfbp"), "strategies", "strategy") == ("ddp",)
    with pytest.raises(UsageError, match="--strategies: unknown strategy 'x'; choose from ddp"):
        parse_names("ddp,x", ("ddp",), "strategies", "strategy")
    with pytest.raises(UsageError, match="name at least one"):
        parse_names(" , ", None, "models", "model")
    assert parse_ratios("0.5, 1,2,1") == (0.5, 1.0, 2.0)
    for bad in ("0", "-1", "inf", "nan", "one"):
        with pytest.raises(UsageError, match="--ratios"):
            parse_ratios(bad)
    assert math.isfinite(parse_ratios("1e-3")[0])
