"""The checks of ``KFAC``'s constructor options and hyperparameters, made before it touches the
model (and, for callables, at every step)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from interlace.checks import is_real
from interlace.errors import UsageError
from interlace.kfac.decomp import COMPUTE_METHODS
from interlace.kfac.factor_comm import FACTOR_COMMS
from interlace.kfac.fusion import FUSIONS
from interlace.kfac.work_assignment import PLACEMENTS

__all__ = ["G_NORMALIZATIONS", "agreement_settings", "check_hyperparameters", "check_options"]

#: Values of ``KFAC(g_normalization=...)``: how ``G`` is scaled.
G_NORMALIZATIONS = ("kfac-pytorch", "per-example")


def check_options(
    *,
    factor_comm: str,
    fusion: str,
    profile_steps: int,
    g_normalization: str,
    placement: str,
    grad_worker_fraction: float | None,
    compute_method: str,
    accumulation_steps: int,
    bucket_cap_mb: float,
) -> None:
    """Refuse impossible constructor options, in a fixed order (see ``interlace.KFAC``).

    Args:
        factor_comm: ``KFAC(factor_comm=)``.
        fusion: ``KFAC(fusion=)``.
        profile_steps: ``KFAC(profile_steps=)``.
        g_normalization: ``KFAC(g_normalization=)``.
        placement: ``KFAC(placement=)``.
        grad_worker_fraction: ``KFAC(grad_worker_fraction=)``.
        compute_method: ``KFAC(compute_method=)``.
        accumulation_steps: ``KFAC(accumulation_steps=)``.
        bucket_cap_mb: ``KFAC(bucket_cap_mb=)``.

    Raises:
        UsageError: The first option that is out of range (a ``ValueError``).
    """
    _check_choice("factor_comm", factor_comm, FACTOR_COMMS)
    _check_choice("fusion", fusion, FUSIONS)
    _check_count("profile_steps", profile_steps)
    _check_choice("g_normalization", g_normalization, G_NORMALIZATIONS)
    _check_choice("placement", placement, PLACEMENTS)
    _check_choice("compute_method", compute_method, COMPUTE_METHODS)
    _check_count("accumulation_steps", accumulation_steps)
    if grad_worker_fraction is not None and not (
        is_real(grad_worker_fraction) and 0 < grad_worker_fraction <= 1
    ):
        raise UsageError(
            f"grad_worker_fraction must be a number in (0, 1] or None, got "
            f"{grad_worker_fraction!r}; use 1 for COMM-OPT, 1/world_size for MEM-OPT"
        )
    if not (is_real(bucket_cap_mb) and 0 < bucket_cap_mb < math.inf):
        raise UsageError(f"bucket_cap_mb must be > 0 and finite, got {bucket_cap_mb!r}")
    if placement == "lbp" and grad_worker_fraction is not None and grad_worker_fraction < 1:
        raise UsageError(
            "placement='lbp' needs grad_worker_fraction=1 (COMM-OPT): it broadcasts each "
            f"factor's decomposition to every rank, got grad_worker_fraction="
            f"{grad_worker_fraction}; use placement='greedy' for MEM-OPT or HYBRID"
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
        UsageError: The first bad value: a bool, a non-number, a non-finite number, a
            fractional step count, or one out of range.
    """
    at = f" (at step {step})"
    for name in _STEP_COUNTS:
        value = values[name]
        if not (is_real(value) and math.isfinite(value) and value == int(value) and value >= 1):
            raise UsageError(f"{name} must be an integer >= 1, got {value!r}{at}")
    for name, value in values.items():
        if name in _STEP_COUNTS or (name == "kl_clip" and value is None):
            continue
        if not (is_real(value) and math.isfinite(value)):
            hint = " (use kl_clip=None for no clip)" if name == "kl_clip" else ""
            raise UsageError(f"{name} must be a finite number, got {value!r}{hint}{at}")
    ranges = [
        (values["damping"] >= 0, "damping must be >= 0"),
        (0 <= values["factor_decay"] < 1, "factor_decay must be in [0, 1)"),
        (values["kl_clip"] is None or values["kl_clip"] > 0, "kl_clip must be > 0 or None"),
        (values["lr"] > 0, "lr must be > 0"),
    ]
    for ok, message in ranges:
        if not ok:
            raise UsageError(f"{message}{at}")


def agreement_settings(
    given: Mapping[str, Any], at_start: Mapping[str, Any], **options: Any
) -> dict[str, Any]:
    """``KFAC``'s settings as ranks compare them (see :mod:`interlace.comm.agree`).

    A hyperparameter given as a callable is compared by its value at step 0; a cost model by its
    value, or as measured at start-up (collectively) when not given.

    Args:
        given: The hyperparameters as given (numbers or callables).
        at_start: Their values at step 0.
        **options: The other settings; ``*_cost`` ones are cost models or None.
    """
    settings: dict[str, Any] = {
        key: f"{at_start[key]!r} at step 0 (a callable)" if callable(value) else value
        for key, value in given.items()
    }
    for key, value in options.items():
        is_cost = key.endswith("_cost")
        settings[key] = (
            ("measured at start-up" if value is None else repr(value)) if is_cost else value
        )
    return settings


def _check_count(name: str, value: object) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise UsageError(f"{name} must be an integer >= 1, got {value!r}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise UsageError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
