"""What DataParallel measures: the backward passes profiled before planning, and timelines."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from interlace.clock import Mark, StreamClock
from interlace.timeline import Timeline

#: One finished all-reduce: (bucket index, channel, bytes, launch time, completion time).
CommRecord = tuple[int, int, int, float, float]


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


class DevicePass:
    """One profiled pass timed on a GPU's stream: marks where the host would read its clock.

    The host runs ahead of the kernels it queues, so on a GPU a gradient hook's host time says
    when the gradient was queued; the mark recorded there says when the device produced it.

    Args:
        clock: The device's clock.
        count: The tensors whose ready times are marked.
    """

    def __init__(self, clock: StreamClock, count: int) -> None:
        self.clock = clock
        self.forward_start = clock.mark()
        self.forward_end: Mark | None = None
        self.backward_start: Mark | None = None
        self.backward_end: Mark | None = None
        self.ready: list[Mark | None] = [None] * count

    def forward_ended(self) -> None:
        """Mark the end of the forward."""
        self.forward_end = self.clock.mark()

    def backward_started(self) -> None:
        """Mark the start of backward (the first call counts)."""
        if self.backward_start is None:
            self.backward_start = self.clock.mark()

    def tensor_ready(self, index: int) -> None:
        """Mark tensor ``index``'s gradient as ready.

        Args:
            index: The tensor's index.
        """
        self.ready[index] = self.clock.mark()
        self.backward_started()

    def backward_ended(self) -> None:
        """Mark the end of backward."""
        self.backward_end = self.clock.mark()

    def seconds(self) -> tuple[float, float, list[float]]:
        """The forward, the backward and each tensor's ready time from the start of backward,
        in device seconds (a tensor whose gradient never came counts as ready at the end: its
        bucket goes out only when backward is over)."""
        forward_end = self.forward_end or self.forward_start
        start = self.backward_start or forward_end
        end = self.backward_end or start
        backward_s = self.clock.seconds(start, end)
        ready = [
            backward_s if mark is None else self.clock.seconds(start, mark) for mark in self.ready
        ]
        return self.clock.seconds(self.forward_start, forward_end), backward_s, ready


def iteration_timeline(
    title: str,
    names: Sequence[str],
    *,
    forward_start: float,
    forward_s: float,
    backward_start: float,
    backward_end: float,
    ready_s: Sequence[float],
    comm_events: Sequence[CommRecord],
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
