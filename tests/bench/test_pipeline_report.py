"""``interlace bench pipeline``'s rows: rows, table, header and timeline from synthetic launch
values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from interlace.bench.pipeline_report import (
    Regime,
    describe_schedule,
    fill_drain_fraction,
    format_header,
    format_regime,
    format_table,
    rows_from_value,
    timeline_from_events,
)


def test_fill_and_drain_per_mini_batch_or_per_block() -> None:
    # A flush fills and drains once per mini-batch of M micro-batches: (N-1)/(M+N-1).
    assert fill_drain_fraction("gpipe", 4, 6, 4) == pytest.approx(3 / 7)
    assert fill_drain_fraction("torch-1f1b", 4, 6, 4) == pytest.approx(3 / 7)
    # A stream does so once per block of K mini-batches: (N-1)/(K+N-1).
    assert fill_drain_fraction("spectrain", 4, 6, 4) == pytest.approx(3 / 9)
    assert fill_drain_fraction("dp", 4, 6, 4) == 0.0
    assert "flush" in describe_schedule("1f1b", 4, 4)
    assert "predicted" in describe_schedule("spectrain", 4, 4)
    assert "4 x 1/4" in describe_schedule("dp", 4, 4)
    assert describe_schedule("spectrain", 4, 8, 4).startswith("4 stages x 2 replicas")
    assert "MG-WFBP" in describe_schedule("gpipe", 4, 8, 2)
    assert describe_schedule("gpipe", 4, 8, 2, "bf16").endswith("buckets sent as bf16")
    assert "bf16" not in describe_schedule("gpipe", 4, 4, None, "bf16")
    assert "DDP per stage" in describe_schedule("torch-1f1b", 4, 8, 2)
    assert "stages x" not in describe_schedule("torch-1f1b", 4, 4)


def _regime(link: str = "100mbit", link_bps: float | None = 100e6) -> Regime:
    return Regime(
        model="m",
        ranks=4,
        link=link,
        link_bps=link_bps,
        batch=64,
        microbatches=4,
        parameters=10_000_000,
        gradient_bytes=40_000_000,
        boundary_bytes=[4_000_000, 2_000_000, 1_000_000],
    )


def _value() -> dict[str, Any]:
    # Blocks of 2 mini-batches of 64 = 128 samples each.
    return {
        "block_s": {
            "gpipe": [2.0, 1.0, 4.0],
            "spectrain": [0.5, 0.5, 0.5],
            "dp": [4.0, 4.0, 4.0],
            "torch-gpipe": [1.0, 1.0, 1.0],
        },
        "stage_stats": {
            "gpipe": {"compute_s": [0.1, 0.2, 0.3, 0.4], "comm_s": [0.0, 0.1, 0.1, 0.1]},
            "spectrain": {"compute_s": [0.1, 0.1, 0.1, 0.1], "comm_s": [0.0, 0.0, 0.0, 0.0]},
        },
        "losses": {"gpipe": 2.3, "spectrain": 2.2, "dp": 2.25, "torch-gpipe": None},
        "cpu_s": {"gpipe": [2.0, 1.0, 4.0], "spectrain": [1.0, 0.5, 0.5]},
    }


def test_rows_give_the_median_rate_and_ratios_of_the_same_launch() -> None:
    rows = rows_from_value(_value(), _regime(), block=2)
    by = {row.schedule: row for row in rows}
    assert [row.schedule for row in rows] == ["gpipe", "spectrain", "dp", "torch-gpipe"]
    assert by["gpipe"].samples_per_s == pytest.approx(64.0)  # median of 64, 128, 32
    assert by["gpipe"].samples_per_s_p25 == pytest.approx(48.0)
    assert by["gpipe"].samples_per_s_p75 == pytest.approx(96.0)
    assert by["spectrain"].samples_per_s == pytest.approx(256.0)
    assert by["spectrain"].vs_torch_gpipe == pytest.approx(2.0)
    assert by["spectrain"].vs_dp == pytest.approx(8.0)
    assert by["torch-gpipe"].vs_torch_gpipe == pytest.approx(1.0)
    assert by["gpipe"].stage_compute_s == [0.1, 0.2, 0.3, 0.4]
    assert by["dp"].stage_compute_s is None and by["dp"].mean_loss == 2.25
    assert by["spectrain"].fill_drain == pytest.approx(3 / 5)
    # CPU seconds of all ranks: the median block's per mini-batch, and over the wall time.
    assert by["gpipe"].cpu_s_per_minibatch == pytest.approx(1.0)
    assert by["gpipe"].cores_busy == pytest.approx(1.0)
    assert by["spectrain"].cores_busy == pytest.approx(1.0)
    assert by["dp"].cpu_s_per_minibatch is None and by["dp"].cores_busy is None
    record = by["spectrain"].to_dict()
    assert record["model"] == "m" and record["schedule"] == "spectrain"
    assert record["samples_per_s"] == pytest.approx(256.0)
    assert record["regime"] == _regime().to_dict()  # the JSON row carries its model's regime
    json.dumps(record)


def test_ratios_are_dashes_without_their_baselines() -> None:
    value = _value()
    del value["block_s"]["torch-gpipe"], value["block_s"]["dp"]
    rows = rows_from_value(value, _regime(), block=2)
    assert all(row.vs_torch_gpipe is None and row.vs_dp is None for row in rows)
    spectrain = rows[1]
    assert spectrain.description == "async 1F1B, predicted, 4 chunks"
    assert spectrain.samples_per_s_p25 == spectrain.samples_per_s_p75 == pytest.approx(256.0)
    assert spectrain.cpu_s_per_minibatch == pytest.approx(0.25)
    assert len(format_table(rows).splitlines()) == 2 + len(rows)


def test_the_table_has_the_promised_columns() -> None:
    rows = rows_from_value(_value(), _regime(), block=2)
    header, rule, *lines = format_table(rows).splitlines()
    for column in ("model", "schedule", "samples/s", "vs torch-gpipe", "vs dp", "cores busy"):
        assert f" {column} |" in header
    assert all(line.count("|") == header.count("|") == rule.count("|") for line in lines)
    assert [row.schedule for row in rows] == ["gpipe", "spectrain", "dp", "torch-gpipe"]
    assert len(lines) == len(rows)
    torch_gpipe, spectrain, dp = rows[3], rows[1], rows[2]
    assert torch_gpipe.vs_torch_gpipe == pytest.approx(1.0)
    assert (spectrain.vs_torch_gpipe, spectrain.vs_dp) == pytest.approx((2.0, 8.0))
    assert (spectrain.cpu_s_per_minibatch, spectrain.cores_busy) == pytest.approx((0.25, 1.0))
    assert dp.vs_dp == pytest.approx(1.0) and dp.cores_busy is None  # no CPU times for dp


def test_the_regime_says_which_side_is_communication_bound() -> None:
    text = format_regime(_regime())
    assert "4.00 MB, 2.00 MB, 1.00 MB" in text and "40.00 MB of gradients" in text
    # 4 MB at 12.5 MB/s is 320 ms; a ring all-reduce sends 1.5 x 40 MB: 4800 ms.
    assert ">= 320 ms" in text and ">= 4800 ms" in text
    assert "dp is the communication-bound side" in text
    heavy = Regime(**{**_regime().to_dict(), "gradient_bytes": 1_000_000})
    assert "the pipeline is the communication-bound side" in format_regime(heavy)
    loopback = format_regime(_regime("loopback", None))
    assert " ms" not in loopback and "communication-bound" not in loopback
    header = format_header(
        [_regime()],
        ranks=4,
        link="100mbit",
        batch=64,
        microbatches=4,
        block=6,
        iters=3,
        warmup=2,
    )
    assert "4 ranks = 4 pipeline stages on 100mbit" in header
    assert "4 micro-batches of 16" in header and "dp: 16 per rank" in header
    assert header.splitlines()[-1] == text


def test_the_timeline_has_a_lane_per_stage_per_schedule(tmp_path: Path) -> None:
    def event(name: str, category: str, stage: int, start: float, batch: int) -> dict[str, Any]:
        return {
            "name": name,
            "category": category,
            "start_s": start,
            "end_s": start + 0.01,
            "lane": "compute",
            "process": f"stage {stage}",
            "args": {"batch": batch},
        }

    events = {
        "spectrain": [
            event("backward", "backward", 1, 100.03, 0),
            event("forward", "forward", 0, 100.0, 0),
            event("recv act", "comm", 1, 100.01, 0),
        ],
        "gpipe": [
            event("forward", "forward", 0, 200.0, 0),
            event("update", "optimizer", 1, 200.1, 1),
        ],
    }
    timeline = timeline_from_events(
        events, {"spectrain": 100.0, "gpipe": 200.0}, {"gpipe": "4 micro-batches, flush"}
    )
    assert timeline.lanes() == [
        ("spectrain", "stage 0"),
        ("spectrain", "stage 1"),
        ("gpipe (4 micro-batches, flush)", "stage 0"),
        ("gpipe (4 micro-batches, flush)", "stage 1"),
    ]
    first = timeline.events[0]
    assert first.name == "F0" and first.start_s == pytest.approx(0.0)
    assert [e.name for e in timeline.events[1:3]] == ["recv act", "B0"]
    assert timeline.events[-1].start_s == pytest.approx(0.1)
    assert timeline.to_png(tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
