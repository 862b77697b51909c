"""The replay: one iteration's plan played forward in time as discrete events.

Backward computes tensor by tensor while each bucket's all-reduce runs once its tensors are
ready; :class:`Contention` says how compute and communication slow each other on shared cores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import gated_stretches
from interlace.comm.plan import Plan


@dataclass(frozen=True)
class Contention:
    """How compute and communication slow each other down when they run at once.

    An all-reduce is a start-up (the cost model's ``a``: handshakes that need every peer's
    communication thread scheduled) and then its bytes (the rest of its time). Bytes left when
    backward ends run at full speed, and bytes of two all-reduces in flight share the wire. The
    start-up is priced as paid beside backward (its ``a`` comes from a stream issued from
    backward's hooks, see :mod:`interlace.sim.contention`), so it runs at its own pace except
    behind another all-reduce's bytes.

    Args:
        compute_slowdown: Compute advances at ``1 / compute_slowdown`` of its speed while only
            bytes are in flight (>= 1: cores shared with the communication library and the
            kernel's network stack).
        transfer_rate: The fraction of their idle speed at which bytes progress while backward
            computes (in [0, 1]).
        startup_compute_slowdown: Compute advances at ``1 / startup_compute_slowdown`` of its
            speed while a start-up is in flight (>= 1; a start-up behind bytes takes
            ``startup_overlap`` of that toll).
        startup_overlap: The speed, as a fraction of its own, at which a start-up progresses
            while the all-reduce before it has bytes on the wire (in [0, 1]): 0 runs
            all-reduces strictly one after another; above 0 a second one may start meanwhile
            (gloo runs a process group's collectives on two worker threads) and, its start-up
            over, shares the wire with the first one's bytes
            (:func:`interlace.sim.contention.fit_startup_overlap`). Applies to one channel; on
            several, each channel runs its own queue as the plan assigned it.

    Raises:
        ValueError: For a slowdown below 1 or a rate outside [0, 1].
    """

    compute_slowdown: float = 1.0
    transfer_rate: float = 1.0
    startup_compute_slowdown: float = 1.0
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
    """One bucket's all-reduce as replayed (seconds from the start of backward).

    Args:
        indices: Its tensors' positions in the plan.
        nbytes: Its bytes.
        ready_s: When its last tensor was ready.
        start_s: When it started.
        end_s: When it ended.
    """

    indices: tuple[int, ...]
    nbytes: int
    ready_s: float
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Replay:
    """One iteration in time; every time in seconds from the start of backward.

    Args:
        forward_s: The forward pass.
        step_s: The optimizer step.
        pre_forward_s: Collectives before forward (buffer broadcasts).
        ready_s: End of each tensor's backward (its ready time under contention).
        backward_end_s: The end of backward.
        comms: Every bucket's all-reduce.
        sync_s: Synchronisation at the end of backward's communication (see
            :class:`interlace.sim.contention.Calibration`).
        forward_end_s: For a plan that overlaps the next forward: when that forward, waiting at
            its gates and applying their updates, ends (0 otherwise).
    """

    forward_s: float
    step_s: float
    pre_forward_s: float
    ready_s: tuple[float, ...]
    backward_end_s: float
    comms: tuple[CommEvent, ...]
    sync_s: float = 0.0
    forward_end_s: float = 0.0

    @property
    def comm_end_s(self) -> float:
        return max((c.end_s for c in self.comms), default=0.0)

    @property
    def iteration_s(self) -> float:
        """Buffer broadcasts, forward, then backward and the last all-reduce, whichever ends
        later, the synchronisation, then the step. For a plan that overlaps the next forward:
        buffer broadcasts and the period from one backward's start to the next (the gated
        forward with its updates in it)."""
        if self.forward_end_s > 0:
            return self.pre_forward_s + self.forward_end_s + self.sync_s
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
    host_s_per_byte: float = 0.0,
) -> Replay:
    """Play ``plan`` forward in time as discrete events.

    Backward is the sequence of compute stretches between consecutive ready times of
    ``plan.tensors`` (then the rest up to ``plan.backward_s``); all-reduces start in the plan's
    launch order, each once its bucket is complete and (with no start-up overlap) the previous
    one has ended. A plan with gates plays the next forward too: it starts when backward ends,
    each gate waits for its due buckets, then applies the update of all their members
    (``plan.step_s`` by bytes, :class:`~interlace.comm.forward_plan.GateDues`) and computes to
    the next gate. With no contention the times equal the planner's own
    (:func:`~interlace.comm.pricing.schedule`, :func:`~interlace.comm.forward_plan.plan_overlap`).

    Args:
        plan: The buckets, with the tensors' ready times and the passes' lengths.
        contention: Slows compute and communication by each other while backward computes, and
            may let the next all-reduce start behind the previous one's bytes and share the
            wire with them (see :class:`Contention`).
        step_s: The optimizer step after communication.
        cost: Prices each all-reduce (default ``plan.cost``: pass another where the planner's
            belief and the network's truth differ).
        pre_forward_bytes: Collectives made before forward, priced by the same cost.
        sync_s: A synchronisation after backward's communication (a measured cost, see
            :class:`interlace.sim.contention.Calibration`).
        host_s_per_byte: Host seconds per byte of a bucket spent on the compute lane as the
            bucket goes out, before its all-reduce starts: the runtime copies the gradients
            into the bucket and divides it in the hook of its last tensor, on the thread that
            runs backward.

    Raises:
        ValueError: If the plan has no tensors, or for a negative ``host_s_per_byte``.
    """
    cost = plan.cost if cost is None else cost
    if not plan.tensors:
        raise ValueError("replaying a plan needs its tensors (plan.tensors is empty)")
    if not (math.isfinite(host_s_per_byte) and host_s_per_byte >= 0.0):
        raise ValueError(f"host_s_per_byte must be >= 0, got {host_s_per_byte}")
    backward = _Lane(plan, host_s_per_byte)
    if plan.channels > 1:
        comms = _replay_channels(plan, contention, cost, backward)
    else:
        comms = _replay_one_channel(plan, contention, cost, backward)
    assert backward.end_s is not None
    return Replay(
        plan.forward_s,
        0.0 if plan.overlaps_forward else step_s,
        sum(cost.time(nbytes) for nbytes in pre_forward_bytes),
        tuple(backward.ready_s),
        backward.end_s,
        comms,
        sync_s,
        backward.forward_end_s or 0.0,
    )


@dataclass
class _Piece:
    """A stretch of the compute lane: ``work_s`` seconds of compute, started once every bucket
    of ``waits`` has arrived; ``tensor`` is the tensor it makes ready (-1: none)."""

    work_s: float
    tensor: int = -1
    waits: frozenset[int] = frozenset()


class _Lane:
    """The compute lane as a replay plays it: backward's stretches between consecutive ready
    times of ``plan.tensors``, the rest up to ``plan.backward_s``, and for a plan with gates
    the next forward (each gate waiting for its buckets); each stretch at whatever speed
    contention leaves it. The stretch that completes a bucket also does the bucket's host work
    (``host_s_per_byte`` of its bytes). It records when each tensor became ready, when backward
    ended and when the gated forward ended."""

    def __init__(self, plan: Plan, host_s_per_byte: float = 0.0) -> None:
        tensors = plan.tensors
        host = [0.0] * len(tensors)
        for bucket in plan.buckets:
            host[max(bucket.indices)] += host_s_per_byte * bucket.nbytes
        pieces = [_Piece(tensors[0].ready_s + host[0], 0)] + [
            _Piece(tensors[i].ready_s - tensors[i - 1].ready_s + host[i], i)
            for i in range(1, len(tensors))
        ]
        pieces.append(_Piece(max(plan.backward_s - tensors[-1].ready_s, 0.0)))
        self._backward_pieces = len(pieces)
        if plan.overlaps_forward:
            pieces += _forward_pieces(plan)
        self._pieces = pieces
        self._at = 0
        self._left = pieces[0].work_s
        #: Buckets whose all-reduces have all ended.
        self.arrived: set[int] = set()
        #: Tensors ready so far, and when each became ready.
        self.done = 0
        self.ready_s = [0.0] * len(tensors)
        #: When backward ended (None while it computes) and the gated forward (None: not yet).
        self.end_s: float | None = None
        self.forward_end_s: float | None = None

    @property
    def computing(self) -> bool:
        """Whether compute is running now (not finished, not waiting at a gate)."""
        return self._at < len(self._pieces) and self._pieces[self._at].waits <= self.arrived

    @property
    def finished(self) -> bool:
        return self._at >= len(self._pieces)

    def settle(self, now: float) -> None:
        """Record every stretch (and pass end) that is done at ``now``."""
        while self._at < len(self._pieces) and self._left <= 0.0:
            piece = self._pieces[self._at]
            if piece.waits and not piece.waits <= self.arrived:
                return
            if piece.tensor >= 0:
                self.ready_s[piece.tensor] = now
                self.done += 1
            self._at += 1
            if self._at == self._backward_pieces:
                self.end_s = now
            if self._at == len(self._pieces):
                if len(self._pieces) > self._backward_pieces:
                    self.forward_end_s = now
                return
            nxt = self._pieces[self._at]
            self._left = nxt.work_s
            if nxt.waits and self._left <= 0.0:
                # A gate with nothing to compute still waits for its buckets.
                self._left = 0.0

    def until_stretch_end(self, rate: float) -> float:
        """Seconds until the current stretch ends at ``rate`` of full speed (inf while done or
        waiting at a gate)."""
        return self._left / rate if self.computing else math.inf

    def advance(self, seconds: float, rate: float, stretch_ends: bool) -> None:
        """``seconds`` pass at ``rate``; ``stretch_ends`` when they are exactly
        :meth:`until_stretch_end` (no rounding left over)."""
        if self.computing:
            self._left = 0.0 if stretch_ends else self._left - seconds * rate


def _forward_pieces(plan: Plan) -> list[_Piece]:
    """The gated next forward as compute stretches: the part before the first gate, then the
    stretches of :func:`~interlace.comm.forward_plan.gated_stretches` (each gate's updates, as
    the runtime lands them, and its forward), each waiting for its buckets."""
    head = max(plan.forward_s - sum(gate.forward_s for gate in plan.gates), 0.0)
    stretches = gated_stretches(plan.tensors, plan.gates, plan.groups, plan.step_s)
    return [_Piece(head)] + [
        _Piece(stretch.work_s, waits=frozenset(stretch.waits)) for stretch in stretches
    ]


def _replay_one_channel(
    plan: Plan, contention: Contention, cost: CostModel, lane: _Lane
) -> tuple[CommEvent, ...]:
    """:func:`replay` on one channel: its all-reduces (``lane`` is played alongside)."""
    launches = plan.launches
    last_of = [max(bucket.indices) for bucket in plan.buckets]
    left = _slices_per_bucket(plan)
    first_start: dict[int, float] = {}
    comms: list[CommEvent | None] = [None] * len(plan.buckets)
    now = 0.0
    position = 0  # next launch to start
    # All-reduces in flight, oldest first: (launch, work left). Start-ups go one at a time;
    # with a `startup_overlap` a second all-reduce may start while the first has bytes on the
    # wire (gloo's two worker threads), and the bytes of both then share the wire.
    flights: list[tuple[int, _InFlight]] = []
    most = 2 if contention.startup_overlap > 0.0 else 1
    while True:
        # Everything that happens at `now` without time passing.
        lane.settle(now)
        if (
            position < len(launches)
            and last_of[launches[position].bucket] < lane.done
            and len(flights) < most
            and not any(flight.starting for _, flight in flights)
        ):
            first_start.setdefault(launches[position].bucket, now)
            flights.append((position, _InFlight.priced(cost, launches[position].nbytes)))
            position += 1
            continue
        finished = next((index for index, (_, f) in enumerate(flights) if f.done), None)
        if finished is not None:
            number = launches[flights.pop(finished)[0]].bucket
            _finish_slice(
                plan, number, now, left=left, first_start=first_start, lane=lane, comms=comms
            )
            continue
        if lane.finished and not flights and position >= len(launches):
            break
        computing = lane.computing
        # With two in flight, the second was started while the first had bytes on the wire
        # (start-ups go one at a time), so any start-up now runs behind bytes.
        behind = len(flights) > 1
        sharing = max(sum(1 for _, flight in flights if not flight.starting), 1)
        rate = min((flight.compute_rate(contention, behind) for _, flight in flights), default=1.0)
        to_compute = lane.until_stretch_end(rate)
        to_comm = min(
            (flight.until_event(contention, computing, behind, sharing) for _, flight in flights),
            default=math.inf,
        )
        step = min(to_compute, to_comm)
        if not math.isfinite(step):
            raise AssertionError("replay stalled: a bucket waits for a tensor never produced")
        now += step
        lane.advance(step, rate, step == to_compute)
        for _, flight in flights:
            flight.advance(step, contention, computing, behind, sharing)
    return tuple(event for event in comms if event is not None)


def _replay_channels(
    plan: Plan, contention: Contention, cost: CostModel, lane: _Lane
) -> tuple[CommEvent, ...]:
    """:func:`replay` on ``plan.channels`` channels: their all-reduces (``lane`` is played
    alongside).

    A slice is launched once its bucket is complete and every earlier launch went out; it
    queues on the channel the plan assigned it; a channel runs its queue one slice after
    another. Slices of one bucket starting together count each other, as in
    :class:`~interlace.comm.pricing.ChannelClock`, so without contention this gives the plan's own
    times. Each slice's start-up and bytes progress at ``contention``'s rates while compute
    runs, and compute at the slowest rate any slice in flight allows.
    """
    launches = plan.launches
    last_of = [max(bucket.indices) for bucket in plan.buckets]
    queues: list[list[int]] = [[] for _ in range(plan.channels)]
    running: dict[int, tuple[int, _InFlight]] = {}  # channel -> (launch, slice in flight)
    left = _slices_per_bucket(plan)
    first_start: dict[int, float] = {}
    comms: list[CommEvent | None] = [None] * len(plan.buckets)

    now = 0.0
    launched = 0
    while True:
        lane.settle(now)
        while launched < len(launches) and last_of[launches[launched].bucket] < lane.done:
            queues[launches[launched].channel].append(launched)
            launched += 1
        # Start what can start now, in launch order: a partitioned bucket's slices together,
        # as ChannelClock places them; an overlap plan's slices one by one, as it places them.
        startable = sorted(
            (queues[c][0], c) for c in range(plan.channels) if c not in running and queues[c]
        )
        together: dict[int, list[tuple[int, int]]] = {}
        for position, channel in startable:
            key = position if plan.overlaps_forward else launches[position].bucket
            together.setdefault(key, []).append((position, channel))
        finished_now = False
        for mine in sorted(together.values()):
            number = launches[mine[0][0]].bucket
            # As ChannelClock prices it, the newcomer in launch order pays for sharing: a slice
            # launched later that got its channel first does not slow this one.
            first = mine[0][0]
            concurrent = sum(1 for p, _ in running.values() if p <= first) + len(mine)
            for position, channel in mine:
                queues[channel].pop(0)
                first_start.setdefault(number, now)
                flight = _InFlight.priced(cost, launches[position].nbytes, concurrent)
                if flight.done:
                    finished_now = (
                        _finish_slice(
                            plan,
                            number,
                            now,
                            left=left,
                            first_start=first_start,
                            lane=lane,
                            comms=comms,
                        )
                        or finished_now
                    )
                else:
                    running[channel] = (position, flight)
        if finished_now:
            continue
        if lane.finished and not running and launched == len(launches) and not any(queues):
            break
        computing = lane.computing
        rate = min((flight.compute_rate(contention) for _, flight in running.values()), default=1.0)
        to_compute = lane.until_stretch_end(rate)
        to_comm = min(
            (flight.until_event(contention, computing) for _, flight in running.values()),
            default=math.inf,
        )
        step = min(to_compute, to_comm)
        if not math.isfinite(step):
            raise AssertionError("replay stalled: a bucket waits for a tensor never produced")
        now += step
        lane.advance(step, rate, step == to_compute)
        for channel, (position, flight) in list(running.items()):
            flight.advance(step, contention, computing)
            if flight.done:
                del running[channel]
                _finish_slice(
                    plan,
                    launches[position].bucket,
                    now,
                    left=left,
                    first_start=first_start,
                    lane=lane,
                    comms=comms,
                )
    return tuple(event for event in comms if event is not None)


def _slices_per_bucket(plan: Plan) -> list[int]:
    count = [0] * len(plan.buckets)
    for launch in plan.launches:
        count[launch.bucket] += 1
    return count


def _finish_slice(
    plan: Plan,
    number: int,
    now: float,
    *,
    left: list[int],
    first_start: dict[int, float],
    lane: _Lane,
    comms: list[CommEvent | None],
) -> bool:
    """Count one slice of bucket ``number`` done; once all its slices are, record the bucket
    and tell the lane it arrived."""
    left[number] -= 1
    if left[number] == 0:
        comms[number] = _comm(plan, number, lane.ready_s, first_start[number], now)
        lane.arrived.add(number)
        return True
    return False


def _comm(plan: Plan, bucket: int, ready: list[float], start: float, end: float) -> CommEvent:
    indices = plan.buckets[bucket].indices
    return CommEvent(
        indices, plan.buckets[bucket].nbytes, max(ready[i] for i in indices), start, end
    )
