"""``interlace.KFAC``: a distributed K-FAC preconditioner used like kfac-pytorch's.

::

    model = interlace.DataParallel(net)            # or torch DDP, or no wrapper at all
    precond = interlace.KFAC(model, lr=lambda step: optimizer.param_groups[0]["lr"])
    loss_fn(model(x), y).backward()                # gradients averaged across ranks
    precond.step()                                 # gradients preconditioned in place
    optimizer.step()

One step, every ``factor_update_steps``: the factors each rank collected in its forward and
backward hooks are averaged across ranks (fused into buckets) and folded into the running
averages. Every ``inv_update_steps``: each layer's factors are decomposed (or inverted) on the
one rank that the placement gave it and sent to the layer's gradient workers; then those workers
precondition and, unless every rank is a worker, send the result on (see
:mod:`interlace.kfac.placement`). Last, kfac-pytorch's KL-clip scales every preconditioned
gradient by one factor.

Placements (the ``placement`` argument):

* ``"greedy"`` (default, SC20 / KAISA): a layer's two factors on one rank, largest layers first
  onto the least-loaded rank (:func:`~interlace.kfac.placement.greedy_placement`).
* ``"round-robin"``: layer ``i`` on rank ``i % world``, the size-blind baseline.
* ``"lbp"`` (SPD-KFAC, COMM-OPT only): each *factor* on its own, from
  :func:`~interlace.kfac.placement.lbp_placement` priced with measured cost models: a factor
  cheaper to decompose than to broadcast is decomposed on every rank, the others on one rank
  each and broadcast, one collective per factor, as soon as it is ready.

Factor communication (the ``factor_comm`` argument):

* ``"bulk"`` (default): ``step()`` all-reduces every factor at once, in buckets of at most
  ``bucket_cap_mb``.
* ``"pipelined"`` (SPD-KFAC, PAPERS.md section 4): each factor's upper triangle
  (:func:`~interlace.kfac.packing.pack_upper`) is all-reduced as soon as its hook computes it,
  overlapping the rest of the forward and backward passes, on a process group of its own so it
  never interleaves with a data-parallel wrapper's gradient all-reduces. ``fusion`` picks the
  buckets (:mod:`interlace.kfac.fusion`): ``"none"`` one per factor, ``"fixed"`` up to
  ``bucket_cap_mb`` in ready order, ``"merged"`` MG-WFBP's rule on ready times profiled over
  ``profile_steps`` factor steps (the slowest rank's) and ``factor_cost`` (fitted on the factor
  group when not given), so every rank launches the same buckets. The first factor step is always
  bulk (it finds the layers whose hooks never fire); the layer set is then taken as fixed. With
  ``accumulation_steps > 1``, or on one rank, factors are sent in bulk. ``step()`` waits for the
  outstanding all-reduces; that exposed wait is ``last_phase_s["factor_comm"]``.

Where interlace deliberately differs from kfac-pytorch:

* ``G`` is normalised to the *global* batch: kfac-pytorch builds ``G`` from each rank's
  gradients of its local mean loss, so on W ranks its ``G`` is W^2 times the one a single process
  builds from the same global batch, and the effective damping changes with the world size.
  interlace divides by W^2, so W ranks give exactly the single-process result (the tests check
  it) and one rank gives exactly kfac-pytorch's numbers. This assumes the usual loss: a mean over
  the local batch, gradients averaged across ranks.
* Decompositions are kept in ``state_dict()`` beside the factors, so a resumed run continues
  exactly even between two decomposition steps (kfac-pytorch recomputes them on load).
* Output gradients are taken by a tensor hook on the layer's output rather than a module
  backward hook, so layers followed by in-place operations (``ReLU(inplace=True)``) work.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from interlace.comm.calibrate import fit_cost_model, time_broadcast
from interlace.comm.cost import CostModel
from interlace.kfac.costs import DecompositionCostModel, broadcast_time
from interlace.kfac.decomp import (
    COMPUTE_METHODS,
    DecompositionError,
    FactorDecomposition,
    decompose,
    empty_like_decomposition,
    kl_clip_scale,
    precondition,
)
from interlace.kfac.fusion import FUSIONS, BucketLauncher, make_groups
from interlace.kfac.layers import LayerHelper, make_helper
from interlace.kfac.packing import pack_upper, packed_size, unpack_upper
from interlace.kfac.placement import (
    FactorItem,
    WorkerGroups,
    decomposition_cost,
    greedy_placement,
    lbp_placement,
    predicted_makespan,
    round_robin_placement,
    schedule_order,
)
from interlace.timeline import Event

__all__ = ["FACTOR_COMMS", "FUSIONS", "KFAC", "PHASES", "PLACEMENTS", "KFACWarning"]

#: Values of ``KFAC(placement=...)``: where decompositions are computed (see the module doc).
PLACEMENTS = ("round-robin", "greedy", "lbp")

#: Values of ``KFAC(g_normalization=...)``: how ``G`` is scaled (see :class:`KFAC`).
G_NORMALIZATIONS = ("kfac-pytorch", "per-example")
#: Values of ``KFAC(factor_comm=...)``: how factors are averaged across ranks (see the module doc).
FACTOR_COMMS = ("bulk", "pipelined")

#: Bytes per broadcast timed to fit LBP's broadcast cost model (besides 4 bytes for the
#: start-up): the span of small and medium factors' decompositions, where LBP's
#: local-or-broadcast decisions fall.
BROADCAST_SIZES = (64 * 1024, 512 * 1024, 2 * 1024 * 1024)

#: The K-FAC phases timed by every :meth:`KFAC.step` (seconds in :attr:`KFAC.last_phase_s`).
#: ``factor_compute`` is the work done in the forward and backward hooks since the last step.
PHASES = (
    "factor_compute",
    "factor_comm",
    "decomposition",
    "decomposition_comm",
    "precondition",
    "precondition_comm",
)

#: A hyperparameter: a number, or a callable giving the number for a step count.
IntHyper = int | Callable[[int], int]
FloatHyper = float | Callable[[int], float]


class KFACWarning(UserWarning):
    """Something K-FAC skipped or worked around; training goes on."""


@dataclass
class _Layer:
    """One preconditioned module and all the K-FAC state that belongs to it."""

    name: str
    helper: LayerHelper
    #: The rank that decomposes both factors (layer-level placements); see :attr:`KFAC.layers`
    #: for what it means under LBP.
    owner: int = 0
    #: Per-factor owners (None: decomposed on every rank) and positions in the global
    #: decomposition order; used by the LBP placement only.
    a_owner: int | None = 0
    g_owner: int | None = 0
    a_order: int = 0
    g_order: int = 0
    a_sum: torch.Tensor | None = None
    g_sum: torch.Tensor | None = None
    a_count: int = 0
    g_count: int = 0
    a_factor: torch.Tensor | None = None
    g_factor: torch.Tensor | None = None
    a_decomp: FactorDecomposition | None = None
    g_decomp: FactorDecomposition | None = None
    handles: list[RemovableHandle] = field(default_factory=list)
    #: Whether a decomposition step has covered this layer (the same on every rank).
    decomposed: bool = False

    def reset_batch(self) -> None:
        self.a_sum = self.g_sum = None
        self.a_count = self.g_count = 0


class _SharedGroups(list[dist.ProcessGroup]):
    """Process groups that a deep copy shares rather than copies.

    A deep copy of a model copies its hooks, and with them this preconditioner; a process
    group cannot be copied (it is a handle on live connections), so the copy refers to the
    same groups.
    """

    def __deepcopy__(self, memo: dict[int, object]) -> _SharedGroups:
        return self


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DataParallel / DDP wrappers (they expose it as ``.module``)."""
    inner = getattr(model, "module", None)
    while isinstance(inner, nn.Module):
        model, inner = inner, getattr(inner, "module", None)
    return model


class KFAC:
    """Distributed K-FAC preconditioner (SC20 / KAISA), a drop-in for kfac-pytorch's.

    Hyperparameters have kfac-pytorch's names and defaults; ``factor_update_steps``,
    ``inv_update_steps``, ``damping``, ``factor_decay``, ``kl_clip`` and ``lr`` may also be
    callables of the step count. ``lr`` is used only by the KL-clip; pass the optimiser's
    current rate when a schedule changes it. ``grad_worker_fraction`` is 1 (COMM-OPT), 1/world
    (MEM-OPT) or a fraction between (HYBRID). ``skip_layers`` names modules (by their name in
    the model, any enclosing module's name, or their class name, case-insensitive) to leave to
    the optimiser. Linear, Conv2d (groups=1) and dense Embedding layers are preconditioned.

    ``placement`` is one of :data:`PLACEMENTS` (see the module docstring). ``"lbp"`` prices
    each factor with ``decomposition_cost`` and ``broadcast_cost``; left out, they are measured
    at start-up on the live group (decompositions on this rank's device in ``inv_dtype``, rank
    0's fit taken by every rank; broadcasts timed on every rank, slowest rank's medians) so
    every rank derives the same placement. Passed in, they must be the same on every rank.

    ``factor_comm`` (``"bulk"`` or ``"pipelined"``), ``fusion`` (``"none"``, ``"fixed"`` or
    ``"merged"``, used by ``"pipelined"`` only), ``profile_steps`` and ``factor_cost`` (the same on
    every rank) choose how factors are averaged across ranks; see the module docstring.

    ``g_normalization="per-example"`` scales ``G`` by the squared global batch: the factor of
    the per-example Fisher (Martens and Grosse; kfac-pytorch's early ``batch_averaged=True``)
    rather than kfac-pytorch's current one, built from gradients of the mean loss, whose
    eigenvalues are ``batch^2`` smaller so that a damping of 1e-3 dominates them. Damping then
    means the same thing at every batch size.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: IntHyper = 1,
        inv_update_steps: IntHyper = 1,
        damping: FloatHyper = 0.001,
        factor_decay: FloatHyper = 0.95,
        kl_clip: FloatHyper | None = 0.001,
        lr: FloatHyper = 0.1,
        accumulation_steps: int = 1,
        compute_method: str = "eigen",
        grad_worker_fraction: float | None = 1.0,
        skip_layers: Iterable[str] = (),
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        placement: str = "greedy",
        decomposition_cost: DecompositionCostModel | None = None,
        broadcast_cost: CostModel | None = None,
        factor_comm: str = "bulk",
        fusion: str = "none",
        profile_steps: int = 3,
        factor_cost: CostModel | None = None,
        g_normalization: str = "kfac-pytorch",
    ) -> None:
        if factor_comm not in FACTOR_COMMS:
            raise ValueError(
                f"factor_comm must be one of {', '.join(FACTOR_COMMS)}, got {factor_comm!r}"
            )
        if fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {', '.join(FUSIONS)}, got {fusion!r}")
        if profile_steps < 1:
            raise ValueError(f"profile_steps must be >= 1, got {profile_steps}")
        if g_normalization not in G_NORMALIZATIONS:
            raise ValueError(
                f"g_normalization must be one of {', '.join(G_NORMALIZATIONS)}, "
                f"got {g_normalization!r}"
            )
        self.g_normalization = g_normalization
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        if placement == "lbp" and grad_worker_fraction is not None and grad_worker_fraction < 1:
            raise ValueError(
                "placement='lbp' needs grad_worker_fraction=1 (COMM-OPT): it broadcasts each "
                f"factor's decomposition to every rank, got grad_worker_fraction="
                f"{grad_worker_fraction}; use placement='greedy' for MEM-OPT or HYBRID"
            )
        if compute_method not in COMPUTE_METHODS:
            raise ValueError(
                f"compute_method must be one of {', '.join(COMPUTE_METHODS)}, "
                f"got {compute_method!r}"
            )
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self._factor_update_steps = factor_update_steps
        self._inv_update_steps = inv_update_steps
        self._damping = damping
        self._factor_decay = factor_decay
        self._kl_clip = kl_clip
        self._lr = lr
        self.accumulation_steps = accumulation_steps
        self.compute_method = compute_method
        self.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        self.bucket_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.placement = placement
        #: LBP's cost models (None for the layer-level placements and on a single rank).
        self.decomposition_cost = decomposition_cost
        self.broadcast_cost = broadcast_cost
        self.factor_comm = factor_comm
        self.fusion = fusion
        self.profile_steps = profile_steps
        #: The all-reduce cost model behind ``fusion="merged"`` (given, or fitted when needed).
        self.factor_cost = factor_cost
        #: The pipelined factor buckets in use (indices into :attr:`factor_order`); None until
        #: pipelining starts, singletons while ``"merged"`` profiles.
        self.factor_plan: list[list[int]] | None = None
        #: The factors' ready order pipelining uses: ``(layer name, "A" or "G")``.
        self.factor_order: list[tuple[str, str]] = []
        self._pipe: _FactorPipeline | None = None
        self._fired: list[tuple[str, str]] = []
        self.steps = 0
        self._check_hyperparameters()

        distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group if distributed else None
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        self.rank = dist.get_rank(process_group) if distributed else 0
        self._global_ranks = (
            [dist.get_global_rank(process_group, r) for r in range(self.world_size)]
            if distributed and process_group is not None
            else list(range(self.world_size))
        )
        fraction = 1.0 if grad_worker_fraction is None else grad_worker_fraction
        self.worker_groups = WorkerGroups.for_fraction(fraction, self.world_size)
        self.grad_worker_fraction = self.worker_groups.workers / self.world_size

        #: Seconds spent in each of :data:`PHASES` by the last :meth:`step`.
        self.last_phase_s: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._hook_s = 0.0
        self._spans: list[tuple[str, str, float, float]] = []
        self._last_spans: list[tuple[str, str, float, float]] = []
        self._hooks_checked = False
        self._needs_decomposition = False
        self._loaded = False

        #: Modules left to the optimiser, with the reason: ``{name: reason}``.
        self.skipped: dict[str, str] = {}
        self._layers: list[_Layer] = []
        self._register(_unwrap(model), {s.lower() for s in skip_layers})
        self._place()
        self._block_groups, self._receiver_groups = self._make_groups(distributed)
        # Pipelined factor all-reduces start inside the hooks, while DataParallel's gradient
        # all-reduces run on the default group: a group of their own keeps the two sequences
        # apart (new_group is collective, so every rank creates it here, in the same order).
        self._factor_group: dist.ProcessGroup | None = None
        if factor_comm == "pipelined" and distributed and self.world_size > 1:
            self._factor_group = dist.new_group(self._global_ranks)
        # LBP's placement assumes different owners' broadcasts run at the same time (each
        # owner's sends leave through its own link); on one group they would queue behind each
        # other, so each owner broadcasts on a group of its own.
        self._owner_groups = _SharedGroups()
        if placement == "lbp" and distributed and self.world_size > 1:
            self._owner_groups.extend(
                dist.new_group(self._global_ranks) for _ in range(self.world_size)
            )
        if self.skipped and self.rank == 0:
            listing = ", ".join(f"{name} ({why})" for name, why in self.skipped.items())
            warnings.warn(
                f"K-FAC preconditions {len(self._layers)} layer(s) and leaves "
                f"{len(self.skipped)} module(s) with parameters to the optimizer: {listing}",
                KFACWarning,
                stacklevel=2,
            )

    # -- hyperparameters ------------------------------------------------------------------

    def _value(self, hyper: Any) -> Any:
        return hyper(self.steps) if callable(hyper) else hyper

    @property
    def factor_update_steps(self) -> int:
        return int(self._value(self._factor_update_steps))

    @property
    def inv_update_steps(self) -> int:
        return int(self._value(self._inv_update_steps))

    @property
    def damping(self) -> float:
        return float(self._value(self._damping))

    @property
    def factor_decay(self) -> float:
        return float(self._value(self._factor_decay))

    @property
    def kl_clip(self) -> float | None:
        value = self._value(self._kl_clip)
        return None if value is None else float(value)

    @property
    def lr(self) -> float:
        return float(self._value(self._lr))

    def _check_hyperparameters(self) -> None:
        checks = [
            (self.factor_update_steps >= 1, "factor_update_steps must be >= 1"),
            (self.inv_update_steps >= 1, "inv_update_steps must be >= 1"),
            (self.damping >= 0, "damping must be >= 0"),
            (0 <= self.factor_decay < 1, "factor_decay must be in [0, 1)"),
            (self.kl_clip is None or self.kl_clip > 0, "kl_clip must be > 0 or None"),
            (self.lr > 0, "lr must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"{message} (at step {self.steps})")

    # -- registration -------------------------------------------------------------------

    def _register(self, model: nn.Module, skip: set[str]) -> None:
        for name, module in model.named_modules():
            own_params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not own_params:
                continue
            # The module's own name and every enclosing module's ("block", "block.0", ...).
            segments = name.lower().split(".")
            names = {".".join(segments[: i + 1]) for i in range(len(segments))}
            if names & skip or type(module).__name__.lower() in skip:
                self.skipped[name] = "in skip_layers"
                continue
            helper, reason = make_helper(module)
            if helper is None:
                self.skipped[name] = reason
                continue
            layer = _Layer(name or type(module).__name__, helper)
            layer.handles.append(module.register_forward_hook(partial(self._forward_hook, layer)))
            self._layers.append(layer)
        if not self._layers:
            raise ValueError(
                "K-FAC found no Linear, Conv2d or Embedding layer with a trainable weight to "
                "precondition in this model (check skip_layers)"
            )

    def _place(self) -> None:
        """Give every layer (or, for LBP, every factor) its owner; the same on every rank."""
        if self.placement == "lbp":
            self._place_factors()
            return
        if self.placement == "round-robin":
            owners = round_robin_placement(len(self._layers), self.world_size)
        else:
            costs = [
                decomposition_cost(layer.helper.a_dim, layer.helper.g_dim, layer.helper.diagonal_a)
                for layer in self._layers
            ]
            owners = greedy_placement(costs, self.world_size)
        for layer, owner in zip(self._layers, owners, strict=True):
            layer.owner = layer.a_owner = layer.g_owner = owner

    def _factor_items(self) -> list[FactorItem]:
        """Every layer's ``A`` then ``G``, in layer order: the factors LBP places."""
        items: list[FactorItem] = []
        for layer in self._layers:
            items.append(FactorItem(layer.helper.a_dim, layer.helper.diagonal_a))
            items.append(FactorItem(layer.helper.g_dim))
        return items

    def _decompose_s(self, n: int) -> float:
        assert self.decomposition_cost is not None
        return self.decomposition_cost.time(n)

    def _broadcast_s(self, n: int) -> float:
        assert self.broadcast_cost is not None
        return broadcast_time(
            self.broadcast_cost, self.compute_method, n, element_size=self.inv_dtype.itemsize
        )

    def _place_factors(self) -> None:
        """LBP: per-factor owners and the one global order every rank decomposes and sends in.

        On one rank nothing is sent, so everything is local and nothing is measured.
        """
        items = self._factor_items()
        if self.world_size == 1:
            owners: list[int | None] = [None] * len(items)
            order = list(range(len(items)))
        else:
            if self.decomposition_cost is None:
                self.decomposition_cost = self._measure_decomposition_cost()
            if self.broadcast_cost is None:
                self.broadcast_cost = self._measure_broadcast_cost()
            owners = lbp_placement(items, self.world_size, self._decompose_s, self._broadcast_s)
            order = schedule_order(
                items, owners, self.world_size, self._decompose_s, self._broadcast_s
            )
        position = {factor: index for index, factor in enumerate(order)}
        for index, layer in enumerate(self._layers):
            layer.a_owner, layer.g_owner = owners[2 * index], owners[2 * index + 1]
            layer.a_order, layer.g_order = position[2 * index], position[2 * index + 1]
            # The summary owner behind :attr:`layers` (see there).
            owned = [o for o in (layer.a_owner, layer.g_owner) if o is not None]
            layer.owner = owned[0] if owned else 0

    def _measure_decomposition_cost(self) -> DecompositionCostModel:
        """Fit decomposition times on this rank's device, then take rank 0's fit everywhere.

        Every rank measures (so the machine is as busy as in training), but fits differ a
        little between ranks, and different placements would deadlock the broadcasts.
        """
        device = self._device()
        fitted = DecompositionCostModel.measure(self.compute_method, device, self.inv_dtype)
        coefficients = torch.tensor(
            [fitted.c3, fitted.c2, fitted.c0], dtype=torch.float64, device=device
        )
        dist.broadcast(coefficients, src=self._global_ranks[0], group=self.group)
        c3, c2, c0 = coefficients.cpu().tolist()
        return DecompositionCostModel(c3=c3, c2=c2, c0=c0)

    def _measure_broadcast_cost(self) -> CostModel:
        """``a + b M`` for a broadcast on this group, fitted like all-reduces are calibrated.

        Mirrors :func:`interlace.comm.calibrate.fit_cost_model` (median per size, the slowest
        rank's medians, a 4-byte message for the start-up, least squares for the per-byte
        cost on top), with broadcasts from rank 0 in place of all-reduces.
        """
        device = self._device()
        medians = torch.tensor(
            [
                time_broadcast(size, self._global_ranks[0], self.group, device=device)
                for size in (4, *BROADCAST_SIZES)
            ],
            dtype=torch.float64,
            device=device,
        )
        # A collective ends when its slowest rank does, and every rank must fit the same model.
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=self.group)
        tiny, *rest = medians.cpu().tolist()
        return CostModel.fit_slope(tiny, [float(size) for size in BROADCAST_SIZES], rest)

    def _make_groups(
        self, distributed: bool
    ) -> tuple[dict[int, dist.ProcessGroup | None], dict[int, dist.ProcessGroup | None]]:
        """Process groups for HYBRID's blocks and receiver groups (the world serves otherwise)."""
        blocks: dict[int, dist.ProcessGroup | None] = {}
        receivers: dict[int, dist.ProcessGroup | None] = {}
        groups = self.worker_groups
        if not distributed or groups.workers in (1, self.world_size):
            return blocks, receivers
        # Every rank creates every group, in the same order: new_group is collective.
        for block in groups.blocks():
            created = dist.new_group([self._global_ranks[r] for r in block])
            blocks[block[0]] = created
        for members in groups.receiver_groups():
            created = dist.new_group([self._global_ranks[r] for r in members])
            receivers[members[0]] = created
        return blocks, receivers

    @property
    def layers(self) -> dict[str, int]:
        """Every preconditioned layer's name and the rank that decomposes its factors.

        Under LBP a layer's two factors may have different owners, or none (decomposed on
        every rank): this gives the owner of ``A``, else of ``G``, else 0 (rank 0 decomposes
        local factors like every rank). :attr:`factor_owners` has the full answer.
        """
        return {layer.name: layer.owner for layer in self._layers}

    @property
    def factor_owners(self) -> dict[str, tuple[int | None, int | None]]:
        """Every layer's ``(A owner, G owner)``; None means decomposed locally on every rank.

        With a layer-level placement both are the layer's owner.
        """
        return {layer.name: (layer.a_owner, layer.g_owner) for layer in self._layers}

    def describe(self) -> str:
        """A few lines: the distribution mode and placement, per-rank load, the layers' owners.

        The first line is a one-line summary. Layer-level placements give each rank's share of
        the ``n^3`` decomposition cost; LBP gives each rank's predicted seconds of decomposition
        (its own factors plus the local ones) and the predicted makespan under its cost models.
        """
        mode = (
            "COMM-OPT"
            if self.worker_groups.workers == self.world_size
            else "MEM-OPT"
            if self.worker_groups.workers == 1
            else f"HYBRID ({self.worker_groups.workers} gradient workers per layer)"
        )
        # Run headers and tests match this prefix, so the placement comes after it.
        head = (
            f"K-FAC ({self.compute_method}, {mode}) on {self.world_size} rank(s): "
            f"{len(self._layers)} layers, {self.placement} placement, "
        )
        if self.placement == "lbp":
            head += self._describe_lbp_load()
        else:
            loads = [0.0] * self.world_size
            for layer in self._layers:
                loads[layer.owner] += decomposition_cost(
                    layer.helper.a_dim, layer.helper.g_dim, layer.helper.diagonal_a
                )
            head += "decomposition cost per rank " + ", ".join(
                f"{load / max(sum(loads), 1.0):.0%}" for load in loads
            )
        lines = [head]
        for layer in self._layers:
            helper = layer.helper
            a_text = f"A {helper.a_dim}{' (diagonal)' if helper.diagonal_a else ''}"
            if self.placement == "lbp":
                lines.append(
                    f"  {layer.name}: {a_text} {_where(layer.a_owner)}, "
                    f"G {helper.g_dim} {_where(layer.g_owner)}"
                )
            else:
                lines.append(f"  {layer.name}: {a_text}, G {helper.g_dim}, rank {layer.owner}")
        return "\n".join(lines)

    def _describe_lbp_load(self) -> str:
        if self.decomposition_cost is None or self.broadcast_cost is None:
            return "every factor decomposed locally (nothing to send)"
        items = self._factor_items()
        owners = [o for layer in self._layers for o in (layer.a_owner, layer.g_owner)]
        seconds = [0.0 if item.diagonal else self._decompose_s(item.dim) for item in items]
        local = sum(s for s, owner in zip(seconds, owners, strict=True) if owner is None)
        loads = [local] * self.world_size
        for cost, owner in zip(seconds, owners, strict=True):
            if owner is not None:
                loads[owner] += cost
        makespan = predicted_makespan(
            items, owners, self.world_size, self._decompose_s, self._broadcast_s
        )
        kept = sum(owner is None for owner in owners)
        return (
            f"{kept} of {len(owners)} factors local, predicted decomposition ms per rank "
            + ", ".join(f"{load * 1e3:.2f}" for load in loads)
            + f", predicted makespan {makespan * 1e3:.2f} ms"
        )

    # -- hooks --------------------------------------------------------------------------

    def _collecting(self, module: nn.Module) -> bool:
        return (
            module.training
            and torch.is_grad_enabled()
            and self.steps % self.factor_update_steps == 0
        )

    def _forward_hook(
        self, layer: _Layer, module: nn.Module, inputs: tuple[Any, ...], output: Any
    ) -> None:
        if not self._collecting(module) or not inputs:
            return
        started = time.perf_counter()
        with torch.no_grad():
            layer_input = inputs[0].detach()
            if self.factor_dtype is not None and layer_input.is_floating_point():
                layer_input = layer_input.to(self.factor_dtype)
            a = layer.helper.a_factor(layer_input)
            layer.a_sum = a if layer.a_sum is None else layer.a_sum + a
            layer.a_count += 1
            self._factor_ready(layer, "A", a, layer.a_count)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(partial(self._grad_hook, layer))
        ended = time.perf_counter()
        self._hook_s += ended - started
        self._spans.append((f"A {layer.name}", "factor", started, ended))

    def _grad_hook(self, layer: _Layer, grad: torch.Tensor) -> None:
        started = time.perf_counter()
        with torch.no_grad():
            grad_output = grad.detach()
            if self.factor_dtype is not None:
                grad_output = grad_output.to(self.factor_dtype)
            # Normalised to the global batch (see the module docstring): each rank's output
            # gradients are W times a single process's, and G is quadratic in them.
            g = layer.helper.g_factor(grad_output) / float(self.world_size**2)
            if self.g_normalization == "per-example":
                # Gradients of a mean loss carry 1/(global batch); undo it in G (quadratic).
                g = g * float(grad_output.shape[0] * self.world_size) ** 2
            layer.g_sum = g if layer.g_sum is None else layer.g_sum + g
            layer.g_count += 1
            self._factor_ready(layer, "G", g, layer.g_count)
        ended = time.perf_counter()
        self._hook_s += ended - started
        self._spans.append((f"G {layer.name}", "factor", started, ended))

    def _factor_ready(self, layer: _Layer, which: str, factor: torch.Tensor, count: int) -> None:
        """Hand a fresh factor to the pipeline, or note its ready order before pipelining."""
        if self._pipe is not None:
            self._pipe.offer((layer.name, which), factor)
        elif self.factor_comm == "pipelined" and count == 1:
            self._fired.append((layer.name, which))

    # -- the step -----------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Precondition every registered layer's gradient in place (call before the optimiser).

        Gradients must already be averaged across ranks, as DataParallel and DDP leave them
        after ``backward()``.
        """
        self._check_hyperparameters()
        phases = dict.fromkeys(PHASES, 0.0)
        phases["factor_compute"] = self._hook_s
        self._hook_s = 0.0
        if self.steps % self.factor_update_steps == 0:
            if self._pipe is not None:
                self._update_factors_pipelined(phases)
            else:
                self._update_factors(phases)
                if self._wants_pipeline():
                    self._start_pipeline()
        self._fired = []
        if self._loaded:
            self._loaded = False
            self._agree_on_decomposition()
        if self.steps % self.inv_update_steps == 0 or self._needs_decomposition:
            self._update_decompositions(phases)
            self._needs_decomposition = False
        self._precondition(phases)
        for layer in self._layers:
            layer.reset_batch()
        self.last_phase_s = phases
        # Only the latest step's spans are kept, so memory stays bounded when nobody asks.
        self._last_spans, self._spans = self._spans, []
        self.steps += 1

    def _timed(self, phases: dict[str, float], phase: str, category: str, name: str) -> _Timer:
        return _Timer(self, phases, phase, category, name)

    def _update_factors(self, phases: dict[str, float]) -> None:
        started = time.perf_counter()
        present = torch.tensor(
            [[layer.a_count > 0, layer.g_count > 0] for layer in self._layers], dtype=torch.int32
        )
        if self.world_size > 1:
            # One small collective so that every rank agrees which layers have factors this
            # step: a layer seen by some ranks only would otherwise desynchronise the buckets.
            both = torch.cat([present, -present]).to(self._device())
            dist.all_reduce(both, op=dist.ReduceOp.MIN, group=self.group)
            both = both.cpu()
            everywhere, anywhere = both[: len(self._layers)], -both[len(self._layers) :]
        else:
            everywhere = anywhere = present
        flags = dict(zip((layer.name for layer in self._layers), everywhere.tolist(), strict=True))
        if not self._hooks_checked:
            self._hooks_checked = True
            self._drop_silent_layers(anywhere)
        ready = [layer for layer in self._layers if all(flags[layer.name])]
        phases["factor_compute"] += time.perf_counter() - started
        tensors: list[torch.Tensor] = []
        for layer in ready:
            assert layer.a_sum is not None and layer.g_sum is not None
            tensors += [layer.a_sum / layer.a_count, layer.g_sum / layer.g_count]
        with self._timed(phases, "factor_comm", "comm", "factor all-reduce"):
            averaged = self._all_reduce_mean(tensors)
        self._fold(phases, ready, averaged)

    def _fold(
        self, phases: dict[str, float], ready: list[_Layer], averaged: list[torch.Tensor]
    ) -> None:
        """Fold each ready layer's averaged ``A`` and ``G`` (alternating in ``averaged``) into its
        running averages, dropping a layer's non-finite factors for this step."""
        with self._timed(phases, "factor_compute", "factor", "running averages"):
            decay = self.factor_decay
            finite = _all_finite(averaged)
            for index, layer in enumerate(ready):
                new_a, new_g = averaged[2 * index], averaged[2 * index + 1]
                if not (finite[2 * index] and finite[2 * index + 1]):
                    warnings.warn(
                        f"K-FAC: non-finite factors for layer {layer.name} at step "
                        f"{self.steps}; this step's factors are dropped, the running "
                        "averages are kept",
                        KFACWarning,
                        stacklevel=4,
                    )
                    continue
                layer.a_factor = _running_average(layer.a_factor, new_a, decay)
                layer.g_factor = _running_average(layer.g_factor, new_g, decay)

    # -- pipelined factor communication (SPD-KFAC) ---------------------------------------

    def _wants_pipeline(self) -> bool:
        """Whether to pipeline factor all-reduces from the next factor-update step on.

        Only with several ranks (one has nothing to send) and without micro-batch accumulation:
        with ``accumulation_steps > 1`` a factor is only complete after the last micro-batch,
        so launching it from the hook would send a partial sum; bulk is kept there.
        """
        return (
            self.factor_comm == "pipelined"
            and self._factor_group is not None
            and self.accumulation_steps == 1
        )

    def _start_pipeline(self) -> None:
        """After the first (bulk) factor step: fix the factors' ready order and first buckets.

        That step also dropped the silent layers, so the layer set is taken as fixed from here
        on. The ready order is rank 0's hook order, broadcast so that every rank indexes the
        plan the same way (factors rank 0 never saw go last, in layer order).
        """
        position = {layer.name: index for index, layer in enumerate(self._layers)}
        count = 2 * len(self._layers)
        codes = torch.full((count,), -1, dtype=torch.int64)
        seen = [
            2 * position[name] + (which == "G") for name, which in self._fired if name in position
        ]
        seen = list(dict.fromkeys(seen))
        codes[: len(seen)] = torch.tensor(seen, dtype=torch.int64)
        codes = codes.to(self._device())
        dist.broadcast(codes, src=self._global_ranks[0], group=self._factor_group)
        order = [int(code) for code in codes.cpu().tolist() if code >= 0]
        order += [code for code in range(count) if code not in set(order)]
        keys: list[tuple[str, str]] = []
        numels: list[int] = []
        dtypes: list[torch.dtype] = []
        for code in order:
            layer, is_g = self._layers[code // 2], code % 2 == 1
            helper = layer.helper
            if is_g:
                numels.append(packed_size(helper.g_dim))
                factor = layer.g_factor
            else:
                numels.append(helper.a_dim if helper.diagonal_a else packed_size(helper.a_dim))
                factor = layer.a_factor
            dtypes.append(helper.weight.dtype if factor is None else factor.dtype)
            keys.append((layer.name, "G" if is_g else "A"))
        self.factor_order = keys
        self._pipe = _FactorPipeline(self, keys, numels, dtypes)
        if self.fusion == "merged":
            # Per-factor launches while the ready times are profiled.
            self._pipe.profiling = True
            self._set_factor_plan(make_groups("none", self._pipe.nbytes))
        else:
            self._set_factor_plan(
                make_groups(self.fusion, self._pipe.nbytes, cap_bytes=self.bucket_bytes)
            )

    def _set_factor_plan(self, groups: list[list[int]]) -> None:
        assert self._pipe is not None
        self.factor_plan = groups
        self._pipe.groups = groups
        self._pipe.reset()

    def _update_factors_pipelined(self, phases: dict[str, float]) -> None:
        """The factor step when the hooks have already launched the all-reduces.

        Flushes the buckets still open (a factor missing on this rank is sent as zeros, so every
        rank issues the same collectives), then one small all-reduce agrees which layers every
        rank has and whether any rank saw a layer twice (a module called twice per step): the
        sums sent then hold only the first call, so the step falls back to the bulk all-reduce
        of the accumulated factors.
        """
        pipe = self._pipe
        assert pipe is not None
        started = time.perf_counter()
        pipe.flush()
        counts = torch.tensor(
            [[layer.a_count, layer.g_count] for layer in self._layers], dtype=torch.int64
        )
        present = (counts > 0).to(torch.int64).reshape(-1)
        repeated = int(bool((counts > 1).any()))
        flags = torch.cat([present, torch.tensor([-repeated])]).to(self._device())
        # On the main group, idle once backward has returned: on the factor group this small
        # all-reduce would queue behind the buckets still in flight and hide their wait here.
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.group)
        flags = flags.cpu()
        everywhere = flags[:-1].reshape(-1, 2).tolist()
        any_repeated = int(flags[-1]) < 0
        ready = [layer for layer, both in zip(self._layers, everywhere, strict=True) if all(both)]
        phases["factor_compute"] += time.perf_counter() - started
        with self._timed(phases, "factor_comm", "comm", "factor all-reduce wait"):
            summed = pipe.wait()
        if any_repeated:
            tensors: list[torch.Tensor] = []
            for layer in ready:
                assert layer.a_sum is not None and layer.g_sum is not None
                tensors += [layer.a_sum / layer.a_count, layer.g_sum / layer.g_count]
            with self._timed(phases, "factor_comm", "comm", "factor all-reduce"):
                averaged = self._all_reduce_mean(tensors)
        else:
            averaged = []
            for layer in ready:
                helper = layer.helper
                for which, dim, diagonal, local in (
                    ("A", helper.a_dim, helper.diagonal_a, layer.a_sum),
                    ("G", helper.g_dim, False, layer.g_sum),
                ):
                    assert local is not None
                    mean = summed[pipe.index[(layer.name, which)]] / self.world_size
                    averaged.append(unpack_upper(mean, dim, diagonal=diagonal).to(local.dtype))
        self._fold(phases, ready, averaged)
        if pipe.profiling:
            pipe.record_profile()
            if pipe.profiled >= self.profile_steps:
                self._plan_merged()
        pipe.reset()

    def _plan_merged(self) -> None:
        """Merged buckets from the profiled ready times (slowest rank's) and the cost model."""
        pipe = self._pipe
        assert pipe is not None
        ready = torch.tensor(pipe.mean_ready_s(), dtype=torch.float64, device=self._device())
        # Every rank must derive the same plan: the same times, sizes and cost model.
        dist.all_reduce(ready, op=dist.ReduceOp.MAX, group=self._factor_group)
        if self.factor_cost is None:
            self.factor_cost = fit_cost_model(self._factor_group, device=self._device())
        pipe.profiling = False
        self._set_factor_plan(
            make_groups("merged", pipe.nbytes, ready_s=ready.cpu().tolist(), cost=self.factor_cost)
        )

    def _drop_silent_layers(self, anywhere: torch.Tensor) -> None:
        """Unregister layers whose forward hook fired on no rank in the first factor step."""
        keep: list[_Layer] = []
        for layer, flags in zip(self._layers, anywhere.tolist(), strict=True):
            if flags[0]:
                keep.append(layer)
                continue
            for handle in layer.handles:
                handle.remove()
            reason = "its forward never ran (its weight is used functionally by its parent)"
            self.skipped[layer.name] = reason
            if self.rank == 0:
                warnings.warn(
                    f"K-FAC skips layer {layer.name}: {reason}; the optimizer updates it "
                    "unpreconditioned",
                    KFACWarning,
                    stacklevel=4,
                )
        if len(keep) != len(self._layers):
            self._layers = keep

    def _all_reduce_mean(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Average ``tensors`` across ranks in fused buckets of at most ``bucket_cap_mb``."""
        if self.world_size == 1 or not tensors:
            return tensors
        buckets: list[list[int]] = [[]]
        size = 0
        for index, tensor in enumerate(tensors):
            nbytes = tensor.numel() * tensor.element_size()
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(index)
            size += nbytes
        flats = [torch.cat([tensors[i].reshape(-1) for i in bucket]) for bucket in buckets]
        works = [dist.all_reduce(flat, group=self.group, async_op=True) for flat in flats]
        result: list[torch.Tensor] = list(tensors)
        for bucket, flat, work in zip(buckets, flats, works, strict=True):
            assert work is not None
            work.wait()
            mean = flat / self.world_size
            offset = 0
            for index in bucket:
                numel = tensors[index].numel()
                result[index] = mean[offset : offset + numel].view_as(tensors[index])
                offset += numel
        return result

    def _update_decompositions(self, phases: dict[str, float]) -> None:
        if self.placement == "lbp":
            self._update_factor_decompositions(phases)
            return
        damping = self.damping
        ready = [layer for layer in self._layers if layer.a_factor is not None]
        with self._timed(phases, "decomposition", "decomposition", "decompositions"):
            for layer in ready:
                layer.decomposed = True
                if layer.owner == self.rank:
                    self._decompose(layer, damping)
        if not self.worker_groups.broadcasts_decompositions:
            return
        with self._timed(phases, "decomposition_comm", "comm", "decomposition broadcast"):
            pending = []
            my_block = self.worker_groups.block_of(self.rank)
            for layer in ready:
                if layer.owner not in my_block:
                    continue
                if layer.owner != self.rank and layer.a_decomp is None:
                    self._allocate_decompositions(layer)
                assert layer.a_decomp is not None and layer.g_decomp is not None
                parts = layer.a_decomp.tensors() + layer.g_decomp.tensors()
                flat = torch.cat([t.reshape(-1) for t in parts])
                work = dist.broadcast(
                    flat,
                    src=self._global_ranks[layer.owner],
                    group=self._block_group(layer.owner),
                    async_op=True,
                )
                pending.append((layer, parts, flat, work))
            for layer, parts, flat, work in pending:
                work.wait()
                if layer.owner == self.rank:
                    continue
                unpacked = list(torch.split(flat, [t.numel() for t in parts]))
                shaped = [u.view_as(t) for u, t in zip(unpacked, parts, strict=True)]
                assert layer.a_decomp is not None and layer.g_decomp is not None
                count_a = len(layer.a_decomp.tensors())
                layer.a_decomp.replace(shaped[:count_a])
                layer.g_decomp.replace(shaped[count_a:])

    def _update_factor_decompositions(self, phases: dict[str, float]) -> None:
        """LBP's decomposition step: owned factors decomposed and broadcast one by one.

        Every rank walks the same global order (owned factors in Johnson's order, then the
        local ones, from :func:`~interlace.kfac.placement.schedule_order`): for an owned
        factor its owner decomposes it and starts the broadcast at once, while the others
        post the matching broadcast into a buffer and move on, so collectives are issued in
        one order everywhere (no deadlock) and each owner's sends start as early as its
        decompositions allow. Local factors come last, as they delay no send; then all
        broadcasts are waited for and unpacked.

        Each owner broadcasts on a process group of its own, so different owners' sends run
        at the same time, as :func:`~interlace.kfac.placement.predicted_makespan` assumes; one
        owner's broadcasts keep their order.
        """
        damping = self.damping
        ready = [layer for layer in self._layers if layer.a_factor is not None]
        factors = sorted(
            [(layer.a_order, layer, "A") for layer in ready]
            + [(layer.g_order, layer, "G") for layer in ready],
            key=lambda entry: entry[0],
        )
        pending: list[tuple[_Layer, str, torch.Tensor, dist.Work | None]] = []
        with self._timed(phases, "decomposition", "decomposition", "decompositions"):
            for _, layer, which in factors:
                layer.decomposed = True
                owner = layer.a_owner if which == "A" else layer.g_owner
                if owner is None or owner == self.rank:
                    self._decompose_factor(layer, which, damping)
                if owner is None:
                    continue
                if owner != self.rank and self._held_decomposition(layer, which) is None:
                    self._allocate_decomposition(layer, which)
                # The owner's numbers, or a receive buffer shaped like them.
                flat = self._decomposition_of(layer, which).flatten()
                group = self._owner_groups[owner] if self._owner_groups else self.group
                work = dist.broadcast(
                    flat, src=self._global_ranks[owner], group=group, async_op=True
                )
                pending.append((layer, which, flat, work))
        if not pending:
            return
        with self._timed(phases, "decomposition_comm", "comm", "decomposition broadcast"):
            for layer, which, flat, work in pending:
                assert work is not None
                work.wait()
                owner = layer.a_owner if which == "A" else layer.g_owner
                if owner != self.rank:
                    self._decomposition_of(layer, which).load_flat(flat)

    @staticmethod
    def _held_decomposition(layer: _Layer, which: str) -> FactorDecomposition | None:
        return layer.a_decomp if which == "A" else layer.g_decomp

    @staticmethod
    def _decomposition_of(layer: _Layer, which: str) -> FactorDecomposition:
        decomposition = layer.a_decomp if which == "A" else layer.g_decomp
        assert decomposition is not None
        return decomposition

    def _allocate_decomposition(self, layer: _Layer, which: str) -> None:
        """A receive buffer for one factor's broadcast decomposition."""
        helper = layer.helper
        dim, diagonal = (helper.a_dim, helper.diagonal_a) if which == "A" else (helper.g_dim, False)
        buffer = empty_like_decomposition(
            self.compute_method, dim, diagonal, self.inv_dtype, self._device()
        )
        if which == "A":
            layer.a_decomp = buffer
        else:
            layer.g_decomp = buffer

    def _decompose(self, layer: _Layer, damping: float) -> None:
        self._decompose_factor(layer, "A", damping)
        self._decompose_factor(layer, "G", damping)

    def _decompose_factor(self, layer: _Layer, which: str, damping: float) -> None:
        """Decompose one of the layer's factors in place, falling back when that fails.

        The fallback is the previous decomposition, or on the first step the factor's
        diagonal in the dense shapes (receivers' broadcast buffers expect those).
        """
        factor = layer.a_factor if which == "A" else layer.g_factor
        previous = layer.a_decomp if which == "A" else layer.g_decomp
        assert factor is not None
        try:
            result = decompose(factor, self.compute_method, damping, self.inv_dtype)
        except DecompositionError as error:
            fallback = previous
            what = "keeps the previous decomposition"
            if fallback is None:
                # Nothing earlier to keep: the diagonal of the factor always decomposes.
                fallback = decompose(
                    torch.diagonal(factor).clone() if factor.dim() == 2 else factor,
                    self.compute_method,
                    damping,
                    self.inv_dtype,
                )
                fallback = _as_dense(fallback, factor)
                what = "uses the factor's diagonal"
            warnings.warn(
                f"K-FAC: factor {which} of layer {layer.name} at step {self.steps}: "
                f"{error}; it {what}",
                KFACWarning,
                # Through the caller, _update_decompositions and step to the user's code.
                stacklevel=5,
            )
            result = fallback
        if which == "A":
            layer.a_decomp = result
        else:
            layer.g_decomp = result

    def _allocate_decompositions(self, layer: _Layer) -> None:
        device = self._device()
        helper = layer.helper
        layer.a_decomp = empty_like_decomposition(
            self.compute_method, helper.a_dim, helper.diagonal_a, self.inv_dtype, device
        )
        layer.g_decomp = empty_like_decomposition(
            self.compute_method, helper.g_dim, False, self.inv_dtype, device
        )

    def _precondition(self, phases: dict[str, float]) -> None:
        damping = self.damping
        # Both conditions are the same on every rank: decompositions are made in lockstep and
        # gradients are averaged, so every rank takes part in the same broadcasts.
        layers = [
            layer
            for layer in self._layers
            if layer.decomposed and layer.helper.weight.grad is not None
        ]
        if not layers:
            return
        grads = {layer.name: layer.helper.grad_matrix() for layer in layers}
        checked = [grad for grad in grads.values() if grad is not None]
        bad = [name for name, ok in zip(grads, _all_finite(checked), strict=True) if not ok]
        if bad:
            warnings.warn(
                f"K-FAC: non-finite gradient in {', '.join(bad)} at step {self.steps}; "
                "preconditioning is skipped for this step (factors are untouched)",
                KFACWarning,
                stacklevel=3,
            )
            return
        groups = self.worker_groups
        results: dict[str, torch.Tensor] = {}
        with self._timed(phases, "precondition", "precondition", "preconditioning"):
            for layer in layers:
                if layer.owner in groups.block_of(self.rank):
                    assert layer.a_decomp is not None and layer.g_decomp is not None
                    grad = grads[layer.name]
                    assert grad is not None
                    results[layer.name] = precondition(
                        grad, layer.a_decomp, layer.g_decomp, damping
                    )
        if groups.broadcasts_gradients:
            with self._timed(phases, "precondition_comm", "comm", "gradient broadcast"):
                pending = []
                for layer in layers:
                    source = groups.gradient_source(layer.owner, self.rank)
                    if layer.name not in results:
                        template = grads[layer.name]
                        assert template is not None
                        results[layer.name] = torch.empty_like(template)
                    buffer = results[layer.name].contiguous()
                    results[layer.name] = buffer
                    work = dist.broadcast(
                        buffer,
                        src=self._global_ranks[source],
                        group=self._receiver_group(self.rank),
                        async_op=True,
                    )
                    pending.append(work)
                for work in pending:
                    work.wait()
        with self._timed(phases, "precondition", "precondition", "KL-clip and write-back"):
            # One sum on the device and one read back, not a device sync per layer.
            per_layer = [
                (results[layer.name] * grads[layer.name]).sum(dtype=torch.float64)  # type: ignore[operator]
                for layer in layers
            ]
            products = float(torch.stack(per_layer).sum())
            scale = kl_clip_scale(products, self.kl_clip, self.lr)
            for layer in layers:
                layer.helper.set_grad(results[layer.name] * scale)

    def _block_group(self, owner: int) -> dist.ProcessGroup | None:
        block = self.worker_groups.block_of(owner)
        return self._block_groups.get(block[0], self.group)

    def _receiver_group(self, rank: int) -> dist.ProcessGroup | None:
        return self._receiver_groups.get(rank % self.worker_groups.workers, self.group)

    def _device(self) -> torch.device:
        return self._layers[0].helper.weight.device

    # -- timeline -----------------------------------------------------------------------

    def take_events(self, process: str = "rank 0", origin_s: float = 0.0) -> list[Event]:
        """The latest step's timed spans (its hooks, collectives, decompositions) and any
        since, as timeline events; each span is returned once.

        Times are ``time.perf_counter()`` values minus ``origin_s``. The hook spans land on the
        ``factor`` lane, collectives on ``kfac comm``, the rest on their own category's lane.
        """
        events = [
            Event(
                name,
                category,
                start - origin_s,
                end - origin_s,
                lane="kfac comm" if category == "comm" else category,
                process=process,
            )
            for name, category, start, end in self._last_spans + self._spans
        ]
        self._last_spans, self._spans = [], []
        return events

    # -- state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Step count, plain hyperparameters, and per layer its factors and decompositions."""
        state: dict[str, Any] = {"steps": self.steps}
        for key in ("factor_update_steps", "inv_update_steps", "damping", "factor_decay"):
            value = getattr(self, f"_{key}")
            if not callable(value):
                state[key] = value
        for key in ("kl_clip", "lr"):
            value = getattr(self, f"_{key}")
            if not callable(value):
                state[key] = value
        layers: dict[str, dict[str, Any]] = {}
        for layer in self._layers:
            entry: dict[str, Any] = {"A": layer.a_factor, "G": layer.g_factor}
            for which, decomposition in (
                ("A_decomp", layer.a_decomp),
                ("G_decomp", layer.g_decomp),
            ):
                if decomposition is not None:
                    entry[which] = {
                        "method": decomposition.method,
                        "values": decomposition.values,
                        "vectors": decomposition.vectors,
                        "inverse": decomposition.inverse,
                    }
            layers[layer.name] = entry
        state["layers"] = layers
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a layer without saved decompositions is re-decomposed."""
        self.steps = int(state["steps"])
        for key in ("factor_update_steps", "inv_update_steps", "damping", "factor_decay"):
            if key in state:
                setattr(self, f"_{key}", state[key])
        for key in ("kl_clip", "lr"):
            if key in state:
                setattr(self, f"_{key}", state[key])
        saved = state.get("layers", {})
        names = {layer.name for layer in self._layers}
        unknown = sorted(set(saved) - names)
        if unknown:
            raise ValueError(
                f"K-FAC state has layers this model does not precondition: {', '.join(unknown)}"
            )
        device = self._device()
        for layer in self._layers:
            entry = saved.get(layer.name)
            if entry is None:
                continue
            layer.a_factor = None if entry["A"] is None else entry["A"].to(device)
            layer.g_factor = None if entry["G"] is None else entry["G"].to(device)
            decomps = []
            for which in ("A_decomp", "G_decomp"):
                raw = entry.get(which)
                decomps.append(
                    None
                    if raw is None
                    else FactorDecomposition(
                        raw["method"],
                        **{
                            k: (None if raw[k] is None else raw[k].to(device))
                            for k in ("values", "vectors", "inverse")
                        },
                    )
                )
            layer.a_decomp, layer.g_decomp = decomps
            layer.decomposed = layer.a_factor is not None
            if layer.decomposed and self._needs_local_decomposition(layer):
                self._needs_decomposition = True
        self._loaded = True

    def _agree_on_decomposition(self) -> None:
        """After a load, decompose again on every rank if any rank lacks a decomposition."""
        if self.world_size == 1:
            return
        flag = torch.tensor([int(self._needs_decomposition)], device=self._device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self._needs_decomposition = bool(flag.item())

    def _needs_local_decomposition(self, layer: _Layer) -> bool:
        holds = layer.a_decomp is not None and layer.g_decomp is not None
        is_worker = layer.owner in self.worker_groups.block_of(self.rank)
        return is_worker and not holds

    def remove_hooks(self) -> None:
        """Detach K-FAC from the model (its modules' hooks); the preconditioner is then inert."""
        for layer in self._layers:
            for handle in layer.handles:
                handle.remove()
            layer.handles.clear()

    def __iter__(self) -> Iterator[str]:
        return iter(layer.name for layer in self._layers)


class _FactorPipeline:
    """The in-hook communicator of pipelined factor all-reduces (one factor step at a time).

    Factors are indexed by their position in the ready order (``keys``). :meth:`offer` packs a
    factor's upper triangle and launches every bucket that is now complete, in plan order, as an
    async SUM all-reduce on the KFAC's dedicated factor group; :meth:`flush` launches the rest
    and :meth:`wait` collects the sums. While profiling it also notes each factor's ready time,
    seconds since the first factor of the step (about the start of the forward pass).
    """

    def __init__(
        self, owner: KFAC, keys: list[tuple[str, str]], numels: list[int], dtypes: list[torch.dtype]
    ) -> None:
        self.owner = owner
        self.index = {key: position for position, key in enumerate(keys)}
        self.numels = numels
        self.dtypes = dtypes
        #: Packed bytes of each factor, in ready order.
        self.nbytes = [n * d.itemsize for n, d in zip(numels, dtypes, strict=True)]
        self.groups: list[list[int]] = [[i] for i in range(len(keys))]
        self.profiling = False
        self.profiled = 0
        self._ready_sum = [0.0] * len(keys)
        self._ready_count = [0] * len(keys)
        self.reset()

    def reset(self) -> None:
        """Forget this step's factors (collectives must have been waited for)."""
        self.launcher = BucketLauncher(self.groups)
        self.packed: dict[int, torch.Tensor] = {}
        self.ready_s: dict[int, float] = {}
        self.origin: float | None = None
        self.pending: list[tuple[int, torch.Tensor, dist.Work | None, float]] = []

    def offer(self, key: tuple[str, str], factor: torch.Tensor) -> None:
        now = time.perf_counter()
        if self.origin is None:
            self.origin = now
        position = self.index.get(key)
        # A second call of the same module in one step is caught by step()'s counts.
        if position is None or position in self.packed:
            return
        packed = pack_upper(factor)
        # The all-reduce works in place, and a diagonal factor is the hook's own tensor.
        self.packed[position] = packed.clone() if packed is factor else packed
        self.ready_s[position] = now - self.origin
        for bucket in self.launcher.add(position):
            self._launch(bucket)

    def flush(self) -> None:
        for bucket in self.launcher.rest():
            self._launch(bucket)

    def _launch(self, bucket: int) -> None:
        members = self.groups[bucket]
        device = self.owner._device()
        parts = [
            self.packed[i]
            if i in self.packed
            else torch.zeros(self.numels[i], dtype=self.dtypes[i], device=device)
            for i in members
        ]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        started = time.perf_counter()
        work = dist.all_reduce(flat, group=self.owner._factor_group, async_op=True)
        self.pending.append((bucket, flat, work, started))

    def wait(self) -> dict[int, torch.Tensor]:
        """Every factor's all-reduced sum (1-D, packed), by ready position."""
        sums: dict[int, torch.Tensor] = {}
        for bucket, flat, work, started in self.pending:
            assert work is not None
            work.wait()
            members = self.groups[bucket]
            self.owner._spans.append(
                (f"factor bucket {bucket} ({len(members)})", "comm", started, time.perf_counter())
            )
            pieces = torch.split(flat, [self.numels[i] for i in members])
            for i, piece in zip(members, pieces, strict=True):
                sums[i] = piece
        self.pending = []
        return sums

    def record_profile(self) -> None:
        self.profiled += 1
        for position, ready in self.ready_s.items():
            self._ready_sum[position] += ready
            self._ready_count[position] += 1

    def mean_ready_s(self) -> list[float]:
        """Each factor's mean profiled ready time (0 for one never seen on this rank)."""
        return [
            total / count if count else 0.0
            for total, count in zip(self._ready_sum, self._ready_count, strict=True)
        ]


class _Timer:
    """Adds a block's wall time to one phase and records it as a timeline span."""

    def __init__(
        self, owner: KFAC, phases: dict[str, float], phase: str, category: str, name: str
    ) -> None:
        self.owner, self.phases, self.phase = owner, phases, phase
        self.category, self.name = category, name
        self.started = 0.0

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        ended = time.perf_counter()
        self.phases[self.phase] += ended - self.started
        self.owner._spans.append((self.name, self.category, self.started, ended))


def _where(owner: int | None) -> str:
    """Where LBP decomposes a factor, for :meth:`KFAC.describe`."""
    return "local" if owner is None else f"on rank {owner}"


def _all_finite(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor is all finite, read back from the device once for all of them."""
    if not tensors:
        return []
    flags: list[bool] = torch.stack([torch.isfinite(t).all() for t in tensors]).tolist()
    return flags


def _running_average(current: torch.Tensor | None, new: torch.Tensor, decay: float) -> torch.Tensor:
    """``decay * current + (1 - decay) * new``, starting from the identity (kfac-pytorch's)."""
    if current is None:
        current = (
            torch.ones_like(new)
            if new.dim() == 1
            else torch.eye(new.shape[0], dtype=new.dtype, device=new.device)
        )
    return decay * current + (1.0 - decay) * new


def _as_dense(decomposition: FactorDecomposition, factor: torch.Tensor) -> FactorDecomposition:
    """A diagonal fallback decomposition in the dense shapes the broadcast buffers expect."""
    if factor.dim() == 1:
        return decomposition
    n = factor.shape[0]
    values = decomposition.values
    assert values is not None
    eye = torch.eye(n, dtype=values.dtype, device=values.device)
    if decomposition.method == "eigen":
        return FactorDecomposition("eigen", values=values, vectors=eye)
    return FactorDecomposition("inverse", inverse=torch.diag(values))
