"""Phase timers and timeline spans recorded by the K-FAC preconditioner."""

from __future__ import annotations

import time
from types import TracebackType

from interlace.timeline import Event

__all__ = ["PhaseTimer", "SpanLog"]

#: One timed span: ``(name, category, start, end)``, times from ``time.perf_counter()``.
Span = tuple[str, str, float, float]


class SpanLog:
    """The spans of the current step and of the last finished one, for :meth:`events`."""

    def __init__(self) -> None:
        #: Spans recorded since the last :meth:`end_step`.
        self.current: list[Span] = []
        #: Spans of the step :meth:`end_step` closed last.
        self.last: list[Span] = []

    def add(self, name: str, category: str, start: float, end: float) -> None:
        """Record one span.

        Args:
            name: What ran, e.g. ``"A fc1"`` or ``"factor all-reduce"``.
            category: Its kind (``"factor"``, ``"comm"``, ``"decomposition"``, ...).
            start: ``time.perf_counter()`` when it started.
            end: ``time.perf_counter()`` when it ended.
        """
        self.current.append((name, category, start, end))

    def timed(self, phases: dict[str, float], phase: str, category: str, name: str) -> PhaseTimer:
        """A context manager that adds its block's wall time to ``phases[phase]`` and logs it.

        Args:
            phases: Seconds per phase, updated in place.
            phase: The phase the block counts towards.
            category: The span's category.
            name: The span's name.
        """
        return PhaseTimer(self, phases, phase, category, name)

    def end_step(self) -> None:
        """Keep only the step just finished (memory stays bounded when nobody asks)."""
        self.last, self.current = self.current, []

    def events(self, process: str, origin_s: float) -> list[Event]:
        """The last step's spans and any since, as timeline events; each span is given once.

        Args:
            process: The timeline process the events belong to.
            origin_s: Subtracted from every time.
        """
        events = [
            Event(
                name,
                category,
                start - origin_s,
                end - origin_s,
                lane="kfac comm" if category == "comm" else category,
                process=process,
            )
            for name, category, start, end in self.last + self.current
        ]
        self.last, self.current = [], []
        return events


class PhaseTimer:
    """Adds a block's wall time to one phase and records it as a span (see :meth:`SpanLog.timed`).

    Args:
        log: Where the span goes.
        phases: Seconds per phase, updated in place.
        phase: The phase the block counts towards.
        category: The span's category.
        name: The span's name.
    """

    def __init__(
        self, log: SpanLog, phases: dict[str, float], phase: str, category: str, name: str
    ) -> None:
        self.log, self.phases, self.phase = log, phases, phase
        self.category, self.name = category, name
        self.started = 0.0

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        ended = time.perf_counter()
        self.phases[self.phase] += ended - self.started
        self.log.add(self.name, self.category, self.started, ended)
