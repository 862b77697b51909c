"""Which factors share an all-reduce bucket: the bulk factor step's, and the pipelined ones
(SPD-KFAC's tensor fusion).

Pure functions of the factors' order, sizes and (``"merged"``) profiled ready times; the runtime
launches these buckets on the communication core's bucket engine and the simulator prices them.
"""

from __future__ import annotations

from collections.abc import Sequence

from interlace.comm.cost import CostModel
from interlace.comm.plan import Bucketing, ReadyTensor
from interlace.comm.planners import pack_by_cap, plan_merged
from interlace.comm.tuning import START_UP_SCALES, scale_start_up
from interlace.errors import OptionError

__all__ = [
    "FUSIONS",
    "FUSION_BUCKETINGS",
    "bulk_groups",
    "fusion_from",
    "make_groups",
    "merged_candidates",
    "merged_groups",
]

#: K-FAC's names of the pipelined buckets (``Pipelined(fusion=...)``, ``--kfac-fusion``).
FUSIONS = ("none", "fixed", "merged")
#: The bucketing each of :data:`FUSIONS` is: DataParallel's rule of the same meaning.
FUSION_BUCKETINGS: dict[str, Bucketing] = {
    "none": Bucketing.PER_TENSOR,
    "fixed": Bucketing.FIXED,
    "merged": Bucketing.MERGED,
}


def fusion_from(value: object, option: str = "fusion") -> Bucketing:
    """K-FAC's fusion as the :class:`~interlace.comm.plan.Bucketing` it is: one of
    :data:`FUSION_BUCKETINGS`' members, its string, or one of :data:`FUSIONS` (``"none"`` is
    ``Bucketing.PER_TENSOR``, a bucket per factor).

    Args:
        value: What the caller passed.
        option: The option's name, for the error.

    Raises:
        OptionError: Any other value (DataParallel's other bucketings included).
    """
    allowed = set(FUSION_BUCKETINGS.values())
    if isinstance(value, Bucketing) and value in allowed:
        return value
    if isinstance(value, str) and not isinstance(value, Bucketing):
        key = value.strip().lower()
        chosen = FUSION_BUCKETINGS.get(key)
        if chosen is None and key in {member.value for member in allowed}:
            chosen = Bucketing(key)
        if chosen is not None:
            return chosen
    raise OptionError(option, f"must be one of {', '.join(FUSIONS)}, got {value!r}")


def bulk_groups(sizes: Sequence[int], cap_bytes: float) -> list[list[int]]:
    """The buckets of the bulk factor all-reduce (``KFAC(bucket_cap_mb=)``), as indices into
    ``sizes``: :func:`~interlace.comm.planners.pack_by_cap` in the order given (the factor that
    reaches the cap joins its bucket); a cap of 0 is kfac-pytorch's "no bucketing", every factor
    on its own.

    Args:
        sizes: Each factor's bytes as sent, in the step's order (each layer's ``A``, then ``G``).
        cap_bytes: The bucket cap, bytes (0: no buckets).

    Raises:
        ValueError: For a negative cap.
    """
    if cap_bytes < 0:
        raise ValueError(f"the bulk factor bucket cap must be >= 0 bytes, got {cap_bytes}")
    if cap_bytes == 0:
        return [[index] for index in range(len(sizes))]
    return pack_by_cap(sizes, cap_bytes)


def merged_groups(
    sizes: Sequence[int], ready_s: Sequence[float], cost: CostModel
) -> list[list[int]]:
    """MG-WFBP's merged buckets for factors of ``sizes`` bytes ready at ``ready_s`` seconds.

    Ready times must be in ready order (non-decreasing); they are made so (a running maximum)
    because averaged profiles can be off by rounding, and the planner insists.

    Args:
        sizes: Each factor's bytes, in ready order.
        ready_s: Each factor's ready time, seconds.
        cost: The all-reduce cost model.
    """
    if len(sizes) != len(ready_s):
        raise ValueError(f"{len(sizes)} sizes but {len(ready_s)} ready times")
    tensors = []
    latest = 0.0
    for index, (size, ready) in enumerate(zip(sizes, ready_s, strict=True)):
        latest = max(latest, float(ready))
        tensors.append(ReadyTensor(f"factor {index}", max(int(size), 1), latest))
    return plan_merged(tensors, cost).groups


def merged_candidates(
    sizes: Sequence[int], ready_s: Sequence[float], cost: CostModel
) -> list[tuple[str, list[list[int]]]]:
    """The buckets ``"merged"`` tries, labelled: the cost model's own first, then the merge
    rule with the start-up :data:`~interlace.comm.tuning.START_UP_SCALES` times larger (fewer,
    larger buckets), each distinct plan once.

    The cost model prices the wire, not the host: every launch also takes the passes' time
    (packing, the collective's call, its thread), which coarser plans pay less often. Which
    wins is measured (``Pipelined(tune_steps=)``), as for ``DataParallel``'s buckets.

    Args:
        sizes: Each factor's bytes, in ready order.
        ready_s: Each factor's ready time, seconds.
        cost: The all-reduce cost model.
    """
    found = [("the cost model's plan", merged_groups(sizes, ready_s, cost))]
    for factor in START_UP_SCALES:
        groups = merged_groups(sizes, ready_s, scale_start_up(cost, factor))
        if all(groups != seen for _, seen in found):
            found.append((f"start-up x{factor:g}", groups))
    return found


def make_groups(
    fusion: Bucketing | str,
    sizes: Sequence[int],
    *,
    cap_bytes: float = 25 * 1024 * 1024,
    ready_s: Sequence[float] | None = None,
    cost: CostModel | None = None,
) -> list[list[int]]:
    """The buckets for ``fusion`` (see :func:`fusion_from`); ``MERGED`` needs times and cost.

    Args:
        fusion: ``Bucketing.PER_TENSOR`` (``"none"``), ``FIXED`` or ``MERGED``, or its string.
        sizes: Each factor's bytes, in ready order.
        cap_bytes: The bucket cap (``FIXED``: :func:`~interlace.comm.planners.pack_by_cap`).
        ready_s: Ready times (``MERGED``).
        cost: The all-reduce cost model (``MERGED``).

    Raises:
        OptionError: For another fusion.
        ValueError: For ``MERGED`` without ready times or a cost model.
    """
    chosen = fusion_from(fusion)
    if chosen is Bucketing.PER_TENSOR:
        return [[index] for index in range(len(sizes))]
    if chosen is Bucketing.FIXED:
        return pack_by_cap(sizes, cap_bytes)
    if ready_s is None or cost is None:
        raise ValueError("merged fusion needs the factors' ready times and a cost model")
    return merged_groups(sizes, ready_s, cost)
