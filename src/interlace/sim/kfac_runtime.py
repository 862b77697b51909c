"""interlace's own K-FAC modes as simulator strategies: what ``KFAC(factor_comm=, placement=)``
does, stage by stage, for validating the simulator against the runtime; the modes and placements
are the runtime's own objects."""

from __future__ import annotations

from interlace.comm.plan import Bucketing
from interlace.errors import UsageError
from interlace.kfac.enums import PlacementChoice
from interlace.kfac.factor_modes import FactorCommMode, Pipelined, factor_comm_from
from interlace.kfac.fusion import fusion_from
from interlace.kfac.placements import Placement, placement_or_auto
from interlace.sim.kfac import KfacStrategy

__all__ = ["PRESENCE_BYTES_PER_LAYER", "RUNTIME_BULK_CAP_BYTES", "runtime_strategy"]


#: interlace's bulk factor all-reduce cap (``KFAC(bucket_cap_mb=25)``, MiB), in bytes.
RUNTIME_BULK_CAP_BYTES = 25 * 1024 * 1024
#: What ``step()``'s agreement on which layers have factors sends per layer before bulk factors:
#: three int32 flags (``FactorComm.agree_presence``).
PRESENCE_BYTES_PER_LAYER = 3 * 4


def runtime_strategy(
    name: str,
    factor_comm: FactorCommMode | str,
    placement: Placement | str,
    *,
    bucket_cap_bytes: int = RUNTIME_BULK_CAP_BYTES,
    symmetry_aware: bool = False,
) -> KfacStrategy:
    """interlace's ``KFAC(factor_comm=, placement=)`` (COMM-OPT) as a simulator strategy.

    What the runtime does, and so what the strategy models:

    * Factors are computed in the hooks in every mode: ``A`` after its layer's forward, ``G``
      before its layer's backward (the simulator's D-KFAC computes them after backward instead).
    * ``"bulk"``: once backward has returned with averaged gradients, ``step()`` all-reduces
      every factor in buckets of at most ``bucket_cap_bytes`` in layer order; whole ``n x n``
      factors unless ``symmetry_aware``.
    * ``Pipelined(fusion="merged")`` (``"pipelined"``): SPD-KFAC's buckets, as the simulator's
      ``spd``, on a process group of their own: a second queue beside the gradients', sharing
      the wire.
    * Decompositions and broadcasts: the placement object places, and the stage prices
      :func:`~interlace.kfac.placements.decomposition_program` as the runtime walks it. A
      colocated placement (greedy, round-robin) sends a layer's two decompositions in one
      broadcast on the world group as soon as its owner has made them, after the previous
      layer's; any other (LBP) sends each factor on its owner's group as soon as it is made
      and every receiver has posted it.

    Bulk factors follow the small all-reduce with which ``step()`` agrees which layers have
    factors (three int32 flags per layer). Host work beside the device's (folding factors into
    running averages) is priced only as the costs give it (:attr:`KfacCosts.host_hooks_s`,
    ``host_step_s``).

    Args:
        name: The strategy's name in rows.
        factor_comm: The runtime's mode object, or its name.
        placement: The runtime's placement object, or its name.
        bucket_cap_bytes: ``KFAC(bucket_cap_mb=)`` in bytes.
        symmetry_aware: ``KFAC(symmetry_aware=)``.

    Raises:
        UsageError: For a mode the simulator has no model of (pipelined factors in other than
            merged buckets) or an unknown name.
    """
    mode = factor_comm_from(factor_comm)
    chosen = placement_or_auto(placement)
    label = chosen.value if isinstance(chosen, PlacementChoice) else chosen.name
    if isinstance(mode, Pipelined) and fusion_from(mode.fusion) is not Bucketing.MERGED:
        raise UsageError(
            f"K-FAC with factor_comm={mode!r}: the simulator models bulk factors, or pipelined "
            "factors in merged buckets"
        )
    return KfacStrategy(
        name,
        mode.pipelined,
        chosen,
        f"interlace's KFAC(factor_comm={mode.name!r}, placement={label!r})",
        factors_in_passes=True,
        bulk_packed=symmetry_aware,
        bulk_cap_bytes=bucket_cap_bytes,
        factor_group=mode.pipelined,
        presence_bytes=0 if mode.pipelined else PRESENCE_BYTES_PER_LAYER,
    )
