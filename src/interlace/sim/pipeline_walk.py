"""The fast engine of the one pipeline model: every stage's program as
:func:`interlace.sim.pipeline.stage_programs` writes it (what the runtime runs, and what the gloo
replay of :mod:`interlace.sim.pipeline_events` times), compiled once into integer triples and
walked in order. A message (payload and its header) takes ``b * bytes`` on the sending rank's
outgoing link of its level (inside a node or between nodes), which carries that rank's sends one
after another, then ``a`` to land; where no link carries two messages at once this is the
replay's time, and it is what the planner can afford at 2048 ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from interlace.pipeline.block import HEADER_BYTES
from interlace.sim.network import Link
from interlace.sim.pipeline import StageCost, stage_programs
from interlace.sim.pipeline_events import (
    SEND_BUFFER_BYTES,
    Compute,
    Join,
    Reduce,
    Send,
    Wait,
)

__all__ = ["StageWork", "walk_block_s", "walk_programs", "walk_works"]


@dataclass(frozen=True)
class StageWork:
    """What one stage does per piece and per mini-batch, for :func:`walk_programs`.

    Args:
        forward_s: One piece's forward (and a recompute's).
        backward_s: One piece's backward.
        update_s: One optimizer step.
        weights_s: One prediction or stash of the stage's weights.
        reduce_s: From the start of the launching backward to the end of the stage's
            all-reduce (0: one replica).
        act_bytes: Bytes of one piece's output sent to the next stage (0 on the last).
        act_link: The link that output crosses (None on the last stage).
        scale_s: Dividing the accumulated gradients (torch's schedules).
        send_s: The host call that starts a send.
    """

    forward_s: float
    backward_s: float
    update_s: float
    weights_s: float
    reduce_s: float
    act_bytes: float
    act_link: Link | None
    scale_s: float = 0.0
    send_s: float = 0.0


@dataclass
class _Stage:
    """One stage's walk: where it is in its program, its clock and its accounts."""

    clock: float = 0.0
    position: int = 0
    pending: float = 0.0  # when its sends so far are complete
    reduce_done: float = 0.0
    busy: float = 0.0
    bubble: float = 0.0
    p2p: float = 0.0
    allreduce: float = 0.0


# Compiled instructions: (code, boundary or kind, message number).
_WORK, _SEND, _SEND_HEADED, _WAIT_SENT, _WAIT_ARRIVED, _REDUCE, _JOIN = range(7)
#: The kinds of work, by the label :mod:`interlace.sim.pipeline` gives its computations.
_FORWARD, _BACKWARD, _WEIGHTS, _UPDATE, _SCALE, _SEND_CALL = range(6)
_KINDS = {
    "forward": _FORWARD,
    "recompute": _FORWARD,
    "backward": _BACKWARD,
    "predict": _WEIGHTS,
    "stash": _WEIGHTS,
    "update": _UPDATE,
    "scale": _SCALE,
    "send": _SEND_CALL,
}
#: The keys the runtime's headers are sent under (:mod:`interlace.sim.pipeline`'s).
_HEADERS = frozenset({"act-header", "grad-header"})
#: Placeholder costs the programs are built on: only their structure is compiled.
_SHAPE = StageCost(1.0, 1.0, 1.0, reduce_s=1.0)


@functools.lru_cache(maxsize=512)
def _compiled(
    schedule: str, stages: int, block: int, pieces: int, hosted: bool
) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Every stage's program of ``block`` mini-batches, as :func:`interlace.sim.pipeline.
    stage_programs` writes it (the one rule for what each stage runs), in small integer
    triples: each message numbered, each computation by kind. A header goes out with its
    payload (nothing waits on it alone); without host costs (``hosted`` False) the host's send
    calls and gradient scaling, which take no time, are left out."""
    # Built replicated: one replica's walk starts and joins all-reduces of no length.
    programs = stage_programs([_SHAPE] * stages, schedule, microbatches=pieces, block=block)
    numbers: dict[tuple[object, ...], int] = {}
    compiled = []
    for k, program in enumerate(programs):
        mine = []
        for op in program:
            if isinstance(op, Compute):
                kind = _KINDS[op.label]
                if hosted or kind not in (_SCALE, _SEND_CALL):
                    mine.append((_WORK, kind, 0))
            elif isinstance(op, Send):
                message = op.message
                if message.after is None and message.key[0] in _HEADERS:
                    continue
                number = numbers.setdefault(message.key, len(numbers))
                code = _SEND_HEADED if message.after is not None else _SEND
                mine.append((code, min(message.src, message.dst), number))
            elif isinstance(op, Wait):
                # Every program waits for all of its sends still in flight at once: one wait.
                messages = op.messages
                if any(message.src == k for message in messages):
                    mine.append((_WAIT_SENT, 0, 0))
                for message in messages:
                    if message.dst == k:
                        number = numbers.setdefault(message.key, len(numbers))
                        mine.append((_WAIT_ARRIVED, 0, number))
            elif isinstance(op, Reduce):
                mine.append((_REDUCE, 0, 0))
            elif isinstance(op, Join):
                mine.append((_JOIN, 0, 0))
            # A Post does nothing here: receives are taken as posted up front (the Inbox).
        compiled.append(tuple(mine))
    return tuple(compiled)


def walk_programs(
    works: Sequence[StageWork],
    schedule: str,
    *,
    pieces: int,
    block: int,
) -> list[list[tuple[float, float, float, float, float]]]:
    """Walk every stage's program of ``block`` mini-batches; per stage, after each update, its
    clock and its busy, bubble, p2p and all-reduce seconds so far.

    Args:
        works: Each stage's work and the link to the next stage.
        schedule: One of :data:`interlace.sim.pipeline.PIPELINE_SCHEDULES`.
        pieces: Micro-batches (synchronous) or chunks (asynchronous) per mini-batch.
        block: Mini-batches.

    Raises:
        ValueError: When the programs deadlock.
    """
    return _walk(works, schedule, pieces=pieces, block=block)[0]


def walk_block_s(
    works: Sequence[StageWork],
    schedule: str,
    *,
    pieces: int,
    block: int,
) -> float:
    """When the last stage ends its program of ``block`` mini-batches, all starting at 0 (the
    walk's counterpart of :attr:`interlace.sim.pipeline.PipelineResult.block_s`).

    Args:
        works: Each stage's work and the link to the next stage.
        schedule: One of :data:`interlace.sim.pipeline.PIPELINE_SCHEDULES`.
        pieces: Micro-batches (synchronous) or chunks (asynchronous) per mini-batch.
        block: Mini-batches.
    """
    return max(_walk(works, schedule, pieces=pieces, block=block)[1])


def _walk(
    works: Sequence[StageWork], schedule: str, *, pieces: int, block: int
) -> tuple[list[list[tuple[float, float, float, float, float]]], list[float]]:
    """:func:`walk_programs`'s marks, and each stage's clock at its program's end."""
    programs = _compiled(
        schedule,
        len(works),
        block,
        pieces,
        any(w.scale_s > 0 or w.send_s > 0 for w in works),
    )
    count = len(works)
    stages = [_Stage() for _ in range(count)]
    walk = _Walk(works, count)
    # Each stage runs until it waits for a message not yet sent; the send wakes it. What a
    # stage does depends only on its own program and its messages, not on the order they run.
    ready = list(range(count - 1, -1, -1))
    while ready:
        k = ready.pop()
        _run(k, stages[k], programs[k], walk, ready)
    if any(s.position < len(p) for s, p in zip(stages, programs, strict=True)):
        raise ValueError(f"the {schedule} programs deadlock on {count} stages")
    return walk.marks, [s.clock for s in stages]


class _Walk:
    """What the stages share as they walk: the messages sent, the links' queues, the stage
    waiting for each message, and every stage's marks."""

    def __init__(self, works: Sequence[StageWork], count: int) -> None:
        self.works = works
        self.count = count
        self.arrivals: dict[int, tuple[float, float]] = {}  # message -> (issued, arrival)
        self.out_free: dict[int, float] = {}
        # Each boundary's link as a number (a rank's sends on one level share its outgoing link).
        levels: dict[Link, int] = {}
        self.level = [
            levels.setdefault(w.act_link, len(levels)) if w.act_link else 0 for w in works
        ]
        self.waiting: dict[int, int] = {}  # message -> the stage waiting for it
        self.marks: list[list[tuple[float, float, float, float, float]]] = [
            [] for _ in range(count)
        ]


def _run(
    k: int, me: _Stage, program: tuple[tuple[int, int, int], ...], walk: _Walk, ready: list[int]
) -> None:
    """Run stage ``k`` on until it waits for a message not yet sent (noted in ``walk``) or
    ends; a stage its sends wake goes on ``ready``."""
    works, arrivals, out_free, waiting = walk.works, walk.arrivals, walk.out_free, walk.waiting
    work, marks, level, count = works[k], walk.marks[k], walk.level, walk.count
    seconds = (
        work.forward_s,
        work.backward_s,
        work.weights_s,
        work.update_s,
        work.scale_s,
        work.send_s,
    )
    clock, busy, bubble, p2p, allreduce = me.clock, me.busy, me.bubble, me.p2p, me.allreduce
    pending, reduce_done, position, last = me.pending, me.reduce_done, me.position, len(program)
    while position < last:
        code, arg, message = program[position]
        if code == _WORK:
            clock += seconds[arg]
            busy += seconds[arg]
            if arg == _UPDATE:
                marks.append((clock, busy, bubble, p2p, allreduce))
        elif code == _WAIT_ARRIVED:
            sent = arrivals.get(message)
            if sent is None:
                waiting[message] = k
                break
            issued, arrival = sent
            if arrival > clock:
                bubble += max(0.0, min(issued, arrival) - clock)
                p2p += arrival - max(issued, clock)
                clock = arrival
        elif code in (_SEND, _SEND_HEADED):
            boundary = works[arg]
            link = boundary.act_link
            assert link is not None  # a neighbour exists where the schedule sends
            lane = k * count + level[arg]
            start = max(clock, out_free.get(lane, 0.0))
            # The runtime's header goes out just before its payload.
            nbytes = boundary.act_bytes + (HEADER_BYTES if code == _SEND_HEADED else 0)
            end = start + link.beta * nbytes
            out_free[lane] = end
            arrivals[message] = (clock, end + link.alpha)
            pending = max(pending, clock, end - link.beta * SEND_BUFFER_BYTES)
            woken = waiting.pop(message, None)
            if woken is not None:
                ready.append(woken)
        elif code == _WAIT_SENT:
            if pending > clock:
                p2p += pending - clock
                clock = pending
        elif code == _REDUCE:
            reduce_done = clock + work.reduce_s
        elif code == _JOIN and reduce_done > clock:
            allreduce += reduce_done - clock
            clock = reduce_done
        position += 1
    me.clock, me.busy, me.bubble, me.p2p, me.allreduce = clock, busy, bubble, p2p, allreduce
    me.pending, me.reduce_done, me.position = pending, reduce_done, position


def walk_works(
    stages: Sequence[StageCost], links: Sequence[Link | None], pieces: int
) -> list[StageWork]:
    """What the walk takes of each stage: its costs per piece, as the replay prices them.

    Args:
        stages: Each stage's costs (:func:`priced_stages`).
        links: The link from each stage to the next (None on the last).
        pieces: Micro-batches or chunks per mini-batch.
    """
    return [
        StageWork(
            forward_s=cost.forward_s / pieces + cost.host.forward_s,
            backward_s=cost.backward_s / pieces + cost.host.backward_s,
            update_s=cost.host.update_s,
            weights_s=cost.host.predict_s,
            reduce_s=cost.reduce_s,
            act_bytes=cost.output_bytes / pieces,
            act_link=link,
            scale_s=cost.host.scale_s,
            send_s=cost.host.send_s,
        )
        for cost, link in zip(stages, links, strict=True)
    ]
