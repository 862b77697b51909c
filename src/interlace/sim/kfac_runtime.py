"""interlace's own K-FAC modes as simulator strategies: what ``KFAC(factor_comm=, fusion=,
placement=)`` does, stage by stage, for validating the simulator against the runtime."""

from __future__ import annotations

from interlace.errors import UsageError
from interlace.sim.kfac import KfacStrategy

__all__ = ["RUNTIME_BULK_CAP_BYTES", "runtime_strategy"]


#: interlace's bulk factor all-reduce cap (``KFAC(bucket_cap_mb=25)``, MiB), in bytes.
RUNTIME_BULK_CAP_BYTES = 25 * 1024 * 1024


def runtime_strategy(
    name: str,
    factor_comm: str,
    fusion: str,
    placement: str,
    *,
    bucket_cap_bytes: int = RUNTIME_BULK_CAP_BYTES,
    symmetry_aware: bool = False,
) -> KfacStrategy:
    """interlace's ``KFAC(factor_comm=, fusion=, placement=)`` (COMM-OPT) as a simulator strategy.

    What the runtime does, and so what the strategy models:

    * Factors are computed in the hooks in every mode: ``A`` after its layer's forward, ``G``
      before its layer's backward (the simulator's D-KFAC computes them after backward instead).
    * ``"bulk"``: once backward has returned with averaged gradients, ``step()`` all-reduces
      every factor in buckets of at most ``bucket_cap_bytes`` in layer order; whole ``n x n``
      factors unless ``symmetry_aware``.
    * ``"pipelined"`` with ``"merged"`` fusion: SPD-KFAC's buckets, as the simulator's ``spd``,
      on a process group of their own: a second queue beside the gradients', sharing the wire.
    * ``"greedy"``: an owner decomposes both of a layer's factors; the broadcasts (one per
      layer, on the world group) start once every decomposition is made and run one after
      another. ``"lbp"``: the simulator's LBP (each owner broadcasts on a group of its own as
      soon as a factor is made).

    Not modelled: the small all-reduce with which ``step()`` agrees which layers have factors
    (one start-up), and host work beside the device's (folding factors into running averages).

    Args:
        name: The strategy's name in rows.
        factor_comm: ``"bulk"`` or ``"pipelined"``.
        fusion: ``"none"`` (bulk) or ``"merged"`` (pipelined).
        placement: ``"greedy"`` or ``"lbp"``.
        bucket_cap_bytes: ``KFAC(bucket_cap_mb=)`` in bytes.
        symmetry_aware: ``KFAC(symmetry_aware=)``.

    Raises:
        UsageError: For a combination the simulator has no model of (``"round-robin"``
            placement, pipelined factors in other than merged buckets, unknown values).
    """
    settings = f"factor_comm={factor_comm!r}, fusion={fusion!r}, placement={placement!r}"
    if placement not in ("greedy", "lbp"):
        raise UsageError(
            f"K-FAC with {settings}: the simulator models greedy and lbp placement only"
        )
    if factor_comm == "pipelined" and fusion == "merged":
        pipelined = True
    elif factor_comm == "bulk":
        pipelined = False
    else:
        raise UsageError(
            f"K-FAC with {settings}: the simulator models bulk factors, or pipelined factors in "
            "merged buckets"
        )
    return KfacStrategy(
        name,
        pipelined,
        placement,
        f"interlace's KFAC({settings})",
        factors_in_passes=True,
        bulk_packed=symmetry_aware,
        bulk_cap_bytes=bucket_cap_bytes,
        broadcasts_after=placement == "greedy",
        factor_group=pipelined,
    )
