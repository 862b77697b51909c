"""How communication and compute slow each other on shared cores: probes and calibration.

On the emulated cluster ranks outnumber cores, and an all-reduce beside a computing thread is
not what it is alone: each handshake waits for every peer's communication thread to be
scheduled, compute loses cycles to gloo and the kernel's network stack, and the start-up of an
all-reduce costs what the machine's state of the moment makes it cost (it moves by 2x between
launches minutes apart). So the replay does not take these from a fit made once: it takes them
from probes of the plain module made in the same rounds as the strategies it is compared with
(:class:`ContentionProbe`), none of them a strategy:

* **start-ups**: plain iterations whose backward issues one small all-reduce
  (:data:`SMALL_BYTES`) from each parameter's gradient hook, as per-tensor all-reduces are
  issued, run back to back in a block of their own in every round, as a strategy's block is
  run: how long backward took, and when the last all-reduce ended;
* **overlap**: the same stream with every second all-reduce :data:`MIXED_BYTES` long (a fixed
  mix, not the model's own sizes), run back to back in the same block: when its last
  all-reduce ended says how far a start-up went on while the previous all-reduce's bytes were
  on the wire (:func:`fit_startup_overlap`);
* **bytes**: backward with one all-reduce of all gradients issued as it starts: the same two
  times, read from the benchmark's own overlapped iteration (the all-reduce alone is its plain
  measurement too);
* **synchronisation**: plain iterations with that all-reduce after backward, back to back in
  the same block as the start-up probe, against their pieces each timed after a barrier.

:func:`calibrate` turns them into a :class:`Calibration`: the start-up the replay prices every
all-reduce with, a :class:`~interlace.sim.engine.Contention` (:func:`progress_rate` and
:func:`compute_slowdown` say how) and a synchronisation cost per iteration;
:func:`fit_startup_overlap` then finds the contention's start-up overlap by replaying the
overlap probe on the model's trace.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from interlace.comm.cost import CostModel
from interlace.sim.engine import Contention, simulate
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
    """Per-round samples (seconds, maxima over ranks) of the three probes; see the module doc."""

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
    """What the probes say about this machine, for the replay."""

    contention: Contention
    #: Seconds per all-reduce start-up, as the start-up probe paced them.
    startup_s: float
    #: Seconds an iteration spends synchronising that its pieces timed apart do not show: the
    #: plain iteration with its all-reduce, run back to back, less its forward, backward, step
    #: and all-reduce each timed after a barrier (ranks drifting apart over compute and waiting
    #: for the slowest, and waking from the wait). At least 0.
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
    """The overlap probe's all-reduce sizes in the order backward's hooks issue them."""
    return [MIXED_BYTES if index % 2 else SMALL_BYTES for index in range(count)]


def overlap_probe_end(
    trace: Trace, timing: CostModel, contention: Contention, overlap: float
) -> float:
    """When the overlap probe's last all-reduce ends, from backward's start, as the replay plays
    it: ``trace``'s ready times carrying :func:`mixed_sizes`, one per tensor, on one channel."""
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
    """The start-up overlap (:attr:`~interlace.sim.engine.Contention.startup_overlap`) with
    which the replay ends the overlap probe when it was measured to end; None without that
    probe.

    The probe is replayed on ``trace`` (the plain module's ready times and totals from the same
    rounds) with the calibrated ``timing`` (start-up pace and per-byte cost) and
    ``contention``. A later end than even strictly serial all-reduces give is 0. The end falls
    as the overlap grows, but not everywhere: a start-up behind bytes also takes its share of
    compute's cycles, so near full overlap backward's tensors can come later. So the overlaps
    are scanned on a grid of :data:`OVERLAP_GRID` steps for the first that ends the probe no
    later than measured, and that step is bisected; if none does, the closest is taken.

    Measured on the emulated cluster, the overlap is what moves between configurations: with 2
    ranks on 2 cores a start-up has no free core while the bytes before it are sent and the
    probe ends almost as late as start-ups and bytes in series; with 4 ranks the start-ups are
    slow enough to hide every byte.
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


# ================================================================================ rank side


def _iteration_with_startups(
    model: Any, optimizer: Any, batch: tuple[Any, Any], issued: list[Any]
) -> tuple[float, float]:
    """One plain iteration whose backward's hooks append all-reduces to ``issued``: seconds of
    backward, and from backward's start to the end of the last all-reduce."""
    from torch.nn import functional

    inputs, targets = batch
    optimizer.zero_grad()
    loss = functional.cross_entropy(model(inputs), targets)
    issued.clear()
    start = time.perf_counter()
    loss.backward()
    backward_end = time.perf_counter()
    # Waited for after backward: the stream outlasts backward on every model measured (a
    # completion callback per all-reduce would say when one ran dry earlier, but each takes the
    # GIL on gloo's threads and slowed the stream by 5-15%).
    for handle in issued:
        handle.wait()
    end = time.perf_counter()
    issued.clear()
    optimizer.step()
    return backward_end - start, end - start


class ContentionProbe:
    """The rank side: takes :class:`ContentionSamples` beside the plain module's measurements.

    While its block runs it hooks every parameter of ``model`` (the plain module the benchmark
    times), so the benchmark's own timings of that module see no hooks.
    """

    def __init__(self, model: Any, optimizer: Any, flat: Any) -> None:
        import torch

        self.model = model
        self.optimizer = optimizer
        self.flat = flat
        self._params = [p for p in model.parameters() if p.requires_grad]
        count = len(self._params)
        self._streams = {
            "stream": [torch.zeros(SMALL_BYTES // 4) for _ in range(count)],
            "mixed": [torch.zeros(nbytes // 4) for nbytes in mixed_sizes(count)],
        }
        self._issued: list[Any] = []
        self._raw: dict[str, list[float]] = {
            "stream_backward_s": [],
            "stream_done_s": [],
            "mixed_backward_s": [],
            "mixed_done_s": [],
            "flat_backward_s": [],
            "flat_done_s": [],
            "serial_s": [],
        }

    def block(self, iterations: int, next_batch: Callable[[], tuple[Any, Any]]) -> None:
        """The start-up, overlap and synchronisation probes: ``iterations`` plain iterations of
        each, back to back, timed as a strategy's block is (collective).

        Timed one by one after barriers, the start-up streams were bimodal (0.6 to 1.9 ms per
        all-reduce within one launch, 2 ranks) and their median moved by 2x between launches
        while per-tensor WFBP's did not; and an iteration that follows another straight away
        waits longer at its all-reduce for the slowest rank than one started after a barrier
        (5 ms longer on 4 ranks at 1 Gbit/s, transformer). Run as strategies run, they pay
        what the strategies pay.
        """
        import torch.distributed as dist

        # The all-reduces of the stream being probed, in the order the hooks issue them.
        stream: list[Any] = []

        def hook(_param: Any) -> None:
            handle = dist.all_reduce(stream[len(self._issued)], async_op=True)
            if handle is not None:
                self._issued.append(handle)

        hooks = [param.register_post_accumulate_grad_hook(hook) for param in self._params]
        try:
            for name, tensors in self._streams.items():
                stream[:] = tensors
                dist.barrier()
                for _ in range(iterations):
                    backward, done = _iteration_with_startups(
                        self.model, self.optimizer, next_batch(), self._issued
                    )
                    self._raw[f"{name}_backward_s"].append(backward)
                    self._raw[f"{name}_done_s"].append(done)
        finally:
            for handle in hooks:
                handle.remove()
        dist.barrier()
        for _ in range(iterations):
            self._raw["serial_s"].append(self._serial(*next_batch()))

    def add_bulk(self, backward_s: float, done_s: float) -> None:
        """The bytes probe: the benchmark's own plain iteration with the all-reduce of all
        gradients launched as backward starts (:func:`interlace.bench.dp_rank._overlapped_sample`),
        its backward and the all-reduce's end, both from backward's start."""
        self._raw["flat_backward_s"].append(backward_s)
        self._raw["flat_done_s"].append(done_s)

    def _serial(self, inputs: Any, targets: Any) -> float:
        """One plain iteration with the all-reduce of all gradients after backward."""
        import torch.distributed as dist
        from torch.nn import functional

        start = time.perf_counter()
        self.optimizer.zero_grad()
        functional.cross_entropy(self.model(inputs), targets).backward()
        dist.all_reduce(self.flat)
        self.optimizer.step()
        return time.perf_counter() - start

    def finish(self) -> ContentionSamples:
        """The samples, each a maximum over ranks (collective: every rank calls it)."""
        from interlace.bench.harness import max_over_ranks

        maxima = {name: max_over_ranks(values) for name, values in self._raw.items()}
        return ContentionSamples(stream_count=len(self._params), **maxima)
