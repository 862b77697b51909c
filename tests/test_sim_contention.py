"""The replay's contention model worked by hand, and its calibration checked by round trip: the
probes' times, produced by replaying known contention, calibrate back to that contention."""

from __future__ import annotations

import math

import pytest

from interlace.comm.cost import CostModel
from interlace.comm.plan import ReadyTensor, schedule
from interlace.sim.contention import (
    Calibration,
    ContentionSamples,
    calibrate,
    compute_slowdown,
    progress_rate,
)
from interlace.sim.engine import Contention, Replay, replay

MS = 1e-3


def test_bytes_progress_at_their_rate_while_backward_computes() -> None:
    # One 1 MB tensor ready at 0; a = 2 ms, b = 4 ms/MB; backward lasts 10 ms.
    # The start-up is priced as paid beside backward: 0..2 ms. Bytes at 1/4 from 2 to 10 ms:
    # 2 of 4 ms done; the other 2 ms at full speed after backward: ends at 12 ms.
    tensors = [ReadyTensor("t0", 1_000_000, 0.0)]
    plan = schedule([[0]], tensors, CostModel(2 * MS, 4e-9), backward_s=10 * MS)
    played = replay(plan, Contention(transfer_rate=0.25))
    assert played.backward_end_s == pytest.approx(10 * MS)
    assert played.comms[0].end_s == pytest.approx(12 * MS)
    # With no contention it is the plan's own time: 0..6 ms.
    assert replay(plan).comms[0].end_s == pytest.approx(6 * MS)


def test_compute_slows_by_the_phase_in_flight() -> None:
    # A start-up (a = 2 ms, no bytes) slows the 10 ms backward to 1/2 while it runs, 0..2 ms:
    # 1 ms of compute done, the other 9 ms at full speed, so backward ends at 11 ms.
    tensors = [ReadyTensor("t0", 4, 0.0)]
    plan = schedule([[0]], tensors, CostModel(2 * MS, 0.0), backward_s=10 * MS)
    played = replay(plan, Contention(startup_compute_slowdown=2.0))
    assert played.backward_end_s == pytest.approx(11 * MS)
    assert played.comms[0].end_s == pytest.approx(2 * MS)
    # A slowdown while bytes are in flight does not apply to a start-up.
    only_bytes = replay(plan, Contention(compute_slowdown=3.0))
    assert only_bytes.backward_end_s == pytest.approx(10 * MS)
    # Bytes (b = 4 ms/MB, 1 MB, at full speed) slow compute by 3 from 2 to 6 ms: 4/3 ms of
    # compute there, 2 ms before; the remaining 8 - 4/3 ms after, so backward ends at 12 2/3 ms.
    big = [ReadyTensor("t0", 1_000_000, 0.0)]
    plan_big = schedule([[0]], big, CostModel(2 * MS, 4e-9), backward_s=10 * MS)
    slowed = replay(plan_big, Contention(compute_slowdown=3.0))
    assert slowed.comms[0].end_s == pytest.approx(6 * MS)
    assert slowed.backward_end_s == pytest.approx((6 + 10 - 2 - 4 / 3) * MS)


def test_a_startup_can_run_behind_the_previous_transfer() -> None:
    # Bucket 0: 1 MB (a = 1 ms, bytes 10 ms), bucket 1: 4 bytes, both ready at 0, backward 0.
    # One at a time: 0..11, 11..12 ms. With a start-up behind a transfer, bucket 1's start-up
    # runs 1..2 ms while bucket 0's bytes are on the wire; its (nil) bytes follow at 11 ms.
    tensors = [ReadyTensor("big", 1_000_000, 0.0), ReadyTensor("tiny", 4, 0.0)]
    plan = schedule([[0], [1]], tensors, CostModel(1 * MS, 1e-8), backward_s=0.0)
    serial = replay(plan)
    assert [c.end_s for c in serial.comms] == pytest.approx([11 * MS, 12 * MS], abs=1e-7)
    behind = replay(plan, Contention(startup_behind_transfer=True))
    assert [c.start_s for c in behind.comms] == pytest.approx([0.0, 1 * MS])
    assert [c.end_s for c in behind.comms] == pytest.approx([11 * MS, 11 * MS], abs=1e-7)
    # Two start-ups never overlap: a third bucket waits for the second's start-up to end.
    three = [*tensors, ReadyTensor("tiny2", 4, 0.0)]
    plan3 = schedule([[0], [1], [2]], three, CostModel(1 * MS, 1e-8), backward_s=0.0)
    ends = [c.end_s for c in replay(plan3, Contention(startup_behind_transfer=True)).comms]
    assert ends == pytest.approx([11 * MS, 11 * MS, 12 * MS], abs=1e-7)


def test_contention_rejects_impossible_numbers() -> None:
    with pytest.raises(ValueError, match="transfer_rate"):
        Contention(transfer_rate=1.5)
    with pytest.raises(ValueError, match="transfer_rate"):
        Contention(transfer_rate=-0.1)
    with pytest.raises(ValueError, match="startup_compute_slowdown"):
        Contention(startup_compute_slowdown=0.5)
    with pytest.raises(ValueError, match="compute_slowdown"):
        Contention(compute_slowdown=math.inf)


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


def test_calibration_needs_probes_and_keeps_the_backends_overlap() -> None:
    def found(samples: ContentionSamples) -> Calibration | None:
        return calibrate(
            samples,
            forward_s=0.001,
            backward_s=0.01,
            step_s=0.001,
            allreduce_s=0.01,
            startup_behind_transfer=True,
        )

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
    assert calibration.contention.startup_behind_transfer
    assert calibration.sync_s == 0.0
