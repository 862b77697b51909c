"""Timelines against hand-computed unions and overlaps, the Chrome trace format, and the chart."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from interlace.timeline import CATEGORIES, COMPUTE_CATEGORIES, Event, Timeline

MS = 1e-3
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _iteration() -> Timeline:
    """Forward 0-10 ms, backward 10-30 ms in three layers, buckets 15-25 ms and 28-40 ms.

    Compute covers 0-30 ms. Bucket 0 lies inside the backward pass (10 ms hidden); bucket 1
    overlaps its last 2 ms (2 ms hidden, 10 ms exposed).
    """
    timeline = Timeline(title="hand-built iteration")
    timeline.add("forward", "forward", 0 * MS, 10 * MS, lane="compute")
    timeline.add("layer3.weight", "backward", 10 * MS, 18 * MS, lane="compute")
    timeline.add("layer2.weight", "backward", 18 * MS, 24 * MS, lane="compute")
    timeline.add("layer1.weight", "backward", 24 * MS, 30 * MS, lane="compute")
    timeline.add("bucket 0", "comm", 15 * MS, 25 * MS, lane="comm ch0", bytes=1_200_000, bucket=0)
    timeline.add("bucket 1", "comm", 28 * MS, 40 * MS, lane="comm ch1", bytes=800_000, bucket=1)
    return timeline


# ---------------------------------------------------------------------- events


def test_event_defaults_and_duration() -> None:
    event = Event("bucket 0", "comm", 1.0, 1.25)
    assert event.lane == "comm"  # the lane defaults to the category
    assert event.process == "rank 0"
    assert event.args == {}
    assert event.duration_s == pytest.approx(0.25)


def test_event_keeps_its_own_copy_of_args() -> None:
    details: dict[str, object] = {"bytes": 10}
    event = Event("b", "comm", 0.0, 1.0, args=details)
    details["bytes"] = 99
    assert event.args == {"bytes": 10}
    assert hash(event) == hash(Event("b", "comm", 0.0, 1.0, args={"bytes": 10}))


def test_unknown_category_is_refused_naming_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="allowed: forward, backward, comm"):
        Event("x", "allreduce", 0.0, 1.0)
    with pytest.raises(ValueError, match="unknown categories"):
        Timeline().busy_s(["comm", "network"])


def test_end_before_start_and_non_finite_times_are_refused() -> None:
    with pytest.raises(ValueError, match="before start_s"):
        Event("x", "comm", 2.0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        Event("x", "comm", 0.0, math.inf)
    with pytest.raises(ValueError, match="before start_s"):
        Timeline().add("x", "forward", 1.0, 0.5)
    Event("instant", "other", 3.0, 3.0)  # zero length is allowed


def test_add_passes_extra_keywords_as_args() -> None:
    timeline = Timeline()
    event = timeline.add("b", "comm", 0.0, 1.0, lane="comm ch1", process="rank 1", bytes=5)
    assert timeline.events == [event]
    assert (event.lane, event.process, event.args) == ("comm ch1", "rank 1", {"bytes": 5})


# ---------------------------------------------------------------------- measurements


def test_busy_counts_overlapping_and_nested_intervals_once() -> None:
    timeline = Timeline()
    timeline.add("a", "comm", 0.0, 4.0)
    timeline.add("overlaps a", "comm", 3.0, 6.0, lane="ch1")
    timeline.add("nested in a", "comm", 1.0, 2.0, lane="ch2")
    timeline.add("disjoint", "comm", 8.0, 9.5)
    timeline.add("touching", "comm", 9.5, 10.0)
    timeline.add("instant", "comm", 20.0, 20.0)
    timeline.add("other rank", "comm", 30.0, 31.0, process="rank 1")
    timeline.add("not comm", "forward", 11.0, 19.0)
    # [0, 6] + [8, 10] on rank 0; [30, 31] on rank 1.
    assert timeline.busy_s("comm", process="rank 0") == pytest.approx(6.0 + 2.0)
    assert timeline.busy_s("comm") == pytest.approx(6.0 + 2.0 + 1.0)
    assert timeline.busy_s(["comm", "forward"], "rank 0") == pytest.approx(8.0 + 8.0)
    assert timeline.busy_s("comm", process="rank 7") == 0.0
    assert timeline.busy_s("optimizer") == 0.0


def test_overlap_is_the_intersection_of_the_two_unions() -> None:
    timeline = Timeline()
    timeline.add("f", "forward", 0.0, 5.0)
    timeline.add("b", "backward", 5.0, 10.0)
    timeline.add("c0", "comm", 2.0, 6.0, lane="ch0")
    timeline.add("c1", "comm", 4.0, 7.0, lane="ch1")  # overlaps c0: counted once
    timeline.add("c2", "comm", 9.0, 12.0, lane="ch0")
    timeline.add("c3", "comm", 20.0, 21.0, lane="ch0")  # hidden behind nothing
    # comm union [2, 7] + [9, 12] + [20, 21]; compute [0, 10]; intersection [2, 7] + [9, 10].
    assert timeline.overlap_s(["forward", "backward"], "comm") == pytest.approx(6.0)
    assert timeline.overlap_s("comm", ["forward", "backward"]) == pytest.approx(6.0)
    assert timeline.overlap_s("forward", "backward") == 0.0  # touching is not overlapping
    assert timeline.overlap_s("comm", "comm") == pytest.approx(timeline.busy_s("comm"))


def test_summary_of_a_hand_built_iteration() -> None:
    summary = _iteration().summary()
    assert summary == pytest.approx(
        {
            "span_s": 40 * MS,
            "compute_s": 30 * MS,
            "comm_s": 22 * MS,
            "hidden_comm_s": 12 * MS,
            "exposed_comm_s": 10 * MS,
        }
    )
    assert _iteration().caption() == (
        "span 40.0 ms: compute 30.0 ms, communication 22.0 ms, 12.0 ms hidden (55%), "
        "10.0 ms exposed"
    )


def test_caption_without_communication_or_exposure() -> None:
    timeline = Timeline()
    timeline.add("forward", "forward", 0.0, 2 * MS)
    assert timeline.caption() == "span 2.00 ms: compute 2.00 ms, no communication"
    timeline.add("bucket", "comm", 0.5 * MS, 1.5 * MS)
    assert timeline.caption().endswith("1.00 ms hidden (100%), 0 ms exposed")


def test_summary_per_process() -> None:
    timeline = _iteration()
    timeline.add("slow rank", "comm", 0.0, 50 * MS, process="rank 1")
    assert timeline.summary("rank 0")["exposed_comm_s"] == pytest.approx(10 * MS)
    assert timeline.summary("rank 1") == pytest.approx(
        {
            "span_s": 50 * MS,
            "compute_s": 0.0,
            "comm_s": 50 * MS,
            "hidden_comm_s": 0.0,
            "exposed_comm_s": 50 * MS,
        }
    )
    assert Timeline().summary() == {
        "span_s": 0.0,
        "compute_s": 0.0,
        "comm_s": 0.0,
        "hidden_comm_s": 0.0,
        "exposed_comm_s": 0.0,
    }


def test_every_compute_category_counts_as_compute() -> None:
    timeline = Timeline()
    for index, category in enumerate(COMPUTE_CATEGORIES):
        timeline.add(category, category, float(index), index + 1.0)
    timeline.add("idle", "idle", 10.0, 11.0)
    timeline.add("other", "other", 12.0, 13.0)
    assert timeline.summary()["compute_s"] == pytest.approx(len(COMPUTE_CATEGORIES))
    assert set(COMPUTE_CATEGORIES) < set(CATEGORIES)


# ---------------------------------------------------------------------- shifting and windows


def test_shifted_defaults_to_the_earliest_start() -> None:
    timeline = Timeline(
        [Event("b", "comm", 105.0, 107.0), Event("a", "forward", 100.0, 104.0)], "t"
    )
    shifted = timeline.shifted()
    assert [(e.name, e.start_s, e.end_s) for e in shifted.events] == [
        ("b", 5.0, 7.0),
        ("a", 0.0, 4.0),
    ]
    assert shifted.title == "t"
    assert timeline.events[0].start_s == 105.0  # the original is untouched
    assert [e.start_s for e in timeline.shifted(90.0).events] == [15.0, 10.0]
    assert len(Timeline().shifted()) == 0


def test_window_keeps_overlapping_events_clipped() -> None:
    window = _iteration().window(20 * MS, 30 * MS)
    assert [e.name for e in window.events] == [
        "layer2.weight",
        "layer1.weight",
        "bucket 0",
        "bucket 1",
    ]
    assert [e.start_s / MS for e in window.events] == pytest.approx([20.0, 24.0, 20.0, 28.0])
    assert [e.end_s / MS for e in window.events] == pytest.approx([24.0, 30.0, 25.0, 30.0])
    assert window.events[2].args == {"bytes": 1_200_000, "bucket": 0}
    assert window.summary()["hidden_comm_s"] == pytest.approx(7 * MS)


def test_window_edges_are_half_open() -> None:
    timeline = Timeline()
    timeline.add("ends at start", "forward", 0.0, 1.0)
    timeline.add("starts at end", "forward", 2.0, 3.0)
    timeline.add("instant at start", "other", 1.0, 1.0)
    timeline.add("instant at end", "other", 2.0, 2.0)
    assert [e.name for e in timeline.window(1.0, 2.0).events] == ["instant at start"]
    with pytest.raises(ValueError, match="before its start"):
        timeline.window(2.0, 1.0)


def test_lanes_in_first_appearance_order() -> None:
    timeline = _iteration()
    timeline.add("late", "comm", 0.0, 1.0, lane="comm ch0", process="rank 1")
    timeline.add("step", "optimizer", 40 * MS, 41 * MS)  # lane defaults to "optimizer"
    assert timeline.lanes() == [
        ("rank 0", "compute"),
        ("rank 0", "comm ch0"),
        ("rank 0", "comm ch1"),
        ("rank 1", "comm ch0"),
        ("rank 0", "optimizer"),
    ]
    assert timeline.processes() == ["rank 0", "rank 1"]


# ---------------------------------------------------------------------- Chrome trace


def _two_ranks() -> Timeline:
    timeline = _iteration().shifted(-1234.5)  # perf_counter-like absolute times
    for event in list(timeline.events):
        timeline.add(
            event.name,
            event.category,
            event.start_s + 1 * MS,
            event.end_s + 1 * MS,
            lane=event.lane,
            process="rank 1",
            **event.args,
        )
    return timeline


def test_chrome_trace_structure(tmp_path: Path) -> None:
    timeline = _two_ranks()
    path = timeline.to_chrome_trace(tmp_path / "trace.json")
    document = json.loads(path.read_text())
    assert document["displayTimeUnit"] == "ms"
    events = document["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    metadata = [e for e in events if e["ph"] == "M"]
    assert len(complete) == len(timeline.events) == 12

    first = complete[0]
    assert (first["name"], first["cat"]) == ("forward", "forward")
    assert first["ts"] == pytest.approx(0.0)  # times are relative to the earliest event
    assert first["dur"] == pytest.approx(10_000.0)  # 10 ms in microseconds
    bucket = complete[4]
    assert bucket["ts"] == pytest.approx(15_000.0)
    assert bucket["dur"] == pytest.approx(10_000.0)
    assert bucket["args"] == {"bytes": 1_200_000, "bucket": 0}
    assert complete[6]["ts"] == pytest.approx(1_000.0)  # rank 1 is 1 ms later
    assert min(e["ts"] for e in complete) >= 0.0

    process_names = {e["pid"]: e["args"]["name"] for e in metadata if e["name"] == "process_name"}
    thread_names = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in metadata if e["name"] == "thread_name"
    }
    assert sorted(process_names.values()) == ["rank 0", "rank 1"]
    assert len(set(process_names)) == 2  # processes -> distinct pids
    assert sorted(thread_names.values()) == sorted(["compute", "comm ch0", "comm ch1"] * 2)
    assert len({tid for _, tid in thread_names}) == 6  # lanes -> distinct tids
    for event, original in zip(complete, timeline.events, strict=True):
        assert process_names[event["pid"]] == original.process
        assert thread_names[(event["pid"], event["tid"])] == original.lane
    sort_names = {e["name"] for e in metadata}
    assert {"process_sort_index", "thread_sort_index"} <= sort_names
    # Lanes keep first-appearance order within their process.
    rank0 = next(pid for pid, name in process_names.items() if name == "rank 0")
    order = {
        e["tid"]: e["args"]["sort_index"]
        for e in metadata
        if e["name"] == "thread_sort_index" and e["pid"] == rank0
    }
    lanes_by_order = [thread_names[(rank0, tid)] for tid in sorted(order, key=order.__getitem__)]
    assert lanes_by_order == ["compute", "comm ch0", "comm ch1"]


def test_chrome_trace_round_trip(tmp_path: Path) -> None:
    timeline = _two_ranks()
    timeline.add("step", "optimizer", -1234.5 + 40 * MS, -1234.5 + 42 * MS, nested={"a": [1, 2]})
    timeline.title = "round trip"
    back = Timeline.from_chrome_trace(timeline.to_chrome_trace(tmp_path / "trace.json"))
    assert back.title == "round trip"
    assert len(back.events) == len(timeline.events)
    for original, restored in zip(timeline.events, back.events, strict=True):
        assert (restored.name, restored.category, restored.lane, restored.process) == (
            original.name,
            original.category,
            original.lane,
            original.process,
        )
        assert restored.args == original.args
        assert restored.start_s == pytest.approx(original.start_s, abs=1e-9)
        assert restored.end_s == pytest.approx(original.end_s, abs=1e-9)
    assert back.summary() == pytest.approx(timeline.summary(), abs=1e-9)


def test_chrome_trace_makes_args_json_safe(tmp_path: Path) -> None:
    timeline = Timeline()
    timeline.add(
        "b",
        "comm",
        0.0,
        1.0,
        path=Path("/tmp/x"),
        shape=(2, 3),
        ratio=math.nan,
        flag=True,
        nothing=None,
    )
    path = timeline.to_chrome_trace(tmp_path / "nested" / "trace.json")
    text = path.read_text()
    assert "NaN" not in text  # strict JSON readers refuse it
    args = next(e for e in json.loads(text)["traceEvents"] if e["ph"] == "X")["args"]
    assert args == {
        "path": "/tmp/x",
        "shape": [2, 3],
        "ratio": "nan",
        "flag": True,
        "nothing": None,
    }


def test_foreign_trace_is_read_as_far_as_it_fits(tmp_path: Path) -> None:
    path = tmp_path / "foreign.json"
    path.write_text(
        json.dumps(
            [
                {
                    "ph": "X",
                    "name": "aten::mm",
                    "cat": "cpu_op",
                    "ts": 10,
                    "dur": 5,
                    "pid": 7,
                    "tid": 3,
                },
                {"ph": "B", "name": "ignored", "ts": 0, "pid": 7, "tid": 3},
            ]
        )
    )
    (event,) = Timeline.from_chrome_trace(path).events
    assert (event.name, event.category, event.process, event.lane) == (
        "aten::mm",
        "other",
        "pid 7",
        "tid 3",
    )
    assert (event.start_s, event.end_s) == pytest.approx((10e-6, 15e-6))


# ---------------------------------------------------------------------- PNG


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5_000


def test_png_for_one_process(tmp_path: Path) -> None:
    timeline = _iteration()
    timeline.add("tiny", "other", 5 * MS, 5 * MS + 1e-9, lane="compute")  # drawn 0.5 px wide
    path = timeline.to_png(tmp_path / "one.png")
    assert path == tmp_path / "one.png"
    _assert_png(path)


def test_png_for_several_processes_and_lanes_grows_with_lanes(tmp_path: Path) -> None:
    one = _iteration().to_png(tmp_path / "one.png", title="")
    two = _two_ranks().to_png(tmp_path / "two.png", title="two ranks", width_in=8.0)
    _assert_png(two)
    assert _png_size(two)[1] > _png_size(one)[1]  # height scales with the number of lanes
    assert _png_size(two)[0] < _png_size(one)[0]  # width follows width_in


def test_png_with_events_overlapping_on_one_lane(tmp_path: Path) -> None:
    # Two buckets in flight on one lane, one nested in the other: labels are left off where
    # they would collide, and the chart still renders.
    timeline = _iteration()
    timeline.add("bucket 2", "comm", 16 * MS, 24 * MS, lane="comm ch0")
    timeline.add("instant", "other", 12 * MS, 12 * MS, lane="compute")
    _assert_png(timeline.to_png(tmp_path / "overlap.png"))


def test_png_of_an_empty_timeline_says_no_events(tmp_path: Path) -> None:
    # Documented choice: an empty timeline still writes a valid PNG (reading "no events").
    path = Timeline(title="nothing recorded").to_png(tmp_path / "sub" / "empty.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 1_000


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height in pixels, from the IHDR chunk."""
    data = path.read_bytes()
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
