"""Stage programs replayed in time: computations and point-to-point messages on shared links.

Each stage runs its program in order (:class:`Compute`, :class:`Send`, :class:`Post`,
:class:`Wait`). Messages move as gloo moves them: each ordered pair of ranks is one TCP stream,
first in first out; a receive posted sends a ready notice back on the reverse stream, behind
whatever that stream already carries, and a message's bytes enter its stream only once it is
sent and its notice has come back. Every rank has one outgoing and one incoming link of
``1 / b`` bytes per second, shared max-min fairly by the streams moving bytes over it; each
crossing of the wire adds a latency (a third of the cost model's ``a``: a lone message of the
pipeline runtime crosses three times, header, notice and payload).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from interlace.comm.cost import CostModel

#: Seconds below which two event times count as equal.
_TOLERANCE = 1e-12
#: What a sending socket holds beyond the wire: a send is complete (gloo's handle done) once
#: its bytes are in the kernel's buffer, no more than this behind the last byte on the wire.
#: Linux grows a busy socket's buffer up to ``net.ipv4.tcp_wmem``'s maximum, 4 MiB by default.
SEND_BUFFER_BYTES = 4 * 1024 * 1024
#: Wire crossings of a lone message of the pipeline runtime: its header, the receiver's ready
#: notice for the payload, the payload. The fitted ``a`` is their sum.
CROSSINGS = 3


@dataclass(frozen=True, slots=True)
class Message:
    """One tensor sent from rank ``src`` to rank ``dst``.

    Args:
        key: What makes it unique (kind, step, batch, piece, ...).
        src: The sending stage.
        dst: The receiving stage.
        nbytes: Its size.
        after: Its receive is posted when this other message arrives (the pipeline runtime's
            ``Inbox`` posts a payload's receive as its header lands), instead of by a
            :class:`Post`.
    """

    key: tuple[object, ...]
    src: int
    dst: int
    nbytes: float
    after: Message | None = None


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class Send:
    """Start sending ``message`` (non-blocking: a later :class:`Wait` waits for it).

    Args:
        message: The message.
    """

    message: Message


@dataclass(frozen=True, slots=True)
class Post:
    """Post the receive of ``message`` (non-blocking).

    Args:
        message: The message.
    """

    message: Message


@dataclass(frozen=True, slots=True)
class Wait:
    """Block until every one of ``messages`` has arrived, or for the sender, is complete (in
    its socket's buffer).

    Args:
        messages: The messages waited on.
    """

    messages: tuple[Message, ...]


@dataclass(frozen=True, slots=True)
class Reduce:
    """Start the stage's gradient all-reduce over its replicas (non-blocking): it ends
    ``seconds`` later, on links of its own (a replicated stage's buckets, priced apart).

    Args:
        seconds: From now (the start of the backward that launches it) to its last bucket's end.
    """

    seconds: float


@dataclass(frozen=True, slots=True)
class Join:
    """Block until the stage's last :class:`Reduce` has ended (the update waits for it)."""


#: One step of a stage program.
Instruction = Compute | Send | Post | Wait | Reduce | Join


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class ProgramReplay:
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
    """Every ordered pair's stream of items (payloads and ready notices) and their arrivals."""

    def __init__(self, cost: CostModel, crossing_s: float, buffer_bytes: float) -> None:
        self.capacity = math.inf if cost.b <= 0 else 1.0 / cost.b
        self.crossing_s = crossing_s
        self.buffer_bytes = buffer_bytes
        self.enqueued: dict[tuple[int, int], float] = {}  # payload bytes put in each stream
        self.moved: dict[tuple[int, int], float] = {}  # of which on the wire
        self.buffered: dict[tuple[int, int], list[tuple[float, Message]]] = {}  # (due, send)
        self.done: set[Message] = set()  # sends complete
        self.sent: set[Message] = set()
        self.posted: set[Message] = set()
        self.ready: set[Message] = set()  # its notice is back at the sender
        self.waiting: dict[Message, list[Message]] = {}  # header -> payloads it posts
        self.streams: dict[tuple[int, int], deque[tuple[bool, Message]]] = {}
        self.remaining: dict[tuple[int, int], float] = {}  # bytes left of each stream's head
        self.started: dict[Message, float] = {}
        self.landing: list[tuple[float, bool, Message]] = []  # (time, payload?, message)
        self.arrived: dict[Message, float] = {}

    def send(self, message: Message, now: float) -> None:
        if message in self.sent:
            raise ValueError(f"{message} is sent twice")
        self.sent.add(message)
        if message.after is not None:
            if message.after in self.arrived:
                self.post(message, now)
            else:
                self.waiting.setdefault(message.after, []).append(message)
        if message in self.ready:
            self._enqueue((message.src, message.dst), (True, message), now)

    def post(self, message: Message, now: float) -> None:
        if message in self.posted:
            raise ValueError(f"{message} is posted twice")
        self.posted.add(message)
        self._enqueue((message.dst, message.src), (False, message), now)

    def _enqueue(self, stream: tuple[int, int], item: tuple[bool, Message], now: float) -> None:
        payload, message = item
        if payload:
            end = self.enqueued.get(stream, 0.0) + message.nbytes
            self.enqueued[stream] = end
            # Complete once no more than the buffer lies between its last byte and the wire.
            self.buffered.setdefault(stream, []).append((end - self.buffer_bytes, message))
            self._complete(stream)
        queue = self.streams.setdefault(stream, deque())
        queue.append(item)
        if len(queue) == 1:
            self._start(stream, now)

    def _start(self, stream: tuple[int, int], now: float) -> None:
        payload, message = self.streams[stream][0]
        self.remaining[stream] = message.nbytes if payload else 0.0
        if payload:
            self.started[message] = now
        if self.remaining[stream] <= 0 or self.capacity == math.inf:
            self.moved[stream] = self.moved.get(stream, 0.0) + self.remaining[stream]
            self._complete(stream)
            self._sent_out(stream, now)

    def _sent_out(self, stream: tuple[int, int], now: float) -> None:
        """The head's last byte is on the wire: it lands one crossing later; the next starts."""
        payload, message = self.streams[stream].popleft()
        del self.remaining[stream]
        self.landing.append((now + self.crossing_s, payload, message))
        if self.streams[stream]:
            self._start(stream, now)

    def _land(self, payload: bool, message: Message, now: float) -> None:
        if not payload:
            self.ready.add(message)
            if message in self.sent:
                self._enqueue((message.src, message.dst), (True, message), now)
            return
        self.arrived[message] = now
        for waiting in self.waiting.pop(message, []):
            self.post(waiting, now)

    def _complete(self, stream: tuple[int, int]) -> None:
        pending = self.buffered.get(stream, [])
        moved = self.moved.get(stream, 0.0)
        while pending and pending[0][0] <= moved + 1e-9 * max(pending[0][1].nbytes, 1.0):
            self.done.add(pending.pop(0)[1])

    def _moving(self) -> dict[tuple[int, int], float]:
        heads = [self.streams[s][0][1] for s, left in self.remaining.items() if left > 0]
        return fair_rates(heads, self.capacity) if heads else {}

    def next_event(self, now: float) -> float:
        """The next landing or end of a transfer (inf when nothing moves)."""
        times = [t for t, _, _ in self.landing]
        for stream, rate in self._moving().items():
            times.append(now + self.remaining[stream] / rate)
            if pending := self.buffered.get(stream):
                times.append(now + (pending[0][0] - self.moved.get(stream, 0.0)) / rate)
        return min(times, default=math.inf)

    def advance(self, now: float, until: float) -> None:
        """Move bytes from ``now`` to ``until``, then land what is due by ``until``."""
        for stream, rate in self._moving().items():
            moved = min((until - now) * rate, self.remaining[stream])
            self.remaining[stream] -= moved
            self.moved[stream] = self.moved.get(stream, 0.0) + moved
            self._complete(stream)
            message = self.streams[stream][0][1]
            if self.remaining[stream] <= 1e-9 * max(message.nbytes, 1.0):
                self._sent_out(stream, until)
        while due := [x for x in self.landing if x[0] <= until + _TOLERANCE]:
            first = min(due, key=lambda x: x[0])
            self.landing.remove(first)
            self._land(first[1], first[2], until)


def _compute_rate(slowdown: Sequence[float], computing: int) -> float:
    """Work seconds done per second by each of ``computing`` computations running together."""
    if not slowdown or computing < 1:
        return 1.0
    return 1.0 / slowdown[min(computing, len(slowdown)) - 1]


def replay_programs(
    programs: Sequence[Sequence[Instruction]],
    cost: CostModel,
    crossing_s: float | None = None,
    buffer_bytes: float = SEND_BUFFER_BYTES,
    slowdown: Sequence[float] = (),
) -> ProgramReplay:
    """Run every stage's program together from time 0; when each ends, and what ran when.

    Args:
        programs: Stage ``k``'s operations, in order.
        cost: ``a + b * bytes`` of one runtime message alone on a link, seconds.
        crossing_s: Latency of one crossing of the wire (default ``a / CROSSINGS``).
        buffer_bytes: A sending socket's buffer: a send completes once its last byte is no
            more than this behind the wire (0: once it is all on the wire).
        slowdown: ``slowdown[k - 1]`` is how many times longer a :class:`Compute` takes while
            ``k`` stages compute at once (stages sharing a host's cores); every computation
            advances at ``1 / slowdown`` of its speed while that many run. Missing entries
            repeat the last one; empty: computations never slow each other.

    Raises:
        ValueError: When the programs deadlock (a stage waits on a message never sent or whose
            receive is never posted).
    """
    if any(not s > 0 for s in slowdown):
        raise ValueError(f"slowdowns must be positive, got {list(slowdown)}")
    stages = len(programs)
    crossing = cost.a / CROSSINGS if crossing_s is None else crossing_s
    network = _Network(cost, crossing, buffer_bytes)
    position = [0] * stages
    left: list[float | None] = [None] * stages  # work left of the running computation, seconds
    busy_from = [0.0] * stages
    reduced = [0.0] * stages  # when each stage's last all-reduce ends
    finish = [math.nan] * stages
    computations: list[Span] = []
    now = 0.0

    def run(stage: int) -> bool:
        moved = False
        program = programs[stage]
        while position[stage] < len(program):
            op = program[position[stage]]
            if isinstance(op, Compute):
                work = left[stage]
                if work is None:
                    if op.seconds > 0:
                        left[stage], busy_from[stage] = op.seconds, now
                        return True
                elif work > _TOLERANCE:
                    return moved
                else:
                    computations.append(Span(op.label, op.category, stage, busy_from[stage], now))
                    left[stage] = None
            elif isinstance(op, Reduce):
                reduced[stage] = now + op.seconds
            elif isinstance(op, Join):
                if reduced[stage] > now + _TOLERANCE:
                    return moved
            elif isinstance(op, Send | Post):
                sending = isinstance(op, Send)
                if (op.message.src if sending else op.message.dst) != stage:
                    raise ValueError(f"stage {stage} cannot {type(op).__name__} {op.message}")
                if sending:
                    network.send(op.message, now)
                else:
                    network.post(op.message, now)
            elif not all(
                m in (network.done if m.src == stage else network.arrived) for m in op.messages
            ):
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
        rate = _compute_rate(slowdown, sum(work is not None for work in left))
        pending = [now + work / rate for work in left if work is not None]
        pending += [t for t in reduced if t > now + _TOLERANCE]
        upcoming = min([*pending, network.next_event(now)])
        if upcoming == math.inf:
            stuck = [s for s in range(stages) if math.isnan(finish[s])]
            raise ValueError(
                f"the stage programs deadlock: stages {stuck} wait on messages that never arrive"
            )
        network.advance(now, upcoming)
        for stage, work in enumerate(left):
            if work is not None:
                left[stage] = work - (upcoming - now) * rate
        now = upcoming
    transfers = tuple(
        Span(f"{m.key[0]} {m.src}->{m.dst}", "comm", m.src, network.started[m], t)
        for m, t in network.arrived.items()
    )
    return ProgramReplay(tuple(finish), tuple(computations), transfers)
