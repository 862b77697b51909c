"""Forward-overlap plans: all-reduces that run on into the next forward, most urgent first.

Pure functions. A plan's gates are the points of the next forward that wait for parameters (a
layer about to run); :class:`GateDues` says what each gate waits for and applies, the one rule
the runtime (:mod:`interlace.dp.forward_overlap`) runs and the planner and the simulator price
(why all-reduces rather than reduce-scatter + all-gather: docs/notes/dp.md).
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass

from interlace.comm.cost import CostModel
from interlace.comm.plan import Gate, Launch, Plan, ReadyTensor
from interlace.comm.planners import pack_by_cap, plan_merged
from interlace.comm.pricing import ChannelClock, PlacedSlice, bucket_of


class Overlap(str, enum.Enum):
    """What the all-reduces of an iteration may overlap; a member or its string works."""

    #: Backward only: ``loss.backward()`` returns with the gradients averaged (DDP's way).
    BACKWARD = "backward"
    #: Backward and the next forward: each layer waits for its own parameters' averages and
    #: updates, right before it runs.
    FORWARD = "forward"

    def __str__(self) -> str:
        return self.value


#: Slice sizes (bytes) weighed for cutting large buckets, besides not cutting them: an urgent
#: bucket then waits behind at most one slice of a big one.
SLICE_CANDIDATES_BYTES = (1e6, 4e6)
#: Start-up factors of the merge rule weighed as the buckets of an overlap plan.
MERGE_SCALES = (1.0, 4.0)
#: Byte caps (with a 1 MB first bucket) weighed as the buckets of an overlap plan.
CAP_CANDIDATES_BYTES = (5e6, 10e6, 25e6)


@dataclass(frozen=True)
class GateTiming:
    """A gate as profiled: its name, the tensors waiting there and when forward reaches it.

    Args:
        name: The gate's name (a module's).
        tensors: The tensors that wait there, as the caller indexes them.
        start_s: Seconds from the start of the forward to the gate.
    """

    name: str
    tensors: tuple[int, ...]
    start_s: float


def gates_from_timings(
    timings: Sequence[GateTiming], position: Sequence[int], forward_s: float
) -> list[Gate]:
    """Plan gates from profiled ones: tensors renumbered, each stretch up to the next gate.

    Args:
        timings: The profiled gates, in forward order.
        position: Each tensor's index in the plan's ready order, by the timings' numbering.
        forward_s: The whole forward (the last gate's stretch ends there).
    """
    gates: list[Gate] = []
    for number, gate in enumerate(timings):
        end = timings[number + 1].start_s if number + 1 < len(timings) else forward_s
        gates.append(
            Gate(
                gate.name,
                tuple(sorted(position[i] for i in gate.tensors)),
                max(end - gate.start_s, 0.0),
            )
        )
    return gates


@dataclass(frozen=True)
class Unit:
    """A slice of a bucket as the launch order lists it.

    Args:
        bucket: The bucket's index.
        part: Which slice (from 0).
        parts: How many slices the bucket is cut into.
        nbytes: The slice's bytes.
    """

    bucket: int
    part: int
    parts: int
    nbytes: int


@dataclass(frozen=True)
class Landing:
    """What the forward waits for and applies at one gate.

    Args:
        buckets: The buckets it waits for.
        tensors: The tensors whose updates land there: every member of those buckets.
    """

    buckets: tuple[int, ...]
    tensors: tuple[int, ...]


@dataclass(frozen=True)
class GateDues:
    """Which buckets fall due at each gate of the next forward, and whose updates land there.

    A gate waits for every bucket that holds one of its tensors and has not landed yet. A
    bucket's average arrives whole, so the update of every member lands with it, the tensors of
    later gates included. The runtime asks :meth:`due` and :meth:`landing` at each gate it
    reaches; the planner and the simulator price :meth:`in_order` (through
    :func:`gated_stretches`).

    Args:
        groups: The buckets, as tensor indices.
        gates: For each gate, in the caller's numbering, the buckets holding one of its tensors.
    """

    groups: tuple[tuple[int, ...], ...]
    gates: tuple[frozenset[int], ...]

    @classmethod
    def of(cls, groups: Sequence[Sequence[int]], waits: Iterable[Iterable[int]]) -> GateDues:
        """The dues of ``groups`` at gates where ``waits`` wait.

        Args:
            groups: The buckets, as tensor indices (every tensor a gate names in one of them).
            waits: For each gate, the tensors that wait there.
        """
        bucket = {index: number for number, group in enumerate(groups) for index in group}
        return cls(
            tuple(tuple(group) for group in groups),
            tuple(frozenset(bucket[index] for index in tensors) for tensors in waits),
        )

    def due(self, gate: int, pending: Set[int]) -> list[int]:
        """The buckets the forward waits for at ``gate``: those of its buckets still in
        ``pending``, in index order.

        Args:
            gate: The gate's number.
            pending: The buckets that have not landed.
        """
        return sorted(self.gates[gate] & pending)

    def landing(self, buckets: Iterable[int]) -> list[int]:
        """The tensors whose updates land with ``buckets``: all their members, in index order.

        Args:
            buckets: Buckets landing together.
        """
        return sorted(index for bucket in buckets for index in self.groups[bucket])

    def in_order(self) -> list[Landing]:
        """A forward that reaches every gate once, in order: what lands at each gate, then one
        more entry for the buckets no gate waited for (they land at the end of the forward)."""
        pending = set(range(len(self.groups)))
        found = []
        for gate in range(len(self.gates)):
            due = self.due(gate, pending)
            pending.difference_update(due)
            found.append(Landing(tuple(due), tuple(self.landing(due))))
        rest = sorted(pending)
        found.append(Landing(tuple(rest), tuple(self.landing(rest))))
        return found

    def first_due(self) -> list[int]:
        """For each bucket, the number of the gate it lands at in :meth:`in_order` (the gate
        count for one no gate waits for)."""
        return _first_due(self.in_order(), len(self.gates), len(self.groups))


def _first_due(landings: Sequence[Landing], gates: int, buckets: int) -> list[int]:
    """:meth:`GateDues.first_due` from the landings :meth:`GateDues.in_order` gave."""
    first = [gates] * buckets
    for gate, landing in enumerate(landings):
        for bucket in landing.buckets:
            first[bucket] = min(first[bucket], gate)
    return first


@dataclass(frozen=True)
class Stretch:
    """A stretch of the gated forward: it waits for ``waits``, then computes ``work_s``.

    Args:
        waits: The buckets it waits for.
        work_s: The updates landing there (the step, shared by bytes), then the forward up to
            the next gate.
    """

    waits: tuple[int, ...]
    work_s: float


def gated_stretches(
    tensors: Sequence[ReadyTensor],
    gates: Sequence[Gate],
    groups: Sequence[Sequence[int]],
    step_s: float,
) -> list[Stretch]:
    """The next forward from its first gate on, as :class:`GateDues` lands the updates: per gate,
    its due buckets, then the update of every tensor landing there (``step_s`` shared by bytes)
    and its forward; last, the buckets no gate waited for and their update (none when there are
    none).

    Args:
        tensors: The tensors in ready order.
        gates: The gates, in forward order.
        groups: The buckets, as indices into ``tensors``.
        step_s: The optimizer step over every tensor.
    """
    landings = GateDues.of(groups, (gate.tensors for gate in gates)).in_order()
    return _stretches(landings, tensors, gates, step_s)


def _stretches(
    landings: Sequence[Landing],
    tensors: Sequence[ReadyTensor],
    gates: Sequence[Gate],
    step_s: float,
) -> list[Stretch]:
    """:func:`gated_stretches` from the landings :meth:`GateDues.in_order` gave."""
    total = sum(t.nbytes for t in tensors) or 1
    stretches = []
    for number, landing in enumerate(landings):
        if number == len(gates) and not landing.buckets:
            break
        update = step_s * sum(tensors[i].nbytes for i in landing.tensors) / total
        forward = gates[number].forward_s if number < len(gates) else 0.0
        stretches.append(Stretch(landing.buckets, update + forward))
    return stretches


def units_of(nbytes: Sequence[int], slice_bytes: float | None) -> list[list[Unit]]:
    """Each bucket cut into slices of at most ``slice_bytes`` (None: one slice each).

    Args:
        nbytes: Each bucket's bytes.
        slice_bytes: The largest slice.
    """
    cut: list[list[Unit]] = []
    for bucket, size in enumerate(nbytes):
        parts = 1 if slice_bytes is None else max(math.ceil(size / slice_bytes), 1)
        sizes = [size // parts + (1 if k < size % parts else 0) for k in range(parts)]
        cut.append([Unit(bucket, k, parts, sizes[k]) for k in range(parts)])
    return cut


def plan_overlap(
    tensors: Sequence[ReadyTensor],
    gates: Sequence[Gate],
    cost: CostModel,
    *,
    groups: Sequence[Sequence[int]],
    forward_s: float,
    backward_s: float | None = None,
    step_s: float = 0.0,
    channels: int = 1,
    slice_bytes: float | None = None,
    strategy: str = "overlap",
) -> Plan:
    """``groups`` sent most urgent first, on into the next forward, which waits at its gates.

    Whenever a channel frees up, the slice sent next is the ready one whose bucket the next
    forward needs first (ties: ready order); with nothing ready, the next to become ready. The
    runtime issues the slices in exactly this order, each once its bucket is complete and the
    one before it is out, so every rank issues the same collectives in the same order.

    The next forward starts when backward ends; each gate waits for its due buckets and applies
    the update of all their members (``step_s`` shared by bytes, :class:`GateDues`), then
    computes up to the next gate. Buckets no gate waits for are waited for, and updated, at
    the end of the forward.

    Args:
        tensors: The tensors in ready order.
        gates: The next forward's gates, in forward order (tensor indices into ``tensors``).
        cost: The price of an all-reduce.
        groups: The buckets, as indices into ``tensors`` (contiguous ones, as the planners of
            :mod:`interlace.comm.planners` make).
        forward_s: The whole forward pass; what precedes the first gate is its part not
            covered by the gates' own stretches.
        backward_s: When backward ends (default: when the last tensor is ready).
        step_s: The optimizer step over every tensor.
        channels: How many channels.
        slice_bytes: Buckets are cut into slices of at most this many bytes (None: never).
        strategy: The name the plan carries.

    Raises:
        ValueError: For groups that do not cover the tensors, gates naming unknown tensors, or
            a slice size that is not positive.
    """
    if slice_bytes is not None and not slice_bytes > 0:
        raise ValueError(f"slice_bytes must be > 0 (or None), got {slice_bytes}")
    gating = _gating(tensors, gates, groups, step_s)
    return _plan_overlap(
        tensors,
        gates,
        cost,
        groups,
        gating,
        forward_s=forward_s,
        backward_s=backward_s,
        step_s=step_s,
        channels=channels,
        slice_bytes=slice_bytes,
        strategy=strategy,
    )


def _gating(
    tensors: Sequence[ReadyTensor],
    gates: Sequence[Gate],
    groups: Sequence[Sequence[int]],
    step_s: float,
) -> tuple[list[int], list[Stretch]]:
    """What an overlap plan of ``groups`` takes from its gates whatever the cost and slices:
    the gate each bucket lands at (:meth:`GateDues.first_due`) and the forward's stretches
    (:func:`gated_stretches`), checked."""
    count = len(tensors)
    flat = sorted(index for group in groups for index in group)
    if flat != list(range(count)) or any(not group for group in groups):
        raise ValueError("buckets must be non-empty and cover every tensor exactly once")
    if any(not 0 <= index < count for gate in gates for index in gate.tensors):
        raise ValueError("a gate names a tensor the plan does not have")
    landings = GateDues.of(groups, (gate.tensors for gate in gates)).in_order()
    return (
        _first_due(landings, len(gates), len(groups)),
        _stretches(landings, tensors, gates, step_s),
    )


def _plan_overlap(
    tensors: Sequence[ReadyTensor],
    gates: Sequence[Gate],
    cost: CostModel,
    groups: Sequence[Sequence[int]],
    gating: tuple[list[int], list[Stretch]],
    *,
    forward_s: float,
    backward_s: float | None,
    step_s: float,
    channels: int,
    slice_bytes: float | None,
    strategy: str,
) -> Plan:
    """:func:`plan_overlap` with its gating (:func:`_gating`) given."""
    needs, stretches = gating
    end_of_backward = max((t.ready_s for t in tensors), default=0.0)
    backward_s = end_of_backward if backward_s is None else max(backward_s, end_of_backward)
    ready = [max(tensors[i].ready_s for i in group) for group in groups]
    sizes = [sum(tensors[i].nbytes for i in group) for group in groups]
    clock = ChannelClock(cost, channels)
    launches: list[Launch] = []
    # Units by ready time; those ready are released into a heap ordered by urgency. "Now" never
    # goes back, so a released unit stays ready.
    waiting = sorted(
        (unit for units in units_of(sizes, slice_bytes) for unit in units),
        key=lambda u: ready[u.bucket],
    )
    released: list[tuple[float, float, int, int, Unit]] = []
    position = 0
    while position < len(waiting) or released:
        now = max(clock.launched, min(clock.free))
        if position < len(waiting) and not released:
            now = max(now, ready[waiting[position].bucket])
        while position < len(waiting) and ready[waiting[position].bucket] <= now:
            u = waiting[position]
            heapq.heappush(released, (needs[u.bucket], ready[u.bucket], u.bucket, u.part, u))
            position += 1
        unit = heapq.heappop(released)[-1]
        (piece,) = clock.place_slices(unit.nbytes, ready[unit.bucket], count=1)
        launches.append(
            Launch(
                unit.bucket,
                unit.part,
                unit.parts,
                unit.nbytes,
                piece.channel,
                piece.start_s,
                piece.end_s,
            )
        )
    slices: list[list[PlacedSlice]] = [[] for _ in groups]
    for launch in launches:
        slices[launch.bucket].append(
            PlacedSlice(launch.channel, launch.nbytes, launch.start_s, launch.end_s)
        )
    buckets = []
    for number, group in enumerate(groups):
        pieces = slices[number]
        buckets.append(bucket_of(tuple(group), sizes[number], ready[number], pieces))
    done = [bucket.end_s for bucket in buckets]
    forward_end = _forward_end(stretches, gates, done, backward_s, forward_s)
    return Plan(
        strategy,
        tuple(buckets),
        backward_s,
        forward_s,
        cost,
        tuple(tensors),
        channels,
        None,
        launches=tuple(launches),
        gates=tuple(gates),
        step_s=step_s,
        forward_end_s=forward_end,
    )


def gated_forward_end(
    tensors: Sequence[ReadyTensor],
    gates: Sequence[Gate],
    groups: Sequence[Sequence[int]],
    done_s: Sequence[float],
    *,
    backward_end_s: float,
    forward_s: float,
    step_s: float,
) -> float:
    """When the next forward ends if it starts at ``backward_end_s`` and bucket ``b`` arrives at
    ``done_s[b]``: each stretch of :func:`gated_stretches` waits for its buckets, then computes.

    Args:
        tensors: The tensors in ready order.
        gates: The gates, in forward order.
        groups: The buckets, as indices into ``tensors``.
        done_s: When each bucket's last slice ends.
        backward_end_s: When backward ends (the forward starts then).
        forward_s: The whole forward.
        step_s: The optimizer step over every tensor, spread by bytes.
    """
    stretches = gated_stretches(tensors, gates, groups, step_s)
    return _forward_end(stretches, gates, done_s, backward_end_s, forward_s)


def _forward_end(
    stretches: Sequence[Stretch],
    gates: Sequence[Gate],
    done_s: Sequence[float],
    backward_end_s: float,
    forward_s: float,
) -> float:
    """:func:`gated_forward_end` from the forward's stretches."""
    now = backward_end_s + max(forward_s - sum(gate.forward_s for gate in gates), 0.0)
    for stretch in stretches:
        now = max([now, *(done_s[bucket] for bucket in stretch.waits)]) + stretch.work_s
    return now


def overlap_groupings(
    tensors: Sequence[ReadyTensor], gates: Sequence[Gate], cost: CostModel
) -> dict[str, list[list[int]]]:
    """The bucketings an overlap plan is weighed with, by label: the merge rule (fewer
    start-ups), one bucket per gate (each layer on its own) and byte caps with a 1 MB first
    bucket (:data:`CAP_CANDIDATES_BYTES`; few start-ups, the early layers apart).

    Args:
        tensors: The tensors in ready order.
        gates: The next forward's gates.
        cost: The price of an all-reduce.
    """
    found: dict[str, list[list[int]]] = {}
    for scale in MERGE_SCALES:
        scaled = CostModel(cost.a * scale, cost.b, cost.concurrency)
        label = "merged" if scale == 1 else f"merged, start-up x{scale:g}"
        found[label] = plan_merged(tensors, scaled).groups
    found["per gate"] = per_gate_groups(len(tensors), gates)
    sizes = [t.nbytes for t in tensors]
    for cap in CAP_CANDIDATES_BYTES:
        found[f"{cap / 1e6:g} MB caps"] = pack_by_cap(sizes, cap, min(cap, 1e6))
    return found


def overlap_candidates(
    tensors: Sequence[ReadyTensor],
    gates: Sequence[Gate],
    cost: CostModel,
    *,
    forward_s: float,
    backward_s: float | None = None,
    step_s: float = 0.0,
    channels: int = 1,
) -> list[tuple[str, Plan]]:
    """Every grouping of :func:`overlap_groupings` with every slice size, fastest predicted
    first: ``(label, plan)``.

    Args:
        tensors: The tensors in ready order.
        gates: The next forward's gates, in forward order.
        cost: The price of an all-reduce.
        forward_s: The whole forward pass.
        backward_s: When backward ends (default: when the last tensor is ready).
        step_s: The optimizer step over every tensor.
        channels: How many channels.
    """
    found: list[tuple[str, Plan]] = []
    for label, groups in overlap_groupings(tensors, gates, cost).items():
        gating = _gating(tensors, gates, groups, step_s)  # the same for every slice size
        for slice_bytes in (None, *SLICE_CANDIDATES_BYTES):
            plan = _plan_overlap(
                tensors,
                gates,
                cost,
                groups,
                gating,
                forward_s=forward_s,
                backward_s=backward_s,
                step_s=step_s,
                channels=channels,
                slice_bytes=slice_bytes,
                strategy="overlap",
            )
            sliced = "" if slice_bytes is None else f", {slice_bytes / 1e6:g} MB slices"
            found.append((f"overlap: {label}{sliced}", plan))
    # sorted() is stable: among equals the earlier family (fewer launches) stays first.
    return sorted(found, key=lambda item: item[1].iteration_s)


def per_gate_groups(count: int, gates: Sequence[Gate]) -> list[list[int]]:
    """Consecutive tensors cut wherever the gate that first waits for them changes.

    Args:
        count: How many tensors (in ready order).
        gates: The gates.
    """
    gate_of = [len(gates)] * count
    for position, gate in reversed(list(enumerate(gates))):
        for index in gate.tensors:
            gate_of[index] = position
    groups: list[list[int]] = []
    for index in range(count):
        if groups and gate_of[groups[-1][-1]] == gate_of[index]:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups
