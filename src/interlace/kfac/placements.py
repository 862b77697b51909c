"""Where each factor is decomposed: placements as objects the runtime runs and the simulator prices.

A placement (:class:`Placement`) names each factor's owner and the order every rank decomposes in;
:func:`decomposition_program` says when each broadcast starts. :class:`Greedy`, :class:`RoundRobin`
and :class:`LBP` are interlace's. No torch here, so the simulator imports these very objects.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from interlace.kfac.balancing import (
    decomposition_cost,
    greedy_placement,
    largest_first,
    memory_cost,
    round_robin_placement,
)
from interlace.kfac.enums import AssignmentStrategy, PlacementChoice, coerce_choice
from interlace.kfac.lbp import FactorItem, lbp_placement, schedule_order

if TYPE_CHECKING:
    from interlace.comm.cost import CostModel
    from interlace.kfac.costs import DecompositionCostModel
    from interlace.kfac.methods import DecompositionMethod

__all__ = [
    "AUTO_LBP_MAX_RANKS",
    "LBP",
    "Broadcast",
    "CostSource",
    "Decompose",
    "FactorPlacement",
    "Greedy",
    "LayerFactors",
    "Placement",
    "PlacementCosts",
    "RoundRobin",
    "Step",
    "auto_placement",
    "decomposition_program",
    "factor_items",
    "placement_from",
    "placement_or_auto",
]


@dataclass(frozen=True)
class LayerFactors:
    """One preconditioned layer as a placement sees it: the sides of its two factors.

    Args:
        a_dim: Side of ``A`` (inputs, plus one for a bias).
        g_dim: Side of ``G`` (outputs).
        a_diagonal: Whether ``A`` is kept as a diagonal (an embedding's).
    """

    a_dim: int
    g_dim: int
    a_diagonal: bool = False


def factor_items(layers: Sequence[LayerFactors]) -> list[FactorItem]:
    """Every layer's ``A`` then ``G``, in layer order: the factors a placement places.

    Args:
        layers: The layers.
    """
    items: list[FactorItem] = []
    for layer in layers:
        items.append(FactorItem(layer.a_dim, layer.a_diagonal))
        items.append(FactorItem(layer.g_dim))
    return items


@dataclass(frozen=True)
class PlacementCosts:
    """Seconds to decompose a factor and to broadcast its decomposition, as placements price
    them: a decomposition model, and the broadcast model on the numbers the method sends.

    Args:
        decomposition: Seconds to decompose a dense factor of a side.
        broadcast: ``a + b M`` seconds to broadcast ``M`` bytes.
        method: The decomposition method (how many numbers a decomposition sends).
        element_bytes: Bytes per number sent.
    """

    decomposition: DecompositionCostModel
    broadcast: CostModel
    method: DecompositionMethod
    element_bytes: int = 4

    def decompose_s(self, n: int) -> float:
        """Seconds to decompose a dense ``n x n`` factor.

        Args:
            n: The factor's side.
        """
        return self.decomposition.time(n)

    def broadcast_s(self, n: int) -> float:
        """Seconds to broadcast a dense ``n x n`` factor's decomposition.

        Args:
            n: The factor's side.
        """
        return self.broadcast.time(self.method.numel(n) * self.element_bytes)


class CostSource(Protocol):
    """Where a cost-aware placement gets its prices: the runtime measures on the live group
    (collectively: every rank asks at the same point), the simulator has its models."""

    def priced(
        self,
        decomposition: DecompositionCostModel | None = None,
        broadcast: CostModel | None = None,
    ) -> PlacementCosts:
        """The costs to place with: the models given, the source's own for those not given.

        Args:
            decomposition: A decomposition model to use as it is (None: the source's).
            broadcast: A broadcast model to use as it is (None: the source's).
        """
        ...


@dataclass(frozen=True)
class FactorPlacement:
    """What a placement decided: every factor's owner and the order ranks decompose in.

    Args:
        owners: Each layer's ``A`` then ``G`` owner (a rank), or None: decomposed on every
            rank (never for a colocated placement, whose two factors of a layer share a rank).
        order: Factor indices (into ``owners``) in the one order every rank walks: each rank
            decomposes the factors it owns or keeps local, in this order.
        costs: The costs a cost-aware placement priced with (None: it priced nothing).
    """

    owners: tuple[int | None, ...]
    order: tuple[int, ...]
    costs: PlacementCosts | None = None

    def check(self, placement: Placement, count: int, ranks: int) -> None:
        """Refuse an answer the runtime cannot run: owners or order of the wrong length, an
        owner that is no rank, a layer split by a colocated placement, or repeated factors.

        Args:
            placement: Who answered, for the message.
            count: The factors placed (two per layer).
            ranks: The number of ranks.

        Raises:
            ValueError: Naming the placement and what is wrong.
        """
        where = f"placement {placement.name!r}"
        if len(self.owners) != count or sorted(self.order) != list(range(count)):
            raise ValueError(
                f"{where} gave {len(self.owners)} owners and an order of {len(self.order)} for "
                f"{count} factors; it must give each layer's A and G an owner and order each once"
            )
        for owner in self.owners:
            if owner is not None and not (isinstance(owner, int) and 0 <= owner < ranks):
                raise ValueError(f"{where} gave owner {owner!r}, which is not a rank of {ranks}")
        if placement.colocated:
            pairs = zip(self.owners[0::2], self.owners[1::2], strict=True)
            if any(a is None or a != g for a, g in pairs):
                raise ValueError(
                    f"{where} is colocated, so each layer's A and G need one owner, got "
                    f"{list(self.owners)}"
                )


@runtime_checkable
class Placement(Protocol):
    """Where each factor is decomposed, and so what travels: ``KFAC(placement=)``'s objects.

    The runtime runs :meth:`place` once, on every rank with the same inputs (the same answer
    everywhere, or the collectives it orders would hang), and the simulator prices the same
    call.
    """

    @property
    def name(self) -> str:
        """The placement's name in descriptions and records."""
        ...

    @property
    def colocated(self) -> bool:
        """True: a layer's two factors have one owner, which sends both decompositions in one
        message to the layer's gradient workers as soon as it has made them (any
        ``grad_worker_fraction``). False: each factor is placed on its own, or on every rank,
        and its owner sends it to every rank as soon as it is made (COMM-OPT only). See
        :func:`decomposition_program`."""
        ...

    def place(
        self, layers: Sequence[LayerFactors], ranks: int, costs: CostSource
    ) -> FactorPlacement:
        """Every factor's owner and the decomposition order, the same on every rank.

        Args:
            layers: The preconditioned layers, in registration order.
            ranks: The number of ranks.
            costs: Prices for placements that weigh time (ask only when they need it: the
                runtime measures on the live group).
        """
        ...


def _per_layer(owners: Sequence[int], layer_order: Sequence[int] | None = None) -> FactorPlacement:
    """Layer owners as a factor placement: both factors on the layer's owner, ``A`` then ``G``,
    the layers in ``layer_order`` (None: layer order)."""
    walk = range(len(owners)) if layer_order is None else layer_order
    return FactorPlacement(
        tuple(owner for owner in owners for _ in "AG"),
        tuple(factor for layer in walk for factor in (2 * layer, 2 * layer + 1)),
    )


@dataclass(frozen=True)
class Greedy:
    """SC20 / KAISA: layers largest first, each onto the least-loaded rank (colocated).

    Every rank decomposes in that order too, largest first, so the longest broadcasts start
    first and travel while the smaller layers are decomposed (the reverse of a model whose
    widest layers come last, as kfac-pytorch walks its layers).

    Args:
        balance: What a layer weighs: its decomposition work, ``n^3`` per factor
            (``"compute"``), or its decompositions' memory, ``n^2`` (``"memory"``;
            kfac-pytorch's ``AssignmentStrategy.MEMORY``). An :class:`AssignmentStrategy` or its
            string.
    """

    balance: AssignmentStrategy = AssignmentStrategy.COMPUTE
    name: ClassVar[str] = "greedy"
    colocated: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "balance", coerce_choice(AssignmentStrategy, self.balance, "balance")
        )

    def place(
        self, layers: Sequence[LayerFactors], ranks: int, costs: CostSource
    ) -> FactorPlacement:
        weigh = memory_cost if self.balance is AssignmentStrategy.MEMORY else decomposition_cost
        weights = [weigh(layer.a_dim, layer.g_dim, layer.a_diagonal) for layer in layers]
        return _per_layer(greedy_placement(weights, ranks), largest_first(weights))


@dataclass(frozen=True)
class RoundRobin:
    """Layer ``i`` on rank ``i % ranks``, whatever its size: the size-blind baseline
    (colocated)."""

    name: ClassVar[str] = "round-robin"
    colocated: ClassVar[bool] = True

    def place(
        self, layers: Sequence[LayerFactors], ranks: int, costs: CostSource
    ) -> FactorPlacement:
        return _per_layer(round_robin_placement(len(layers), ranks))


@dataclass(frozen=True)
class LBP:
    """SPD-KFAC's load-balancing placement of single factors: each on the rank that finishes
    first, or decomposed on every rank when that beats sending it; every rank then decomposes
    in Johnson's order (see :func:`~interlace.kfac.lbp.lbp_placement`). COMM-OPT only.

    Args:
        decomposition_cost: Seconds to decompose a factor, the same on every rank (None:
            measured at start-up: rank 0's fit, sent to every rank).
        broadcast_cost: Seconds to broadcast, the same on every rank (None: measured at
            start-up: the slowest rank's medians).
        search: Also try other local sets and factor-level greedy, keeping the best under the
            makespan model (False: the paper's rule alone).
    """

    decomposition_cost: DecompositionCostModel | None = None
    broadcast_cost: CostModel | None = None
    search: bool = True
    name: ClassVar[str] = "lbp"
    colocated: ClassVar[bool] = False

    def place(
        self, layers: Sequence[LayerFactors], ranks: int, costs: CostSource
    ) -> FactorPlacement:
        items = factor_items(layers)
        if ranks == 1:
            # Nothing is sent on one rank: every factor is local, and nothing is priced.
            return FactorPlacement((None,) * len(items), tuple(range(len(items))))
        priced = costs.priced(self.decomposition_cost, self.broadcast_cost)
        owners = lbp_placement(
            items, ranks, priced.decompose_s, priced.broadcast_s, search=self.search
        )
        order = schedule_order(items, owners, ranks, priced.decompose_s, priced.broadcast_s)
        return FactorPlacement(tuple(owners), tuple(order), priced)


@dataclass(frozen=True)
class Decompose:
    """A step of :func:`decomposition_program`: ``factor``'s owner (every rank when it has
    none) decomposes it.

    Args:
        factor: The factor's index (layer ``i``'s ``A`` is ``2 i``, its ``G`` ``2 i + 1``).
    """

    factor: int


@dataclass(frozen=True)
class Broadcast:
    """A step of :func:`decomposition_program`: ``owner`` starts sending the decompositions of
    ``factors`` (every other rank of the channel posts the matching receive).

    Args:
        factors: The factors the message carries: one, or a layer's ``A`` and ``G``.
        owner: The rank that made them.
        channel: The rank whose own process group carries it, or None: the one group all owners
            share (a layer's gradient workers; the world under COMM-OPT), which runs its
            messages one after another in program order.
    """

    factors: tuple[int, ...]
    owner: int
    channel: int | None


#: One step of a decomposition program.
Step = Decompose | Broadcast


def decomposition_program(
    placement: Placement, placed: FactorPlacement, due: Collection[int] | None = None
) -> tuple[Step, ...]:
    """The one list of steps every rank walks: the runtime runs it, the simulator prices it.

    The decompositions come in the placement's order, and each broadcast right after the
    decomposition that completes it, so it starts as soon as its owner has made it and overlaps
    the decompositions after it (kfac-pytorch's order). A colocated placement sends a layer's
    two decompositions in one message on the shared group once both are made; any other sends
    each factor on its owner's own group. Local factors (owner None) are never sent.

    Args:
        placement: The placement that placed (its ``colocated`` decides the messages).
        placed: What it decided.
        due: The factors to decompose this step (None: all); a colocated layer's two are due
            together.
    """
    owners = placed.owners
    order = [f for f in placed.order if due is None or f in due]
    made: set[int] = set()
    steps: list[Step] = []
    for factor in order:
        steps.append(Decompose(factor))
        made.add(factor)
        owner = owners[factor]
        if owner is None:
            continue
        if not placement.colocated:
            steps.append(Broadcast((factor,), owner, owner))
        elif (factor ^ 1) in made:
            # Both of the layer's factors are made: one message carries them (A first).
            first = factor & ~1
            steps.append(Broadcast((first, first + 1), owner, None))
    return tuple(steps)


_BY_CHOICE: dict[PlacementChoice, type[Greedy | RoundRobin | LBP]] = {
    PlacementChoice.GREEDY: Greedy,
    PlacementChoice.ROUND_ROBIN: RoundRobin,
    PlacementChoice.LBP: LBP,
}

#: The most ranks :func:`auto_placement` gives LBP: LBP opens one process group spanning the
#: world per rank (each a communicator with its own buffers), and SPD-KFAC's measurements go up
#: to 64 workers.
AUTO_LBP_MAX_RANKS = 64


def auto_placement(ranks: int | None, comm_opt: bool) -> Placement:
    """``KFAC(placement="auto")``, the default: SPD-KFAC's :class:`LBP` where it applies,
    :class:`Greedy` (SC20 / KAISA) elsewhere.

    LBP balances single factors by their priced decomposition and broadcast, keeps small ones
    local and lets owners' broadcasts overlap, which shortens the decomposition stage; it needs
    every rank to receive every decomposition (COMM-OPT) and a process group per rank. One rank
    sends nothing, so greedy's placement is the same work without the start-up pricing.

    Args:
        ranks: The ranks K-FAC runs on (None: not known yet; greedy, which runs with any
            gradient-worker fraction).
        comm_opt: Whether every rank is a gradient worker (``grad_worker_fraction=1``).
    """
    if comm_opt and ranks is not None and 1 < ranks <= AUTO_LBP_MAX_RANKS:
        return LBP()
    return Greedy()


def placement_or_auto(value: object, option: str = "placement") -> Placement | PlacementChoice:
    """What ``value`` names, with ``"auto"`` left as :attr:`PlacementChoice.AUTO` for whoever
    knows the world to resolve (:func:`placement_from` with ``ranks``).

    Args:
        value: What the caller passed.
        option: The option's name, for the error.

    Raises:
        OptionError: A value that names no placement.
    """
    if isinstance(value, str | enum.Enum) and (
        coerce_choice(PlacementChoice, value, option) is PlacementChoice.AUTO
    ):
        return PlacementChoice.AUTO
    return placement_from(value, option)


def placement_from(
    value: object, option: str = "placement", *, ranks: int | None = None, comm_opt: bool = True
) -> Placement:
    """The placement ``value`` names: a :class:`Placement` as it is, or a
    :class:`~interlace.kfac.enums.PlacementChoice` (or its string) at its defaults.

    Args:
        value: What the caller passed.
        option: The option's name, for the error.
        ranks: The ranks K-FAC runs on, for ``"auto"`` (see :func:`auto_placement`).
        comm_opt: Whether every rank is a gradient worker, for ``"auto"``.

    Raises:
        OptionError: A value that is neither.
    """
    if not isinstance(value, str | enum.Enum) and isinstance(value, Placement):
        return value
    choice = coerce_choice(PlacementChoice, value, option)
    if choice is PlacementChoice.AUTO:
        return auto_placement(ranks, comm_opt)
    return _BY_CHOICE[choice]()
