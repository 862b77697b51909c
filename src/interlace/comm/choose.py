"""Choosing a plan from measured times: the candidate plans, the channel count, and why.

Pure functions: DataParallel feeds them the slowest rank's timings and a cost model, and runs
the plans they return (see docs/notes/dp.md for how the constants were chosen).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import GateTiming, Overlap, gates_from_timings, overlap_candidates
from interlace.comm.plan import MIB, Bucketing, Plan, ReadyTensor
from interlace.comm.planners import make_plan
from interlace.comm.tuning import (
    START_UP_SCALES,
    TIE_MARGIN,
    describe_trials,
    fastest,
    scale_start_up,
)

#: With ``merged``/``optimal``, the trials also weigh gradients cut into about this many buckets
#: of equal bytes (DDP-style caps of total/count).
EVEN_BUCKET_COUNTS = (4, 8)
#: Partition thresholds the planner weighs (besides none) when ``partition_mb="auto"``.
PARTITION_CANDIDATES_MB = (0.25, 1.0, 4.0)
#: ``channels="auto"`` takes more channels only for a predicted gain above this fraction.
AUTO_MARGIN = 0.10
#: With ``overlap="forward"``, the overlap plans (of different bucketings) the trials weigh.
OVERLAP_TRIALS = 2


@dataclass(frozen=True)
class PlanRequest:
    """What a wrapper asks of its buckets: every input of the choice but timings and cost.

    Args:
        bucketing: the planner.
        cap_bytes: the cap of ``fixed`` buckets, in bytes.
        first_cap_bytes: the first ``fixed`` bucket's cap, in bytes.
        channels: as asked: a count ``k >= 1`` or ``"auto"``.
        channel_groups: the channels that exist (``k``, or the most ``"auto"`` tries).
        partition_mb: buckets above this many MiB are split across channels; None never splits,
            ``"auto"`` weighs :data:`PARTITION_CANDIDATES_MB`.
        compression: ``None``, ``"fp16"`` or ``"bf16"``: half the bytes on the wire.
        tune_steps: timed iterations per candidate and round; 0 weighs no candidates.
        overlap: what the all-reduces may overlap; with ``"forward"`` the plans that run on into
            the next forward are weighed, and backward-only ones beside them.
    """

    bucketing: Bucketing
    cap_bytes: float = 25 * MIB
    first_cap_bytes: float = MIB
    channels: int | str = 1
    channel_groups: int = 1
    partition_mb: float | str | None = "auto"
    compression: str | None = None
    tune_steps: int = 2
    overlap: Overlap = Overlap.BACKWARD


@dataclass(frozen=True)
class Timings:
    """What profiled backward passes showed (the slowest rank's medians).

    Args:
        names: the tensors' names, in registration order.
        nbytes: their sizes in bytes (uncompressed).
        forward_s: the forward pass, in seconds.
        backward_s: the backward pass, in seconds.
        ready_s: when each tensor's gradient was ready, seconds from the start of backward.
        gates: where the forward waits for parameters, in forward order (tensors by
            registration index); empty without ``overlap="forward"``.
        step_s: the optimizer step over every tensor.
    """

    names: tuple[str, ...]
    nbytes: tuple[int, ...]
    forward_s: float
    backward_s: float
    ready_s: tuple[float, ...]
    gates: tuple[GateTiming, ...] = ()
    step_s: float = 0.0


@dataclass(frozen=True)
class Candidate:
    """A plan worth running.

    Args:
        plan: the buckets, as indices into ``order``, with their predicted timeline.
        order: registration indices of the tensors in ready order.
        why: one line explaining the channels chosen ("" when there is nothing to say).
        label: the name the trials give it.
    """

    plan: Plan
    order: tuple[int, ...]
    why: str
    label: str = ""

    @property
    def groups(self) -> list[list[int]]:
        """The buckets as registration indices, in launch order."""
        return [[self.order[i] for i in group] for group in self.plan.groups]


@dataclass(frozen=True)
class TrialOutcome:
    """Which candidate the trials kept, and what they measured.

    Args:
        kept: the candidate kept, its ``why`` saying so under ``channels="auto"``.
        summary: one line: each candidate's measured time and the one kept.
        results: per candidate: its label, its bucket count, its median iteration seconds.
    """

    kept: Candidate
    summary: str
    results: list[tuple[str, int, float]]


def ready_order(ready_s: Sequence[float], backward_s: float) -> tuple[list[int], list[float]]:
    """Tensors in the order they became ready, and their ready times clamped to the backward.

    Ties (and tensors that never got a gradient, ready at the end) keep the reverse registration
    order, which is how backward usually visits them.

    Args:
        ready_s: each tensor's ready time, in registration order.
        backward_s: the backward pass, in seconds.

    Returns:
        The registration indices in ready order, and the clamped times in registration order.
    """
    clamped = [min(max(value, 0.0), backward_s) for value in ready_s]
    order = sorted(range(len(ready_s)), key=lambda i: (clamped[i], -i))
    return order, clamped


def best_plan(
    request: PlanRequest,
    timings: Timings,
    cost: CostModel,
    *,
    bucketing: Bucketing | str | None = None,
    channel_counts: Sequence[int] | None = None,
    caps: tuple[float, float] | None = None,
    label: str = "",
) -> Candidate:
    """The plan ``bucketing`` makes: over ``channel_counts`` the fastest predicted, or one with
    fewer channels within :data:`AUTO_MARGIN` of it.

    Args:
        request: the wrapper's settings.
        timings: the profiled times.
        cost: the price of an all-reduce.
        bucketing: the planner (default: the request's).
        channel_counts: channel counts to weigh (default: as requested, 1..k for ``"auto"``).
        caps: ``(first, other)`` bucket caps in bytes (default: the request's).
        label: the candidate's name in the trials.
    """
    order, tensors = _ready_tensors(request, timings)
    if channel_counts is not None:
        counts = list(channel_counts)
    elif request.channels == "auto":
        counts = list(range(1, request.channel_groups + 1))
    else:
        counts = [request.channel_groups]
    if request.partition_mb == "auto":
        partitions: list[float | None] = [None, *(mb * MIB for mb in PARTITION_CANDIDATES_MB)]
    else:
        partitions = [None if request.partition_mb is None else float(request.partition_mb) * MIB]
    candidates = [
        make_plan(
            bucketing or request.bucketing,
            tensors,
            cost,
            cap_bytes=caps[1] if caps else request.cap_bytes,
            first_cap_bytes=caps[0] if caps else request.first_cap_bytes,
            backward_s=max(timings.backward_s, tensors[-1].ready_s),
            forward_s=timings.forward_s,
            channels=count,
            partition_bytes=partition if count > 1 else None,
        )
        for count in counts
        for partition in (partitions if count > 1 else [None])
    ]
    candidates = [replace(plan, step_s=timings.step_s) for plan in candidates]
    plan = fewest_channels_within_margin(candidates)
    return Candidate(plan, tuple(order), explain_choice(plan, candidates, request.channels), label)


def _ready_tensors(request: PlanRequest, timings: Timings) -> tuple[list[int], list[ReadyTensor]]:
    """The registration indices in ready order, and the planners' tensors in that order (their
    bytes as they travel)."""
    order, clamped = ready_order(timings.ready_s, timings.backward_s)
    wire_scale = 0.5 if request.compression is not None else 1.0
    tensors = [
        ReadyTensor(timings.names[i], max(int(timings.nbytes[i] * wire_scale), 1), clamped[i])
        for i in order
    ]
    return order, tensors


def overlap_plans(request: PlanRequest, timings: Timings, cost: CostModel) -> list[Candidate]:
    """The plans that run on into the next forward, fastest predicted first, one per bucketing.

    Args:
        request: the wrapper's settings.
        timings: the profiled times, with the gates.
        cost: the price of an all-reduce.
    """
    order, tensors = _ready_tensors(request, timings)
    position = [0] * len(order)
    for place, index in enumerate(order):
        position[index] = place
    gates = gates_from_timings(timings.gates, position, timings.forward_s)
    channels = request.channel_groups if request.channels != "auto" else 1
    found: list[Candidate] = []
    seen: set[str] = set()
    for label, plan in overlap_candidates(
        tensors,
        gates,
        cost,
        forward_s=timings.forward_s,
        backward_s=max(timings.backward_s, tensors[-1].ready_s),
        step_s=timings.step_s,
        channels=channels,
    ):
        family = label.split(",")[0]
        if family not in seen:
            seen.add(family)
            found.append(Candidate(plan, tuple(order), "", label))
    return found


def candidate_plans(request: PlanRequest, timings: Timings, cost: CostModel) -> list[Candidate]:
    """The plans worth trying, the cost model's own first, without duplicates.

    With ``merged``/``optimal``: the same rule with larger start-ups (each bucket launched
    during backward costs that backward more than the idle-network fit knows), DDP's buckets
    and even buckets; with ``channels="auto"``: the best plan for each channel count. A plan
    found twice is tried once, under both names.

    Args:
        request: the wrapper's settings (``tune_steps=0``: the cost model's plan alone).
        timings: the profiled times.
        cost: the price of an all-reduce.
    """
    found = [best_plan(request, timings, cost, label="the cost model's plan")]
    if request.overlap is Overlap.FORWARD:
        ahead = overlap_plans(request, timings, cost)
        if request.tune_steps == 0:
            return ahead[:1]
        # The best backward-only plans stay in the trials: where overlap cannot win, they do.
        found = [*ahead[:OVERLAP_TRIALS], *found]
    if request.tune_steps > 0:
        if request.bucketing in (Bucketing.MERGED, Bucketing.OPTIMAL):
            for factor in START_UP_SCALES:
                found.append(
                    best_plan(
                        request,
                        timings,
                        scale_start_up(cost, factor),
                        label=f"start-up x{factor:g}",
                    )
                )
            found.append(
                best_plan(
                    request,
                    timings,
                    cost,
                    bucketing=Bucketing.FIXED,
                    label=f"DDP's buckets ({request.first_cap_bytes / MIB:g} MiB first, "
                    f"{request.cap_bytes / MIB:g} MiB)",
                )
            )
            total = sum(timings.nbytes)
            for count in EVEN_BUCKET_COUNTS:
                found.append(
                    best_plan(
                        request,
                        timings,
                        cost,
                        bucketing=Bucketing.FIXED,
                        caps=(total / count, total / count),
                        label=f"{count} even buckets",
                    )
                )
        if request.channels == "auto":
            for count in range(1, request.channel_groups + 1):
                found.append(
                    best_plan(
                        request, timings, cost, channel_counts=[count], label=f"{count} channel(s)"
                    )
                )
    distinct: dict[object, Candidate] = {}
    for candidate in found:
        plan = candidate.plan
        key = (
            tuple(tuple(group) for group in plan.groups),
            tuple((x.bucket, x.part, x.parts, x.channel) for x in plan.launches),
            plan.partition_bytes,
            plan.overlaps_forward,
        )
        if key in distinct:
            first = distinct[key]
            distinct[key] = replace(first, label=f"{first.label} = {candidate.label}")
        else:
            distinct[key] = candidate
    return list(distinct.values())


def fewest_channels_within_margin(candidates: Sequence[Plan]) -> Plan:
    """The fastest predicted plan, unless one with fewer channels is within :data:`AUTO_MARGIN`.

    Args:
        candidates: plans ordered by channel count.
    """
    best = min(candidates, key=lambda plan: plan.predicted_s)
    for plan in candidates:
        if plan.predicted_s <= best.predicted_s * (1 + AUTO_MARGIN):
            return plan
    return best


def explain_choice(plan: Plan, candidates: Sequence[Plan], requested: int | str) -> str:
    """One line: the channels and threshold chosen, and what they were weighed against.

    Args:
        plan: the plan chosen.
        candidates: every plan weighed.
        requested: the channels asked for (``"auto"`` explains the weighing; a count says
            nothing about one channel).
    """
    split = "off" if plan.partition_bytes is None else f"{plan.partition_bytes / MIB:g} MiB"
    chosen = (
        f"{plan.channels} channel(s), partition {split}: predicted "
        f"{plan.predicted_s * 1e3:.2f} ms per iteration with {len(plan.buckets)} bucket(s)"
    )
    if requested != "auto":
        return chosen if plan.channels > 1 else ""
    best_by_count: dict[int, Plan] = {}
    for candidate in candidates:
        known = best_by_count.get(candidate.channels)
        if known is None or candidate.predicted_s < known.predicted_s:
            best_by_count[candidate.channels] = candidate
    weighed = ", ".join(
        f"k={count}: {candidate.predicted_s * 1e3:.2f} ms"
        for count, candidate in sorted(best_by_count.items())
    )
    measured = ", ".join(
        f"a({j})={a_j * 1e3:.2f} ms c({j})={c_j:.2f}"
        for j, (a_j, c_j) in enumerate(plan.cost.concurrency, start=2)
    )
    return (
        f"channels='auto' chose {chosen} (weighed {weighed}; measured concurrency "
        f"{measured or 'none'}; more channels only for a predicted gain above "
        f"{AUTO_MARGIN:.0%}; a(1)={plan.cost.a * 1e3:.2f} ms)"
    )


def settle_trials(
    candidates: Sequence[Candidate],
    medians: Sequence[float],
    requested: int | str,
    margin: float = TIE_MARGIN,
) -> TrialOutcome:
    """The candidate measured fastest (the fewest buckets among those within ``margin`` of the
    fastest median), and the trials' summary.

    Args:
        candidates: the candidates tried, in trial order.
        medians: each one's median iteration seconds (on the slowest rank).
        requested: the channels asked for (``"auto"``: the kept plan's ``why`` says so).
        margin: the fraction of the least median within which candidates tie
            (:func:`~interlace.comm.tuning.tie_margin`).
    """
    labels = [candidate.label for candidate in candidates]
    buckets = [len(candidate.plan.buckets) for candidate in candidates]
    chosen = fastest(medians, buckets, margin)
    results = [
        (candidate.label, len(candidate.plan.buckets), median)
        for candidate, median in zip(candidates, medians, strict=True)
    ]
    kept = candidates[chosen]
    if requested == "auto":
        kept = replace(
            kept,
            why=f"channels='auto' kept {kept.plan.channels} channel(s) by measured iteration "
            f"time (the planner's prediction: {kept.why or 'one channel'})",
        )
    return TrialOutcome(kept, describe_trials(labels, medians, chosen, margin), results)
