"""Event simulation of one data-parallel training iteration from a trace.

The simulator never decides or prices anything itself: a strategy is a row of
:data:`STRATEGIES` naming a planner of :mod:`interlace.comm.plan` and its arguments, the buckets
come from :func:`~interlace.comm.plan.make_plan` fed with the trace's ready times and the
network's :class:`~interlace.comm.cost.CostModel` at the chosen worker count, exactly as
:class:`interlace.DataParallel` plans them at run time. What the engine adds is the replay of
that plan as events in time (:func:`replay`): layers computing one after another, each bucket's
all-reduce starting once its last tensor is ready and the channel is free, and the iteration's
forward, backward, communication tail and optimizer step.

On a GPU, compute and communication proceed independently and the replay gives exactly the
times :func:`~interlace.comm.plan.schedule` gives (a test checks it). On a CPU they share the
cores, and each slows the other: gloo's threads and the kernel's network stack take cycles from
backward, and an all-reduce whose peers' threads wait behind a computing thread to be scheduled
makes little progress until backward ends. :class:`Contention` models both, each from a
measurement of no strategy (see :mod:`interlace.sim.validate`): the factor by which compute
slows while a start-up or bytes are in flight, and the fraction of their own speed at which an
all-reduce's bytes progress while backward computes. The default is no contention.

Several channels (AIACC-Training) are the same planners priced by the k-channel cost model:
``mgwfbp/k=2`` is MG-WFBP planned and replayed on two channels, each bucket on the channel the
plan gave it, a slice lasting ``a_j + c_j * b * m`` for ``j`` all-reduces in flight when it
starts, exactly as :class:`~interlace.comm.plan.ChannelClock` prices it. Any strategy takes a
``/k=K`` suffix. K-FAC factor fusion and pipelines are further callers of :func:`replay`: the
D-KFAC and SPD-KFAC strategies (:mod:`interlace.sim.kfac`) replay gradient and factor buckets on
one link through it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from interlace.comm.cost import CostModel
from interlace.comm.plan import Plan, schedule, slice_sizes
from interlace.comm.strategies import PLANNED_STRATEGIES, Strategy, planned_strategy

if TYPE_CHECKING:
    from interlace.sim.kfac import KfacCosts
    from interlace.sim.network import Network
    from interlace.sim.trace import Trace
    from interlace.timeline import Timeline


#: Every simulated strategy by name: the planned ones of :mod:`interlace.comm.strategies`.
STRATEGIES: dict[str, Strategy] = PLANNED_STRATEGIES


@dataclass(frozen=True)
class Contention:
    """How compute and communication slow each other down when they run at once.

    An all-reduce is a start-up (the cost model's ``a``: handshakes that need every peer's
    communication thread scheduled) and then its bytes (the rest of its time). While backward
    computes, its bytes progress at ``transfer_rate`` of their speed on idle cores (in [0, 1]);
    bytes left when backward ends run at full speed, and bytes of two all-reduces in flight
    share the wire. The start-up is priced as paid beside backward (its ``a`` comes from a
    stream issued from backward's hooks, see :mod:`interlace.sim.contention`), so it runs at
    its own pace, except behind another all-reduce's bytes, where it runs at
    ``startup_overlap``. Compute advances at ``1 / startup_compute_slowdown`` of its speed while
    a start-up is in flight (a start-up behind bytes takes ``startup_overlap`` of that toll)
    and at ``1 / compute_slowdown`` while only bytes are (both >= 1: cores shared with the
    communication library and the kernel's network stack).
    """

    compute_slowdown: float = 1.0
    transfer_rate: float = 1.0
    startup_compute_slowdown: float = 1.0
    #: The speed, as a fraction of its own, at which an all-reduce's start-up progresses while
    #: the one before it has bytes on the wire: 0 runs all-reduces strictly one after another;
    #: above 0 a second one may start meanwhile (gloo runs each process group's collectives on
    #: two worker threads) and, its start-up over, shares the wire with the first one's bytes
    #: (one connection per peer, messages interleaved). How much a start-up gets done behind
    #: bytes depends on whether the cores are free
    #: (:func:`interlace.sim.contention.fit_startup_overlap`). Applies to one channel; on
    #: several, each channel runs its own queue as the plan assigned it.
    startup_overlap: float = 0.0

    def __post_init__(self) -> None:
        for name in ("compute_slowdown", "startup_compute_slowdown"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 1.0):
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("transfer_rate", "startup_overlap"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                raise ValueError(f"{name} must be in [0, 1], got {value}")


@dataclass
class _InFlight:
    """One all-reduce (or slice) in flight: its start-up, then its bytes, in seconds of work."""

    startup_left: float
    transfer_left: float

    @classmethod
    def priced(cls, cost: CostModel, nbytes: float, concurrent: int = 1) -> _InFlight:
        total = cost.time(nbytes, concurrent)
        startup = min(cost.concurrent_terms(concurrent)[0], total)
        return cls(startup, total - startup)

    # Work is exact until advanced; :meth:`advance` snaps a rounding residue to 0, so a phase
    # is over exactly when its work is 0 (an all-reduce priced below the residue still runs).
    @property
    def done(self) -> bool:
        return self.startup_left <= 0.0 and self.transfer_left <= 0.0

    @property
    def starting(self) -> bool:
        return self.startup_left > 0.0

    def compute_rate(self, contention: Contention, behind: bool = False) -> float:
        """The speed of compute while this one is in flight. A start-up ``behind`` another
        all-reduce's bytes does its work at the start-up overlap, so it takes that share of
        the cycles a start-up takes from compute (none when it makes no progress)."""
        if self.starting:
            extra = contention.startup_compute_slowdown - 1.0
            return 1.0 / (1.0 + (contention.startup_overlap if behind else 1.0) * extra)
        return 1.0 / contention.compute_slowdown

    def rate(
        self, contention: Contention, computing: bool, behind: bool = False, sharing: int = 1
    ) -> float:
        """The speed of its current phase: a start-up ``behind`` another all-reduce's bytes goes
        at the start-up overlap; bytes share the wire with ``sharing`` all-reduces' bytes."""
        if self.starting:
            return contention.startup_overlap if behind else 1.0
        return (contention.transfer_rate if computing else 1.0) / sharing

    def until_event(
        self, contention: Contention, computing: bool, behind: bool = False, sharing: int = 1
    ) -> float:
        """Seconds until this one ends its current phase (inf while it makes no progress)."""
        rate = self.rate(contention, computing, behind, sharing)
        left = self.startup_left if self.starting else self.transfer_left
        return left / rate if rate > 0.0 else math.inf

    def advance(
        self,
        seconds: float,
        contention: Contention,
        computing: bool,
        behind: bool = False,
        sharing: int = 1,
    ) -> None:
        work = seconds * self.rate(contention, computing, behind, sharing)
        if self.starting:
            left = self.startup_left - work
            self.startup_left = left if left > _EPSILON_S else 0.0
        else:
            left = self.transfer_left - work
            self.transfer_left = left if left > _EPSILON_S else 0.0


#: Work left below this (seconds) counts as none: phase ends computed as ``left / rate`` and then
#: subtracted back come out a few ulps off.
_EPSILON_S = 1e-12


NO_CONTENTION = Contention()


@dataclass(frozen=True)
class CommEvent:
    """One bucket's all-reduce as replayed: its tensors, bytes and when it ran."""

    indices: tuple[int, ...]
    nbytes: int
    ready_s: float
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Replay:
    """One iteration in time; every time in seconds from the start of backward."""

    forward_s: float
    step_s: float
    #: Collectives before forward (buffer broadcasts), seconds.
    pre_forward_s: float
    #: End of each tensor's backward (its ready time under contention).
    ready_s: tuple[float, ...]
    backward_end_s: float
    comms: tuple[CommEvent, ...]
    #: Synchronisation at the end of backward's communication (see
    #: :class:`interlace.sim.contention.Calibration`), seconds.
    sync_s: float = 0.0

    @property
    def comm_end_s(self) -> float:
        return max((c.end_s for c in self.comms), default=0.0)

    @property
    def iteration_s(self) -> float:
        """Buffer broadcasts, forward, then backward and the last all-reduce, whichever ends
        later, the synchronisation, then the step."""
        return (
            self.pre_forward_s
            + self.forward_s
            + max(self.backward_end_s, self.comm_end_s)
            + self.sync_s
            + self.step_s
        )


def replay(
    plan: Plan,
    contention: Contention = NO_CONTENTION,
    *,
    step_s: float = 0.0,
    cost: CostModel | None = None,
    pre_forward_bytes: Sequence[int] = (),
    sync_s: float = 0.0,
) -> Replay:
    """Play ``plan`` forward in time as discrete events.

    Backward is the sequence of compute stretches between consecutive ready times of
    ``plan.tensors`` (then the rest up to ``plan.backward_s``); all-reduces start in plan order,
    each once its tensors are all ready and (with no start-up overlap) the previous one has
    ended, and take ``cost.time(bytes)`` (default ``plan.cost``: pass another where the
    planner's belief and the network's truth differ). ``contention`` slows each by the other
    while backward computes and may let the next all-reduce start behind the previous one's
    bytes and share the wire with them (see :class:`Contention`). With no contention the times
    equal :func:`~interlace.comm.plan.schedule`'s.
    ``pre_forward_bytes`` are collectives made before forward, priced by the same cost;
    ``sync_s`` is a synchronisation after backward's communication (a measured cost, see
    :class:`interlace.sim.contention.Calibration`).
    """
    cost = plan.cost if cost is None else cost
    if not plan.tensors:
        raise ValueError("replaying a plan needs its tensors (plan.tensors is empty)")
    backward = _Backward(plan)
    if plan.channels > 1:
        comms = _replay_channels(plan, contention, cost, backward)
    else:
        comms = _replay_one_channel(plan, contention, cost, backward)
    assert backward.end_s is not None
    return Replay(
        plan.forward_s,
        step_s,
        sum(cost.time(nbytes) for nbytes in pre_forward_bytes),
        tuple(backward.ready_s),
        backward.end_s,
        comms,
        sync_s,
    )


class _Backward:
    """Backward's compute as a replay plays it: the stretches between consecutive ready times of
    ``plan.tensors``, then the rest up to ``plan.backward_s``, each at whatever speed contention
    leaves it; it records when each tensor became ready and when backward ended."""

    def __init__(self, plan: Plan) -> None:
        tensors = plan.tensors
        self._work = [tensors[0].ready_s] + [
            tensors[i].ready_s - tensors[i - 1].ready_s for i in range(1, len(tensors))
        ]
        self._tail = max(plan.backward_s - tensors[-1].ready_s, 0.0)
        self._left = self._work[0]  # compute left in the current stretch (or the tail)
        self._in_tail = False
        #: Tensors ready so far, and when each became ready.
        self.done = 0
        self.ready_s = [0.0] * len(tensors)
        #: When backward ended (None while it computes).
        self.end_s: float | None = None

    @property
    def computing(self) -> bool:
        return self.end_s is None

    def settle(self, now: float) -> None:
        """Record every tensor (and backward's end) that is done at ``now``."""
        while self.end_s is None and self._left <= 0.0:
            if self._in_tail:
                self.end_s = now
            else:
                self.ready_s[self.done] = now
                self.done += 1
                if self.done < len(self._work):
                    self._left = self._work[self.done]
                else:
                    self._in_tail, self._left = True, self._tail

    def until_stretch_end(self, rate: float) -> float:
        """Seconds until the current stretch ends at ``rate`` of full speed (inf once done)."""
        return self._left / rate if self.computing else math.inf

    def advance(self, seconds: float, rate: float, stretch_ends: bool) -> None:
        """``seconds`` pass at ``rate``; ``stretch_ends`` when they are exactly
        :meth:`until_stretch_end` (no rounding left over)."""
        if self.computing:
            self._left = 0.0 if stretch_ends else self._left - seconds * rate


def _replay_one_channel(
    plan: Plan, contention: Contention, cost: CostModel, backward: _Backward
) -> tuple[CommEvent, ...]:
    """:func:`replay` on one channel: its all-reduces (``backward`` is played alongside)."""
    last_of = [max(bucket.indices) for bucket in plan.buckets]
    comms: list[CommEvent] = []
    now = 0.0
    bucket = 0  # next bucket to start
    # All-reduces in flight, oldest first: (bucket, work left, start). Start-ups go one at a
    # time; with a `startup_overlap` a second all-reduce may start while the first has bytes
    # on the wire (gloo's two worker threads), and the bytes of both then share the wire.
    flights: list[tuple[int, _InFlight, float]] = []
    most = 2 if contention.startup_overlap > 0.0 else 1
    while True:
        # Everything that happens at `now` without time passing.
        backward.settle(now)
        if (
            bucket < len(plan.buckets)
            and last_of[bucket] < backward.done
            and len(flights) < most
            and not any(flight.starting for _, flight, _ in flights)
        ):
            flights.append((bucket, _InFlight.priced(cost, plan.buckets[bucket].nbytes), now))
            bucket += 1
            continue
        finished = next((index for index, (_, f, _) in enumerate(flights) if f.done), None)
        if finished is not None:
            number, _, started = flights.pop(finished)
            comms.append(_comm(plan, number, backward.ready_s, started, now))
            continue
        if not backward.computing and not flights and bucket >= len(plan.buckets):
            break
        computing = backward.computing
        # With two in flight, the second was started while the first had bytes on the wire
        # (start-ups go one at a time), so any start-up now runs behind bytes.
        behind = len(flights) > 1
        sharing = max(sum(1 for _, flight, _ in flights if not flight.starting), 1)
        rate = min(
            (flight.compute_rate(contention, behind) for _, flight, _ in flights), default=1.0
        )
        to_compute = backward.until_stretch_end(rate)
        to_comm = min(
            (
                flight.until_event(contention, computing, behind, sharing)
                for _, flight, _ in flights
            ),
            default=math.inf,
        )
        step = min(to_compute, to_comm)
        if not math.isfinite(step):
            raise AssertionError("replay stalled: a bucket waits for a tensor never produced")
        now += step
        backward.advance(step, rate, step == to_compute)
        for _, flight, _ in flights:
            flight.advance(step, contention, computing, behind, sharing)
    comms.sort(key=lambda event: event.indices)
    return tuple(comms)


def _replay_channels(
    plan: Plan, contention: Contention, cost: CostModel, backward: _Backward
) -> tuple[CommEvent, ...]:
    """:func:`replay` on ``plan.channels`` channels: their all-reduces (``backward`` is played
    alongside).

    A bucket is launched once its tensors are ready and every earlier bucket was launched; its
    slices queue on the channels the plan assigned; a channel runs its queue one slice after
    another. Slices starting together count each other, as in
    :class:`~interlace.comm.plan.ChannelClock`, so without contention this gives the plan's own
    times. Each slice's start-up and bytes progress at ``contention``'s rates while backward
    computes, and compute at the slowest rate any slice in flight allows.
    """
    last_of = [max(bucket.indices) for bucket in plan.buckets]
    queues: list[list[tuple[int, int]]] = [[] for _ in range(plan.channels)]
    running: dict[int, tuple[int, _InFlight]] = {}  # channel -> (bucket, slice in flight)
    slices_left = [len(bucket.channels) for bucket in plan.buckets]
    first_start: dict[int, float] = {}
    comms: list[CommEvent | None] = [None] * len(plan.buckets)

    ready = backward.ready_s
    now = 0.0
    launched = 0
    while True:
        backward.settle(now)
        while launched < len(plan.buckets) and last_of[launched] < backward.done:
            bucket = plan.buckets[launched]
            sizes = slice_sizes(bucket.nbytes, len(bucket.channels))
            for channel, size in zip(bucket.channels, sizes, strict=True):
                queues[channel].append((launched, size))
            launched += 1
        # Start what can start now, bucket by bucket in launch order.
        startable = sorted(
            (queues[c][0][0], c) for c in range(plan.channels) if c not in running and queues[c]
        )
        finished_now = False
        for number in sorted({bucket for bucket, _ in startable}):
            channels = [c for bucket, c in startable if bucket == number]
            # As ChannelClock prices it, the newcomer in launch order pays for sharing: a slice
            # of a later bucket that got its channel first does not slow this one.
            concurrent = sum(1 for bucket, _ in running.values() if bucket <= number)
            concurrent += len(channels)
            for channel in channels:
                _, size = queues[channel].pop(0)
                first_start.setdefault(number, now)
                flight = _InFlight.priced(cost, size, concurrent)
                if flight.done:
                    finished_now = (
                        _finish_slice(
                            plan,
                            number,
                            now,
                            slices_left=slices_left,
                            first_start=first_start,
                            ready=ready,
                            comms=comms,
                        )
                        or finished_now
                    )
                else:
                    running[channel] = (number, flight)
        if finished_now:
            continue
        if (
            not backward.computing
            and not running
            and launched == len(plan.buckets)
            and not any(queues)
        ):
            break
        computing = backward.computing
        rate = min((flight.compute_rate(contention) for _, flight in running.values()), default=1.0)
        to_compute = backward.until_stretch_end(rate)
        to_comm = min(
            (flight.until_event(contention, computing) for _, flight in running.values()),
            default=math.inf,
        )
        step = min(to_compute, to_comm)
        if not math.isfinite(step):
            raise AssertionError("replay stalled: a bucket waits for a tensor never produced")
        now += step
        backward.advance(step, rate, step == to_compute)
        for channel, (number, flight) in list(running.items()):
            flight.advance(step, contention, computing)
            if flight.done:
                del running[channel]
                _finish_slice(
                    plan,
                    number,
                    now,
                    slices_left=slices_left,
                    first_start=first_start,
                    ready=ready,
                    comms=comms,
                )
    return tuple(event for event in comms if event is not None)


def _finish_slice(
    plan: Plan,
    number: int,
    now: float,
    *,
    slices_left: list[int],
    first_start: dict[int, float],
    ready: list[float],
    comms: list[CommEvent | None],
) -> bool:
    """Count one slice of bucket ``number`` done; record the bucket once all its slices are."""
    slices_left[number] -= 1
    if slices_left[number] == 0:
        comms[number] = _comm(plan, number, ready, first_start[number], now)
        return True
    return False


def _comm(plan: Plan, bucket: int, ready: list[float], start: float, end: float) -> CommEvent:
    indices = plan.buckets[bucket].indices
    return CommEvent(
        indices, plan.buckets[bucket].nbytes, max(ready[i] for i in indices), start, end
    )


@dataclass(frozen=True)
class SimResult:
    """One strategy on one trace at one worker count."""

    strategy: str
    workers: int
    cost: CostModel
    plan: Plan
    replay: Replay
    model: str = ""
    network: str = ""
    extra: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def iteration_s(self) -> float:
        return self.replay.iteration_s

    @property
    def buckets(self) -> int:
        return len(self.plan.buckets)

    def timeline(self, process: str = "simulated") -> Timeline:
        """The iteration as a :class:`~interlace.timeline.Timeline` (same PNG and Chrome trace
        renderer as ``interlace profile``): forward, each tensor's backward and the optimizer
        step on the compute lane, each bucket's all-reduce on the communication lane."""
        from interlace.timeline import Timeline

        replayed = self.replay
        title = f"{self.model or 'trace'}, {self.strategy}, {self.workers} workers, simulated" + (
            f" ({self.network})" if self.network else ""
        )
        timeline = Timeline(title=title)
        pre = replayed.pre_forward_s
        if pre > 0:
            timeline.add("broadcast buffers", "comm", 0.0, pre, lane="all-reduce", process=process)
        origin = pre + replayed.forward_s
        timeline.add("forward", "forward", pre, origin, lane="compute", process=process)
        previous = 0.0
        for tensor, ready in zip(self.plan.tensors, replayed.ready_s, strict=True):
            if ready > previous:
                timeline.add(
                    tensor.name,
                    "backward",
                    origin + previous,
                    origin + ready,
                    lane="compute",
                    process=process,
                )
                previous = ready
        if replayed.backward_end_s > previous:
            timeline.add(
                "backward (rest)",
                "backward",
                origin + previous,
                origin + replayed.backward_end_s,
                lane="compute",
                process=process,
            )
        for number, comm in enumerate(replayed.comms):
            timeline.add(
                f"bucket {number} ({comm.nbytes / 1e6:.2f} MB)",
                "comm",
                origin + comm.start_s,
                origin + comm.end_s,
                lane="all-reduce",
                process=process,
                bytes=comm.nbytes,
                tensors=len(comm.indices),
                ready_ms=round((origin + comm.ready_s) * 1e3, 3),
            )
        end = origin + max(replayed.backward_end_s, replayed.comm_end_s)
        if replayed.sync_s > 0:
            timeline.add(
                "synchronise",
                "comm",
                end,
                end + replayed.sync_s,
                lane="all-reduce",
                process=process,
            )
            end += replayed.sync_s
        if replayed.step_s > 0:
            timeline.add(
                "optimizer step",
                "optimizer",
                end,
                end + replayed.step_s,
                lane="compute",
                process=process,
            )
        return timeline


def strategy_named(name: str) -> Strategy:
    """The :data:`STRATEGIES` entry ``name``; a clear error naming the choices otherwise."""
    from interlace.errors import UsageError

    chosen = planned_strategy(name)
    if chosen is not None:
        return chosen
    from interlace.sim.kfac import KFAC_STRATEGIES

    if name in KFAC_STRATEGIES:
        raise UsageError(
            f"{name!r} is a K-FAC strategy: simulate it with interlace.sim.kfac.simulate_kfac "
            "or simulate_scaling"
        )
    raise UsageError(
        f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}, or any of them "
        "with /k=K for K channels (e.g. mgwfbp/k=3), or a K-FAC strategy "
        f"({', '.join(KFAC_STRATEGIES)})"
    )


def simulate(
    trace: Trace,
    strategy: str | Strategy,
    cost: CostModel,
    *,
    workers: int = 0,
    contention: Contention = NO_CONTENTION,
    per_layer: bool = False,
    network: str = "",
    timing_cost: CostModel | None = None,
    buckets: Sequence[Sequence[str]] | None = None,
    sync_s: float = 0.0,
) -> SimResult:
    """One iteration of ``trace`` with ``strategy`` when an all-reduce costs ``cost``.

    The planner decides with ``cost``; the replay times all-reduces with ``timing_cost``
    (default ``cost``), for a runtime that plans with one model while its network behaves as
    another (DataParallel fits ``a`` on isolated all-reduces but issues them back to back).
    ``per_layer`` sends a layer's tensors as one message (Caffe's unit, as in the MG-WFBP
    paper's WFBP) instead of one message per tensor (PyTorch's unit). ``buckets`` (tensor
    names, in launch order) replays a bucketing a run actually used instead of planning one:
    DataParallel keeps whichever candidate plan it measured fastest, which the cost model
    alone cannot foresee. ``sync_s`` is added after backward's communication (a measured
    synchronisation cost, :class:`interlace.sim.contention.Calibration`).
    """
    chosen = strategy if isinstance(strategy, Strategy) else strategy_named(strategy)
    tensors = trace.ready_tensors(per_layer=per_layer)
    if buckets is None:
        plan = chosen.plan(tensors, cost, backward_s=trace.backward_s, forward_s=trace.forward_s)
    else:
        position = {tensor.name: index for index, tensor in enumerate(tensors)}
        missing = sorted({name for bucket in buckets for name in bucket} - set(position))
        if missing:
            raise ValueError(
                f"the buckets name tensors the trace does not have: {', '.join(missing[:5])}"
            )
        plan = schedule(
            [[position[name] for name in bucket] for bucket in buckets],
            tensors,
            cost,
            backward_s=max(trace.backward_s, *(t.ready_s for t in tensors)),
            forward_s=trace.forward_s,
            strategy=chosen.name,
        )
    replayed = replay(
        plan,
        contention,
        step_s=trace.step_s,
        cost=timing_cost,
        pre_forward_bytes=trace.broadcast_bytes,
        sync_s=sync_s,
    )
    return SimResult(chosen.name, workers, cost, plan, replayed, trace.model, network)


def simulate_scaling(
    trace: Trace,
    network: Network,
    workers: Sequence[int],
    strategies: Sequence[str],
    *,
    per_layer: bool = False,
    kfac_costs: KfacCosts | None = None,
) -> list[SimResult]:
    """Every strategy at every worker count, the network priced at each count.

    K-FAC strategies (:data:`interlace.sim.kfac.KFAC_STRATEGIES`) run through
    :func:`interlace.sim.kfac.simulate_kfac` with ``kfac_costs``; they need the trace's factor
    sizes.
    """
    from interlace.sim.kfac import KFAC_STRATEGIES, check_trace, simulate_kfac

    chosen = {name: strategy_named(name) for name in strategies if name not in KFAC_STRATEGIES}
    if len(chosen) < len(strategies):
        check_trace(trace)
    results: list[SimResult] = []
    for count in workers:
        cost = network.cost(count)
        for name in strategies:
            if name in KFAC_STRATEGIES:
                results.append(
                    simulate_kfac(
                        trace,
                        name,
                        cost,
                        count,
                        costs=kfac_costs,
                        per_layer=per_layer,
                        network=network.spec,
                    )
                )
                continue
            results.append(
                simulate(
                    trace,
                    chosen[name],
                    cost,
                    workers=count,
                    per_layer=per_layer,
                    network=network.spec,
                )
            )
    return results
