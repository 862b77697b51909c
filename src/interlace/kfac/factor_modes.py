"""How factors are averaged across ranks: ``KFAC(factor_comm=)``'s modes as objects.

:class:`Bulk` (D-KFAC: ``step()`` all-reduces every factor) and :class:`Pipelined` (SPD-KFAC:
each factor from its hook, in fused buckets, with the fusion's settings). The runtime's
:class:`~interlace.kfac.factor_comm.FactorComm` runs them and the simulator prices the same
objects; no torch here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from interlace.checks import is_int
from interlace.comm.plan import Bucketing
from interlace.errors import OptionError
from interlace.kfac.enums import FactorCommChoice, coerce_choice
from interlace.kfac.fusion import fusion_from

if TYPE_CHECKING:
    from interlace.comm.cost import CostModel

__all__ = ["Bulk", "FactorCommMode", "Pipelined", "factor_comm_from"]


@dataclass(frozen=True)
class Bulk:
    """D-KFAC: ``step()`` all-reduces every factor, in buckets of at most ``bucket_cap_mb``."""

    name: ClassVar[str] = "bulk"
    pipelined: ClassVar[bool] = False


@dataclass(frozen=True)
class Pipelined:
    """SPD-KFAC: each factor is all-reduced as soon as its hook computes it (kfac-pytorch's
    ``update_factors_in_hook=True``), in fused buckets, and ``step()`` waits for them.

    Args:
        fusion: The buckets, as DataParallel's :class:`~interlace.comm.plan.Bucketing` (or its
            string): ``MERGED`` (MG-WFBP's rule over measured factor times), ``PER_TENSOR``
            (``"none"``: one per factor) or ``FIXED`` (up to ``bucket_cap_mb`` in ready order);
            kept as the member.
        profile_steps: Factor steps profiled before ``"merged"`` plans its buckets.
        factor_cost: The all-reduce cost model behind ``"merged"``, the same on every rank
            (None: fitted on the factor group).
        tune_steps: Factor steps timed per candidate and round when ``"merged"`` tries its
            plan against coarser ones (the merge rule with larger start-ups) and keeps the
            fastest; 0: the cost model's plan alone.

    Raises:
        OptionError: An unknown fusion, or a step count below 1 (below 0 for ``tune_steps``).
    """

    fusion: Bucketing | str = Bucketing.MERGED
    profile_steps: int = 3
    factor_cost: CostModel | None = None
    tune_steps: int = 2
    name: ClassVar[str] = "pipelined"
    pipelined: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "fusion", fusion_from(self.fusion))
        if not (is_int(self.profile_steps) and self.profile_steps >= 1):
            raise OptionError(
                "profile_steps", f"must be an integer >= 1, got {self.profile_steps!r}"
            )
        if not (is_int(self.tune_steps) and self.tune_steps >= 0):
            raise OptionError(
                "tune_steps", f"must be an integer >= 0 (0: no trials), got {self.tune_steps!r}"
            )


#: A mode ``KFAC(factor_comm=)`` runs.
FactorCommMode = Bulk | Pipelined


def factor_comm_from(value: object, option: str = "factor_comm") -> FactorCommMode:
    """The mode ``value`` names: a :class:`Bulk` or :class:`Pipelined` as it is, or a
    :class:`~interlace.kfac.enums.FactorCommChoice` (or its string) at its defaults.

    Args:
        value: What the caller passed.
        option: The option's name, for the error.

    Raises:
        OptionError: A value that is neither.
    """
    if isinstance(value, Bulk | Pipelined):
        return value
    if isinstance(value, str | enum.Enum):
        chosen = coerce_choice(FactorCommChoice, value, option)
        return Pipelined() if chosen is FactorCommChoice.PIPELINED else Bulk()
    raise OptionError(
        option,
        f"must be 'bulk', 'pipelined', a FactorCommChoice, Bulk() or Pipelined(...), got {value!r}",
    )
