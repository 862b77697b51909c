"""The checks of ``KFAC``'s constructor options, made before it touches the model."""

from __future__ import annotations

from interlace.kfac.assignment import PLACEMENTS
from interlace.kfac.decomp import COMPUTE_METHODS
from interlace.kfac.factor_comm import FACTOR_COMMS
from interlace.kfac.fusion import FUSIONS

__all__ = ["G_NORMALIZATIONS", "check_options"]

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
        ValueError: The first option that is out of range.
    """
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
            f"g_normalization must be one of {', '.join(G_NORMALIZATIONS)}, got {g_normalization!r}"
        )
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
            f"compute_method must be one of {', '.join(COMPUTE_METHODS)}, got {compute_method!r}"
        )
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
