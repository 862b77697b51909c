"""Stage programs replayed in time: computations and point-to-point messages on shared links.

Each stage runs its program in order (:class:`Compute`, :class:`Send`, :class:`Post`,
:class:`Wait`). A message moves once it is sent and its receive is posted (gloo writes a message
only then), behind the earlier messages of the same pair of ranks (one socket each way); it
takes the cost model's start-up ``a``, then its bytes at the rate the links leave it: every rank
has one outgoing and one incoming link of ``1 / b`` bytes per second, shared max-min fairly by
the pairs sending over it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from interlace.comm.cost import CostModel

#: Seconds below which two event times count as equal.
_TOLERANCE = 1e-12


@dataclass(frozen=True)
class Message:
    """One tensor sent from rank ``src`` to rank ``dst``.

    Args:
        key: What makes it unique (kind, step, batch, piece, ...).
        src: The sending stage.
        dst: The receiving stage.
        nbytes: Its size.
    """

    key: tuple[object, ...]
    src: int
    dst: int
    nbytes: float


@dataclass(frozen=True)
class Compute:
    """Busy for ``seconds`` (device time and the host work around it).

    Args:
        seconds: How long (>= 0).
        label: What it is (``forward``, ``backward``, ``update``, ...).
        category: A :data:`interlace.timeline.CATEGORIES` entry for the timeline.
    """

    seconds: float
    label: str
    category: str = "forward"


@dataclass(frozen=True)
class Send:
    """Start sending ``message`` (non-blocking: a later :class:`Wait` waits for it).

    Args:
        message: The message.
    """

    message: Message


@dataclass(frozen=True)
class Post:
    """Post the receive of ``message`` (non-blocking).

    Args:
        message: The message.
    """

    message: Message


@dataclass(frozen=True)
class Wait:
    """Block until every one of ``messages`` has arrived (a send counts as done then too).

    Args:
        messages: The messages waited on.
    """

    messages: tuple[Message, ...]


Op = Compute | Send | Post | Wait


@dataclass(frozen=True)
class Span:
    """A stretch of time: a stage's computation or a message's transfer.

    Args:
        label: What ran.
        category: Its timeline category.
        stage: The stage that computed, or the sending stage of a transfer.
        start_s: When it started.
        end_s: When it ended.
    """

    label: str
    category: str
    stage: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Replay:
    """What :func:`replay_programs` found.

    Args:
        finish_s: When each stage ended its program.
        computations: Every :class:`Compute` in time.
        transfers: Every message from its start-up to its arrival.
    """

    finish_s: tuple[float, ...]
    computations: tuple[Span, ...]
    transfers: tuple[Span, ...]

    @property
    def makespan_s(self) -> float:
        """When the last stage ended."""
        return max(self.finish_s)

    def busy_s(self, stage: int) -> float:
        """Seconds ``stage`` spent computing.

        Args:
            stage: The stage.
        """
        return math.fsum(s.end_s - s.start_s for s in self.computations if s.stage == stage)


def fair_rates(flows: Sequence[Message], capacity: float) -> dict[tuple[int, int], float]:
    """Max-min fair rates of the pairs ``(src, dst)`` moving bytes now.

    Every rank's outgoing link and incoming link carries ``capacity`` bytes per second; each
    pair's rate is raised with the others' until one of its links is full.

    Args:
        flows: One moving message per pair.
        capacity: Bytes per second of every link.
    """
    users: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for message in flows:
        pair = (message.src, message.dst)
        users.setdefault(("out", message.src), []).append(pair)
        users.setdefault(("in", message.dst), []).append(pair)
    left = dict.fromkeys(users, capacity)
    rates: dict[tuple[int, int], float] = {}
    while len(rates) < len(flows):
        share, link = min(
            (left[link] / len(open_), link)
            for link, pairs in users.items()
            if (open_ := [p for p in pairs if p not in rates])
        )
        for pair in users[link]:
            if pair in rates:
                continue
            rates[pair] = share
            for other in (("out", pair[0]), ("in", pair[1])):
                left[other] -= share
    return rates


class _Network:
    """Messages between being sent or posted and their arrival."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.capacity = math.inf if cost.b <= 0 else 1.0 / cost.b
        self.sent: set[Message] = set()
        self.posted: set[Message] = set()
        self.queues: dict[tuple[int, int], list[Message]] = {}
        self.started: dict[Message, float] = {}
        self.bytes_from: dict[Message, float] = {}  # when its start-up ends
        self.remaining: dict[Message, float] = {}
        self.arrived: dict[Message, float] = {}

    def mark(self, message: Message, sent: bool, now: float) -> None:
        marks = self.sent if sent else self.posted
        if message in marks:
            raise ValueError(f"{message} is {'sent' if sent else 'posted'} twice")
        marks.add(message)
        if message in self.sent and message in self.posted:
            queue = self.queues.setdefault((message.src, message.dst), [])
            queue.append(message)
            if len(queue) == 1:
                self._start(message, now)

    def _start(self, message: Message, now: float) -> None:
        self.started[message] = now
        if message.nbytes <= 0:
            self._arrive(message, now)
            return
        self.bytes_from[message] = now + self.cost.a
        self.remaining[message] = float(message.nbytes)

    def _arrive(self, message: Message, now: float) -> None:
        self.arrived[message] = now
        self.bytes_from.pop(message, None)
        self.remaining.pop(message, None)
        queue = self.queues[(message.src, message.dst)]
        queue.pop(0)
        if queue:
            self._start(queue[0], now)

    def _moving(self, now: float) -> list[Message]:
        return [m for m, t in self.bytes_from.items() if t <= now + _TOLERANCE]

    def next_event(self, now: float) -> float:
        """The next start-up's end or arrival (inf when nothing moves)."""
        times = [t for t in self.bytes_from.values() if t > now + _TOLERANCE]
        moving = self._moving(now)
        if moving:
            rates = fair_rates(moving, self.capacity)
            for message in moving:
                rate = rates[(message.src, message.dst)]
                times.append(now + (self.remaining[message] / rate if rate < math.inf else 0.0))
        return min(times, default=math.inf)

    def advance(self, now: float, until: float) -> None:
        """Move bytes from ``now`` to ``until`` and deliver what has fully arrived."""
        moving = self._moving(now)
        rates = fair_rates(moving, self.capacity) if moving else {}
        for message in moving:
            rate = rates[(message.src, message.dst)]
            if rate == math.inf:
                self.remaining[message] = 0.0
            else:
                self.remaining[message] -= (until - now) * rate
        for message in sorted(moving, key=lambda m: self.started[m]):
            if self.remaining[message] <= 1e-9 * max(message.nbytes, 1.0):
                self._arrive(message, until)


def replay_programs(programs: Sequence[Sequence[Op]], cost: CostModel) -> Replay:
    """Run every stage's program together from time 0; when each ends, and what ran when.

    Args:
        programs: Stage ``k``'s operations, in order.
        cost: ``a + b * bytes`` of one message alone on a link, seconds.

    Raises:
        ValueError: When the programs deadlock (a stage waits on a message never sent or whose
            receive is never posted).
    """
    stages = len(programs)
    network = _Network(cost)
    position = [0] * stages
    busy_until: list[float | None] = [None] * stages
    busy_from = [0.0] * stages
    finish = [math.nan] * stages
    computations: list[Span] = []
    now = 0.0

    def run(stage: int) -> bool:
        moved = False
        program = programs[stage]
        while position[stage] < len(program):
            op = program[position[stage]]
            if isinstance(op, Compute):
                until = busy_until[stage]
                if until is None:
                    if op.seconds > 0:
                        busy_until[stage], busy_from[stage] = now + op.seconds, now
                        return True
                elif until > now + _TOLERANCE:
                    return moved
                else:
                    computations.append(Span(op.label, op.category, stage, busy_from[stage], until))
                    busy_until[stage] = None
            elif isinstance(op, Send | Post):
                sending = isinstance(op, Send)
                if (op.message.src if sending else op.message.dst) != stage:
                    raise ValueError(f"stage {stage} cannot {type(op).__name__} {op.message}")
                network.mark(op.message, sending, now)
            elif not all(m in network.arrived for m in op.messages):
                return moved
            position[stage] += 1
            moved = True
        if math.isnan(finish[stage]):
            finish[stage] = now
        return moved

    while True:
        while any([run(stage) for stage in range(stages)]):
            pass
        if all(not math.isnan(f) for f in finish):
            break
        pending = [t for t in busy_until if t is not None]
        upcoming = min([*pending, network.next_event(now)])
        if upcoming == math.inf:
            stuck = [s for s in range(stages) if math.isnan(finish[s])]
            raise ValueError(
                f"the stage programs deadlock: stages {stuck} wait on messages that never arrive"
            )
        network.advance(now, upcoming)
        now = upcoming
    transfers = tuple(
        Span(f"{m.key[0]} {m.src}->{m.dst}", "comm", m.src, network.started[m], t)
        for m, t in network.arrived.items()
    )
    return Replay(tuple(finish), tuple(computations), transfers)
