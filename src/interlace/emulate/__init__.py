"""Emulated compute: a model built from a trace whose layers take device time, not cores.

With time dilation (:mod:`interlace.emulate.dilation`) it measures what a strategy does for a
traced GPU model on a target network, on a machine without that GPU. See docs/emulate.md. The
model's names (torch) are imported on first use, so ``--compute``'s parsing needs no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from interlace.emulate.compute import (
    Compute,
    ComputeKind,
    add_compute_arguments,
    compute_from_args,
    parse_compute,
)
from interlace.emulate.dilation import (
    DEFAULT_DILATION,
    check_dilation,
    dilate_rate,
    undilate,
    undilate_cost,
)

if TYPE_CHECKING:
    from interlace.emulate.model import (
        EmulatedLayer,
        EmulatedModel,
        EmulatedStep,
        EmulationCost,
        gradient_factor,
        measure_cost,
    )

__all__ = [
    "DEFAULT_DILATION",
    "Compute",
    "ComputeKind",
    "EmulatedLayer",
    "EmulatedModel",
    "EmulatedStep",
    "EmulationCost",
    "add_compute_arguments",
    "check_dilation",
    "compute_from_args",
    "dilate_rate",
    "gradient_factor",
    "measure_cost",
    "parse_compute",
    "undilate",
    "undilate_cost",
]

#: The public names of :mod:`interlace.emulate.model`, which imports torch.
_MODEL_NAMES = frozenset(
    {
        "EmulatedLayer",
        "EmulatedModel",
        "EmulatedStep",
        "EmulationCost",
        "gradient_factor",
        "measure_cost",
    }
)


def __getattr__(name: str) -> Any:
    """A name of :mod:`interlace.emulate.model`, imported on first use.

    Args:
        name: The attribute asked for.
    """
    if name not in _MODEL_NAMES:
        raise AttributeError(f"module 'interlace.emulate' has no attribute {name!r}")
    value = getattr(importlib.import_module("interlace.emulate.model"), name)
    globals()[name] = value
    return value
