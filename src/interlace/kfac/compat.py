"""kfac-pytorch's constructor arguments, translated into interlace's own settings.

``KFAC`` accepts every argument of kfac-pytorch's ``KFACPreconditioner`` with its meaning; this
module holds the translations, so that the preconditioner reads as K-FAC, not as a shim.
"""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Callable
from typing import Any

from interlace.errors import UsageError
from interlace.kfac.enums import AssignmentStrategy, DistributedStrategy, coerce_choice

__all__ = [
    "asks_for_comm_opt",
    "bucket_cap_from",
    "factor_comm_from",
    "grad_scale_function",
    "placement_from",
    "resolve_grad_worker_fraction",
]


def resolve_grad_worker_fraction(value: object, world_size: int) -> float:
    """``grad_worker_fraction`` as a fraction that gives whole, equal worker groups.

    kfac-pytorch's meanings: a :class:`DistributedStrategy` (COMM-OPT 1, HYBRID-OPT 1/2,
    MEM-OPT 1/world_size) or its string; a number in [0, 1], 0 meaning MEM-OPT, rounded to a
    whole number of workers per layer (with a warning when rounding changes it); None is 1.

    Args:
        value: What the caller passed.
        world_size: The ranks K-FAC runs on.

    Raises:
        UsageError: Out of [0, 1], not a number, or workers that do not divide the ranks.
    """
    if value is None:
        return 1.0
    if isinstance(value, str | enum.Enum):
        strategy = coerce_choice(DistributedStrategy, value, "grad_worker_fraction")
        workers = {
            DistributedStrategy.COMM_OPT: world_size,
            DistributedStrategy.HYBRID_OPT: max(1, round(world_size / 2)),
            DistributedStrategy.MEM_OPT: 1,
        }[strategy]
        if world_size % workers:
            raise UsageError(
                f"grad_worker_fraction={strategy.name} gives {workers} gradient workers, which "
                f"does not divide the {world_size} ranks; use COMM_OPT or MEM_OPT"
            )
        return workers / world_size
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and 0 <= value <= 1)
    ):
        raise UsageError(
            f"grad_worker_fraction must be a number in [0, 1] (0: MEM-OPT) or a "
            f"DistributedStrategy, got {value!r}"
        )
    if value == 0:
        return 1.0 / world_size
    workers = max(1, round(value * world_size))
    if world_size % workers:
        raise UsageError(
            f"grad_worker_fraction {value} gives {workers} gradient workers, which does not "
            f"divide the {world_size} ranks into equal groups; pick k/{world_size} with k "
            f"dividing {world_size}"
        )
    fraction = workers / world_size
    if not math.isclose(fraction, value, rel_tol=1e-6):
        warnings.warn(
            f"grad_worker_fraction {value} of {world_size} ranks is rounded to {workers} "
            f"gradient worker(s) per layer ({fraction:g})",
            UserWarning,
            stacklevel=3,
        )
    return fraction


def asks_for_comm_opt(value: object) -> bool:
    """Whether ``grad_worker_fraction`` asks for every rank as a gradient worker (COMM-OPT).

    Args:
        value: What the caller passed.
    """
    if value is None:
        return True
    if isinstance(value, str | enum.Enum):
        return coerce_choice(DistributedStrategy, value, "grad_worker_fraction") is (
            DistributedStrategy.COMM_OPT
        )
    return value == 1


def bucket_cap_from(bucket_cap_mb: float | None, allreduce_bucket_cap_mb: float | None) -> float:
    """The factor all-reduce bucket cap in MiB; 0 means one all-reduce per factor.

    Args:
        bucket_cap_mb: interlace's name for it.
        allreduce_bucket_cap_mb: kfac-pytorch's name for it.

    Raises:
        UsageError: Both given with different values, or a negative or non-finite cap.
    """
    if (
        allreduce_bucket_cap_mb is not None
        and bucket_cap_mb is not None
        and allreduce_bucket_cap_mb != bucket_cap_mb
    ):
        raise UsageError(
            "bucket_cap_mb and allreduce_bucket_cap_mb name the same setting; pass one"
        )
    cap = (
        allreduce_bucket_cap_mb
        if allreduce_bucket_cap_mb is not None
        else (25.0 if bucket_cap_mb is None else bucket_cap_mb)
    )
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not (0 <= cap < math.inf):
        raise UsageError(
            f"bucket_cap_mb must be a finite number >= 0 (0: one all-reduce per factor), "
            f"got {cap!r}"
        )
    return float(cap)


def factor_comm_from(factor_comm: str | None, update_factors_in_hook: bool | None) -> str:
    """``factor_comm`` from interlace's option or kfac-pytorch's ``update_factors_in_hook``.

    kfac-pytorch's ``update_factors_in_hook=True`` folds and all-reduces each factor from its
    module's hook, as ``factor_comm="pipelined"`` does; ``False`` does it all in ``step()``, as
    ``"bulk"`` does. Neither given: ``"pipelined"``, as kfac-pytorch's default.

    Args:
        factor_comm: ``"bulk"``, ``"pipelined"`` or None (not given).
        update_factors_in_hook: kfac-pytorch's switch, or None (not given).

    Raises:
        UsageError: The two given and contradicting each other.
    """
    if update_factors_in_hook is None:
        return "pipelined" if factor_comm is None else factor_comm
    if not isinstance(update_factors_in_hook, bool):
        raise UsageError(
            f"update_factors_in_hook must be True or False, got {update_factors_in_hook!r}"
        )
    implied = "pipelined" if update_factors_in_hook else "bulk"
    if factor_comm is not None and factor_comm != implied:
        raise UsageError(
            f"update_factors_in_hook={update_factors_in_hook} means factor_comm={implied!r}, "
            f"but factor_comm={factor_comm!r} was given; pass one of the two"
        )
    return implied


def placement_from(
    placement: str | None,
    assignment_strategy: object,
    colocate_factors: bool | None,
    compute_eigenvalue_outer_product: bool,
    eigen: bool,
) -> tuple[str, AssignmentStrategy]:
    """The placement and what greedy placement balances, from both libraries' options.

    Greedy and round-robin placement keep a layer's two factors on one rank (kfac-pytorch's
    ``colocate_factors=True``); LBP places each factor on its own (``colocate_factors=False``).

    Args:
        placement: ``"greedy"``, ``"round-robin"``, ``"lbp"`` or None (not given).
        assignment_strategy: kfac-pytorch's :class:`AssignmentStrategy` or its string.
        colocate_factors: kfac-pytorch's switch, or None (not given).
        compute_eigenvalue_outer_product: kfac-pytorch's switch (needs colocated factors).
        eigen: Whether the compute method is eigendecomposition.

    Raises:
        UsageError: Contradicting options, with what to write instead.
    """
    strategy = coerce_choice(AssignmentStrategy, assignment_strategy, "assignment_strategy")
    if colocate_factors is not None and not isinstance(colocate_factors, bool):
        raise UsageError(f"colocate_factors must be True or False, got {colocate_factors!r}")
    if colocate_factors is False and eigen and compute_eigenvalue_outer_product:
        raise UsageError(
            "colocate_factors must be True to use compute_eigenvalue_outer_product; pass "
            "compute_eigenvalue_outer_product=False with colocate_factors=False"
        )
    chosen = placement
    if colocate_factors is False:
        if chosen not in (None, "lbp"):
            raise UsageError(
                f"placement={chosen!r} keeps a layer's factors on one rank, but "
                "colocate_factors=False was given; use placement='lbp' to place them apart"
            )
        chosen = "lbp"
    elif colocate_factors is True and chosen == "lbp":
        raise UsageError(
            "placement='lbp' places each factor on its own, but colocate_factors=True was "
            "given; drop colocate_factors or use placement='greedy'"
        )
    chosen = chosen or "greedy"
    if strategy is AssignmentStrategy.MEMORY and chosen != "greedy":
        raise UsageError(
            f"assignment_strategy=MEMORY balances greedy placement, not placement={chosen!r}; "
            "use placement='greedy'"
        )
    return chosen, strategy


def grad_scale_function(grad_scaler: object) -> Callable[[], float] | None:
    """How to read the current loss scale: ``GradScaler.get_scale`` or the callable itself.

    Args:
        grad_scaler: None, a ``torch.amp.GradScaler`` (anything with ``get_scale()``), or a
            callable returning the current scale.

    Raises:
        UsageError: Anything else.
    """
    if grad_scaler is None:
        return None
    get_scale = getattr(grad_scaler, "get_scale", None)
    if callable(get_scale):
        return lambda: float(get_scale())
    if callable(grad_scaler):
        scaler: Callable[[], Any] = grad_scaler
        return lambda: float(scaler())
    raise UsageError(
        f"grad_scaler must be a torch.amp.GradScaler or a callable returning the loss scale, "
        f"got {grad_scaler!r}"
    )
