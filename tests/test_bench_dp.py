"""``interlace bench dp``: rate selection, rows and tables, a tiny real run, and bad input."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from pathlib import Path

import pytest

from interlace.bench import dp
from interlace.comm.links import parse_link
from interlace.errors import UsageError
from interlace.testing import run_ranks

# ---------------------------------------------------------------------------- rate selection


def test_the_rate_scales_the_reference_all_reduce_to_ratio_times_compute() -> None:
    # 50 ms at 1 Gbit/s, compute 100 ms: ratio 1 wants 100 ms, i.e. half the rate.
    assert dp.rate_for_ratio(1.0, 0.1, 1e9, 0.05).rate_bps == pytest.approx(5e8)
    assert dp.rate_for_ratio(2.0, 0.1, 1e9, 0.05).rate_bps == pytest.approx(2.5e8)
    assert dp.rate_for_ratio(0.5, 0.1, 1e9, 0.05).rate_bps == pytest.approx(1e9)
    assert not dp.rate_for_ratio(1.0, 0.1, 1e9, 0.05).clamped


def test_the_rate_independent_latency_is_kept_out_of_the_scaling() -> None:
    # 10 ms of the 50 ms do not shrink with the rate: 1e9 * 0.04 / (0.2 - 0.01).
    choice = dp.rate_for_ratio(2.0, 0.1, 1e9, 0.05, latency_s=0.01)
    assert choice.rate_bps == pytest.approx(1e9 * 0.04 / 0.19)


def test_rates_outside_the_faithful_range_are_clamped_and_say_so() -> None:
    fast = dp.rate_for_ratio(0.01, 0.1, 1e9, 0.05, min_bps=20e6, max_bps=2.5e9)
    assert fast.rate_bps == 2.5e9 and fast.wanted_bps == pytest.approx(5e10) and fast.clamped
    slow = dp.rate_for_ratio(100.0, 0.1, 1e9, 0.05, min_bps=20e6, max_bps=2.5e9)
    assert slow.rate_bps == 20e6 and slow.wanted_bps == pytest.approx(5e6) and slow.clamped
    # A target below the latency is out of reach at any rate: the fastest one is the closest.
    unreachable = dp.rate_for_ratio(0.05, 0.1, 1e9, 0.05, latency_s=0.01, max_bps=2.5e9)
    assert unreachable.rate_bps == 2.5e9 and math.isinf(unreachable.wanted_bps)


@pytest.mark.parametrize("ratio", [0.0, -1.0, math.nan, math.inf])
def test_a_ratio_must_be_positive(ratio: float) -> None:
    with pytest.raises(UsageError, match="ratio"):
        dp.rate_for_ratio(ratio, 0.1, 1e9, 0.05)


@pytest.mark.parametrize(
    ("rate", "text"),
    [(5e8, "500mbit"), (2.5e9, "2.5gbit"), (1e9, "1gbit"), (43.63e6, "43.6mbit"), (2e4, "20kbit")],
)
def test_rates_are_written_as_links_the_launcher_accepts(rate: float, text: str) -> None:
    assert dp.format_rate(rate) == text
    assert parse_link(text) == pytest.approx(rate, rel=5e-3)
    assert dp.RateChoice(rate, rate).link == text


def test_the_bound_is_forward_plus_the_longer_of_backward_and_all_reduce_plus_step() -> None:
    assert dp.ideal_bound_s(0.1, 0.3, 0.2, 0.01) == pytest.approx(0.41)
    assert dp.ideal_bound_s(0.1, 0.2, 0.3, 0.01) == pytest.approx(0.41)


# ---------------------------------------------------------------------------- rows and tables


def _measurement() -> dp.Measurement:
    return dp.Measurement(
        model="mlp",
        batch=8,
        ranks=4,
        gradient_bytes=1000,
        tensors=4,
        strategies=[
            dp.StrategySamples("ddp", [0.30, 0.20, 0.25], 2, 4),
            dp.StrategySamples("mgwfbp", [0.20, 0.10, 0.125, 0.15], 3, 9, 0.12, 1e-3, 1e-9, "plan"),
        ],
        forward_s=[0.02, 0.03, 0.04],
        backward_s=[0.05, 0.06, 0.07],
        step_s=[0.01, 0.01, 0.01],
        allreduce_s=[0.09, 0.08, 0.10],
        overlapped_s=[0.15, 0.16, 0.14],
    )


def test_rows_carry_medians_speedups_and_the_bound() -> None:
    rows = dp.rows_from_measurement(_measurement(), dp.LaunchContext(1.0, "300mbit"))
    ddp, mgwfbp = rows
    assert ddp.iteration_s == pytest.approx(0.25) and ddp.speedup_vs_ddp == 1.0
    assert mgwfbp.iteration_s == pytest.approx(0.1375)
    assert mgwfbp.speedup_vs_ddp == pytest.approx(0.25 / 0.1375)
    # forward 30 + max(backward 60, all-reduce 90) + step 10 ms; compute 100 ms.
    assert mgwfbp.bound_s == pytest.approx(0.13) and mgwfbp.compute_s == pytest.approx(0.1)
    assert mgwfbp.comm_compute == pytest.approx(0.9)
    assert mgwfbp.time_over_bound == pytest.approx(0.1375 / 0.13)
    assert mgwfbp.contended_bound_s == pytest.approx(0.15)
    assert mgwfbp.time_over_contended == pytest.approx(0.1375 / 0.15)
    assert mgwfbp.iteration_p25_s <= mgwfbp.iteration_s <= mgwfbp.iteration_p75_s
    assert (mgwfbp.buckets, mgwfbp.samples, mgwfbp.plan) == (3, 4, "plan")
    assert {
        "model",
        "ratio",
        "link",
        "strategy",
        "iteration_s",
        "speedup_vs_ddp",
        "bound_s",
    } <= set(mgwfbp.to_dict())


def test_without_ddp_or_an_overlap_run_those_columns_read_dash() -> None:
    measurement = _measurement()
    only = dp.Measurement(
        **{
            **measurement.__dict__,
            "strategies": [dp.StrategySamples("single", [0.2], None, 3)],
            "overlapped_s": [],
        }
    )
    (row,) = dp.rows_from_measurement(only, dp.LaunchContext(None, "loopback"))
    assert row.speedup_vs_ddp is None and row.buckets == "-"
    assert row.contended_bound_s is None and row.time_over_contended is None
    line = dp.format_table([row]).splitlines()[2]
    assert "| single |" in line and line.endswith("| - | - |")


def test_tables_show_every_row_and_a_clamped_link(tmp_path: Path) -> None:
    context = dp.LaunchContext(0.5, "2.5gbit", clamped=True, wanted_link="3.1gbit")
    rows = dp.rows_from_measurement(_measurement(), context)
    table = dp.format_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert "2.5gbit (clamped; wanted 3.1gbit)" in table[2] and "| 1.00x |" in table[2]
    summary = dp.format_summary(rows).splitlines()
    assert len(summary) == 3 and "mgwfbp vs DDP" in summary[0] and "1.82x" in summary[2]
    dp.plot_speedups(rows, tmp_path / "speedups.png")
    assert (tmp_path / "speedups.png").read_bytes()[:4] == b"\x89PNG"


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
    assert dp.parse_variant("mgwfbp/k=auto/fp16") == ("mgwfbp", "auto", "fp16")
    assert dp.parse_variant("wfbp/k=3") == ("wfbp", 3, None)
    assert dp.parse_variant("ddp") == ("ddp", 1, None)


def test_timed_iterations_are_split_into_even_rounds() -> None:
    assert dp._blocks(12, 3) == [4, 4, 4]
    assert dp._blocks(8, 3) == [3, 3, 2]
    assert dp._blocks(2, 5) == [1, 1]


@pytest.mark.parametrize("slots", [1, 2, 3, 4, 5, 6, 7])
def test_round_orders_balance_positions_and_predecessors(slots: int) -> None:
    # A balanced Latin square: over `slots` rounds (2x for an odd count) each slot takes every
    # position equally often and follows every other slot equally often.
    rounds = slots if slots % 2 == 0 else 2 * slots
    orders = [dp._round_order(slots, index) for index in range(rounds)]
    for order in orders:
        assert sorted(order) == list(range(slots))
    per_round = rounds // slots
    for position in range(slots):
        assert Counter(order[position] for order in orders) == dict.fromkeys(
            range(slots), per_round
        )
    follows = Counter((a, b) for order in orders for a, b in itertools.pairwise(order))
    expected = {(a, b): per_round for a in range(slots) for b in range(slots) if a != b}
    assert follows == expected


def test_the_old_rotation_would_have_kept_predecessors() -> None:
    # The reason for the design: with 6 slots, 5 rounds already put every slot behind at
    # least 3 different ones (a rotation gives each exactly one).
    orders = [dp._round_order(6, index) for index in range(5)]
    for slot in range(6):
        before = {order[order.index(slot) - 1] for order in orders if order.index(slot) > 0}
        assert len(before) >= 3


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
    assert "| model | batch | target ratio | link |" in out and "| mlp | 16 | - | loopback |" in out
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
        (["--input-shape", "3,0,32"], "positive"),
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


def test_a_malformed_flag_is_an_argparse_error_with_status_2() -> None:
    with pytest.raises(SystemExit) as exc:
        dp.main(["--iters", "many"])
    assert exc.value.code == 2


def test_run_raises_usage_error_for_the_lead_cli() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    dp.add_arguments(parser)
    with pytest.raises(UsageError, match="unknown model"):
        dp.run(parser.parse_args(["--models", "nope"]))


def _completion_before_wait() -> tuple[float, float, int]:
    import time

    import torch
    import torch.distributed as dist

    tensor = torch.ones(64)
    issued = time.perf_counter()
    handle = dist.all_reduce(tensor, async_op=True)
    ends = dp.record_completion(handle)
    time.sleep(0.5)  # stands in for a backward that outlasts the all-reduce
    handle.wait()
    waited = time.perf_counter()
    return ends[0] - issued, waited - issued, len(ends)


def test_record_completion_gives_the_collectives_own_end() -> None:
    # A wait after a long backward returns no earlier than that backward; the recorded end is
    # the all-reduce's, long before.
    for own, waited, count in run_ranks(_completion_before_wait, 2, timeout=120):
        assert count == 1
        assert waited >= 0.5
        assert 0.0 < own < 0.4
