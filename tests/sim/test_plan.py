"""The planner: every family ranked on a tiny trace, what it leaves out and why, bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from interlace.errors import UsageError
from interlace.sim import plan_command
from interlace.sim.network import parse_network
from interlace.sim.plan import FAMILIES, plan
from interlace.sim.trace import ActivationTrace, FactorTrace, TensorTrace, Trace


def tiny(params: int = 4_000_000, *, activations: bool = True, factors: bool = True) -> Trace:
    """Four equal layers of ``params`` bytes each, 1 ms forward and 2 ms backward per layer."""
    names = ["l0", "l1", "l2", "l3"]
    ms = 1e-3
    return Trace(
        "tiny",
        tuple(TensorTrace(f"{n}.w", n, params // 4, params, ms, 2 * ms) for n in reversed(names)),
        forward_s=4 * ms,
        backward_s=8 * ms,
        step_s=0.4 * ms,
        activations=tuple(ActivationTrace(n, (64,)) for n in names) if activations else (),
        factors=tuple(FactorTrace(n, 33, 32) for n in names) if factors else (),
        batch_size=8,
        source="interlace trace --model tiny --batch-size 8",
    )


def test_every_family_is_ranked_fastest_first_with_its_flags() -> None:
    result = plan(tiny(), parse_network("ring:10gbit"), 8)
    families = {c.family for c in result.candidates}
    assert families == set(FAMILIES)
    speeds = [c.throughput for c in result.candidates]
    assert speeds == sorted(speeds, reverse=True)
    assert all(c.global_batch == 8 * 8 for c in result.candidates)  # the same global batch
    pipelines = [c for c in result.candidates if c.family == "pipeline"]
    assert {c.name.split()[1] for c in pipelines} == {"2x4", "4x2"}
    spectrain = next(c for c in pipelines if c.name == "spectrain 2x4")
    assert spectrain.asynchronous
    assert spectrain.flags == (
        "interlace train --model tiny -n 8 --batch-size 16 --parallel pipeline --stages 2 "
        "--schedule spectrain --chunks 1 --strategy mgwfbp"
    )
    assert not next(c for c in pipelines if c.name.startswith("gpipe")).asynchronous


def test_slow_links_favour_pipelines_and_fast_ones_data_parallelism() -> None:
    # 16 MB of gradients per GPU over 100 Mbit/s: data parallelism waits on its all-reduce,
    # a 4 x 2 pipeline averages a quarter of them over 2 replicas.
    slow = plan(tiny(), parse_network("ring:100mbit"), 8, families=("data", "pipeline"))
    assert slow.candidates[0].family == "pipeline"
    assert slow.candidates[0].bound == "all-reduce"
    # Tiny gradients on a fast link: data parallelism is compute-bound and beats every
    # synchronous pipeline (their bubbles); an asynchronous stream has none, and shares the
    # optimizer step out among its stages: it edges ahead, compute-bound too.
    fast = plan(tiny(4_000), parse_network("ring:100gbit:1us"), 8, families=("data", "pipeline"))
    synchronous = [c for c in fast.candidates if not c.asynchronous]
    assert synchronous[0].family == "data"
    assert synchronous[0].bound == "compute"
    assert fast.candidates[0].asynchronous
    assert "wins, bounded by compute" in fast.why()


def test_families_a_trace_cannot_price_are_left_out_with_a_reason() -> None:
    bare = tiny(activations=False, factors=False)
    result = plan(bare, parse_network("ring:10gbit"), 4)
    assert {c.family for c in result.candidates} == {"data"}
    assert any(
        line.startswith("pipeline left out: the trace has no activation")
        for line in result.left_out
    )
    assert any(line.startswith("kfac left out") for line in result.left_out)


def test_a_memory_limit_leaves_out_what_does_not_fit() -> None:
    everything = plan(tiny(), parse_network("ring:10gbit"), 4, families=("data", "pipeline"))
    data = next(c for c in everything.candidates if c.family == "data")
    assert data.memory_bytes == pytest.approx(4 * 16e6 + 4 * 64 * 4 * 8)
    fits = plan(
        tiny(),
        parse_network("ring:10gbit"),
        4,
        families=("data", "pipeline"),
        gpu_memory_bytes=data.memory_bytes - 1,
    )
    assert {c.family for c in fits.candidates} == {"pipeline"}
    assert any("over" in line for line in fits.left_out)


def test_bad_worker_counts_and_node_sizes_are_one_line_errors() -> None:
    network = parse_network("ring:10gbit")
    with pytest.raises(UsageError, match="positive integers"):
        plan(tiny(), network, 0)
    with pytest.raises(UsageError, match="does not divide 12"):
        plan(tiny(), network, 12, gpus_per_node=8)
    with pytest.raises(UsageError, match="unknown family"):
        plan(tiny(), network, 4, families=("zero",))


def _args(**given: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan_command.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in given.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize(
    "given, message",
    [
        ({"trace": "vgg11-h200", "network": "two-level:8:fast"}, "two-level takes"),
        ({"trace": "vgg11-h200", "workers": "4,x"}, "'x' is not an integer"),
        ({"trace": "vgg11-h200", "workers": "-8"}, "must be >= 1"),
        ({"trace": "vgg11-h200", "workers": "12", "gpus_per_node": 8}, "does not divide 12"),
        ({"trace": "vgg11-h200", "gpus_per_node": 0}, "positive integer"),
        (
            {"trace": "vgg11-h200", "network": "two-level:8:100gbit:10gbit", "gpus_per_node": 4},
            "contradicts",
        ),
        ({"model": "nosuchnet"}, "has no shipped trace; choose from"),
        ({}, "give --trace T or --model M"),
        ({"trace": "vgg11-h200", "families": "data,zero"}, "'zero' is not a family"),
        ({"trace": "vgg11-h200", "gpu_memory": -1.0}, "positive number of GiB"),
    ],
)
def test_bad_command_input_names_the_value_and_the_choices(
    given: dict[str, object], message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        plan_command.run(_args(**given))


def test_the_command_prints_the_ranking_the_winner_and_its_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = tmp_path / "rows.json"
    args = _args(
        trace="vgg11-h200", workers="8", json=str(rows), network="two-level:4:100gbit:10gbit"
    )
    assert plan_command.run(args) == 0
    out = capsys.readouterr().out
    assert "| 1 | pipeline |" in out
    assert "wins, bounded by" in out
    assert "run it: interlace train --model vgg11 --data synthetic-cifar10 -n 8" in out
    data = json.loads(rows.read_text())
    assert {row["family"] for row in data} == set(FAMILIES)


def test_png_none_draws_no_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    args = _args(trace="vgg11-h200", workers="4", families="data", png="none")
    assert plan_command.run(args) == 0
    assert "plot:" not in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
