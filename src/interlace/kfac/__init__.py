"""Distributed K-FAC (SC20 / KAISA, SPD-KFAC): :class:`KFAC` and the pieces it is built from.

``KFACPreconditioner`` is :class:`KFAC` under kfac-pytorch's name, and :mod:`interlace.kfac.enums`
holds its enums, so a kfac-pytorch script switches by changing its imports.
"""

from interlace.kfac.damping import LevenbergMarquardt
from interlace.kfac.enums import (
    AssignmentStrategy,
    ComputeMethod,
    DampingAdaptation,
    DistributedStrategy,
)
from interlace.kfac.preconditioner import KFAC, PHASES, KFACPreconditioner, KFACWarning

__all__ = [
    "KFAC",
    "PHASES",
    "AssignmentStrategy",
    "ComputeMethod",
    "DampingAdaptation",
    "DistributedStrategy",
    "KFACPreconditioner",
    "KFACWarning",
    "LevenbergMarquardt",
]
