"""The decomposition stage of a simulated K-FAC iteration: who decomposes each factor, what that
costs, and when every rank holds every decomposition.

The placement is the runtime's own object (:mod:`interlace.kfac.placements`), run on the costs the
runtime places with; the stage is priced with what each decomposition takes
(:meth:`KfacCosts.decomposition_s`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from interlace.comm.cost import CostModel
from interlace.kfac.costs import DecompositionCostModel
from interlace.kfac.lbp import FactorItem, schedule_order
from interlace.kfac.placements import LayerFactors, Placement, PlacementCosts
from interlace.sim.kfac_costs import KfacCosts

__all__ = ["SimulatedCosts", "Stage", "decomposition_stage"]

#: One stage event: ``(name, category, start, end)``, seconds from the stage's start.
StageEvent = tuple[str, str, float, float]


@dataclass(frozen=True)
class Stage:
    """The decomposition stage: its length, its compute part, the owners and what to draw.

    Args:
        makespan_s: Until every rank holds every decomposition.
        decomposition_s: The busiest rank's decompositions, local ones included.
        owners: Each placed item's owner (None: decomposed on every rank): a layer for a
            colocated placement, a factor otherwise.
        local_factors: Factors decomposed on every rank.
        events: The rank that finishes last: its decompositions and the broadcasts drawn.
    """

    makespan_s: float
    decomposition_s: float
    owners: list[int | None]
    local_factors: int
    events: list[StageEvent]


@dataclass(frozen=True)
class SimulatedCosts:
    """The simulator's :class:`~interlace.kfac.placements.CostSource`: the placement prices
    with :meth:`KfacCosts.decomposition_model` and the broadcast model, as the runtime's LBP
    prices with its fitted models.

    Args:
        costs: The K-FAC costs.
        broadcast: Prices a decomposition's broadcast.
    """

    costs: KfacCosts
    broadcast: CostModel

    def priced(
        self,
        decomposition: DecompositionCostModel | None = None,
        broadcast: CostModel | None = None,
    ) -> PlacementCosts:
        """The models given, the simulator's own for those not given.

        Args:
            decomposition: A decomposition model to use as it is.
            broadcast: A broadcast model to use as it is.
        """
        return PlacementCosts(
            decomposition or self.costs.decomposition_model(),
            broadcast or self.broadcast,
            self.costs.method,
            element_bytes=self.costs.element_bytes,
        )


def decomposition_stage(
    layers: Sequence[tuple[str, int, int]],
    *,
    placement: Placement,
    broadcasts_after: bool,
    workers: int,
    costs: KfacCosts,
    broadcast: CostModel,
) -> Stage:
    """Place the decompositions of ``layers`` with ``placement`` and price the stage.

    A colocated placement's items are layers (both decompositions on one rank, one broadcast of
    both); any other's are single factors, each layer's ``A`` then ``G``, walked in the
    placement's order (LBP's: :func:`~interlace.kfac.lbp.schedule_order` of its placement).

    Each owner decomposes its items in order. Without ``broadcasts_after`` it sends each result
    as soon as it is made and its previous send is done, owners' sends overlapping (the LBP
    model's assumption), layers in Johnson's order for a colocated placement; local factors
    come last and delay no send. With ``broadcasts_after`` (colocated placements only, as the
    runtime runs them) every decomposition is made before the first broadcast, and the
    broadcasts follow one another in layer order (one per layer on the world group).

    Args:
        layers: ``(name, a_dim, g_dim)`` of each preconditioned layer, in module order.
        placement: The runtime's placement object.
        broadcasts_after: Broadcast only once every decomposition is made (see above).
        workers: The ranks (>= 1).
        costs: Prices decompositions (and gives the model a placement prices with).
        broadcast: Prices a decomposition's broadcast.
    """
    method, size = costs.method, costs.element_bytes
    price = costs.decomposition_s
    source = SimulatedCosts(costs, broadcast)
    placed = placement.place([LayerFactors(a, g) for _, a, g in layers], workers, source)
    placed.check(placement, 2 * len(layers), workers)
    if placement.colocated:
        names = [name for name, _, _ in layers]
        owners = list(placed.owners[0::2])
        work = [price(a) + price(g) for _, a, g in layers]
        sent = [broadcast.time((method.numel(a) + method.numel(g)) * size) for _, a, g in layers]
        # An item's dim is the layer's index, priced by lookup (Johnson's order, not placing).
        items = [FactorItem(index) for index in range(len(layers))]
        johnson = (lambda index: work[index], lambda index: sent[index])
        order = (
            list(range(len(layers)))
            if broadcasts_after
            else schedule_order(items, owners, workers, *johnson)
        )
    else:
        names = [f"{name}.{which}" for name, _, _ in layers for which in ("A", "G")]
        owners = list(placed.owners)
        dims = [dim for _, a, g in layers for dim in (a, g)]
        work = [price(dim) for dim in dims]
        sent = [broadcast.time(method.numel(dim) * size) for dim in dims]
        order = list(placed.order)
        broadcasts_after = False
    transfer = [s if workers > 1 else 0.0 for s in sent]
    local = [w for w, owner in zip(work, owners, strict=True) if owner is None]
    own: list[list[float]] = [[] for _ in range(workers)]
    for w, owner in zip(work, owners, strict=True):
        if owner is not None:
            own[owner].append(w)
    busiest = max(math.fsum(own[rank] + local) for rank in range(workers))
    local_count = sum(owner is None for owner in owners)
    if broadcasts_after:
        last = max(range(workers), key=lambda r: (math.fsum(own[r] + local), -r))
        sends = math.fsum(transfer)
        makespan = busiest + sends
        events = _draw(names, order, owners, (work, transfer), last, after=busiest)
        return Stage(makespan, busiest, owners, local_count, events)
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
    return Stage(makespan, min(busiest, makespan), owners, local_count, events)


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
