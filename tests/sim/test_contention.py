"""The contention fits by hand, and the calibration checked by round trip: the probes' times,
produced by replaying known contention, calibrate back to that contention."""

from __future__ import annotations

import pytest

from interlace.comm.cost import CostModel
from interlace.comm.plan import ReadyTensor
from interlace.comm.pricing import schedule
from interlace.sim.contention import (
    MIXED_BYTES,
    SMALL_BYTES,
    Calibration,
    ContentionSamples,
    calibrate,
    compute_slowdown,
    fit_startup_overlap,
    mixed_sizes,
    overlap_probe_end,
    progress_rate,
)
from interlace.sim.replay import Contention, Replay, replay
from interlace.sim.trace import TensorTrace, Trace

MS = 1e-3


def test_progress_rate_and_compute_slowdown_by_hand() -> None:
    # 6 ms of work alongside a 10 ms backward, done at 12 ms: 4 ms of it during backward.
    assert progress_rate(6 * MS, 10 * MS, 12 * MS) == pytest.approx(0.4)
    # Done within backward at 8 ms: 6 ms of work in 8 ms.
    assert progress_rate(6 * MS, 10 * MS, 8 * MS) == pytest.approx(0.75)
    # Done no later than alone: full speed (never above 1); done after backward plus all of
    # it: no progress (never below 0).
    assert progress_rate(6 * MS, 10 * MS, 5 * MS) == 1.0
    assert progress_rate(6 * MS, 10 * MS, 17 * MS) == 0.0
    # A 10 ms backward took 12 ms with communication in flight for its first 8 ms:
    # 10 = 8/s + 4, so s = 4/3.
    assert compute_slowdown(10 * MS, 12 * MS, 8 * MS) == pytest.approx(4 / 3)
    assert compute_slowdown(10 * MS, 9 * MS, 8 * MS) == 1.0
    # All of the extra and more within the overlap: capped.
    assert compute_slowdown(10 * MS, 20 * MS, 5 * MS) == 100.0


def _stream_probe(contention: Contention, a: float, count: int, backward: float) -> Replay:
    """The start-up probe as the replay plays it: ``count`` tiny all-reduces, all ready as a
    backward of ``backward`` seconds starts."""
    tensors = [ReadyTensor(f"s{i}", 4, 0.0) for i in range(count)]
    plan = schedule([[i] for i in range(count)], tensors, CostModel(a, 0.0), backward_s=backward)
    return replay(plan, contention)


def _flat_probe(contention: Contention, cost: CostModel, nbytes: int, backward: float) -> Replay:
    """The bytes probe: one all-reduce of ``nbytes`` issued as backward starts."""
    plan = schedule([[0]], [ReadyTensor("flat", nbytes, 0.0)], cost, backward_s=backward)
    return replay(plan, contention)


@pytest.mark.parametrize(
    ("truth", "backward_ms"),
    [
        # The stream outlasts backward; the bytes end after it.
        (Contention(compute_slowdown=1.2, transfer_rate=0.6, startup_compute_slowdown=1.5), 10.0),
        # The bytes end within a long backward.
        (Contention(compute_slowdown=1.1, transfer_rate=0.9, startup_compute_slowdown=1.3), 60.0),
        # No contention at all.
        (Contention(), 10.0),
    ],
)
def test_calibration_recovers_the_contention_the_probes_were_played_with(
    truth: Contention, backward_ms: float
) -> None:
    a, cost_b, nbytes, count = 0.5 * MS, 1e-8, 2_000_000, 40
    forward, backward, step, sync = 3 * MS, backward_ms * MS, 1 * MS, 0.7 * MS
    cost = CostModel(a, cost_b)
    stream = _stream_probe(truth, a, count, backward)
    flat = _flat_probe(truth, cost, nbytes, backward)
    allreduce = cost.time(nbytes)
    samples = ContentionSamples(
        stream_count=count,
        stream_backward_s=[stream.backward_end_s],
        stream_done_s=[stream.comm_end_s],
        flat_backward_s=[flat.backward_end_s],
        flat_done_s=[flat.comm_end_s],
        serial_s=[forward + backward + step + allreduce + sync],
    )
    found = calibrate(
        samples, forward_s=forward, backward_s=backward, step_s=step, allreduce_s=allreduce
    )
    assert found is not None
    assert found.startup_s == pytest.approx(a)
    assert found.sync_s == pytest.approx(sync)
    got = found.contention
    assert got.startup_compute_slowdown == pytest.approx(truth.startup_compute_slowdown)
    assert got.transfer_rate == pytest.approx(truth.transfer_rate)
    assert got.compute_slowdown == pytest.approx(truth.compute_slowdown)
    # And the calibrated model replays the probes as they were measured.
    again = _stream_probe(got, found.startup_s, count, backward)
    assert again.comm_end_s == pytest.approx(stream.comm_end_s)
    assert again.backward_end_s == pytest.approx(stream.backward_end_s)
    assert _flat_probe(got, cost, nbytes, backward).comm_end_s == pytest.approx(flat.comm_end_s)


def test_calibration_needs_probes_and_leaves_the_overlap_to_the_trace() -> None:
    def found(samples: ContentionSamples) -> Calibration | None:
        return calibrate(samples, forward_s=0.001, backward_s=0.01, step_s=0.001, allreduce_s=0.01)

    assert found(ContentionSamples()) is None
    probes = ContentionSamples(
        stream_count=4,
        stream_backward_s=[0.01],
        stream_done_s=[0.004],
        flat_backward_s=[0.01],
        flat_done_s=[0.011],
        # Faster than its pieces: no negative synchronisation.
        serial_s=[0.015],
    )
    calibration = found(probes)
    assert calibration is not None
    assert calibration.contention.startup_overlap == 0.0
    assert calibration.sync_s == 0.0


def _trace(count: int, backward_ms: float) -> Trace:
    """``count`` one-tensor layers whose gradients come evenly over a backward."""
    layer = backward_ms * MS / count
    return Trace(
        "probe",
        tuple(TensorTrace(f"t{i}", f"l{i}", 1, 4, 0.0, layer) for i in range(count)),
        forward_s=1 * MS,
        # A hair past the last layer, which the sum of the layers may round above.
        backward_s=backward_ms * MS + 1e-9,
    )


def test_overlap_probe_end_by_hand() -> None:
    # Two tensors, ready at 0 and at the 0 ms backward's end: a 256-byte then a 128 KB
    # all-reduce (a = 1 ms, 10 ns/byte: 2.56 us and 1.31072 ms of bytes), serial with no
    # overlap: 1.00256 ms, then 1 + 1.31072 ms more.
    trace = _trace(2, 0.0)
    timing = CostModel(1 * MS, 1e-8)
    serial = overlap_probe_end(trace, timing, Contention(), 0.0)
    assert serial == pytest.approx(2 * MS + (SMALL_BYTES + MIXED_BYTES) * 1e-8)
    # With full overlap the second start-up runs behind the first's 2.56 us of bytes.
    full = overlap_probe_end(trace, timing, Contention(), 1.0)
    assert full == pytest.approx(serial - SMALL_BYTES * 1e-8)
    assert mixed_sizes(5) == [SMALL_BYTES, MIXED_BYTES, SMALL_BYTES, MIXED_BYTES, SMALL_BYTES]


@pytest.mark.parametrize("truth", [0.0, 0.3, 0.6, 0.9, 1.0])
def test_the_overlap_is_found_from_the_probe_it_was_played_with(truth: float) -> None:
    # 12 tensors over a 4 ms backward, start-ups of 0.5 ms, 128 KB in 1.3 ms: start-ups wait
    # behind bytes, so the probe's end moves with the overlap.
    trace = _trace(12, 4.0)
    timing = CostModel(0.5 * MS, 1e-8)
    contention = Contention(compute_slowdown=1.2, transfer_rate=0.7, startup_compute_slowdown=1.4)

    def end(overlap: float) -> float:
        return overlap_probe_end(trace, timing, contention, overlap)

    samples = ContentionSamples(mixed_done_s=[end(truth), end(truth) * 0.9, end(truth) * 1.1])
    found = fit_startup_overlap(samples, trace, timing, contention)
    assert found is not None
    # The found overlap replays the probe as it was measured; it is the least that does, so
    # where the end falls with the overlap (up to 0.8 here; beyond, start-ups behind bytes take
    # enough of compute's cycles to delay it again) it is the overlap the probe was played with.
    assert end(found) == pytest.approx(end(truth), rel=1e-4)
    assert found <= truth + 1e-3
    if truth <= 0.6:
        assert found == pytest.approx(truth, abs=1e-3)
    # Later than serial is 0; earlier than any overlap gives is the overlap that comes closest.
    late = ContentionSamples(mixed_done_s=[end(0.0) * 2])
    early = ContentionSamples(mixed_done_s=[1e-6])
    assert fit_startup_overlap(late, trace, timing, contention) == 0.0
    closest = fit_startup_overlap(early, trace, timing, contention)
    assert closest is not None
    assert all(end(closest) <= end(step / 20) for step in range(21))
    assert fit_startup_overlap(ContentionSamples(), trace, timing, contention) is None
