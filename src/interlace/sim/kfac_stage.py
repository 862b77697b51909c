"""The decomposition stage of a simulated K-FAC iteration: who decomposes each factor, what that
costs, and when every rank holds every decomposition.

Placement follows :mod:`interlace.kfac.placements` on the costs the runtime places with; the stage
is priced with what each decomposition takes (:meth:`KfacCosts.decomposition_s`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from interlace.comm.cost import CostModel
from interlace.kfac.balancing import decomposition_cost, greedy_placement
from interlace.kfac.costs import decomposition_numel
from interlace.kfac.lbp import FactorItem, lbp_placement, schedule_order
from interlace.sim.kfac_costs import KfacCosts

__all__ = ["Stage", "decomposition_stage"]

#: One stage event: ``(name, category, start, end)``, seconds from the stage's start.
StageEvent = tuple[str, str, float, float]


@dataclass(frozen=True)
class Stage:
    """The decomposition stage: its length, its compute part, the owners and what to draw.

    Args:
        makespan_s: Until every rank holds every decomposition.
        decomposition_s: The busiest rank's decompositions, local ones included.
        owners: Each placed item's owner (None: decomposed on every rank).
        local_factors: Factors decomposed on every rank (LBP).
        events: The rank that finishes last: its decompositions and the broadcasts drawn.
    """

    makespan_s: float
    decomposition_s: float
    owners: list[int | None]
    local_factors: int
    events: list[StageEvent]


def decomposition_stage(
    layers: Sequence[tuple[str, int, int]],
    *,
    placement: str,
    broadcasts_after: bool,
    workers: int,
    costs: KfacCosts,
    broadcast: CostModel,
) -> Stage:
    """Place the decompositions of ``layers`` and price the stage.

    ``"greedy"`` places layers (both decompositions on one rank by ``n^3``, one broadcast of
    both); ``"lbp"`` places single factors, each layer's ``A`` then ``G``, by
    :func:`~interlace.kfac.placements.lbp_placement` on :meth:`KfacCosts.decomposition_model`
    (what the runtime's LBP places with), and every rank walks
    :func:`~interlace.kfac.placements.schedule_order` of that placement.

    Each owner decomposes its items in that order. Without ``broadcasts_after`` it sends each
    result as soon as it is made and its previous send is done, owners' sends overlapping (the
    placement model's assumption); local factors come last and delay no send. With
    ``broadcasts_after`` every decomposition is made before the first broadcast, and the
    broadcasts follow one another in layer order (interlace's greedy placement: one broadcast
    per layer on the world group once the decompositions are done).

    Args:
        layers: ``(name, a_dim, g_dim)`` of each preconditioned layer, in module order.
        placement: ``"greedy"`` or ``"lbp"``.
        broadcasts_after: Broadcast only once every decomposition is made (see above).
        workers: The ranks (>= 1).
        costs: Prices decompositions (and gives the model LBP places with).
        broadcast: Prices a decomposition's broadcast.
    """
    method, size = costs.compute_method, costs.element_bytes
    price = costs.decomposition_s
    names: list[str]
    items: list[FactorItem]
    place_decompose: Callable[[int], float]
    send: Callable[[int], float]
    owners: list[int | None]
    if placement == "greedy":
        names = [name for name, _, _ in layers]
        seconds = [price(a) + price(g) for _, a, g in layers]
        sent = [
            broadcast.time((decomposition_numel(method, a) + decomposition_numel(method, g)) * size)
            for _, a, g in layers
        ]
        # An item's dim is the layer's index, priced by lookup.
        items = [FactorItem(index) for index in range(len(layers))]

        def place_decompose(index: int) -> float:
            return seconds[index]

        def send(index: int) -> float:
            return sent[index]

        owners = list(greedy_placement([decomposition_cost(a, g) for _, a, g in layers], workers))
        work = list(seconds)
        transfer = [s if workers > 1 else 0.0 for s in sent]
    else:
        names = [f"{name}.{which}" for name, _, _ in layers for which in ("A", "G")]
        items = [FactorItem(dim) for _, a, g in layers for dim in (a, g)]
        place_decompose = costs.decomposition_model().time

        def send(dim: int) -> float:
            return broadcast.time(decomposition_numel(method, dim) * size)

        owners = lbp_placement(items, workers, place_decompose, send)
        work = [price(item.dim) for item in items]
        transfer = [send(item.dim) if workers > 1 else 0.0 for item in items]
    local = [w for w, owner in zip(work, owners, strict=True) if owner is None]
    own: list[list[float]] = [[] for _ in range(workers)]
    for w, owner in zip(work, owners, strict=True):
        if owner is not None:
            own[owner].append(w)
    busiest = max(math.fsum(own[rank] + local) for rank in range(workers))
    if broadcasts_after:
        order = list(range(len(items)))
        last = max(range(workers), key=lambda r: (math.fsum(own[r] + local), -r))
        sends = math.fsum(transfer)
        makespan = busiest + sends
        events = _draw(names, order, owners, (work, transfer), last, after=busiest)
        return Stage(makespan, busiest, owners, _local_count(placement, owners), events)
    order = schedule_order(items, owners, workers, place_decompose, send)
    finish: list[float] = []
    for rank in range(workers):
        clock = sending = 0.0
        for index in order:
            if owners[index] == rank:
                clock += work[index]
                sending = max(sending, clock) + transfer[index]
        finish.append(max(math.fsum(own[rank] + local), sending))
    makespan = max(finish)
    last = max(range(workers), key=lambda r: (finish[r], -r))
    events = _draw(names, order, owners, (work, transfer), last, after=None)
    return Stage(makespan, min(busiest, makespan), owners, _local_count(placement, owners), events)


def _local_count(placement: str, owners: Sequence[int | None]) -> int:
    return sum(owner is None for owner in owners) if placement == "lbp" else 0


def _draw(
    names: Sequence[str],
    order: Sequence[int],
    owners: Sequence[int | None],
    seconds: tuple[Sequence[float], Sequence[float]],
    last: int,
    *,
    after: float | None,
) -> list[StageEvent]:
    """Rank ``last``'s decompositions in ``order`` (then the local ones), and the broadcasts:
    its own, each as soon as it is made (``after`` None), or every broadcast one after another
    from ``after`` on. ``seconds`` is each item's decomposition and broadcast."""
    work, transfer = seconds
    events: list[StageEvent] = []
    clock = sending = 0.0
    for index in order:
        if owners[index] == last:
            end = clock + work[index]
            events.append((f"decompose {names[index]}", "decomposition", clock, end))
            clock += work[index]
            if after is None and transfer[index] > 0:
                start = max(sending, clock)
                sending = start + transfer[index]
                events.append((f"broadcast {names[index]} (rank {last})", "comm", start, sending))
    for index in order:
        if owners[index] is None and work[index] > 0:
            events.append(
                (f"decompose {names[index]} (local)", "decomposition", clock, clock + work[index])
            )
            clock += work[index]
    if after is not None:
        sending = after
        for index in order:
            if transfer[index] > 0:
                events.append(
                    (
                        f"broadcast {names[index]} (rank {owners[index]})",
                        "comm",
                        sending,
                        sending + transfer[index],
                    )
                )
                sending += transfer[index]
    return events
