"""The checks of ``KFAC``'s options and hyperparameters, each made in one place: before the
preconditioner touches the model (:func:`settle`, which ``interlace train`` runs before any rank
starts) and, for callables, at every step."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch

from interlace.checks import is_int, is_real
from interlace.errors import OptionError, Setting
from interlace.kfac.damping import LevenbergMarquardt, check_adaptation, damping_adaptation_from
from interlace.kfac.enums import FactorSync, coerce_choice
from interlace.kfac.factor_modes import FactorCommMode, factor_comm_from
from interlace.kfac.methods import DecompositionMethod, method_from
from interlace.kfac.placements import Placement, placement_from
from interlace.kfac.worker_groups import (
    asks_for_comm_opt,
    check_grad_worker_fraction,
    resolve_grad_worker_fraction,
)

__all__ = [
    "G_NORMALIZATIONS",
    "Settled",
    "agreement_settings",
    "check_hyperparameters",
    "check_placement",
    "grad_scale_function",
    "settle",
]

#: Values of ``KFAC(g_normalization=...)``: how ``G`` is scaled.
G_NORMALIZATIONS = ("kfac-pytorch", "per-example")


@dataclass(frozen=True)
class Settled:
    """``KFAC``'s options checked, as the runtime uses them (see :func:`settle`).

    Args:
        method: The decomposition method.
        placement: The placement.
        factor_comm: The factor-communication mode.
        grad_worker_fraction: Gradient workers per layer as a fraction of the world, resolved
            on the world size (None when no world size was given).
        bucket_cap_mb: The factor all-reduce bucket cap (0: one all-reduce per factor).
        accumulation_steps: Micro-batches per optimiser step.
        g_normalization: One of :data:`G_NORMALIZATIONS`.
        symmetry_aware: Bulk all-reduces send upper triangles.
        grad_scale: Reads the current loss scale (None: no AMP scaler).
        adaptation: The Levenberg-Marquardt rule's settings (None: fixed damping).
        skip_layers: The modules left out, as given.
        factor_sync: When factors are averaged across ranks.
    """

    method: DecompositionMethod
    placement: Placement
    factor_comm: FactorCommMode
    grad_worker_fraction: float | None
    bucket_cap_mb: float
    accumulation_steps: int
    g_normalization: str
    symmetry_aware: bool
    grad_scale: Callable[[], float] | None
    adaptation: LevenbergMarquardt | None
    skip_layers: tuple[str, ...]
    factor_sync: FactorSync = FactorSync.AT_DECOMPOSITION


def settle(
    *,
    world_size: int | None,
    factor_update_steps: Any,
    inv_update_steps: Any,
    damping: Any,
    factor_decay: Any,
    kl_clip: Any,
    lr: Any,
    accumulation_steps: int,
    compute_method: object,
    grad_worker_fraction: object,
    skip_layers: Iterable[str] | None,
    factor_dtype: torch.dtype | None,
    inv_dtype: torch.dtype,
    bucket_cap_mb: float,
    placement: object,
    factor_comm: object,
    g_normalization: str,
    symmetry_aware: bool,
    grad_scaler: object,
    damping_adaptation: object,
    factor_sync: object = FactorSync.AT_DECOMPOSITION,
) -> Settled:
    """Check ``KFAC``'s options (its keywords but the model and the process group) and give them
    in the form the runtime uses; what needs no model is refused here, before anything starts.

    Args:
        world_size: The ranks K-FAC runs on (None: not known yet; the gradient-worker fraction
            is then checked for range only).
        factor_update_steps: ``KFAC(factor_update_steps=)``, and so on for the rest.
        inv_update_steps: As ``KFAC``'s.
        damping: As ``KFAC``'s.
        factor_decay: As ``KFAC``'s.
        kl_clip: As ``KFAC``'s.
        lr: As ``KFAC``'s.
        accumulation_steps: As ``KFAC``'s.
        compute_method: As ``KFAC``'s.
        grad_worker_fraction: As ``KFAC``'s.
        skip_layers: As ``KFAC``'s.
        factor_dtype: As ``KFAC``'s.
        inv_dtype: As ``KFAC``'s.
        bucket_cap_mb: As ``KFAC``'s.
        placement: As ``KFAC``'s.
        factor_comm: As ``KFAC``'s.
        g_normalization: As ``KFAC``'s.
        symmetry_aware: As ``KFAC``'s.
        grad_scaler: As ``KFAC``'s.
        damping_adaptation: As ``KFAC``'s.
        factor_sync: As ``KFAC``'s.

    Raises:
        OptionError: The first option out of range, in the order of ``KFAC``'s signature's
            concerns: choices, counts and switches, then the hyperparameters (at step 0), then
            options that contradict each other.
    """
    method = method_from(compute_method)
    chosen_placement = placement_from(
        placement, ranks=world_size, comm_opt=asks_for_comm_opt(grad_worker_fraction)
    )
    mode = factor_comm_from(factor_comm)
    sync = coerce_choice(FactorSync, factor_sync, "factor_sync")
    if g_normalization not in G_NORMALIZATIONS:
        raise OptionError(
            "g_normalization",
            f"must be one of {', '.join(G_NORMALIZATIONS)}, got {g_normalization!r}",
        )
    _check_count("accumulation_steps", accumulation_steps)
    check_grad_worker_fraction(grad_worker_fraction)
    if not (is_real(bucket_cap_mb) and 0 <= bucket_cap_mb < math.inf):
        raise OptionError(
            "bucket_cap_mb",
            f"must be a finite number >= 0 (0: one all-reduce per factor), got {bucket_cap_mb!r}",
        )
    if not isinstance(symmetry_aware, bool):
        raise OptionError("symmetry_aware", f"must be True or False, got {symmetry_aware!r}")
    for name, dtype in (("factor_dtype", factor_dtype), ("inv_dtype", inv_dtype)):
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point) and not (
            dtype is None and name == "factor_dtype"
        ):
            raise OptionError(name, f"must be a floating-point torch dtype, got {dtype!r}")
    if isinstance(skip_layers, str):
        raise OptionError(
            "skip_layers", f"must be a collection of names, got the string {skip_layers!r}"
        )
    grad_scale = grad_scale_function(grad_scaler)
    given = {
        "factor_update_steps": factor_update_steps,
        "inv_update_steps": inv_update_steps,
        "damping": damping,
        "factor_decay": factor_decay,
        "kl_clip": kl_clip,
        "lr": lr,
    }
    check_hyperparameters(
        {key: value(0) if callable(value) else value for key, value in given.items()}, 0
    )
    adaptation = damping_adaptation_from(damping_adaptation)
    check_adaptation(adaptation, damping)
    check_placement(chosen_placement, grad_worker_fraction)
    return Settled(
        method=method,
        placement=chosen_placement,
        factor_comm=mode,
        grad_worker_fraction=None
        if world_size is None
        else resolve_grad_worker_fraction(grad_worker_fraction, world_size, stacklevel=3),
        bucket_cap_mb=float(bucket_cap_mb),
        accumulation_steps=accumulation_steps,
        g_normalization=g_normalization,
        symmetry_aware=symmetry_aware,
        grad_scale=grad_scale,
        adaptation=adaptation,
        skip_layers=() if skip_layers is None else tuple(skip_layers),
        factor_sync=sync,
    )


def check_placement(placement: Placement, grad_worker_fraction: object) -> None:
    """Refuse a placement that sends factor by factor (not colocated) unless every rank is a
    gradient worker: it sends each decomposition to every rank (or decomposes it on each).

    Args:
        placement: The placement.
        grad_worker_fraction: ``KFAC(grad_worker_fraction=)`` as given.

    Raises:
        OptionError: Naming the placement and the fraction to use instead.
    """
    if placement.colocated or asks_for_comm_opt(grad_worker_fraction):
        return
    raise OptionError(
        "placement",
        Setting("placement", placement.name),
        " needs ",
        Setting("grad_worker_fraction", 1),
        " (COMM-OPT): it broadcasts each factor's decomposition to every rank, got ",
        Setting("grad_worker_fraction", grad_worker_fraction),
        "; use ",
        Setting("placement", "greedy"),
        " for MEM-OPT or HYBRID",
    )


#: ``KFAC``'s hyperparameters that count steps (integers >= 1).
_STEP_COUNTS = ("factor_update_steps", "inv_update_steps")


def check_hyperparameters(values: Mapping[str, Any], step: int) -> None:
    """Refuse a hyperparameter value (given, or a callable's at ``step``) out of range.

    Args:
        values: ``factor_update_steps``, ``inv_update_steps``, ``damping``, ``factor_decay``,
            ``kl_clip`` and ``lr`` as numbers.
        step: The step they hold at, for the message.

    Raises:
        OptionError: The first bad value: a bool, a non-number, a non-finite number, a
            fractional step count, or one out of range.
    """
    at = f" (at step {step})"
    for name in _STEP_COUNTS:
        value = values[name]
        if not (is_real(value) and math.isfinite(value) and value == int(value) and value >= 1):
            raise OptionError(name, f"must be an integer >= 1, got {value!r}{at}")
    for name, value in values.items():
        if name in _STEP_COUNTS or (name == "kl_clip" and value is None):
            continue
        if not (is_real(value) and math.isfinite(value)):
            hint = " (use kl_clip=None for no clip)" if name == "kl_clip" else ""
            raise OptionError(name, f"must be a finite number, got {value!r}{hint}{at}")
    ranges = [
        ("damping", values["damping"] >= 0, "must be >= 0"),
        ("factor_decay", 0 <= values["factor_decay"] < 1, "must be in [0, 1)"),
        ("kl_clip", values["kl_clip"] is None or values["kl_clip"] > 0, "must be > 0 or None"),
        ("lr", values["lr"] >= 0, "must be >= 0"),  # 0: a warm-up's first step, no KL-clip
    ]
    for name, ok, problem in ranges:
        if not ok:
            raise OptionError(name, f"{problem}, got {values[name]!r}{at}")


def agreement_settings(
    given: Mapping[str, Any], at_start: Mapping[str, Any], **options: Any
) -> dict[str, Any]:
    """``KFAC``'s settings as ranks compare them (see :mod:`interlace.comm.agree`).

    A hyperparameter given as a callable is compared by its value at step 0. A policy object
    (a placement, a factor-communication mode) is compared by its name and each of its fields
    (a custom one that is no dataclass by its ``repr``); a cost model by its value, or as
    measured at start-up (collectively) when not given.

    Args:
        given: The hyperparameters as given (numbers or callables).
        at_start: Their values at step 0.
        **options: The other settings.
    """
    settings: dict[str, Any] = {
        key: f"{at_start[key]!r} at step 0 (a callable)" if callable(value) else value
        for key, value in given.items()
    }
    for key, value in options.items():
        if not hasattr(value, "name") or isinstance(value, str | torch.dtype):
            settings[key] = value
            continue
        settings[key] = value.name
        if not is_dataclass(value):
            settings[f"{key} settings"] = repr(value)
            continue
        for item in fields(value):
            inner = getattr(value, item.name)
            is_cost = item.name.endswith("_cost")
            settings[item.name] = (
                ("measured at start-up" if inner is None else repr(inner)) if is_cost else inner
            )
    return settings


def grad_scale_function(grad_scaler: object) -> Callable[[], float] | None:
    """How to read the current loss scale: ``GradScaler.get_scale`` or the callable itself.

    Args:
        grad_scaler: None, a ``torch.amp.GradScaler`` (anything with ``get_scale()``), or a
            callable returning the current scale.

    Raises:
        OptionError: Anything else.
    """
    if grad_scaler is None:
        return None
    get_scale = getattr(grad_scaler, "get_scale", None)
    if callable(get_scale):
        return lambda: float(get_scale())
    if callable(grad_scaler):
        scaler: Callable[[], Any] = grad_scaler
        return lambda: float(scaler())
    raise OptionError(
        "grad_scaler",
        f"must be a torch.amp.GradScaler or a callable returning the loss scale, got "
        f"{grad_scaler!r}",
    )


def _check_count(name: str, value: object) -> None:
    if not (is_int(value) and value >= 1):
        raise OptionError(name, f"must be an integer >= 1, got {value!r}")
