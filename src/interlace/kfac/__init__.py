"""Distributed K-FAC (SC20 / KAISA, SPD-KFAC): :class:`KFAC` and the pieces it is built from.

``KFACPreconditioner`` is :class:`KFAC` with kfac-pytorch's name and arguments, and
:mod:`interlace.kfac.enums` holds its enums, so a kfac-pytorch script switches by changing its
imports. The torch-backed names are imported on first use, so the simulator's torch-free
submodules load without torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from interlace.kfac.enums import (
    AssignmentStrategy,
    ComputeMethod,
    DampingAdaptation,
    DistributedStrategy,
    FactorSync,
)

if TYPE_CHECKING:
    from interlace.kfac.damping import LevenbergMarquardt
    from interlace.kfac.preconditioner import KFAC, PHASES, KFACPreconditioner, KFACWarning

__all__ = [
    "KFAC",
    "PHASES",
    "AssignmentStrategy",
    "ComputeMethod",
    "DampingAdaptation",
    "DistributedStrategy",
    "FactorSync",
    "KFACPreconditioner",
    "KFACWarning",
    "LevenbergMarquardt",
]

#: The module each torch-backed public name comes from.
_LAZY = {
    "KFAC": "interlace.kfac.preconditioner",
    "PHASES": "interlace.kfac.preconditioner",
    "KFACPreconditioner": "interlace.kfac.preconditioner",
    "KFACWarning": "interlace.kfac.preconditioner",
    "LevenbergMarquardt": "interlace.kfac.damping",
}


def __getattr__(name: str) -> Any:
    """A torch-backed public name, or a submodule (``kfac.preconditioner``, as kfac-pytorch's
    scripts write it), imported on first use.

    Args:
        name: The attribute asked for.
    """
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'interlace.kfac' has no attribute {name!r}")
    globals()[name] = value
    return value
