"""The engine of :class:`~interlace.kfac.preconditioner.KFAC`: the order of a step over the
parts ``KFAC`` builds (layers, work assignment, factor update, gradients, hooks), what it reports
(layers, owners, costs, phases) and its checkpoints."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from functools import partial
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from interlace.comm.cost import CostModel
from interlace.kfac.costs import DecompositionCostModel
from interlace.kfac.damping import AdaptiveDamping
from interlace.kfac.enums import FactorSync
from interlace.kfac.factor_comm import FactorComm
from interlace.kfac.factor_modes import FactorCommMode
from interlace.kfac.factor_update import FactorUpdate
from interlace.kfac.gradients import GradientPreconditioning
from interlace.kfac.hooks import FactorHooks
from interlace.kfac.methods import DecompositionMethod
from interlace.kfac.options import check_hyperparameters
from interlace.kfac.placements import Placement
from interlace.kfac.preconditioned_layer import (
    GradientMark,
    KFACLayer,
    gradient_marks,
    gradients_unchanged,
)
from interlace.kfac.state import (
    PLAIN_HYPERPARAMETERS,
    agree_on_decomposition,
    load_state,
    memory_usage,
    save_state,
)
from interlace.kfac.timing import SpanLog
from interlace.kfac.warning import KFACWarning
from interlace.kfac.work_assignment import WorkAssignment
from interlace.kfac.worker_groups import WorkerGroups
from interlace.timeline import Event

__all__ = ["PHASES", "BasePreconditioner"]

#: The K-FAC phases timed by every :meth:`KFAC.step` (seconds in :attr:`KFAC.last_phase_s`).
#: ``factor_compute`` is the work done in the forward and backward hooks since the last step
#: and the running averages; the hooks' hand-over of factors to their all-reduce and the step's
#: agreement on which layers have factors are ``factor_comm``.
PHASES = (
    "factor_compute",
    "factor_comm",
    "decomposition",
    "decomposition_comm",
    "precondition",
    "precondition_comm",
)


class BasePreconditioner:
    """K-FAC's step, reports and checkpoints over the parts :class:`~interlace.kfac.KFAC`
    builds; not made on its own (``KFAC`` sets every attribute below)."""

    steps: int
    group: dist.ProcessGroup | None
    world_size: int
    rank: int
    accumulation_steps: int
    compute_method: DecompositionMethod
    placement: Placement
    factor_comm: FactorCommMode
    factor_sync: FactorSync
    factor_dtype: torch.dtype | None
    inv_dtype: torch.dtype
    bucket_bytes: int
    g_normalization: str
    symmetry_aware: bool
    worker_groups: WorkerGroups
    grad_worker_fraction: float
    skipped: dict[str, str]
    last_phase_s: dict[str, float]
    assignment: WorkAssignment
    adaptive_damping: AdaptiveDamping | None
    _factor_update_steps: Any
    _inv_update_steps: Any
    _damping: Any
    _factor_decay: Any
    _kl_clip: Any
    _lr: Any
    _grad_scale: Any
    _layers: list[KFACLayer]
    _spans: SpanLog
    _comm: FactorComm
    _hooks: FactorHooks
    _factor_update: FactorUpdate
    _gradients: GradientPreconditioning
    _written: list[GradientMark | None] | None
    _needs_decomposition: bool
    _loaded: bool

    # -- hyperparameters ------------------------------------------------------------------

    def _value(self, hyper: Any) -> Any:
        return hyper(self.steps) if callable(hyper) else hyper

    @property
    def factor_update_steps(self) -> int:
        """Steps between factor updates, at the current step."""
        return int(self._value(self._factor_update_steps))

    @property
    def inv_update_steps(self) -> int:
        """Steps between decompositions, at the current step."""
        return int(self._value(self._inv_update_steps))

    @property
    def damping(self) -> float:
        """The damping at the current step (the adapted one under Levenberg-Marquardt)."""
        if self.adaptive_damping is not None:
            return self.adaptive_damping.damping
        return float(self._value(self._damping))

    @property
    def factor_decay(self) -> float:
        """The running averages' decay at the current step."""
        return float(self._value(self._factor_decay))

    @property
    def kl_clip(self) -> float | None:
        """The KL-clip bound at the current step (None: no clip)."""
        value = self._value(self._kl_clip)
        return None if value is None else float(value)

    @property
    def lr(self) -> float:
        """The learning rate the KL-clip assumes at the current step."""
        return float(self._value(self._lr))

    def _hyperparameters(self) -> dict[str, Any]:
        """The plain hyperparameters' values at the current step."""
        return {key: self._value(getattr(self, f"_{key}")) for key in PLAIN_HYPERPARAMETERS}

    def _check_hyperparameters(self) -> None:
        check_hyperparameters(self._hyperparameters(), self.steps)

    # -- what is preconditioned, and where ------------------------------------------------

    @property
    def layers(self) -> dict[str, int]:
        """Every preconditioned layer's name and the rank that decomposes its factors.

        Under LBP a layer's two factors may have different owners, or none (decomposed on
        every rank): this gives the owner of ``A``, else of ``G``, else 0 (rank 0 decomposes
        local factors like every rank). :attr:`factor_owners` has the full answer.
        """
        return {layer.name: self.assignment.owner(layer.name) for layer in self._layers}

    @property
    def kfac_layers(self) -> Mapping[str, KFACLayer]:
        """Every preconditioned layer's state (factors, decompositions), by name; read-only."""
        return MappingProxyType({layer.name: layer for layer in self._layers})

    @property
    def factor_owners(self) -> dict[str, tuple[int | None, int | None]]:
        """Every layer's ``(A owner, G owner)``; None means decomposed locally on every rank.

        With a colocated placement both are the layer's owner.
        """
        owner = self.assignment.factor_owner
        return {name: (owner(name, "A"), owner(name, "G")) for name in self}

    @property
    def decomposition_cost(self) -> DecompositionCostModel | None:
        """The decomposition cost model the placement priced with, given or measured (None
        when it priced nothing: greedy, round-robin, any placement on one rank)."""
        costs = self.assignment.costs
        return None if costs is None else costs.decomposition

    @property
    def broadcast_cost(self) -> CostModel | None:
        """The broadcast cost model the placement priced with, given or measured (None when it
        priced nothing)."""
        costs = self.assignment.costs
        return None if costs is None else costs.broadcast

    @property
    def factor_cost(self) -> CostModel | None:
        """The all-reduce cost model behind pipelined ``fusion="merged"`` (given, or fitted
        when needed)."""
        return self._comm.factor_cost

    @property
    def factor_plan(self) -> list[list[int]] | None:
        """The pipelined factor buckets in use (indices into :attr:`factor_order`); None until
        pipelining starts, singletons while ``"merged"`` profiles."""
        return self._comm.factor_plan

    @property
    def factor_plan_settled(self) -> bool:
        """Whether the pipelined factor buckets are final (no profiling or trials to come);
        True where factors are not pipelined."""
        return self._comm.plan_settled

    @property
    def factor_tuning(self) -> str | None:
        """One line: each candidate factor plan's measured time and the one kept (None before
        the trials end, or with none to run)."""
        return self._comm.tuning

    @property
    def factor_order(self) -> list[tuple[str, str]]:
        """The factors' ready order pipelining uses: ``(layer name, "A" or "G")``."""
        return self._comm.factor_order

    def describe(self) -> str:
        """A few lines: the distribution mode and placement, per-rank load, the layers' owners.

        The first line is a one-line summary. A placement that priced nothing gives each rank's
        share of the ``n^3`` decomposition cost; one that priced its choice (LBP) gives each
        rank's predicted seconds of decomposition (its own factors plus the local ones) and the
        predicted makespan under its cost models.
        """
        return self.assignment.describe(self._layers)

    # -- hooks --------------------------------------------------------------------------

    def _collecting(self, module: nn.Module) -> bool:
        return (
            module.training
            and torch.is_grad_enabled()
            and self.steps % self.factor_update_steps == 0
        )

    # -- the step -----------------------------------------------------------------------

    @torch.no_grad()
    def step(self, loss: torch.Tensor | float | None = None) -> None:
        """Precondition every registered layer's gradient in place (call before the optimiser).

        Gradients must already be averaged across ranks, as DataParallel and DDP leave them
        after ``backward()``. A second call with no backward in between does nothing (with a
        :class:`KFACWarning`): the gradients it would see are preconditioned already.

        Args:
            loss: This rank's loss of the batch behind the gradients (a tensor or a number),
                at every step on every rank: it drives ``damping_adaptation``. Ignored under
                fixed damping; without it the damping stays as it is.
        """
        self._check_hyperparameters()
        if self._written is not None and gradients_unchanged(self._written, self._layers):
            warnings.warn(
                f"K-FAC: step() called again with no backward since the last one (step "
                f"{self.steps - 1}); the gradients are preconditioned already, so this call "
                "does nothing",
                KFACWarning,
                stacklevel=3,
            )
            return
        phases = dict.fromkeys(PHASES, 0.0)
        phases["factor_compute"], phases["factor_comm"] = self._hooks.take_seconds()
        adaptive = self.adaptive_damping
        if adaptive is not None and loss is not None:
            with self._spans.timed(phases, "precondition", "precondition", "adaptive damping"):
                adaptive.observe(loss, self._layers)
        if self.steps % self.factor_update_steps == 0:
            self._layers = self._factor_update.run(
                self._layers,
                skipped=self.skipped,
                decay=self.factor_decay,
                step=self.steps,
                device=self._device(),
                phases=phases,
            )
        if self._decompositions_due():
            self._factor_update.sync(self._layers, self.steps, self._device(), phases)
            self._update_decompositions(phases)
        preconditioned = self._gradients.precondition(
            self._layers, self.damping, self.steps, phases
        )
        if adaptive is not None and loss is not None and preconditioned:
            # Before the write-back, which may overwrite the raw gradients' storage.
            raw = {layer.name: grad for layer, _, grad in preconditioned}
            adaptive.remember(self._layers, raw, self._curvature_scale())
        elif adaptive is not None:
            adaptive.forget()
        if preconditioned:
            self._gradients.clip_and_write(
                preconditioned, self.kl_clip, self.lr, self.steps, phases
            )
        self._written = gradient_marks(self._layers) if preconditioned else None
        self._end_step(phases)

    def _curvature_scale(self) -> float:
        """What turns the factors into the per-example Fisher of the mean loss (``G`` of the
        mean loss is the per-example one over the squared global batch)."""
        if self.g_normalization == "per-example":
            return 1.0
        return float(self._hooks.batch_rows * self.world_size) ** 2

    def _decompositions_due(self) -> bool:
        """A decomposition step, or the first step after a load that left a rank without one."""
        if self._loaded:
            self._loaded = False
            self._needs_decomposition = agree_on_decomposition(
                self._needs_decomposition, self.world_size, self.group, self._device()
            )
        return self.steps % self.inv_update_steps == 0 or self._needs_decomposition

    def _update_decompositions(self, phases: dict[str, float]) -> None:
        """Decompose every factor where the assignment puts it, and send it where it is used."""
        work = self.assignment
        ready = [layer for layer in self._layers if layer.a_factor is not None]
        with self._spans.timed(phases, "decomposition", "decomposition", "decompositions"):
            # Each broadcast starts as soon as its owner has made it, beside the later ones.
            decompose = partial(self._decompose, damping=self.damping)
            pending = work.decompose(ready, decompose, self._device())
        if pending:
            with self._spans.timed(phases, "decomposition_comm", "comm", "decomposition broadcast"):
                for broadcast in pending:
                    broadcast.wait()
        self._needs_decomposition = False

    def _decompose(self, layer: KFACLayer, which: str, damping: float) -> None:
        failure = layer.decompose(which, damping)
        if failure is not None:
            warnings.warn(
                f"K-FAC: factor {which} of layer {layer.name} at step {self.steps}: {failure}",
                KFACWarning,
                # Through WorkAssignment.decompose, _update_decompositions and step to the
                # caller of step.
                stacklevel=5,
            )

    def _end_step(self, phases: dict[str, float]) -> None:
        for layer in self._layers:
            layer.reset_batch()
        self._comm.forget_ready_order()
        self.last_phase_s = phases
        # Only the latest step's spans are kept, so memory stays bounded when nobody asks.
        self._spans.end_step()
        self.steps += 1
        self._plan_factor_step()

    def _plan_factor_step(self) -> None:
        """Tell the factor communication whether this step's factors stay on this rank (under
        ``factor_sync="at-decomposition"``: a step that does not decompose, or any step while
        running averages wait to be averaged), and whether pipelining is of use at all (only
        when every factor step decomposes)."""
        held = self.factor_sync is FactorSync.AT_DECOMPOSITION
        # A bad interval is refused by the next step's check; it must not divide by zero here.
        inv = max(self.inv_update_steps, 1)
        self._comm.holding = held and (self._factor_update.pending or self.steps % inv != 0)
        self._comm.pipeline_wanted = not self.factor_sync.holds(self.factor_update_steps, inv)

    def sync_factors(self) -> None:
        """Average the running averages across ranks now, if some hold this rank's factors
        only (``factor_sync="at-decomposition"`` between decompositions); a collective, so every
        rank calls it. Call it before one rank saves :meth:`state_dict` between decomposition
        steps, so the checkpoint holds every rank's factors."""
        phases = dict.fromkeys(PHASES, 0.0)
        self._factor_update.sync(self._layers, self.steps, self._device(), phases)
        self._plan_factor_step()

    def _device(self) -> torch.device:
        return self._layers[0].helper.weight.device

    # -- timeline -----------------------------------------------------------------------

    def take_events(self, process: str = "rank 0", origin_s: float = 0.0) -> list[Event]:
        """The latest step's timed spans (its hooks, collectives, decompositions) and any
        since, as timeline events; each span is returned once.

        Times are ``time.perf_counter()`` values minus ``origin_s``. The hook spans land on the
        ``factor`` lane, collectives on ``kfac comm``, the rest on their own category's lane.

        Args:
            process: The timeline process the events belong to.
            origin_s: Subtracted from every time.
        """
        return self._spans.events(process, origin_s)

    # -- state --------------------------------------------------------------------------

    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """Step count, plain hyperparameters, and per layer its factors and decompositions.

        Between decomposition steps under ``factor_sync="at-decomposition"`` the running
        averages are this rank's own; :meth:`sync_factors` on every rank first makes them
        everyone's (a resumed run averages what its ranks loaded before it decomposes).

        Args:
            include_factors: Keep the layers' factors and decompositions (kfac-pytorch's
                option). Without them the checkpoint is small, but a resumed run
                preconditions nothing until its next factor and decomposition steps.
        """
        given = {key: getattr(self, f"_{key}") for key in PLAIN_HYPERPARAMETERS}
        state = save_state(self.steps, given, self._layers, include_factors)
        if self.adaptive_damping is not None:
            state["adaptive_damping"] = self.adaptive_damping.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any], compute_inverses: bool = True) -> None:
        """Restore :meth:`state_dict`.

        Args:
            state: What :meth:`state_dict` returned (on any rank of the same run).
            compute_inverses: Decompose the loaded factors again at the next step wherever a
                gradient worker lacks a saved decomposition (kfac-pytorch's option). False
                waits for the next scheduled decomposition step instead.
        """
        self.steps = int(state["steps"])
        for key in PLAIN_HYPERPARAMETERS:
            if key in state:
                setattr(self, f"_{key}", state[key])
        device = self._device()
        if self.adaptive_damping is not None and "adaptive_damping" in state:
            self.adaptive_damping.load_state_dict(state["adaptive_damping"], device)
        elif self.adaptive_damping is not None and "damping" in state:
            self.adaptive_damping.damping = float(state["damping"])  # a fixed-damping run's
        if load_state(state, self._layers, self.assignment, device, compute_inverses):
            self._needs_decomposition = True
        self._loaded = True
        # Ranks may have loaded different running averages: average them before decomposing.
        self._factor_update.pending = self.factor_sync is FactorSync.AT_DECOMPOSITION
        self._plan_factor_step()

    def memory_usage(self) -> dict[str, int]:
        """Bytes this rank holds for K-FAC, by kind, as kfac-pytorch reports them.

        Returns:
            ``a_factors``, ``g_factors`` (running averages), ``a_batch``, ``g_batch`` (this
            step's sums), ``a_inverses``, ``g_inverses`` (decompositions) and ``total``.
        """
        return memory_usage(self._layers)

    def reset_batch(self) -> None:
        """Forget the factors summed since the last step (kfac-pytorch's ``reset_batch``)."""
        for layer in self._layers:
            layer.reset_batch()

    def __repr__(self) -> str:
        settings = {
            "layers": len(self._layers),
            "steps": self.steps,
            **{key: getattr(self, f"_{key}") for key in PLAIN_HYPERPARAMETERS},
            "accumulation_steps": self.accumulation_steps,
            "compute_method": self.compute_method,
            "grad_worker_fraction": self.grad_worker_fraction,
            "placement": self.placement,
            "factor_comm": self.factor_comm,
            "factor_sync": self.factor_sync,
            "bucket_cap_mb": self.bucket_bytes / 2**20,
            "symmetry_aware": self.symmetry_aware,
            "grad_scaler": self._grad_scale is not None,
            "factor_dtype": self.factor_dtype,
            "inv_dtype": self.inv_dtype,
            "damping_adaptation": "fixed"
            if self.adaptive_damping is None
            else self.adaptive_damping.settings,
        }
        lines = "".join(f"  {key}={value!r},\n" for key, value in sorted(settings.items()))
        return f"{type(self).__name__}(\n{lines})"

    def remove_hooks(self) -> None:
        """Detach K-FAC from the model (its modules' hooks); the preconditioner is then inert."""
        for layer in self._layers:
            layer.remove_hooks()

    def __iter__(self) -> Iterator[str]:
        return iter(layer.name for layer in self._layers)
