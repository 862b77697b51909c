"""Traces retimed: the same tensors with other compute times (a faster device, totals measured
elsewhere, a forward set as a fraction of backward).
"""

from __future__ import annotations

import math
from dataclasses import replace

from interlace.errors import UsageError
from interlace.sim.trace import Trace


def scaled(trace: Trace, compute: float) -> Trace:
    """``trace`` with every compute time multiplied by ``compute`` (e.g. a faster device).

    Args:
        trace: The trace.
        compute: The factor, > 0.
    """
    if not compute > 0:
        raise ValueError(f"a compute scale must be > 0, got {compute}")
    return _rescaled(trace, compute, compute, trace.step_s * compute)


def with_totals(trace: Trace, forward_s: float, backward_s: float, step_s: float) -> Trace:
    """``trace`` with its forward, backward and step lasting the given totals.

    Each layer's forward and backward time is scaled with its pass, so the trace keeps its
    shape (which layer takes what share, when each tensor is ready) while its totals come from
    another measurement, e.g. one taken alongside the runs it is compared with.

    Args:
        trace: The trace.
        forward_s: The new forward total.
        backward_s: The new backward total.
        step_s: The new optimizer step.
    """
    if min(forward_s, backward_s, step_s) < 0:
        raise ValueError("totals must be >= 0")
    forward = forward_s / trace.forward_s if trace.forward_s > 0 else 1.0
    backward = backward_s / trace.backward_s if trace.backward_s > 0 else 1.0
    return _rescaled(trace, forward, backward, step_s)


def _rescaled(trace: Trace, forward: float, backward: float, step_s: float) -> Trace:
    """``trace`` with its forward times (each layer's and the total) multiplied by ``forward``,
    its backward times by ``backward``, and ``step_s`` as its step."""
    return replace(
        trace,
        tensors=tuple(
            replace(
                t,
                layer_forward_s=t.layer_forward_s * forward,
                layer_backward_s=t.layer_backward_s * backward,
            )
            for t in trace.tensors
        ),
        forward_s=trace.forward_s * forward,
        backward_s=trace.backward_s * backward,
        step_s=step_s,
    )


def with_forward_ratio(trace: Trace, ratio: float) -> Trace:
    """``trace`` with every layer's forward, and the whole forward, ``ratio`` times its backward.

    The MG-WFBP authors' simulator took the forward as half the backward (their logs time only
    backward); any trace can be set up so.

    Args:
        trace: The trace.
        ratio: Forward per backward, >= 0.

    Raises:
        UsageError: For a negative or non-finite ratio.
    """
    if not (math.isfinite(ratio) and ratio >= 0):
        raise UsageError(f"forward per backward must be a number >= 0, got {ratio}")
    return replace(
        trace,
        tensors=tuple(
            replace(t, layer_forward_s=t.layer_backward_s * ratio) for t in trace.tensors
        ),
        forward_s=trace.backward_s * ratio,
    )
