"""The validation's comparison side: rows of predicted against measured, drawn."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import matplotlib.image
import pytest

from interlace.comm.cost import CostModel
from interlace.errors import UsageError
from interlace.sim.profiled import from_ready
from interlace.sim.trace import Trace
from interlace.sim.validate import (
    ValidateSample,
    ValidationRow,
    plot_validation,
    rounds_cost,
    rows_from_sample,
    run_slice_bytes,
)


def test_the_validation_plot_draws_every_row(tmp_path: Path) -> None:
    def row(strategy: str, ranks: int, predicted: float, measured: float) -> ValidationRow:
        error = (predicted - measured) / measured
        return ValidationRow(
            model="mlp",
            strategy=strategy,
            ranks=ranks,
            link="1gbit",
            predicted_s=predicted,
            measured_s=measured,
            error=error,
            predicted_uncontended_s=predicted,
            compute_slowdown=1.0,
            compute_drift=1.0,
            stream_a=0.001,
            stream_b=1e-8,
            predicted_buckets=1,
            measured_buckets=1,
            comm_compute=0.5,
            cost_a=0.0001,
            cost_b=1e-8,
        )

    rows = [row("wfbp", 2, 0.05, 0.06), row("single", 4, 0.2, 0.19), row("mgwfbp", 2, 0.03, 0.03)]
    path = plot_validation(rows, tmp_path / "out" / "validation.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width > 400 and height > 400
    with pytest.raises(UsageError, match="no validation rows"):
        plot_validation([], tmp_path / "empty.png")


MS = 1e-3


def _toy_trace() -> Trace:
    return from_ready(
        "toy",
        names=["t0", "t1", "t2"],
        layers=["l0", "l1", "l2"],
        numels=[250_000] * 3,
        element_bytes=[4] * 3,
        ready_s=[1 * MS, 2 * MS, 3 * MS],
        forward_s=2 * MS,
        backward_s=3 * MS,
        step_s=1 * MS,
    )


def _sample(
    host: float, copy_out: float, parts: list[int] | None = None, streams: list[float] | None = None
) -> ValidateSample:
    cost = CostModel(1 * MS, 1e-9)
    strategy = SimpleNamespace(
        strategy="single",
        bucket_tensors=[["t0", "t1", "t2"]],
        chosen_channels=1,
        iteration_s=[12 * MS],
        buckets=1,
        bucket_parts=parts,
    )
    measurement = SimpleNamespace(
        model="toy",
        ranks=4,
        gradient_bytes=3_000_000,
        strategies=[strategy],
        forward_s=[2 * MS],
        backward_s=[3 * MS],
        step_s=[1 * MS],
        allreduce_s=[4 * MS],
        overlapped_s=[],
        contention=None,
        tensors=3,
        latency_s=[1 * MS],
        stream_s=streams or [],
    )
    return ValidateSample(
        _toy_trace(),
        cost,
        cost,
        measurement,
        host_s_per_byte=host,
        copy_out_s_per_byte=copy_out,
    )


def test_the_runtime_s_host_work_is_priced_where_it_runs() -> None:
    # One 3 MB bucket; a = 1 ms, b = 1 ms/MB. Without host work: forward 2 + backward 3 +
    # all-reduce 4 + step 1 = 10 ms.
    (plain,) = rows_from_sample(_sample(0.0, 0.0), "link", ["single"])
    assert plain.predicted_s == pytest.approx(10 * MS)
    # Copying in and dividing at 0.5 ms/MB (1.5 ms) delays the all-reduce; copying the
    # averages back at 0.25 ms/MB (0.75 ms) comes before the step: 2 + 4.5 + 4 + 0.75 + 1.
    (row,) = rows_from_sample(_sample(0.5e-9, 0.25e-9), "link", ["single"])
    assert row.predicted_s == pytest.approx(12.25 * MS)
    assert row.error == pytest.approx((12.25 - 12) / 12)


def test_the_run_s_slice_size_is_read_back_from_its_slices() -> None:
    trace = _toy_trace()
    buckets = [["t0"], ["t1", "t2"]]
    # 1 MB and 2 MB buckets: uncut, one slice each; at the 1 MB candidate, 1 and 2 slices.
    assert run_slice_bytes(trace, buckets, [1, 1]) is None
    assert run_slice_bytes(trace, buckets, [1, 2]) == 1e6
    # Nothing recorded, slices no candidate gives, or tensors the trace lacks: uncut.
    assert run_slice_bytes(trace, buckets, None) is None
    assert run_slice_bytes(trace, buckets, [3, 3]) is None
    assert run_slice_bytes(trace, [["t0"], ["t9"]], [1, 2]) is None


def test_the_replay_s_cost_is_what_the_strategies_rounds_measured() -> None:
    # The all-reduce of all 3 MB alone took 4 ms and one float 1 ms: 1 ms/MB. Streams of the
    # three tensors' all-reduces took 9, 30 and 10 ms: the median 10 ms less 3 ms of bytes is
    # 7 ms for three start-ups.
    sample = _sample(0.0, 0.0, streams=[9 * MS, 30 * MS, 10 * MS])
    cost = rounds_cost(sample.stream_cost, sample.measurement)
    assert (cost.a, cost.b) == (pytest.approx(7 / 3 * MS), pytest.approx(1e-9))
    (row,) = rows_from_sample(sample, "link", ["single"])
    assert (row.stream_a, row.stream_b) == (pytest.approx(7 / 3 * MS), pytest.approx(1e-9))
    # forward 2 + backward 3 + one 3 MB all-reduce (7/3 + 3) + step 1.
    assert row.predicted_s == pytest.approx((9 + 7 / 3) * MS)
    # A slower lone all-reduce (7 ms: 2 ms/MB) leaves (10 - 6) / 3 ms per start-up.
    slower = SimpleNamespace(**{**vars(sample.measurement), "allreduce_s": [7 * MS]})
    cost = rounds_cost(sample.stream_cost, slower)
    assert (cost.a, cost.b) == (pytest.approx(4 / 3 * MS), pytest.approx(2e-9))
    # A stream faster than its bytes leaves no start-up, never a negative one; without the
    # rounds' probes the fitted model stands.
    faster = SimpleNamespace(**{**vars(sample.measurement), "stream_s": [1 * MS]})
    assert rounds_cost(sample.stream_cost, faster).a == 0.0
    bare = SimpleNamespace(**{**vars(sample.measurement), "latency_s": [], "stream_s": []})
    assert rounds_cost(sample.stream_cost, bare) == sample.stream_cost
