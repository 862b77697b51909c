"""Time dilation: device time runs D times slower, emulated links D times slower, results / D.

See docs/emulate.md for why a dilated run stands for the undilated cluster.
"""

from __future__ import annotations

import math

from interlace.comm.cost import CostModel
from interlace.comm.links import parse_link
from interlace.errors import UsageError

#: The default dilation. At 4, the 10 GbE cluster of the shipped GoogLeNet K80 trace (4.63
#: Gbit/s per link fitted at 4 workers) becomes links of about 1.2-2.5 Gbit/s that a 2-core
#: machine moves with its cores mostly free, and the emulation's own CPU work stays small
#: next to the dilated device time.
DEFAULT_DILATION = 4.0


def check_dilation(dilation: float) -> float:
    """``dilation`` as a float, if it is a finite number > 0.

    Args:
        dilation: The factor by which device time is stretched.

    Raises:
        UsageError: For zero, a negative, or a non-finite value.
    """
    try:
        value = float(dilation)
    except (TypeError, ValueError):
        raise UsageError(f"dilation must be a number > 0, got {dilation!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"dilation must be a finite number > 0, got {dilation!r}")
    return value


def dilate_rate(rate: float | str, dilation: float) -> float:
    """The emulated link's rate in bits/s: the target's rate divided by ``dilation``.

    Args:
        rate: The target link's rate in bits/s, or a rate as ``--link`` writes it (``10gbit``).
        dilation: The dilation factor (:func:`check_dilation`).

    Raises:
        UsageError: For a bad rate or dilation.
    """
    bps = parse_link(rate) if isinstance(rate, str) else float(rate)
    if not (bps > 0):
        raise UsageError(f"a link rate must be > 0 bits/s, got {rate!r}")
    return bps / check_dilation(dilation)


def undilate(seconds: float, dilation: float) -> float:
    """A time measured on the dilated system, as the undilated cluster would take it.

    Args:
        seconds: The measured time.
        dilation: The dilation factor the run used (:func:`check_dilation`).
    """
    return seconds / check_dilation(dilation)


def undilate_cost(cost: CostModel, dilation: float) -> CostModel:
    """``cost`` fitted on the dilated cluster, as the undilated cluster's: ``a`` and ``b``
    divided by ``dilation`` (concurrency terms dropped: one channel).

    Args:
        cost: The fitted model.
        dilation: The run's dilation.
    """
    return CostModel(cost.a / dilation, cost.b / dilation)
