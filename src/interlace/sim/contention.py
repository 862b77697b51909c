"""How communication and compute slow each other on shared cores, fitted from probes.

:class:`ContentionSamples` holds the probes' samples (taken on the ranks by
:class:`interlace.bench.probes.ContentionProbe`); :func:`calibrate` and
:func:`fit_startup_overlap` turn them into the replay's :class:`~interlace.sim.replay.Contention`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from interlace.comm.cost import CostModel
from interlace.sim.replay import Contention
from interlace.sim.simulation import simulate
from interlace.sim.trace import Trace

#: Bytes of each all-reduce in the start-up probe: a norm layer's parameter, all start-up.
SMALL_BYTES = 256
#: Bytes of every second all-reduce in the overlap probe: the size of a mid-sized layer's
#: weight, long enough on the wire for the next start-up to run behind it.
MIXED_BYTES = 128 * 1024
#: Steps of the grid :func:`fit_startup_overlap` scans the overlap on, before bisecting.
OVERLAP_GRID = 20
#: The most a compute slowdown is taken to be (a pair that took as long as both in series).
MAX_SLOWDOWN = 100.0


@dataclass
class ContentionSamples:
    """Per-round samples (seconds, maxima over ranks) of the probes of the plain module.

    Args:
        stream_count: All-reduces in the start-up stream (one per gradient tensor).
        stream_backward_s: Backward of a plain iteration whose hooks issue a small all-reduce
            per tensor (the start-up probe).
        stream_done_s: From that backward's start to the end of its last all-reduce.
        mixed_backward_s: Backward of the overlap probe (every second all-reduce
            :data:`MIXED_BYTES` long).
        mixed_done_s: From its start to the end of its last all-reduce.
        flat_backward_s: Backward with one all-reduce of all gradients issued as it starts
            (the bytes probe).
        flat_done_s: From that backward's start to the all-reduce's end.
        serial_s: Plain iterations with that all-reduce after backward, run back to back.
    """

    stream_count: int = 0
    stream_backward_s: list[float] = field(default_factory=list)
    stream_done_s: list[float] = field(default_factory=list)
    mixed_backward_s: list[float] = field(default_factory=list)
    mixed_done_s: list[float] = field(default_factory=list)
    flat_backward_s: list[float] = field(default_factory=list)
    flat_done_s: list[float] = field(default_factory=list)
    serial_s: list[float] = field(default_factory=list)

    def medians(self) -> dict[str, float]:
        """Each sample list's median (and the stream's length), for reports."""
        values: dict[str, float] = {"stream_count": float(self.stream_count)}
        for name in (
            "stream_backward_s",
            "stream_done_s",
            "mixed_backward_s",
            "mixed_done_s",
            "flat_backward_s",
            "flat_done_s",
            "serial_s",
        ):
            samples = getattr(self, name)
            if samples:
                values[name] = statistics.median(samples)
        return values


def progress_rate(alone_s: float, backward_s: float, done_s: float, head_s: float = 0.0) -> float:
    """The fraction of its idle speed at which communication progressed while backward ran.

    Work that takes ``alone_s`` on idle cores was issued as a backward of ``backward_s`` began
    and ended ``done_s`` after it. ``head_s`` seconds at the start were spent on something else
    (e.g. start-ups priced separately) and are not counted. If the work ended within backward it
    ran at ``alone_s / done_s`` throughout; otherwise it ran at full speed after backward, so
    backward saw ``alone_s - (done_s - backward_s)`` of it. Clamped to [0, 1].

    Args:
        alone_s: The work's time on idle cores.
        backward_s: The backward it ran beside.
        done_s: When the work ended, from backward's start.
        head_s: Seconds at the start spent on something else, not counted.
    """
    if alone_s <= 0.0:
        return 1.0
    window = min(done_s, backward_s) - head_s
    if window <= 0.0:
        return 1.0 if done_s <= backward_s else 0.0
    progressed = alone_s if done_s <= backward_s else alone_s - (done_s - backward_s)
    return min(max(progressed / window, 0.0), 1.0)


def compute_slowdown(
    plain_s: float,
    backward_s: float,
    done_s: float,
    head_s: float = 0.0,
    head_slowdown: float = 1.0,
) -> float:
    """The factor compute slowed by while communication was in flight.

    A backward of ``plain_s`` alone took ``backward_s`` with communication in flight from its
    start until ``overlap = min(done_s, backward_s)``, the first ``head_s`` of it at a known
    ``head_slowdown``: ``plain_s = head_s / head_slowdown + (overlap - head_s) / s +
    (backward_s - overlap)``, solved for ``s``. At least 1, at most :data:`MAX_SLOWDOWN`.

    Args:
        plain_s: Backward alone.
        backward_s: Backward with communication in flight.
        done_s: When the communication ended, from backward's start.
        head_s: Seconds at the start slowed by ``head_slowdown`` instead.
        head_slowdown: The known slowdown of the first ``head_s``.
    """
    overlap = min(done_s, backward_s)
    window = overlap - head_s
    if window <= 0.0 or backward_s <= plain_s:
        return 1.0
    room = plain_s - backward_s + overlap - head_s / head_slowdown
    if room <= window / MAX_SLOWDOWN:
        return MAX_SLOWDOWN
    return min(max(window / room, 1.0), MAX_SLOWDOWN)


@dataclass(frozen=True)
class Calibration:
    """What the probes say about this machine, for the replay.

    Args:
        contention: How compute and communication slow each other.
        startup_s: Seconds per all-reduce start-up, as the start-up probe paced them.
        sync_s: Seconds an iteration spends synchronising that its pieces timed apart do not
            show: the plain iteration with its all-reduce, run back to back, less its forward,
            backward, step and all-reduce each timed after a barrier (ranks drifting apart over
            compute and waiting for the slowest, and waking from the wait). At least 0.
    """

    contention: Contention
    startup_s: float
    sync_s: float


def calibrate(
    samples: ContentionSamples,
    *,
    forward_s: float,
    backward_s: float,
    step_s: float,
    allreduce_s: float,
) -> Calibration | None:
    """:class:`Calibration` from the probes and the plain module's medians in the same rounds
    (forward, backward, step, one all-reduce of all gradients); None without probes.

    The start-up probe's all-reduces were issued from backward's hooks, one per gradient
    tensor, as per-tensor WFBP issues them; on this machine they are bound by their start-ups
    (backward produces tensors faster than they go), so the stream's pace, its end over its
    length, is the start-up as such a stream pays it. That pace already includes backward's
    company, so the replay runs start-ups at it throughout (a stream on idle cores is no faster
    here, its threads wake slower); the stream's backward gives the compute
    slowdown while start-ups are in flight. The all-reduce of all gradients is one start-up
    and then bytes: its end gives the transfer rate and its backward the compute slowdown while
    bytes are in flight. The contention's start-up overlap is left at 0: it needs the model's
    trace (:func:`fit_startup_overlap`).

    Args:
        samples: The probes' samples.
        forward_s: The plain module's forward.
        backward_s: Its backward.
        step_s: Its optimizer step.
        allreduce_s: One all-reduce of all gradients, alone.
    """
    if not (samples.stream_done_s and samples.flat_done_s and samples.stream_count > 0):
        return None
    stream_backward = statistics.median(samples.stream_backward_s)
    stream_done = statistics.median(samples.stream_done_s)
    flat_backward = statistics.median(samples.flat_backward_s)
    flat_done = statistics.median(samples.flat_done_s)
    startup = stream_done / samples.stream_count
    startup_compute = compute_slowdown(backward_s, stream_backward, stream_done)
    if startup >= min(flat_done, flat_backward):
        # The start-up outlasted the overlap: nothing tells bytes from start-ups.
        transfer_rate, transfer_compute = 1.0, startup_compute
    else:
        transfer_rate = progress_rate(
            max(allreduce_s - startup, 0.0), flat_backward, flat_done, startup
        )
        transfer_compute = compute_slowdown(
            backward_s, flat_backward, flat_done, startup, startup_compute
        )
    pieces = forward_s + backward_s + step_s + allreduce_s
    sync = max(statistics.median(samples.serial_s) - pieces, 0.0) if samples.serial_s else 0.0
    contention = Contention(
        compute_slowdown=transfer_compute,
        transfer_rate=transfer_rate,
        startup_compute_slowdown=startup_compute,
    )
    return Calibration(contention, startup, sync)


def mixed_sizes(count: int) -> list[int]:
    """The overlap probe's all-reduce sizes in the order backward's hooks issue them.

    Args:
        count: The probe's all-reduces (one per gradient tensor).
    """
    return [MIXED_BYTES if index % 2 else SMALL_BYTES for index in range(count)]


def overlap_probe_end(
    trace: Trace, timing: CostModel, contention: Contention, overlap: float
) -> float:
    """When the overlap probe's last all-reduce ends, from backward's start, as the replay plays
    it: ``trace``'s ready times carrying :func:`mixed_sizes`, one per tensor, on one channel.

    Args:
        trace: The ready times and totals to play the probe on.
        timing: Prices each all-reduce.
        contention: The calibrated contention.
        overlap: The start-up overlap to play with.
    """
    sizes = mixed_sizes(len(trace.tensors))
    probe = replace(
        trace,
        tensors=tuple(
            replace(tensor, numel=nbytes // 4, nbytes=nbytes)
            for tensor, nbytes in zip(trace.tensors, sizes, strict=True)
        ),
    )
    played = simulate(
        probe, "wfbp", timing, contention=replace(contention, startup_overlap=overlap)
    ).replay
    return played.comm_end_s


def fit_startup_overlap(
    samples: ContentionSamples,
    trace: Trace,
    timing: CostModel,
    contention: Contention,
    *,
    tolerance: float = 1e-4,
) -> float | None:
    """The start-up overlap (:attr:`~interlace.sim.replay.Contention.startup_overlap`) with
    which the replay ends the overlap probe when it was measured to end; None without that
    probe.

    The probe is replayed on ``trace`` (the plain module's ready times and totals from the same
    rounds) with the calibrated ``timing`` (start-up pace and per-byte cost) and
    ``contention``. A later end than even strictly serial all-reduces give is 0. The end falls
    as the overlap grows, but not everywhere: a start-up behind bytes also takes its share of
    compute's cycles, so near full overlap backward's tensors can come later. So the overlaps
    are scanned on a grid of :data:`OVERLAP_GRID` steps for the first that ends the probe no
    later than measured, and that step is bisected; if none does, the closest is taken.

    Args:
        samples: The probes' samples (the overlap probe's end is used).
        trace: The plain module's ready times and totals from the same rounds.
        timing: The calibrated start-up pace and per-byte cost.
        contention: The calibrated contention.
        tolerance: The bisection's stopping width.
    """
    if not samples.mixed_done_s or len(trace.tensors) < 2:
        return None
    measured = statistics.median(samples.mixed_done_s)

    def end(overlap: float) -> float:
        return overlap_probe_end(trace, timing, contention, overlap)

    grid = [step / OVERLAP_GRID for step in range(OVERLAP_GRID + 1)]
    ends = [end(overlap) for overlap in grid]
    if measured >= ends[0]:
        return 0.0
    for step in range(OVERLAP_GRID):
        if ends[step + 1] <= measured:
            low, high = grid[step], grid[step + 1]
            while high - low > tolerance:
                middle = (low + high) / 2
                if end(middle) > measured:
                    low = middle
                else:
                    high = middle
            return (low + high) / 2
    return grid[min(range(len(grid)), key=lambda step: abs(ends[step] - measured))]
