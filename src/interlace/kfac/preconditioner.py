"""``interlace.KFAC``: the distributed K-FAC preconditioner (SC20 / KAISA), like kfac-pytorch's.

This module builds it from its options (the step, reports and checkpoints it runs are in
:mod:`~interlace.kfac.base_preconditioner`), and holds :class:`KFACPreconditioner`, which takes
kfac-pytorch's arguments.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from interlace.comm.agree import check_agreement
from interlace.comm.cost import CostModel
from interlace.comm.plan import Bucketing
from interlace.kfac.base_preconditioner import PHASES, BasePreconditioner
from interlace.kfac.compat import kfac_keywords
from interlace.kfac.costs import DecompositionCostModel
from interlace.kfac.damping import AdaptiveDamping, LevenbergMarquardt
from interlace.kfac.enums import (
    AssignmentStrategy,
    ComputeMethod,
    DampingAdaptation,
    DistributedStrategy,
    FactorCommChoice,
    FactorSync,
    LayerKind,
    LayerRule,
    PlacementChoice,
    coerce_choice,
)
from interlace.kfac.factor_comm import FactorComm
from interlace.kfac.factor_modes import FactorCommMode
from interlace.kfac.factor_update import FactorUpdate
from interlace.kfac.gradients import GradientPreconditioning
from interlace.kfac.hooks import FactorHooks, LayerForwardHook
from interlace.kfac.methods import DecompositionMethod
from interlace.kfac.options import Settled, agreement_settings, settle
from interlace.kfac.placements import Placement
from interlace.kfac.preconditioned_layer import GradientMark, describe_layers
from interlace.kfac.registration import check_layer_options, find_layers
from interlace.kfac.state import PLAIN_HYPERPARAMETERS
from interlace.kfac.timing import SpanLog
from interlace.kfac.warning import KFACWarning
from interlace.kfac.work_assignment import GroupRanks, WorkAssignment
from interlace.kfac.worker_groups import WorkerGroups

__all__ = ["KFAC", "PHASES", "KFACPreconditioner", "KFACWarning"]


#: A hyperparameter: a number, or a callable giving the number for a step count.
IntHyper = int | Callable[[int], int]
FloatHyper = float | Callable[[int], float]


_LOG = logging.getLogger("interlace.kfac")


class KFAC(BasePreconditioner):
    """Distributed K-FAC preconditioner (SC20 / KAISA, SPD-KFAC), with kfac-pytorch's step.

    ::

        model = interlace.DataParallel(net)         # or torch DDP, or no wrapper at all
        precond = interlace.KFAC(model, lr=lambda step: optimizer.param_groups[0]["lr"])
        loss_fn(model(x), y).backward()             # gradients averaged across ranks
        precond.step()                              # gradients preconditioned in place
        optimizer.step()

    Every ``factor_update_steps`` the hooks' factors are folded into the running averages,
    which are averaged across ranks when a decomposition needs them (``factor_sync``); every
    ``inv_update_steps`` each factor is decomposed where the placement
    puts it and sent to the layer's gradient workers, which precondition (and send the result on
    unless every rank is a worker); last, the KL-clip scales every preconditioned gradient by one
    factor. Linear, Conv1d and Conv2d (groups=1), dense Embedding and ``transformers``' Conv1D
    layers are preconditioned (interlace's rule, :attr:`layer_rule`; a weight two modules share,
    as tied embeddings are, is left to the optimizer, with the reason). ``G`` is
    normalised to the *global* batch, so W ranks give exactly the single-process result.
    kfac-pytorch's other arguments (``allreduce_bucket_cap_mb``, ``colocate_factors``, ...) are
    :class:`KFACPreconditioner`'s.

    Args:
        model: The model, or a DataParallel / DDP wrapper around it.
        factor_update_steps: Steps between factor updates (a number, or a callable of the step
            count, like the other hyperparameters below).
        inv_update_steps: Steps between decompositions.
        damping: Tikhonov damping (where ``damping_adaptation`` starts from).
        factor_decay: Weight of the old running average of each factor, in ``[0, 1)``.
        kl_clip: KL-clip bound, or None for no clip.
        lr: Learning rate, used only by the KL-clip; pass the optimiser's current rate when a
            schedule changes it.
        accumulation_steps: Micro-batches per optimiser step.
        compute_method: How factors become preconditioners: a
            :class:`~interlace.kfac.methods.DecompositionMethod` object, or a
            :class:`ComputeMethod` (or its string): ``"eigen"`` (inverse-free) or ``"inverse"``.
        grad_worker_fraction: Gradient workers per layer as a fraction of the world: 1
            (COMM-OPT), 1/world (MEM-OPT) or a fraction between (HYBRID), or a
            :class:`DistributedStrategy`; 0 is MEM-OPT and None 1, as in kfac-pytorch.
        skip_layers: Modules to leave to the optimiser, by their name in the model, any
            enclosing module's name, or their class name (case-insensitive).
        factor_dtype: dtype the factors are computed in (None: the layer's).
        inv_dtype: dtype the decompositions are computed and kept in.
        process_group: The group K-FAC runs on (None: the default group, if initialised).
        bucket_cap_mb: Largest bulk factor all-reduce (and ``"fixed"`` bucket), in MiB; 0: one
            all-reduce per factor.
        placement: Where decompositions are computed: a
            :class:`~interlace.kfac.placements.Placement` object, or a :class:`PlacementChoice`
            (or its string) at its defaults: ``"auto"`` (the default: ``"lbp"`` under COMM-OPT
            on 2 to 64 ranks, ``"greedy"`` otherwise), ``"greedy"`` (SC20 / KAISA),
            ``"round-robin"`` or ``"lbp"`` (SPD-KFAC, COMM-OPT only; ``LBP(decomposition_cost=...,
            broadcast_cost=...)`` to give its cost models, which it measures at start-up
            otherwise). ``KFAC.placement`` holds the one chosen. See
            :mod:`interlace.kfac.placements`.
        factor_comm: How factors are averaged across ranks: ``"pipelined"`` (SPD-KFAC, and
            kfac-pytorch's ``update_factors_in_hook=True``: each factor is all-reduced as soon
            as its hook computes it, and ``step()`` waits for them; ``Pipelined(fusion=...,
            profile_steps=..., factor_cost=...)`` for its buckets) or ``"bulk"`` (D-KFAC:
            ``step()`` all-reduces every factor in buckets); see
            :mod:`interlace.kfac.factor_modes`.
        g_normalization: ``"kfac-pytorch"`` (``G`` of the mean loss) or ``"per-example"``
            (``G`` scaled by the squared global batch: the per-example Fisher's factor, whose
            damping means the same thing at every batch size).
        symmetry_aware: Bulk factor all-reduces send each factor's upper triangle only
            (pipelined ones always do).
        grad_scaler: The AMP ``torch.amp.GradScaler`` (or a callable returning the loss scale),
            so that ``G`` is the unscaled loss's; None without AMP.
        factor_sync: When factors are averaged across ranks (a :class:`FactorSync` or its
            string): ``"at-decomposition"`` (the default: between decompositions each rank
            folds its own factors into its running averages, which are averaged, in bulk,
            only before a decomposition; the same running averages, as they are linear in
            the factors, for one all-reduce per decomposition instead of one per factor
            update; pipelining then runs only when every factor step decomposes) or
            ``"every-update"`` (kfac-pytorch's and KAISA's: every factor update is averaged).
            Between decompositions, adaptive damping scores steps with this rank's running
            averages.
        damping_adaptation: ``"levenberg-marquardt"`` (a :class:`DampingAdaptation`, its
            string, or :class:`~interlace.kfac.damping.LevenbergMarquardt` settings): the
            damping follows Martens & Grosse's rule, driven by the loss given to :meth:`step`
            (no loss: it stays as given, kfac-pytorch's behaviour); ``"fixed"``: kfac-pytorch's
            fixed (or scheduled) damping. See docs/kfac/damping.md.
    Raises:
        UsageError: For a bad option or hyperparameter (a ``ValueError``; an
            :class:`~interlace.errors.OptionError` naming it), or, on every rank instead of a
            hang later, for ranks that differ in settings or registered layers (see
            :func:`interlace.comm.agree.check_agreement`).
    """

    #: The level of the messages naming the registered layers and the placement
    #: (kfac-pytorch's ``loglevel``; :class:`KFACPreconditioner` takes it).
    loglevel: int = logging.DEBUG
    #: Which modules are preconditioned: interlace's rule (every :class:`LayerKind` with a
    #: trainable weight, less ``skip_layers``); :class:`KFACPreconditioner` takes it, and
    #: :attr:`extra_layers`, as keywords. See docs/kfac.md.
    layer_rule: LayerRule = LayerRule.INTERLACE
    #: The kinds added to kfac-pytorch's Linear and Conv2d under its rule.
    extra_layers: frozenset[LayerKind] = frozenset()

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
        compute_method: DecompositionMethod | ComputeMethod | str = ComputeMethod.EIGEN,
        grad_worker_fraction: DistributedStrategy | float | None = 1.0,
        skip_layers: Iterable[str] | None = (),
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        placement: Placement | PlacementChoice | str = PlacementChoice.AUTO,
        factor_comm: FactorCommMode | FactorCommChoice | str = FactorCommChoice.PIPELINED,
        g_normalization: str = "kfac-pytorch",
        symmetry_aware: bool = False,
        grad_scaler: Any = None,
        damping_adaptation: DampingAdaptation
        | str
        | LevenbergMarquardt = DampingAdaptation.LEVENBERG_MARQUARDT,
        factor_sync: FactorSync | str = FactorSync.AT_DECOMPOSITION,
    ) -> None:
        ranks = GroupRanks.of(process_group)
        options = settle(
            world_size=ranks.world_size,
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            damping=damping,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            lr=lr,
            accumulation_steps=accumulation_steps,
            compute_method=compute_method,
            grad_worker_fraction=grad_worker_fraction,
            skip_layers=skip_layers,
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            bucket_cap_mb=bucket_cap_mb,
            placement=placement,
            factor_comm=factor_comm,
            g_normalization=g_normalization,
            symmetry_aware=symmetry_aware,
            grad_scaler=grad_scaler,
            damping_adaptation=damping_adaptation,
            factor_sync=factor_sync,
        )
        self._grad_scale = options.grad_scale
        self.g_normalization = options.g_normalization
        self.symmetry_aware = options.symmetry_aware
        self._factor_update_steps = factor_update_steps
        self._inv_update_steps = inv_update_steps
        self._damping = damping
        self._factor_decay = factor_decay
        self._kl_clip = kl_clip
        self._lr = lr
        self.accumulation_steps = options.accumulation_steps
        #: The decomposition method, placement and factor-communication mode, as objects.
        self.compute_method: DecompositionMethod = options.method
        self.placement: Placement = options.placement
        self.factor_comm: FactorCommMode = options.factor_comm
        self.factor_sync: FactorSync = options.factor_sync
        self.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        # A cap of 0 (kfac-pytorch: no bucketing) gives every factor an all-reduce of its own.
        self.bucket_bytes = int(options.bucket_cap_mb * 1024 * 1024)
        self.steps = 0

        self.group, self.world_size, self.rank = ranks.group, ranks.world_size, ranks.rank
        assert options.grad_worker_fraction is not None  # settled on this world size
        self.worker_groups = WorkerGroups.for_fraction(
            options.grad_worker_fraction, self.world_size
        )
        self.grad_worker_fraction = self.worker_groups.workers / self.world_size

        #: Seconds spent in each of :data:`PHASES` by the last :meth:`step`.
        self.last_phase_s: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._spans = SpanLog()
        # The preconditioned gradients' (id, version) after the last step: equal at the next
        # step means no backward since, and the step would precondition them twice.
        self._written: list[GradientMark | None] | None = None
        self._needs_decomposition = False
        self._loaded = False

        #: Modules left to the optimiser, with the reason: ``{name: reason}``.
        self.skipped: dict[str, str]
        found = find_layers(
            model,
            options.skip_layers,
            self.compute_method,
            inv_dtype,
            rule=self.layer_rule,
            extra_layers=self.extra_layers,
        )
        self._layers, self.skipped = found.layers, found.skipped
        if ranks.distributed and self.world_size > 1:
            # Before the first collective: ranks that disagree here would hang, abort in gloo
            # or drift apart silently later.
            settings = agreement_settings(
                {key: getattr(self, f"_{key}") for key in PLAIN_HYPERPARAMETERS},
                self._hyperparameters(),
                skip_layers=sorted(
                    {name.lower() for name in options.skip_layers}
                    if self.layer_rule is LayerRule.INTERLACE
                    else set(options.skip_layers)
                ),
                layer_rule=self.layer_rule.value,
                extra_layers=sorted(kind.value for kind in self.extra_layers),
                accumulation_steps=self.accumulation_steps,
                compute_method=self.compute_method,
                grad_worker_fraction=self.grad_worker_fraction,
                factor_dtype=factor_dtype,
                inv_dtype=inv_dtype,
                bucket_cap_mb=options.bucket_cap_mb,
                placement=self.placement,
                symmetry_aware=self.symmetry_aware,
                grad_scaler=self._grad_scale is not None,
                factor_comm=self.factor_comm,
                factor_sync=self.factor_sync,
                g_normalization=self.g_normalization,
                damping_adaptation=repr(options.adaptation) if options.adaptation else "fixed",
            )
            check_agreement("K-FAC", settings, describe_layers(self._layers), self.group)
        # The order below is the order of the collectives each part issues at start-up.
        self.assignment = WorkAssignment(
            self._layers,
            placement=self.placement,
            worker_groups=self.worker_groups,
            method=self.compute_method,
            inv_dtype=inv_dtype,
            ranks=ranks,
            device=self._device(),
        )
        self._comm = FactorComm(
            self.factor_comm,
            ranks=ranks,
            bucket_bytes=self.bucket_bytes,
            accumulation_steps=self.accumulation_steps,
            spans=self._spans,
            symmetry_aware=self.symmetry_aware,
        )
        self.assignment.make_owner_groups()
        self._hooks = FactorHooks(
            self._comm,
            self._spans,
            collecting=self._collecting,
            layers=lambda: self._layers,
            factor_dtype=factor_dtype,
            world_size=self.world_size,
            per_example=self.g_normalization == "per-example",
            grad_scale=self._grad_scale,
        )
        for layer in self._layers:
            hook = LayerForwardHook(layer, self._hooks.forward)
            layer.handles.append(layer.helper.module.register_forward_hook(hook))
        self._factor_update = FactorUpdate(self._comm, self._spans, self.rank)
        self._plan_factor_step()
        self._gradients = GradientPreconditioning(self.assignment, self.worker_groups, self._spans)
        #: The Levenberg-Marquardt damping (None: the ``damping`` given, fixed or scheduled).
        self.adaptive_damping = (
            None
            if options.adaptation is None
            else AdaptiveDamping(
                options.adaptation, cast(float, damping), self.world_size, self.group
            )
        )
        for layer in self._layers:
            _LOG.log(
                self.loglevel,
                "K-FAC registered %s: A %d, G %d",
                layer.name,
                layer.helper.a_dim,
                layer.helper.g_dim,
            )
        _LOG.log(self.loglevel, "K-FAC layer assignment: %s", self.describe().splitlines()[0])
        self._report_layers(found.notes)

    def _report_layers(self, notes: list[str]) -> None:
        """Warn (on rank 0) of the modules left to the optimizer and of tied weights kept."""
        if self.rank != 0:
            return
        for note in notes:
            warnings.warn(f"K-FAC: {note}", KFACWarning, stacklevel=3)
        if self.skipped:
            listing = ", ".join(f"{name} ({why})" for name, why in self.skipped.items())
            warnings.warn(
                f"K-FAC preconditions {len(self._layers)} layer(s) and leaves "
                f"{len(self.skipped)} module(s) with parameters to the optimizer: {listing}",
                KFACWarning,
                stacklevel=3,
            )

    def describe(self) -> str:
        """:meth:`BasePreconditioner.describe`'s lines, then one per module left to the optimizer
        with its reason."""
        lines = [super().describe()]
        lines += [f"  left to the optimizer: {n} ({why})" for n, why in self.skipped.items()]
        return "\n".join(lines)

    @classmethod
    def check_options(cls, world_size: int | None = None, **keywords: Any) -> Settled:
        """Check keywords as the constructor does, with no model or process group yet (what
        ``interlace train`` runs before it starts any rank).

        Args:
            world_size: The ranks K-FAC will run on (None: not known; the gradient-worker
                fraction is then checked for range only).
            **keywords: The constructor's keywords (but ``model`` and ``process_group``); the
                rest take their defaults.

        Raises:
            OptionError: What the constructor would raise before touching the model.
            TypeError: A keyword the constructor does not take.
        """
        bound = inspect.signature(KFAC.__init__).bind(None, None, **keywords)
        bound.apply_defaults()
        given = {
            key: value
            for key, value in bound.arguments.items()
            if key not in ("self", "model", "process_group")
        }
        return settle(world_size=world_size, **given)


class KFACPreconditioner(KFAC):
    """kfac-pytorch's ``KFACPreconditioner``: :class:`KFAC` with kfac-pytorch's arguments, its
    fixed damping and its layer rule by default, so a script switched by its import behaves as
    before (the same layers, the same numbers).

    Takes every keyword of :class:`KFAC` and, besides, kfac-pytorch's own names and the flat
    spellings of settings :class:`KFAC` keeps in its policy objects (``interlace train``'s
    flags are these keywords); :func:`~interlace.kfac.compat.kfac_keywords` maps them.

    Args:
        model: The model, or a DataParallel / DDP wrapper around it.
        allreduce_bucket_cap_mb: kfac-pytorch's name for ``bucket_cap_mb`` (None: not given).
        assignment_strategy: What greedy placement balances: ``COMPUTE`` (``n^3``) or
            ``MEMORY`` (``n^2``), an :class:`AssignmentStrategy` or its string.
        colocate_factors: True keeps a layer's two factors on one rank (greedy, round-robin),
            False places them apart (LBP); None: as ``placement`` says.
        compute_eigenvalue_outer_product: kfac-pytorch's switch; results do not depend on it,
            but with ``eigen`` it needs colocated factors.
        update_factors_in_hook: True is ``factor_comm="pipelined"``, False ``"bulk"``; None:
            as ``factor_comm`` says.
        loglevel: The level of the messages naming the registered layers and the placement.
        fusion: The pipelined buckets (see :class:`~interlace.kfac.factor_modes.Pipelined`;
            None: its default).
        profile_steps: Factor steps profiled before ``"merged"`` plans (None: the default).
        factor_cost: The all-reduce cost model behind ``"merged"`` (None: fitted).
        tune_steps: Factor steps timed per candidate bucket plan and round of ``"merged"``'s
            trials; 0: the cost model's plan alone (None: the default).
        decomposition_cost: LBP's decomposition cost model (None: measured at start-up).
        broadcast_cost: LBP's broadcast cost model (None: measured at start-up).
        damping_adaptation: As :class:`KFAC`'s, ``"fixed"`` unless given.
        layer_rule: Which modules are preconditioned (a :class:`LayerRule` or its string):
            ``"kfac-pytorch"`` (the default: kfac-pytorch's rule, leaf Linear and Conv2d
            modules whose parameters are all trainable, less those whose name in the model
            given or class name a ``skip_layers`` regular expression is found in,
            case-sensitive) or ``"interlace"`` (:class:`KFAC`'s rule). A layer whose weight
            another registered layer shares is left to the optimizer either way.
        extra_layers: Kinds added to kfac-pytorch's rule, interlace's extension
            (:class:`LayerKind` members or their strings: ``"conv1d"``, ``"embedding"``,
            ``"transformers-conv1d"``, ``"custom"``); refused with ``"interlace"``, which
            has them all.
        **options: :class:`KFAC`'s other keyword arguments.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        allreduce_bucket_cap_mb: float | None = None,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        colocate_factors: bool | None = None,
        compute_eigenvalue_outer_product: bool = True,
        update_factors_in_hook: bool | None = None,
        loglevel: int = logging.DEBUG,
        fusion: Bucketing | str | None = None,
        profile_steps: int | None = None,
        factor_cost: CostModel | None = None,
        tune_steps: int | None = None,
        decomposition_cost: DecompositionCostModel | None = None,
        broadcast_cost: CostModel | None = None,
        damping_adaptation: DampingAdaptation | str | LevenbergMarquardt = DampingAdaptation.FIXED,
        layer_rule: LayerRule | str = LayerRule.KFAC_PYTORCH,
        extra_layers: Iterable[LayerKind | str] = (),
        **options: Any,
    ) -> None:
        self.loglevel = loglevel
        self.layer_rule, self.extra_layers = check_layer_options(
            layer_rule, extra_layers, options.get("skip_layers")
        )
        keywords = kfac_keywords(
            {**options, "damping_adaptation": damping_adaptation},
            allreduce_bucket_cap_mb=allreduce_bucket_cap_mb,
            assignment_strategy=assignment_strategy,
            colocate_factors=colocate_factors,
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
            update_factors_in_hook=update_factors_in_hook,
            fusion=fusion,
            profile_steps=profile_steps,
            factor_cost=factor_cost,
            tune_steps=tune_steps,
            decomposition_cost=decomposition_cost,
            broadcast_cost=broadcast_cost,
        )
        super().__init__(model, **keywords)
        #: kfac-pytorch's switches as given, for scripts that read them back.
        self.assignment_strategy = coerce_choice(
            AssignmentStrategy, assignment_strategy, "assignment_strategy"
        )
        self.compute_eigenvalue_outer_product = compute_eigenvalue_outer_product

    @classmethod
    def check_options(cls, world_size: int | None = None, **keywords: Any) -> Settled:
        """Check keywords as the constructor does, with no model or process group yet (what
        ``interlace train`` runs before it starts any rank).

        Args:
            world_size: The ranks K-FAC will run on (None: not known yet).
            **keywords: The constructor's keywords (but ``model`` and ``process_group``).

        Raises:
            OptionError: What the constructor would raise before touching the model.
            TypeError: A keyword neither this class nor :class:`KFAC` takes.
        """
        bound = inspect.signature(cls.__init__).bind(None, None, **keywords)
        bound.apply_defaults()
        given = dict(bound.arguments)
        options = given.pop("options")
        for key in ("self", "model", "loglevel"):
            given.pop(key)
        options["damping_adaptation"] = given.pop("damping_adaptation")
        check_layer_options(
            given.pop("layer_rule"), given.pop("extra_layers"), options.get("skip_layers")
        )
        return KFAC.check_options(world_size, **kfac_keywords(options, **given))
