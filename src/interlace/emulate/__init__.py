"""Emulated compute: a model built from a trace whose layers take device time, not cores.

With time dilation (:mod:`interlace.emulate.dilation`) it measures what a strategy does for a
traced GPU model on a target network, on a machine without that GPU. See docs/emulate.md.
"""

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
