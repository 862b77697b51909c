"""The choices ``KFAC`` takes as enums: kfac-pytorch's, with its names, so its scripts switch
unchanged, and interlace's own (:class:`PlacementChoice`, :class:`FactorCommChoice`,
:class:`DampingAdaptation`, :class:`FactorSync`, :class:`LayerRule`, :class:`LayerKind`).

Each option accepts a member of these enums, its string (any case, ``-`` or ``_``), or a member
of kfac-pytorch's enum of the same name (``kfac.enums.ComputeMethod.EIGEN``).
"""

from __future__ import annotations

import enum
from typing import TypeVar

from interlace.errors import OptionError

__all__ = [
    "COMPUTE_METHODS",
    "AssignmentStrategy",
    "ComputeMethod",
    "DampingAdaptation",
    "DistributedStrategy",
    "FactorCommChoice",
    "FactorSync",
    "LayerKind",
    "LayerRule",
    "PlacementChoice",
    "coerce_choice",
]


class ComputeMethod(str, enum.Enum):
    """How factors are turned into a preconditioner: eigendecompositions or inverses."""

    EIGEN = "eigen"
    INVERSE = "inverse"


#: The :class:`ComputeMethod` values as strings, as the configs and cost models take them.
COMPUTE_METHODS: tuple[str, ...] = tuple(method.value for method in ComputeMethod)


class DistributedStrategy(str, enum.Enum):
    """Shortcuts for ``grad_worker_fraction`` (KAISA): 1, 1/2 or 1/world_size."""

    COMM_OPT = "comm-opt"
    HYBRID_OPT = "hybrid-opt"
    MEM_OPT = "mem-opt"


class AssignmentStrategy(str, enum.Enum):
    """What greedy placement balances: decomposition work (``n^3``) or memory (``n^2``)."""

    COMPUTE = "compute"
    MEMORY = "memory"


class PlacementChoice(str, enum.Enum):
    """The built-in placements of ``KFAC(placement=)`` (see :mod:`interlace.kfac.placements`);
    ``AUTO`` is LBP where it applies and greedy elsewhere
    (:func:`~interlace.kfac.placements.auto_placement`)."""

    AUTO = "auto"
    GREEDY = "greedy"
    ROUND_ROBIN = "round-robin"
    LBP = "lbp"


class FactorCommChoice(str, enum.Enum):
    """How ``KFAC(factor_comm=)`` averages factors (see :mod:`interlace.kfac.factor_modes`)."""

    BULK = "bulk"
    PIPELINED = "pipelined"


class FactorSync(str, enum.Enum):
    """When ``KFAC(factor_sync=)`` averages factors across ranks: at every factor update
    (kfac-pytorch, KAISA), or only when a decomposition needs them (each rank folds its own
    factors into its running averages in between; the average of those is the same running
    average, as it is linear in the factors)."""

    EVERY_UPDATE = "every-update"
    AT_DECOMPOSITION = "at-decomposition"

    def holds(self, factor_update_steps: int, inv_update_steps: int) -> bool:
        """Whether some factor steps keep their factors on each rank: averaged at decompositions
        only, and some factor steps do not decompose.

        Args:
            factor_update_steps: Steps between factor updates.
            inv_update_steps: Steps between decompositions.
        """
        every, inv = max(factor_update_steps, 1), max(inv_update_steps, 1)
        return self is FactorSync.AT_DECOMPOSITION and every % inv != 0


class DampingAdaptation(str, enum.Enum):
    """How the damping changes: fixed (kfac-pytorch), or by the Levenberg-Marquardt rule."""

    FIXED = "fixed"
    LEVENBERG_MARQUARDT = "levenberg-marquardt"


class LayerRule(str, enum.Enum):
    """Which modules ``KFAC(layer_rule=)`` preconditions (see docs/kfac.md, "Which layers are
    preconditioned").

    ``INTERLACE`` (``KFAC``'s default): every module with a trainable weight of a kind in
    :class:`LayerKind`, less the ``skip_layers`` matches (a module's name, an enclosing module's
    name or its class name, any case, or a regular expression found in the name or class
    name). ``KFAC_PYTORCH`` (``KFACPreconditioner``'s default): kfac-pytorch's rule, leaf
    ``Linear`` and ``Conv2d`` modules all of whose parameters are trainable, less those whose
    name in the model given or class name a ``skip_layers`` regular expression is found in
    (case-sensitive), plus the ``extra_layers`` kinds.
    """

    INTERLACE = "interlace"
    KFAC_PYTORCH = "kfac-pytorch"


class LayerKind(str, enum.Enum):
    """A kind of module K-FAC can precondition.

    kfac-pytorch's are ``LINEAR`` (``nn.Linear`` and subclasses) and ``CONV2D``; interlace adds
    ``CONV1D``, ``EMBEDDING`` (dense), ``TRANSFORMERS_CONV1D`` (``transformers``' ``Conv1D``,
    GPT-2's projection: a Linear with its weight stored transposed) and ``CUSTOM`` (a module
    whose ``kfac_helper()`` supplies its factors). Under ``layer_rule="kfac-pytorch"`` the added
    kinds are opt-in through ``extra_layers``.
    """

    LINEAR = "linear"
    CONV2D = "conv2d"
    CONV1D = "conv1d"
    EMBEDDING = "embedding"
    TRANSFORMERS_CONV1D = "transformers-conv1d"
    CUSTOM = "custom"


Choice = TypeVar(
    "Choice",
    ComputeMethod,
    DistributedStrategy,
    AssignmentStrategy,
    PlacementChoice,
    FactorCommChoice,
    FactorSync,
    DampingAdaptation,
    LayerRule,
    LayerKind,
)


def coerce_choice(kind: type[Choice], value: object, option: str) -> Choice:
    """``value`` as a member of ``kind``: a member, its string, or a foreign enum of that name.

    Args:
        kind: The enum (:class:`ComputeMethod`, ...).
        value: What the caller passed.
        option: The keyword, for the error.

    Raises:
        OptionError: A value that names no member.
    """
    if isinstance(value, kind):
        return value
    key: str | None = None
    if isinstance(value, enum.Enum) and type(value).__name__ == kind.__name__:
        key = value.name  # kfac-pytorch's enum of the same name: match by member name
    elif isinstance(value, str):
        key = value.strip().upper().replace("-", "_")
    if key is not None and key in kind.__members__:
        return kind.__members__[key]
    names = ", ".join(repr(member.value) for member in kind)
    raise OptionError(option, f"must be one of {names} (or {kind.__name__}.<NAME>), got {value!r}")
