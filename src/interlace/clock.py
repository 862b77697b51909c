"""Marks on one device's timeline: CUDA events on a GPU, the host clock elsewhere.

On a GPU the host runs ahead of the kernels it launches, so a host timestamp says when work was
queued, not when it finished. An event recorded on the stream says when the device got there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Mark:
    """One point in time: a host ``perf_counter`` reading, or a recorded CUDA event.

    Args:
        host_s: ``time.perf_counter()`` when the mark was made.
        event: The CUDA event recorded on the current stream (None on a CPU).
    """

    host_s: float
    event: Any = None


class StreamClock:
    """Makes marks on ``device``'s timeline and measures the seconds between two of them.

    Args:
        device: The device whose work is timed; CUDA devices use events, others the host clock.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.uses_events = self.device.type == "cuda"

    def mark(self) -> Mark:
        """A mark at the current point of the device's current stream."""
        if not self.uses_events:
            return Mark(time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return Mark(time.perf_counter(), event)

    def seconds(self, start: Mark, end: Mark) -> float:
        """Seconds from ``start`` to ``end`` on the device (waits for ``end`` on a GPU).

        Args:
            start: The earlier mark.
            end: The later mark.
        """
        if start.event is None or end.event is None:
            return end.host_s - start.host_s
        end.event.synchronize()
        return float(start.event.elapsed_time(end.event)) / 1e3

    def describe(self) -> str:
        """What the clock reads, for a trace's notes."""
        if self.uses_events:
            return f"CUDA events on {torch.cuda.get_device_name(self.device)}"
        return "the host clock"
