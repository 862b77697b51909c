"""SPD-KFAC's load-balancing placement (LBP) of single factors, and the makespan model it optimises.

Functions of the factors' sizes, the world size and two cost functions, so every rank derives the
same answer without talking.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from interlace.kfac.balancing import greedy_placement

__all__ = [
    "CostFunction",
    "FactorItem",
    "factor_greedy_placement",
    "lbp_placement",
    "predicted_makespan",
    "schedule_order",
]

#: Seconds for one factor of a given dimension: to decompose it, or to broadcast the result.
CostFunction = Callable[[int], float]


@dataclass(frozen=True)
class FactorItem:
    """One Kronecker factor to place: its dimension, and whether it is kept as a diagonal.

    A diagonal factor (an embedding's ``A``) needs no decomposition and its result is ``n``
    numbers, so the placement model prices it at zero and LBP always keeps it local.

    Args:
        dim: The factor's side.
        diagonal: Whether it is kept as a diagonal.
    """

    dim: int
    diagonal: bool = False

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ValueError(f"a factor's dimension must be >= 0, got {self.dim}")


def factor_greedy_placement(factors: Sequence[FactorItem | int], ranks: int) -> list[int]:
    """:func:`greedy_placement` on single factors: ``n^3`` each (``n`` for a diagonal).

    The SC20 / KAISA rule applied at SPD-KFAC's granularity (a layer's ``A`` and ``G`` may land
    on different ranks); the baseline that :func:`lbp_placement` is guaranteed to match or beat.

    Args:
        factors: The factors (a bare ``int`` is a dense factor of that side).
        ranks: The number of ranks.
    """
    items = _factor_items(factors)
    return greedy_placement([float(f.dim if f.diagonal else f.dim**3) for f in items], ranks)


def lbp_placement(
    factors: Sequence[FactorItem | int],
    ranks: int,
    decompose_s: CostFunction,
    broadcast_s: CostFunction,
    *,
    search: bool = True,
) -> list[int | None]:
    """SPD-KFAC's load-balancing placement: each factor's owner, or None to decompose it locally.

    ``factors`` are :class:`FactorItem` (a bare ``int`` is a dense factor of that dimension);
    ``decompose_s(n)`` and ``broadcast_s(n)`` are the seconds to decompose a dense ``n x n``
    factor and to broadcast its result (``n^2 + n`` numbers for ``eigen``), e.g. a fitted
    :class:`~interlace.kfac.costs.DecompositionCostModel` and
    :func:`~interlace.kfac.costs.broadcast_time`. Every rank must pass the same functions (say,
    rank 0's fits, broadcast), or the ranks will disagree on the placement.

    The paper's rule (``search=False``): a factor whose decomposition costs less than its
    broadcast is decomposed locally on every rank; the others, longest decomposition first (ties
    to the earlier factor), each go to the rank whose predicted finish time *after taking it*
    is least (ties to the lowest rank), tracking each rank's decomposition and send times in
    the order it is given factors, with the local work counted on every rank. (That running
    estimate only steers the choice; placements are compared by :func:`predicted_makespan`,
    whose per-rank order can only be better.)

    That rule can lose to plain greedy under its own model: local work is repeated on every
    rank, while a broadcast overlaps with the owner's next decomposition, so many factors just
    below the threshold are better spread. With ``search`` (the default) LBP therefore also
    tries every other local set of the form "the ``k`` factors with the smallest
    decomposition-to-broadcast ratio" (``k = 0`` spreads everything, the largest ``k`` keeps
    everything local), each balanced as above, and :func:`factor_greedy_placement`; it takes
    the candidate with the least :func:`predicted_makespan`, the paper's rule on ties (then the
    smaller ``k``), and then moves single factors off the rank that finishes last, or swaps
    one of them with another rank's, while that lowers the makespan (longest-first balancing
    leaves ranks apart by up to its last, smallest factor). Including greedy, and refining
    only downwards, makes "never worse than greedy under this model" hold by construction. A
    local set is skipped when a bound on its makespan reaches the best so far
    (some factor's owner decomposes it, then sends it or does the local work), and so is every
    larger set once the local work plus a ``1/R`` share of the rest reaches it; the worst case
    is ``O(F^2 R)`` for ``F`` factors on ``R`` ranks. On one rank nothing is broadcast, so
    everything is local.

    Args:
        factors: The factors (a bare ``int`` is a dense factor of that side).
        ranks: The number of ranks.
        decompose_s: Seconds to decompose a dense factor of a side.
        broadcast_s: Seconds to broadcast its decomposition.
        search: Also try other local sets and factor-level greedy (see above).
    """
    items = _factor_items(factors)
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    decompose, broadcast = _factor_costs(items, ranks, decompose_s, broadcast_s)
    if ranks == 1:
        return [None] * len(items)
    dense = [index for index, item in enumerate(items) if not item.diagonal]
    # Most worth keeping local first; d < b exactly on a prefix, the paper's local set.
    by_ratio = sorted(dense, key=lambda i: (_local_ratio(decompose[i], broadcast[i]), i))
    paper = sum(1 for i in dense if decompose[i] < broadcast[i])
    owners = _balance(decompose, broadcast, set(dense) - set(by_ratio[:paper]), ranks)
    best = (_makespan(decompose, broadcast, owners, ranks), owners)
    if search:
        total = math.fsum(decompose)
        for count in range(len(dense) + 1):
            # Every rank does the local work and some rank at least its share of the rest:
            # a bound that only grows with the count, so no larger count can win past it.
            local = math.fsum(decompose[i] for i in by_ratio[:count])
            if total / ranks + local * (1 - 1 / ranks) >= best[0]:
                break
            # The owner of a placed factor finishes after decomposing it and either sending it
            # or doing the local work: a bound for this count alone.
            if count == paper or any(
                decompose[i] + max(broadcast[i], local) >= best[0] for i in by_ratio[count:]
            ):
                continue
            owners = _balance(decompose, broadcast, set(dense) - set(by_ratio[:count]), ranks)
            span = _makespan(decompose, broadcast, owners, ranks)
            if span < best[0]:
                best = (span, owners)
        greedy: list[int | None] = [
            None if item.diagonal else owner
            for item, owner in zip(items, factor_greedy_placement(items, ranks), strict=True)
        ]
        span = _makespan(decompose, broadcast, greedy, ranks)
        if span < best[0]:
            best = (span, greedy)
        return _refine(decompose, broadcast, best[1], ranks)
    return best[1]


def predicted_makespan(
    factors: Sequence[FactorItem | int],
    owners: Sequence[int | None],
    ranks: int,
    decompose_s: CostFunction,
    broadcast_s: CostFunction,
) -> float:
    """Seconds until every rank holds every factor's decomposition, for a given placement.

    The model, the same for every placement (greedy, round-robin, LBP):

    * A factor owned by rank ``r`` is decomposed on ``r`` (``decompose_s(n)`` seconds), then
      broadcast by ``r`` (``broadcast_s(n)``), starting once its decomposition is done. Each
      rank has one communication channel: its sends run one at a time, while different ranks'
      sends overlap (receiving is free), as do a rank's sends and its next decompositions.
    * A local factor (owner None) is decomposed on every rank and never sent.
    * A diagonal factor costs nothing, wherever it is placed; with one rank nothing is sent.
    * Each rank decomposes its own factors in :func:`schedule_order` (Johnson's rule, the
      optimal order for this compute-then-send pipeline), then the local ones, which delay no
      send. Rank ``r`` finishes at ``max(C_r + L, S_r)``: ``C_r`` its own decompositions,
      ``L`` the local ones, ``S_r`` the end of its last send; the makespan is the latest rank.

    Independent channels per sender are what the runtime must provide for this to hold: NCCL
    broadcasts queued on one stream serialise on the receivers too, so different roots' sends
    need their own streams (or process groups) to overlap.

    Args:
        factors: The factors (a bare ``int`` is a dense factor of that side).
        owners: Each factor's owner, None for local.
        ranks: The number of ranks.
        decompose_s: Seconds to decompose a dense factor of a side.
        broadcast_s: Seconds to broadcast its decomposition.
    """
    decompose, broadcast = _checked_costs(factors, owners, ranks, decompose_s, broadcast_s)
    return _makespan(decompose, broadcast, owners, ranks)


def schedule_order(
    factors: Sequence[FactorItem | int],
    owners: Sequence[int | None],
    ranks: int,
    decompose_s: CostFunction,
    broadcast_s: CostFunction,
) -> list[int]:
    """The order in which to decompose the factors so that :func:`predicted_makespan` holds.

    Every rank walks this one list and decomposes the factors it owns or keeps local, sending
    each owned result as soon as it is ready. Owned factors come first in Johnson's order
    (broadcast longer than decomposition: shortest decomposition first; then the rest, longest
    broadcast first; ties by index), then the local factors by index.

    Args:
        factors: The factors (a bare ``int`` is a dense factor of that side).
        owners: Each factor's owner, None for local.
        ranks: The number of ranks.
        decompose_s: Seconds to decompose a dense factor of a side.
        broadcast_s: Seconds to broadcast its decomposition.
    """
    decompose, broadcast = _checked_costs(factors, owners, ranks, decompose_s, broadcast_s)
    return _schedule(decompose, broadcast, owners)


def _checked_costs(
    factors: Sequence[FactorItem | int],
    owners: Sequence[int | None],
    ranks: int,
    decompose_s: CostFunction,
    broadcast_s: CostFunction,
) -> tuple[list[float], list[float]]:
    """Each factor's decomposition and broadcast seconds, once the owners are checked."""
    items = _factor_items(factors)
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    _check_owners(owners, len(items), ranks)
    return _factor_costs(items, ranks, decompose_s, broadcast_s)


def _factor_items(factors: Sequence[FactorItem | int]) -> list[FactorItem]:
    return [f if isinstance(f, FactorItem) else FactorItem(f) for f in factors]


def _factor_costs(
    items: Sequence[FactorItem],
    ranks: int,
    decompose_s: CostFunction,
    broadcast_s: CostFunction,
) -> tuple[list[float], list[float]]:
    """Each factor's decomposition and broadcast seconds under the model's conventions."""
    decompose: list[float] = []
    broadcast: list[float] = []
    for item in items:
        if item.diagonal:
            decompose.append(0.0)
            broadcast.append(0.0)
            continue
        seconds = float(decompose_s(item.dim))
        sending = float(broadcast_s(item.dim)) if ranks > 1 else 0.0
        if not (math.isfinite(seconds) and math.isfinite(sending)) or seconds < 0 or sending < 0:
            raise ValueError(
                f"costs must be finite and >= 0; a {item.dim}-factor got decompose "
                f"{seconds} s and broadcast {sending} s"
            )
        decompose.append(seconds)
        broadcast.append(sending)
    return decompose, broadcast


def _check_owners(owners: Sequence[int | None], count: int, ranks: int) -> None:
    if len(owners) != count:
        raise ValueError(f"{len(owners)} owners for {count} factors")
    for owner in owners:
        if owner is not None and not 0 <= owner < ranks:
            raise ValueError(f"owner {owner} is not a rank of {ranks}")


def _local_ratio(decompose: float, broadcast: float) -> float:
    """Decomposition over broadcast time: below 1 the paper keeps the factor local."""
    # A free broadcast is never worth replacing with local work (and d < b is false there).
    return decompose / broadcast if broadcast > 0 else math.inf


def _balance(
    decompose: Sequence[float], broadcast: Sequence[float], placed: set[int], ranks: int
) -> list[int | None]:
    """The paper's balancing: ``placed`` factors, longest first, each to the earliest finish.

    Every other factor is local (``L`` seconds on every rank). A rank's state is its
    decomposition end ``C`` and send end ``S`` with factors appended in the order given; taking
    a factor ``(d, b)`` it would finish at ``max(C + d + L, max(C + d, S) + b)``, which is
    ``max(C + d + max(L, b), S + b)`` because ``S >= C``. Ranks that have nothing yet are all
    alike (and are the highest ones), so only the first of them is tried.
    """
    local = math.fsum(decompose[i] for i in range(len(decompose)) if i not in placed)
    owners: list[int | None] = [None] * len(decompose)
    computed = [0.0] * ranks
    sent = [0.0] * ranks
    used = 0
    for index in sorted(placed, key=lambda i: (-decompose[i], i)):
        seconds, sending = decompose[index], broadcast[index]
        after_compute = seconds + max(local, sending)
        best_rank, best_finish = 0, math.inf
        for rank in range(min(used + 1, ranks)):
            finish = max(computed[rank] + after_compute, sent[rank] + sending)
            if finish < best_finish:
                best_rank, best_finish = rank, finish
        owners[index] = best_rank
        used = max(used, best_rank + 1)
        computed[best_rank] += seconds
        sent[best_rank] = max(sent[best_rank], computed[best_rank]) + sending
    return owners


def _schedule(
    decompose: Sequence[float], broadcast: Sequence[float], owners: Sequence[int | None]
) -> list[int]:
    """Owned factors in Johnson's order, then local ones (see :func:`schedule_order`)."""
    owned = sorted(
        (i for i, owner in enumerate(owners) if owner is not None),
        key=lambda i: _johnson(decompose, broadcast, i),
    )
    return owned + [i for i, owner in enumerate(owners) if owner is None]


def _johnson(
    decompose: Sequence[float], broadcast: Sequence[float], index: int
) -> tuple[int, float, int]:
    """Johnson's key: sends longer than decompositions first, shortest decomposition first;
    then longest send first; ties by index."""
    if decompose[index] < broadcast[index]:
        return (0, decompose[index], index)
    return (1, -broadcast[index], index)


#: Passes of :func:`_refine` at most: each lowers the makespan, and this bounds the work on
#: large models.
REFINE_PASSES = 32


def _refine(
    decompose: Sequence[float],
    broadcast: Sequence[float],
    owners: Sequence[int | None],
    ranks: int,
) -> list[int | None]:
    """``owners`` improved by single moves and swaps of placed factors off the rank that
    finishes last (the lowest such rank), each pass taking the first change, in factor and
    rank order, that leaves both ranks it touches finishing earlier than that rank did; the
    makespan never rises. Deterministic, so every rank refines to the same placement."""
    owners = list(owners)
    local = [d for d, owner in zip(decompose, owners, strict=True) if owner is None]

    # A rank's finish depends only on which factors it owns (its order is Johnson's, ties by
    # index): many candidate moves ask for the same set again.
    seen: dict[frozenset[int], float] = {}
    johnson = sorted(range(len(decompose)), key=lambda i: _johnson(decompose, broadcast, i))
    position = [0] * len(decompose)
    for place, index in enumerate(johnson):
        position[index] = place

    def finish(members: list[int]) -> float:
        key = frozenset(members)
        if key not in seen:
            seen[key] = _rank_finish(decompose, broadcast, members, local, position)
        return seen[key]

    members = [[i for i, owner in enumerate(owners) if owner == r] for r in range(ranks)]
    finishes = [finish(members[r]) for r in range(ranks)]
    for _ in range(REFINE_PASSES):
        span = max(finishes)
        late = finishes.index(span)
        changed = False
        for index in members[late]:
            idle_tried = False
            for other in range(ranks):
                if other == late:
                    continue
                if not members[other]:
                    # Every rank owning nothing offers the same move: try the first only.
                    if idle_tried:
                        continue
                    idle_tried = True
                # A move of ``index`` to ``other``, then each swap with one of its factors.
                for partner in [None, *members[other]]:
                    kept = [i for i in members[late] if i != index]
                    taken = [i for i in members[other] if i != partner] + [index]
                    if partner is not None:
                        kept.append(partner)
                    pair = (finish(kept), finish(taken))
                    # Both below the latest finish: with another rank as late, the makespan
                    # stays but one rank fewer reaches it, and the next pass takes that one.
                    if max(pair) < span * (1 - 1e-12):
                        members[late], members[other] = sorted(kept), sorted(taken)
                        finishes[late], finishes[other] = pair
                        changed = True
                        break
                if changed:
                    break
            if changed:
                break
        if not changed:
            break
    for rank, indices in enumerate(members):
        for index in indices:
            owners[index] = rank
    return owners


def _rank_finish(
    decompose: Sequence[float],
    broadcast: Sequence[float],
    members: Sequence[int],
    local: Sequence[float],
    position: Sequence[int],
) -> float:
    """When a rank owning ``members`` is done: its decompositions in Johnson's order, each
    sent once decomposed (``position``: each factor's place in that order), and the ``local``
    work after its own (as :func:`_makespan`)."""
    computed = sent = 0.0
    own = []
    for index in sorted(members, key=position.__getitem__):
        own.append(decompose[index])
        computed += decompose[index]
        sent = max(sent, computed) + broadcast[index]
    return max(math.fsum([*own, *local]), sent)


def _makespan(
    decompose: Sequence[float],
    broadcast: Sequence[float],
    owners: Sequence[int | None],
    ranks: int,
) -> float:
    """:func:`predicted_makespan` on precomputed per-factor seconds.

    A rank's total work is summed exactly (``fsum``) over its own and the local factors, so a
    placement's price does not depend on the order of additions: keeping a factor local and
    owning it on the only rank cost the same, to the last bit.
    """
    local = [seconds for seconds, owner in zip(decompose, owners, strict=True) if owner is None]
    own: list[list[float]] = [[] for _ in range(ranks)]
    computed = [0.0] * ranks
    sent = [0.0] * ranks
    for index in _schedule(decompose, broadcast, owners):
        rank = owners[index]
        if rank is None:
            break  # the local factors come last and delay no send
        own[rank].append(decompose[index])
        computed[rank] += decompose[index]
        sent[rank] = max(sent[rank], computed[rank]) + broadcast[index]
    return max(max(math.fsum(own[r] + local), sent[r]) for r in range(ranks))
