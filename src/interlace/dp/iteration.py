"""What DataParallel measures: the backward passes profiled before planning, and timelines."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from interlace.timeline import Timeline

#: One finished all-reduce: (bucket index, channel, bytes, launch time, completion time).
CommEvent = tuple[int, int, int, float, float]


class ProfiledPasses:
    """Forward, backward and per-tensor ready times of the backward passes measured so far."""

    def __init__(self) -> None:
        self.forward_s: list[float] = []
        self.backward_s: list[float] = []
        self.ready_s: list[list[float]] = []

    def __len__(self) -> int:
        return len(self.ready_s)

    def add(self, forward_s: float, backward_s: float, ready_s: Sequence[float]) -> None:
        """Keep one pass.

        Args:
            forward_s: its forward, in seconds.
            backward_s: its backward, in seconds.
            ready_s: each tensor's ready time, seconds from the start of backward.
        """
        self.forward_s.append(forward_s)
        self.backward_s.append(backward_s)
        self.ready_s.append(list(ready_s))

    def medians(self) -> list[float]:
        """The median forward, the median backward, then each tensor's median ready time."""
        count = len(self.ready_s[0])
        return [
            statistics.median(self.forward_s),
            statistics.median(self.backward_s),
            *[statistics.median(step[i] for step in self.ready_s) for i in range(count)],
        ]

    def clear(self) -> None:
        """Forget every pass."""
        self.forward_s.clear()
        self.backward_s.clear()
        self.ready_s.clear()


def iteration_timeline(
    title: str,
    names: Sequence[str],
    *,
    forward_start: float,
    forward_s: float,
    backward_start: float,
    backward_end: float,
    ready_s: Sequence[float],
    comm_events: Sequence[CommEvent],
    channels: int,
) -> Timeline:
    """One iteration's forward, per-tensor backward and per-bucket all-reduces as a timeline.

    A bar of an all-reduce runs from when it could start (launched, and the one before it on the
    same channel done) to its completion: time queued behind earlier all-reduces is not drawn,
    so a lane reads as a channel's busy periods.

    Args:
        title: the timeline's title.
        names: the tensors' names, in registration order.
        forward_start: ``time.perf_counter()`` at the start of the forward: the time origin.
        forward_s: the forward's length.
        backward_start: when backward started (``perf_counter`` seconds).
        backward_end: when backward ended.
        ready_s: when each tensor's gradient was ready (``perf_counter`` seconds).
        comm_events: the all-reduces that finished.
        channels: the channels in use (one lane each when more than one).
    """
    timeline = Timeline(title=title)
    origin = forward_start
    timeline.add("forward", "forward", 0.0, forward_s, lane="compute")
    previous = backward_start
    for index in sorted(range(len(names)), key=lambda i: ready_s[i]):
        ready = ready_s[index]
        if ready < backward_start:
            continue
        timeline.add(names[index], "backward", previous - origin, ready - origin, lane="compute")
        previous = ready
    channel_free: dict[int, float] = {}
    for bucket, channel, nbytes, launched, done in sorted(comm_events):
        start = max(launched, channel_free.get(channel, 0.0))
        channel_free[channel] = max(done, start)
        timeline.add(
            f"bucket {bucket} ({nbytes / 1e6:.2f} MB)",
            "comm",
            start - origin,
            channel_free[channel] - origin,
            lane="all-reduce" if channels == 1 else f"all-reduce ch{channel}",
            bytes=nbytes,
            channel=channel,
            launched_ms=round((launched - origin) * 1e3, 3),
        )
    if backward_end > previous:
        timeline.add(
            "backward (rest)",
            "backward",
            previous - origin,
            backward_end - origin,
            lane="compute",
        )
    return timeline
