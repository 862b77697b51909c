"""The decomposition stage of a simulated K-FAC iteration: who decomposes each factor, what that
costs, and when every rank holds every decomposition.

The placement and the program of decompositions and broadcasts are the runtime's own
(:mod:`interlace.kfac.placements`), priced with :meth:`KfacCosts.decomposition_s`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from interlace.comm.cost import CostModel
from interlace.kfac.costs import DecompositionCostModel
from interlace.kfac.placements import (
    Broadcast,
    Decompose,
    LayerFactors,
    Placement,
    PlacementCosts,
    decomposition_program,
)
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
        events: The rank that finishes last: its decompositions, and the broadcasts on its own
            channel or the shared one.
        broadcasts: The messages sent (one per layer for a colocated placement).
    """

    makespan_s: float
    decomposition_s: float
    owners: list[int | None]
    local_factors: int
    events: list[StageEvent]
    broadcasts: int = 0


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
    workers: int,
    costs: KfacCosts,
    broadcast: CostModel,
    a_diagonal: Sequence[bool] = (),
) -> Stage:
    """Place the decompositions of ``layers`` with ``placement`` and price the stage.

    The stage is :func:`~interlace.kfac.placements.decomposition_program`, the steps the
    runtime walks, priced step by step: each rank decomposes the factors it owns or keeps
    local, in order, and each broadcast starts once every rank has reached it in the program
    (its owner has made it, and each receiver, having made its own earlier decompositions,
    has posted the receive: gloo sends nothing until the receiver posts) and its channel is
    free. The shared channel (a colocated placement's) runs its messages one after another;
    each owner's own channel (any other placement's) overlaps the others'.

    Args:
        layers: ``(name, a_dim, g_dim)`` of each preconditioned layer, in module order.
        placement: The runtime's placement object.
        workers: The ranks (>= 1).
        costs: Prices decompositions (and gives the model a placement prices with).
        broadcast: Prices a decomposition's broadcast.
        a_diagonal: Per layer, whether ``A`` is kept as a diagonal (nothing to decompose, ``n``
            numbers sent); none given: no layer's is.
    """
    method, size = costs.method, costs.element_bytes
    flags = list(a_diagonal) or [False] * len(layers)
    if len(flags) != len(layers):
        raise ValueError(f"a_diagonal has {len(flags)} flags for {len(layers)} layers")
    source = SimulatedCosts(costs, broadcast)
    factors = [LayerFactors(a, g, flag) for (_, a, g), flag in zip(layers, flags, strict=True)]
    placed = placement.place(factors, workers, source)
    placed.check(placement, 2 * len(layers), workers)
    names = [f"{name}.{which}" for name, _, _ in layers for which in ("A", "G")]
    dims = [dim for _, a, g in layers for dim in (a, g)]
    diagonal = [d for flag in flags for d in (flag, False)]
    work = [costs.decomposition_s(dim, flag) for dim, flag in zip(dims, diagonal, strict=True)]
    clock = [0.0] * workers
    busy: list[list[float]] = [[] for _ in range(workers)]
    made: list[list[StageEvent]] = [[] for _ in range(workers)]
    sends: list[tuple[Broadcast, float, float]] = []
    free: dict[int | None, float] = {}
    for step in decomposition_program(placement, placed):
        if isinstance(step, Decompose):
            owner = placed.owners[step.factor]
            label = f"decompose {names[step.factor]}" + (" (local)" if owner is None else "")
            for rank in range(workers) if owner is None else (owner,):
                seconds = work[step.factor]
                made[rank].append((label, "decomposition", clock[rank], clock[rank] + seconds))
                clock[rank] += seconds
                busy[rank].append(seconds)
            continue
        numbers = sum(method.numel(dims[factor], diagonal[factor]) for factor in step.factors)
        seconds = broadcast.time(numbers * size) if workers > 1 else 0.0
        # Every rank takes part (COMM-OPT): the broadcast waits for the last to post.
        start = max(*clock, free.get(step.channel, 0.0))
        free[step.channel] = start + seconds
        sends.append((step, start, start + seconds))
    # Summed exactly, so a rank's work does not depend on the order of additions (LBP's model).
    computed = [math.fsum(busy[rank]) for rank in range(workers)]
    ends: dict[int | None, list[float]] = {}
    for step, _, end in sends:
        ends.setdefault(step.owner, []).append(end)
    finish = [max([computed[rank], *ends.get(rank, ())]) for rank in range(workers)]
    makespan = max(finish)
    last = max(range(workers), key=lambda r: (finish[r], -r))
    events = made[last] + [
        (f"broadcast {_message(names, step)} (rank {step.owner})", "comm", start, end)
        for step, start, end in sends
        if end > start and step.channel in (None, last)
    ]
    owners = list(placed.owners[0::2] if placement.colocated else placed.owners)
    local_count = sum(owner is None for owner in placed.owners)
    return Stage(makespan, max(computed), owners, local_count, events, len(sends))


def _message(names: Sequence[str], step: Broadcast) -> str:
    """What a broadcast carries, for the timeline: a factor, or a layer's two."""
    if len(step.factors) == 2:
        return names[step.factors[0]].rsplit(".", 1)[0]
    return names[step.factors[0]]
