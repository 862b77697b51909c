"""Work kept per trace: what a sweep (the planner at every worker count, every mode sharing a
placement) would otherwise price again on the same model."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from interlace.sim.trace import Trace

__all__ = ["kept"]

#: Work kept per trace (by identity: hashing a trace costs more than the work), the trace
#: itself held so that its identity stays its own; the last few traces only.
_KEPT: dict[int, tuple[Trace, dict[Hashable, Any]]] = {}
_KEEP_TRACES = 4


def kept(trace: Trace) -> dict[Hashable, Any]:
    """A memo for work on ``trace`` that a sweep repeats.

    Args:
        trace: The trace.
    """
    entry = _KEPT.get(id(trace))
    if entry is None or entry[0] is not trace:
        while len(_KEPT) >= _KEEP_TRACES:
            del _KEPT[next(iter(_KEPT))]
        entry = _KEPT[id(trace)] = (trace, {})
    return entry[1]
