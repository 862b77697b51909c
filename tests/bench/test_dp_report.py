"""``interlace bench dp``'s rows: rate selection, the bound, rows and tables."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from interlace.bench import dp_rank, dp_report
from interlace.comm.links import parse_link
from interlace.errors import UsageError

# ---------------------------------------------------------------------------- rate selection


def test_the_rate_scales_the_reference_all_reduce_to_ratio_times_compute() -> None:
    # 50 ms at 1 Gbit/s, compute 100 ms: ratio 1 wants 100 ms, i.e. half the rate.
    assert dp_report.rate_for_ratio(1.0, 0.1, 1e9, 0.05).rate_bps == pytest.approx(5e8)
    assert dp_report.rate_for_ratio(2.0, 0.1, 1e9, 0.05).rate_bps == pytest.approx(2.5e8)
    assert dp_report.rate_for_ratio(0.5, 0.1, 1e9, 0.05).rate_bps == pytest.approx(1e9)
    assert not dp_report.rate_for_ratio(1.0, 0.1, 1e9, 0.05).clamped


def test_the_rate_independent_latency_is_kept_out_of_the_scaling() -> None:
    # 10 ms of the 50 ms do not shrink with the rate: 1e9 * 0.04 / (0.2 - 0.01).
    choice = dp_report.rate_for_ratio(2.0, 0.1, 1e9, 0.05, latency_s=0.01)
    assert choice.rate_bps == pytest.approx(1e9 * 0.04 / 0.19)


def test_rates_outside_the_faithful_range_are_clamped_and_say_so() -> None:
    fast = dp_report.rate_for_ratio(0.01, 0.1, 1e9, 0.05, min_bps=20e6, max_bps=2.5e9)
    assert fast.rate_bps == 2.5e9 and fast.wanted_bps == pytest.approx(5e10) and fast.clamped
    slow = dp_report.rate_for_ratio(100.0, 0.1, 1e9, 0.05, min_bps=20e6, max_bps=2.5e9)
    assert slow.rate_bps == 20e6 and slow.wanted_bps == pytest.approx(5e6) and slow.clamped
    # A target below the latency is out of reach at any rate: the fastest one is the closest.
    unreachable = dp_report.rate_for_ratio(0.05, 0.1, 1e9, 0.05, latency_s=0.01, max_bps=2.5e9)
    assert unreachable.rate_bps == 2.5e9 and math.isinf(unreachable.wanted_bps)


@pytest.mark.parametrize("ratio", [0.0, -1.0, math.nan, math.inf])
def test_a_ratio_must_be_positive(ratio: float) -> None:
    with pytest.raises(UsageError, match="ratio"):
        dp_report.rate_for_ratio(ratio, 0.1, 1e9, 0.05)


def test_a_chosen_rate_is_a_link_the_launcher_accepts() -> None:
    choice = dp_report.rate_for_ratio(1.0, 0.1, 1e9, 0.0873)
    assert choice.link == "873mbit" and parse_link(choice.link) == pytest.approx(choice.rate_bps)


def test_the_bound_is_forward_plus_the_longer_of_backward_and_all_reduce_plus_step() -> None:
    assert dp_report.ideal_bound_s(0.1, 0.3, 0.2, 0.01) == pytest.approx(0.41)
    assert dp_report.ideal_bound_s(0.1, 0.2, 0.3, 0.01) == pytest.approx(0.41)


# ---------------------------------------------------------------------------- rows and tables


def _measurement() -> dp_rank.Measurement:
    return dp_rank.Measurement(
        model="mlp",
        batch=8,
        ranks=4,
        gradient_bytes=1000,
        tensors=4,
        strategies=[
            dp_rank.StrategySamples("ddp", [0.30, 0.20, 0.25], 2, 4),
            dp_rank.StrategySamples(
                "mgwfbp", [0.20, 0.10, 0.125, 0.15], 3, 9, 0.12, 1e-3, 1e-9, "plan"
            ),
        ],
        forward_s=[0.02, 0.03, 0.04],
        backward_s=[0.05, 0.06, 0.07],
        step_s=[0.01, 0.01, 0.01],
        allreduce_s=[0.09, 0.08, 0.10],
        overlapped_s=[0.15, 0.16, 0.14],
    )


def test_rows_carry_medians_speedups_and_the_bound() -> None:
    rows = dp_report.rows_from_measurement(_measurement(), dp_report.LaunchContext(1.0, "300mbit"))
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


def test_without_ddp_or_an_overlap_run_those_values_are_none() -> None:
    measurement = _measurement()
    only = dp_rank.Measurement(
        **{
            **measurement.__dict__,
            "strategies": [dp_rank.StrategySamples("single", [0.2], None, 3)],
            "overlapped_s": [],
        }
    )
    (row,) = dp_report.rows_from_measurement(only, dp_report.LaunchContext(None, "loopback"))
    assert row.speedup_vs_ddp is None and row.buckets == "-"
    assert row.contended_bound_s is None and row.time_over_contended is None
    assert dp_report.format_table([row]).count("\n") == 2


def test_tables_show_every_row_and_a_clamped_link(tmp_path: Path) -> None:
    context = dp_report.LaunchContext(0.5, "2.5gbit", clamped=True, wanted_link="3.1gbit")
    rows = dp_report.rows_from_measurement(_measurement(), context)
    assert [(row.link, row.clamped, row.wanted_link) for row in rows] == [
        ("2.5gbit", True, "3.1gbit")
    ] * 2
    assert [row.speedup_vs_ddp for row in rows] == pytest.approx([1.0, 0.25 / 0.1375])
    table = dp_report.format_table(rows).splitlines()
    assert len(table) == 2 + len(rows)
    assert all(line.count("|") == table[0].count("|") for line in table)
    # One summary line per (model, ratio, link), a column per strategy.
    summary = dp_report.format_summary(rows).splitlines()
    assert len(summary) == 3 and "mgwfbp vs DDP" in summary[0]
    dp_report.plot_speedups(rows, tmp_path / "speedups.png")
    assert (tmp_path / "speedups.png").read_bytes()[:4] == b"\x89PNG"


def test_the_host_share_is_the_ranks_cpu_over_the_cores_times_the_iteration() -> None:
    measurement = _measurement()
    ddp = dp_rank.StrategySamples("ddp", [0.2, 0.4, 0.3], 2, 4, host_cpu_s=[0.12, 0.3, 0.18])
    shared = dp_rank.Measurement(**{**measurement.__dict__, "strategies": [ddp], "cores": 2})
    (row,) = dp_report.rows_from_measurement(shared, dp_report.LaunchContext(None, "loopback"))
    # Median CPU 0.18 s of all ranks against 2 cores for the median 0.3 s iteration.
    assert row.host_cpu_share == pytest.approx(0.18 / (2 * 0.3))
    unknown = dp_rank.Measurement(**{**shared.__dict__, "cores": 0})
    (row,) = dp_report.rows_from_measurement(unknown, dp_report.LaunchContext(None, "loopback"))
    assert row.host_cpu_share is None
