"""Who decomposes each factor and who preconditions each gradient (kfac-pytorch's WorkAssignment).

Built once by running a placement object (:mod:`interlace.kfac.placements`), the same on every
rank, with the process groups that carry decompositions and preconditioned gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from interlace.comm.calibrate import time_broadcast
from interlace.comm.cost import CostModel
from interlace.kfac.balancing import decomposition_cost
from interlace.kfac.costs import MEASURED_SIZES, DecompositionCostModel
from interlace.kfac.lbp import predicted_makespan
from interlace.kfac.methods import DecompositionMethod
from interlace.kfac.placements import (
    Broadcast,
    Decompose,
    FactorPlacement,
    LayerFactors,
    Placement,
    PlacementCosts,
    decomposition_program,
    factor_items,
)
from interlace.kfac.preconditioned_layer import KFACLayer, PendingBroadcast
from interlace.kfac.worker_groups import WorkerGroups

__all__ = [
    "BROADCAST_SIZES",
    "GroupRanks",
    "WorkAssignment",
    "fit_broadcast_cost_model",
    "layer_factors",
]

#: Bytes per broadcast timed to fit LBP's broadcast cost model (besides 4 bytes for the
#: start-up): the span of small and medium factors' decompositions, where LBP's
#: local-or-broadcast decisions fall.
BROADCAST_SIZES = (64 * 1024, 512 * 1024, 2 * 1024 * 1024)


@dataclass(frozen=True)
class GroupRanks:
    """The process group K-FAC runs on, its size, this rank in it, and its global ranks.

    Args:
        group: The group (None: the default group, or no group when not distributed).
        world_size: Its ranks (1 when not distributed).
        rank: This rank in it.
        global_ranks: The global rank of each of its ranks.
        distributed: Whether a process group is initialised.
    """

    group: dist.ProcessGroup | None
    world_size: int
    rank: int
    global_ranks: list[int]
    distributed: bool

    @classmethod
    def of(cls, process_group: dist.ProcessGroup | None) -> GroupRanks:
        """The ranks of ``process_group`` (None: the default group), or one lone rank.

        Args:
            process_group: The group, or None.
        """
        distributed = dist.is_available() and dist.is_initialized()
        world_size = dist.get_world_size(process_group) if distributed else 1
        global_ranks = (
            [dist.get_global_rank(process_group, r) for r in range(world_size)]
            if distributed and process_group is not None
            else list(range(world_size))
        )
        return cls(
            group=process_group if distributed else None,
            world_size=world_size,
            rank=dist.get_rank(process_group) if distributed else 0,
            global_ranks=global_ranks,
            distributed=distributed,
        )


def fit_broadcast_cost_model(
    group: dist.ProcessGroup | None, source: int, device: torch.device | None = None
) -> CostModel:
    """``a + b M`` for a broadcast on ``group``, fitted like all-reduces are calibrated: the
    broadcast model of a placement that prices broadcasts, when it is not given (collective;
    the same model on every rank).

    Mirrors :func:`interlace.comm.calibrate.fit_cost_model` (median per size, the slowest
    rank's medians, a 4-byte message for the start-up, least squares for the per-byte cost on
    top), with broadcasts from ``source`` in place of all-reduces.

    Args:
        group: The group (None: the world).
        source: The global rank that sends.
        device: Where the messages live (default: the CPU).
    """
    medians = torch.tensor(
        [time_broadcast(size, source, group, device=device) for size in (4, *BROADCAST_SIZES)],
        dtype=torch.float64,
        device=device,
    )
    # A collective ends when its slowest rank does, and every rank must fit the same model.
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
    tiny, *rest = medians.cpu().tolist()
    return CostModel.fit_slope(tiny, [float(size) for size in BROADCAST_SIZES], rest)


class _SharedGroups(list[dist.ProcessGroup]):
    """Process groups that a deep copy shares rather than copies.

    A deep copy of a model copies its hooks, and with them the preconditioner; a process
    group cannot be copied (it is a handle on live connections), so the copy refers to the
    same groups.
    """

    def __deepcopy__(self, memo: dict[int, object]) -> _SharedGroups:
        return self


def layer_factors(layer: KFACLayer) -> LayerFactors:
    """A preconditioned layer's factor sides, as placements see them.

    Args:
        layer: The layer.
    """
    return LayerFactors(layer.helper.a_dim, layer.helper.g_dim, layer.helper.diagonal_a)


class _MeasuredCosts:
    """The runtime's :class:`~interlace.kfac.placements.CostSource`: models not given are
    measured on the live group, once, the same on every rank (collective)."""

    def __init__(self, work: WorkAssignment) -> None:
        self.work = work

    def priced(
        self,
        decomposition: DecompositionCostModel | None = None,
        broadcast: CostModel | None = None,
    ) -> PlacementCosts:
        work = self.work
        return PlacementCosts(
            decomposition or work.measure_decomposition_cost(),
            broadcast or fit_broadcast_cost_model(work.group, work.global_ranks[0], work.device),
            work.method,
            element_bytes=work.inv_dtype.itemsize,
        )


class WorkAssignment:
    """Every factor's owner, from a placement object, and the groups its results travel on.

    A colocated placement (greedy, round-robin) gives a layer's two factors one owner, which
    decomposes both and sends them to the layer's gradient workers (:class:`WorkerGroups`) as
    soon as both are made; any other places each factor on its own, or on every rank (owner
    None), and each owner broadcasts a factor as soon as it is made, on a process group of its
    own. Both run :func:`~interlace.kfac.placements.decomposition_program`. A placement that
    prices its choice (LBP) gets the models it was not given measured here on the live group.

    Args:
        layers: The preconditioned layers, in registration order.
        placement: The placement to run.
        worker_groups: The gradient-worker blocks for this world size.
        method: The decomposition method.
        inv_dtype: The dtype decompositions are computed and sent in.
        ranks: The process group K-FAC runs on and this rank in it.
        device: Where start-up measurements run.
    """

    def __init__(
        self,
        layers: Sequence[KFACLayer],
        *,
        placement: Placement,
        worker_groups: WorkerGroups,
        method: DecompositionMethod,
        inv_dtype: torch.dtype,
        ranks: GroupRanks,
        device: torch.device,
    ) -> None:
        self.placement = placement
        self.worker_groups = worker_groups
        self.world_size = worker_groups.world_size
        self.method = method
        self.inv_dtype = inv_dtype
        self.group = ranks.group
        self.rank = ranks.rank
        self.global_ranks = ranks.global_ranks
        self.device = device
        self._owner: dict[str, int] = {}
        self._factor_owner: dict[tuple[str, str], int | None] = {}
        #: Each layer's index among the placed layers (its factors are ``2 i`` and ``2 i + 1``).
        self._index = {layer.name: index for index, layer in enumerate(layers)}
        #: The costs the placement priced with (None: it priced nothing).
        self.costs = self._place(layers)
        self._block_groups: dict[int, dist.ProcessGroup | None] = {}
        self._receiver_groups: dict[int, dist.ProcessGroup | None] = {}
        self._make_worker_groups(ranks.distributed)
        self._owner_groups = _SharedGroups()
        self._distributed = ranks.distributed

    # -- placing -------------------------------------------------------------------------

    @property
    def colocated(self) -> bool:
        """Whether a layer's two factors share an owner (the placement's ``colocated``)."""
        return bool(self.placement.colocated)

    def _place(self, layers: Sequence[KFACLayer]) -> PlacementCosts | None:
        """Run the placement: every factor's owner and the one order every rank decomposes
        and sends in; the same on every rank."""
        placed = self.placement.place(
            [layer_factors(layer) for layer in layers], self.world_size, _MeasuredCosts(self)
        )
        placed.check(self.placement, 2 * len(layers), self.world_size)
        self._placed: FactorPlacement = placed
        for index, layer in enumerate(layers):
            for offset, which in enumerate(("A", "G")):
                self._factor_owner[(layer.name, which)] = placed.owners[2 * index + offset]
            # The layer's owner behind KFAC.layers and its gradient workers: A's, else G's,
            # else 0 (a layer decomposed on every rank).
            owned = [o for o in placed.owners[2 * index : 2 * index + 2] if o is not None]
            self._owner[layer.name] = owned[0] if owned else 0
        return placed.costs

    def measure_decomposition_cost(self) -> DecompositionCostModel:
        """Fit decomposition times on this rank's device, then take rank 0's fit everywhere.

        Every rank measures (so the machine is as busy as in training), but fits differ a
        little between ranks, and different placements would deadlock the broadcasts.
        Collective.
        """
        fitted = DecompositionCostModel.measure(self.method, self.device, self.inv_dtype)
        sizes = MEASURED_SIZES
        # A fixed length on every rank: the points' times, or zeros where rank 0 kept none.
        times = [t for _, t in fitted.points] if fitted.points else [0.0] * len(sizes)
        values = torch.tensor(
            [fitted.c3, fitted.c2, fitted.c0, *times], dtype=torch.float64, device=self.device
        )
        dist.broadcast(values, src=self.global_ranks[0], group=self.group)
        c3, c2, c0, *taken = values.cpu().tolist()
        points = tuple(zip(sizes, taken, strict=True)) if all(t > 0 for t in taken) else ()
        return DecompositionCostModel(c3=c3, c2=c2, c0=c0, points=points)

    # -- process groups ------------------------------------------------------------------

    def _make_worker_groups(self, distributed: bool) -> None:
        """Process groups for HYBRID's blocks and receiver groups (the world serves otherwise)."""
        groups = self.worker_groups
        if not distributed or groups.workers in (1, self.world_size):
            return
        # Every rank creates every group, in the same order: new_group is collective.
        for block in groups.blocks():
            self._block_groups[block[0]] = dist.new_group([self.global_ranks[r] for r in block])
        for members in groups.receiver_groups():
            self._receiver_groups[members[0]] = dist.new_group(
                [self.global_ranks[r] for r in members]
            )

    def make_owner_groups(self) -> None:
        """Factor by factor (not colocated): one process group per owner, so that different
        owners' broadcasts run at once.

        LBP's makespan model assumes each owner's sends leave through their own channel; on one
        group they would queue behind each other. Collective: every rank calls it, in the same
        place of its start-up.
        """
        if not self.colocated and self._distributed and self.world_size > 1:
            self._owner_groups.extend(
                dist.new_group(self.global_ranks) for _ in range(self.world_size)
            )

    def block_group(self, owner: int) -> dist.ProcessGroup | None:
        """The group of ``owner``'s gradient workers, which its decompositions go to.

        Args:
            owner: The rank that decomposed the layer.
        """
        block = self.worker_groups.block_of(owner)
        return self._block_groups.get(block[0], self.group)

    def receiver_group(self) -> dist.ProcessGroup | None:
        """This rank's receiver group: preconditioned gradients reach it on this group."""
        return self._receiver_groups.get(self.rank % self.worker_groups.workers, self.group)

    def owner_group(self, owner: int) -> dist.ProcessGroup | None:
        """The group ``owner`` broadcasts its factors' decompositions on (not colocated).

        Args:
            owner: The rank that decomposed the factor.
        """
        return self._owner_groups[owner] if self._owner_groups else self.group

    # -- decompositions ------------------------------------------------------------------

    def decompose(
        self,
        ready: Sequence[KFACLayer],
        decompose: Callable[[KFACLayer, str], None],
        device: torch.device,
    ) -> list[PendingBroadcast]:
        """Decompose the factors this rank is given, starting each broadcast once it is made.

        Every rank walks the same :func:`~interlace.kfac.placements.decomposition_program`:
        it decomposes the factors it owns or keeps local, and at each broadcast the owner
        starts sending while the others post the matching receive and move on. So collectives
        are issued in one order everywhere, and each broadcast overlaps the decompositions
        after it.

        Args:
            ready: The layers with factors, in the same order on every rank.
            decompose: Decomposes one factor of a layer on this rank.
            device: Where receive buffers live.

        Returns:
            The broadcasts started, to be waited for.
        """
        by_factor: dict[int, tuple[KFACLayer, str]] = {}
        for layer in ready:
            index = self._index[layer.name]
            by_factor[2 * index] = (layer, "A")
            by_factor[2 * index + 1] = (layer, "G")
        pending: list[PendingBroadcast] = []
        for step in decomposition_program(self.placement, self._placed, by_factor.keys()):
            if isinstance(step, Decompose):
                layer, which = by_factor[step.factor]
                layer.decomposed = True
                owner = self.factor_owner(layer.name, which)
                if owner is None or owner == self.rank:
                    decompose(layer, which)
                continue
            started = self._start_broadcast(step, by_factor, device)
            if started is not None:
                pending.append(started)
        return pending

    def _start_broadcast(
        self,
        step: Broadcast,
        by_factor: Mapping[int, tuple[KFACLayer, str]],
        device: torch.device,
    ) -> PendingBroadcast | None:
        """Start one broadcast of the program on this rank, or None where it takes no part."""
        src = self.global_ranks[step.owner]
        receive = step.owner != self.rank
        if step.channel is not None:
            if self.world_size == 1:
                return None  # one rank already holds everything
            layer, which = by_factor[step.factors[0]]
            group = self.owner_group(step.channel)
            return layer.broadcast_decomposition(
                which, src=src, group=group, receive=receive, device=device
            )
        layer, _ = by_factor[step.factors[0]]
        # A layer's decompositions go to its gradient workers only (none under MEM-OPT).
        if not self.worker_groups.broadcasts_decompositions or not self.is_grad_worker(layer.name):
            return None
        return layer.broadcast_decompositions(
            src=src, group=self.block_group(step.owner), receive=receive, device=device
        )

    # -- queries -------------------------------------------------------------------------

    def owner(self, name: str) -> int:
        """The rank that decomposes a layer's factors (factor by factor: see ``KFAC.layers``).

        Args:
            name: The layer's name.
        """
        return self._owner[name]

    def factor_owner(self, name: str, which: str) -> int | None:
        """The rank that decomposes one factor; None means every rank does.

        Args:
            name: The layer's name.
            which: ``"A"`` or ``"G"``.
        """
        return self._factor_owner[(name, which)]

    def is_grad_worker(self, name: str) -> bool:
        """Whether this rank is one of a layer's gradient workers (it preconditions it).

        Args:
            name: The layer's name.
        """
        return self._owner[name] in self.worker_groups.block_of(self.rank)

    def gradient_source(self, name: str) -> int:
        """The gradient worker that sends this rank a layer's preconditioned gradient (global).

        Args:
            name: The layer's name.
        """
        source = self.worker_groups.gradient_source(self._owner[name], self.rank)
        return self.global_ranks[source]

    def share_gradients(
        self,
        layers: Sequence[KFACLayer],
        results: dict[KFACLayer, torch.Tensor],
        grads: Mapping[KFACLayer, torch.Tensor | None],
    ) -> None:
        """Send each layer's preconditioned gradient from its workers to every other rank.

        Each rank receives from the worker at its own position of the layer's block, on its
        receiver group; all broadcasts are started before the first is waited for.

        Args:
            layers: The layers preconditioned this step, in the same order on every rank.
            results: The preconditioned gradients this rank computed; completed in place.
            grads: The layers' gradients (shapes and dtypes for receive buffers).
        """
        pending = []
        for layer in layers:
            if layer not in results:
                template = grads[layer]
                assert template is not None
                results[layer] = torch.empty_like(template)
            buffer = results[layer].contiguous()
            results[layer] = buffer
            pending.append(
                dist.broadcast(
                    buffer,
                    src=self.gradient_source(layer.name),
                    group=self.receiver_group(),
                    async_op=True,
                )
            )
        for handle in pending:
            assert handle is not None
            handle.wait()

    # -- description ---------------------------------------------------------------------

    def mode(self) -> str:
        """``"COMM-OPT"``, ``"MEM-OPT"`` or ``"HYBRID (k gradient workers per layer)"``."""
        workers = self.worker_groups.workers
        if workers == self.world_size:
            return "COMM-OPT"
        if workers == 1:
            return "MEM-OPT"
        return f"HYBRID ({workers} gradient workers per layer)"

    def describe(self, layers: Sequence[KFACLayer]) -> str:
        """A few lines: the mode and placement, per-rank load, the layers' owners.

        Args:
            layers: The preconditioned layers.
        """
        # Run headers and tests match this prefix, so the placement comes after it.
        head = (
            f"K-FAC ({self.method.name}, {self.mode()}) on {self.world_size} rank(s): "
            f"{len(layers)} layers, {self.placement.name} placement, {self._load(layers)}"
        )
        lines = [head]
        for layer in layers:
            helper = layer.helper
            a_text = f"A {helper.a_dim}{' (diagonal)' if helper.diagonal_a else ''}"
            if self.colocated:
                lines.append(
                    f"  {layer.name}: {a_text}, G {helper.g_dim}, rank {self._owner[layer.name]}"
                )
            else:
                lines.append(
                    f"  {layer.name}: {a_text} {_where(self.factor_owner(layer.name, 'A'))}, "
                    f"G {helper.g_dim} {_where(self.factor_owner(layer.name, 'G'))}"
                )
        return "\n".join(lines)

    def _load(self, layers: Sequence[KFACLayer]) -> str:
        """Each rank's share of the ``n^3`` work, or, when the placement priced its choice,
        its predicted seconds and the predicted makespan."""
        items = factor_items([layer_factors(layer) for layer in layers])
        owners = [self.factor_owner(layer.name, which) for layer in layers for which in "AG"]
        costs = self.costs
        if costs is None and all(owner is None for owner in owners):
            return "every factor decomposed locally (nothing to send)"
        if costs is None:
            loads = [0.0] * self.world_size
            for layer in layers:
                loads[self._owner[layer.name]] += decomposition_cost(
                    layer.helper.a_dim, layer.helper.g_dim, layer.helper.diagonal_a
                )
            return "decomposition cost per rank " + ", ".join(
                f"{load / max(sum(loads), 1.0):.0%}" for load in loads
            )
        seconds = [0.0 if item.diagonal else costs.decompose_s(item.dim) for item in items]
        local = sum(s for s, owner in zip(seconds, owners, strict=True) if owner is None)
        per_rank = [local] * self.world_size
        for cost, owner in zip(seconds, owners, strict=True):
            if owner is not None:
                per_rank[owner] += cost
        makespan = predicted_makespan(
            items, owners, self.world_size, costs.decompose_s, costs.broadcast_s
        )
        kept = sum(owner is None for owner in owners)
        return (
            f"{kept} of {len(owners)} factors local, predicted decomposition ms per rank "
            + ", ".join(f"{load * 1e3:.2f}" for load in per_rank)
            + f", predicted makespan {makespan * 1e3:.2f} ms"
        )


def _where(owner: int | None) -> str:
    """Where a factor is decomposed, for :meth:`WorkAssignment.describe`."""
    return "local" if owner is None else f"on rank {owner}"
