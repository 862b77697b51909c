"""Timed events of one or more training iterations, measured or simulated, and their pictures.

A :class:`Timeline` measures its events (busy, overlapping and exposed time on unions of
intervals), writes Chrome trace-event JSON and draws PNG Gantt charts (matplotlib, only then).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from interlace.gantt import draw_gantt

#: Every category an event may have; the chart's legend and colours follow this order.
CATEGORIES = (
    "forward",
    "backward",
    "comm",
    "factor",
    "decomposition",
    "precondition",
    "optimizer",
    "idle",
    "other",
)

#: The categories that count as computation in :meth:`Timeline.summary`: everything that keeps
#: the accelerator busy with the model or the optimiser and so can hide communication.
COMPUTE_CATEGORIES = (
    "forward",
    "backward",
    "factor",
    "decomposition",
    "precondition",
    "optimizer",
)

_US = 1e6  # Chrome traces count microseconds
_MS = 1e3


@dataclass(frozen=True)
class Event:
    """One timed piece of work: a layer's backward pass, one bucket's all-reduce, an optimiser step.

    Times are in seconds from any origin (``time.perf_counter()`` values, or seconds since the
    start of the iteration); only differences matter. ``lane`` is the chart row the event is drawn
    in and defaults to the category; ``process`` groups lanes (one per rank, or "simulated" next to
    "rank 0"). ``args`` are free-form details shown in Perfetto's detail pane.

    Args:
        name: what ran.
        category: one of :data:`CATEGORIES`.
        start_s: when it started, in seconds.
        end_s: when it ended (not before ``start_s``).
        lane: the chart row (default: the category).
        process: the group of lanes (default ``"rank 0"``).
        args: free-form details.

    Raises:
        ValueError: for an unknown category, times that are not finite, or an end before the start.
    """

    name: str
    category: str
    start_s: float
    end_s: float
    lane: str = ""
    process: str = "rank 0"
    # A dict is not hashable, so it is left out of the hash (events stay usable in sets).
    args: Mapping[str, object] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(
                f"event {self.name!r}: unknown category {self.category!r}; "
                f"allowed: {', '.join(CATEGORIES)}"
            )
        if not (math.isfinite(self.start_s) and math.isfinite(self.end_s)):
            raise ValueError(
                f"event {self.name!r}: times must be finite, got {self.start_s}..{self.end_s}"
            )
        if self.end_s < self.start_s:
            raise ValueError(
                f"event {self.name!r}: end_s {self.end_s} is before start_s {self.start_s}"
            )
        # Frozen dataclass: fill the defaults and take a private copy of args through
        # object.__setattr__, so a caller mutating its dict later cannot change the event.
        object.__setattr__(self, "start_s", float(self.start_s))
        object.__setattr__(self, "end_s", float(self.end_s))
        if not self.lane:
            object.__setattr__(self, "lane", self.category)
        object.__setattr__(self, "args", dict(self.args))

    @property
    def duration_s(self) -> float:
        """``end_s - start_s`` in seconds."""
        return self.end_s - self.start_s


class Timeline:
    """An ordered collection of :class:`Event` objects with measurements and renderings.

    Events are kept in the order they were added; that order decides the order of lanes and
    processes in the chart and in the trace, so add the lane that should come first first.

    Args:
        events: the first events.
        title: the chart's and the trace's title.
    """

    def __init__(self, events: Iterable[Event] = (), title: str = "") -> None:
        self.events: list[Event] = list(events)
        self.title = title

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        return f"Timeline({len(self.events)} events, title={self.title!r})"

    # ------------------------------------------------------------------ building

    def add(
        self,
        name: str,
        category: str,
        start_s: float,
        end_s: float,
        *,
        lane: str = "",
        process: str = "rank 0",
        **args: object,
    ) -> Event:
        """Append one event (keyword arguments beyond ``lane``/``process`` become its args).

        Args:
            name: what ran.
            category: one of :data:`CATEGORIES`.
            start_s: when it started, in seconds.
            end_s: when it ended.
            lane: the chart row (default: the category).
            process: the group of lanes.
            **args: free-form details.
        """
        event = Event(name, category, start_s, end_s, lane=lane, process=process, args=args)
        self.events.append(event)
        return event

    def extend(self, events: Iterable[Event]) -> None:
        """Append events, e.g. another rank's or a simulated schedule for comparison.

        Args:
            events: the events to append.
        """
        self.events.extend(events)

    def shifted(self, origin_s: float | None = None) -> Timeline:
        """A new timeline with every time measured from ``origin_s`` (default: earliest start).

        Measured events carry ``perf_counter`` times; shifting makes them read as "ms into the
        iteration".

        Args:
            origin_s: the new time zero.
        """
        if origin_s is None:
            origin_s = self._start_s()
        return Timeline(
            (
                dataclasses.replace(
                    event, start_s=event.start_s - origin_s, end_s=event.end_s - origin_s
                )
                for event in self.events
            ),
            self.title,
        )

    def window(self, start_s: float, end_s: float) -> Timeline:
        """A new timeline with the events that overlap ``[start_s, end_s)``, clipped to it.

        Used to cut one iteration out of a longer recording. An instantaneous event counts when
        ``start_s <= time < end_s``.

        Args:
            start_s: the window's start.
            end_s: its end (not before the start).
        """
        if end_s < start_s:
            raise ValueError(f"window end {end_s} is before its start {start_s}")
        kept: list[Event] = []
        for event in self.events:
            if event.duration_s == 0.0:
                inside = start_s <= event.start_s < end_s
            else:
                inside = event.start_s < end_s and event.end_s > start_s
            if inside:
                kept.append(
                    dataclasses.replace(
                        event,
                        start_s=max(event.start_s, start_s),
                        end_s=min(event.end_s, end_s),
                    )
                )
        return Timeline(kept, self.title)

    # ------------------------------------------------------------------ structure

    def lanes(self) -> list[tuple[str, str]]:
        """Every ``(process, lane)`` pair, in the order of first appearance."""
        return list(dict.fromkeys((event.process, event.lane) for event in self.events))

    def processes(self) -> list[str]:
        """Every process, in the order of first appearance."""
        return list(dict.fromkeys(event.process for event in self.events))

    def _rows(self) -> list[tuple[str, str]]:
        """Lanes grouped by process (processes, then lanes, in first-appearance order)."""
        lanes = self.lanes()
        return [pair for process in self.processes() for pair in lanes if pair[0] == process]

    # ------------------------------------------------------------------ measurements

    def busy_s(self, category: str | Iterable[str], process: str | None = None) -> float:
        """Seconds during which at least one event of ``category`` (one or several) was running.

        This is the length of the *union* of the intervals, not the sum of durations: two
        all-reduces in flight at once on two channels occupy the wire once.

        Args:
            category: a category or several.
            process: one process's events only (default: all).
        """
        return _length(self._union(category, process))

    def overlap_s(
        self,
        a: str | Iterable[str],
        b: str | Iterable[str],
        process: str | None = None,
    ) -> float:
        """Seconds during which both some event of ``a`` and some event of ``b`` were running.

        ``overlap_s(COMPUTE_CATEGORIES, "comm")`` is the communication hidden behind compute.

        Args:
            a: a category or several.
            b: a category or several.
            process: one process's events only (default: all).
        """
        return _length(_intersect(self._union(a, process), self._union(b, process)))

    def span_s(self, process: str | None = None) -> float:
        """From the earliest start to the latest end, in seconds (0 without events).

        Args:
            process: one process's events only (default: all).
        """
        events = [e for e in self.events if process is None or e.process == process]
        if not events:
            return 0.0
        return max(e.end_s for e in events) - min(e.start_s for e in events)

    def summary(self, process: str | None = None) -> dict[str, float]:
        """The headline numbers in seconds: how long, how much compute and communication, and
        how much of the communication was hidden behind compute.

        Keys: ``span_s``, ``compute_s`` (union of :data:`COMPUTE_CATEGORIES`), ``comm_s`` (union
        of ``comm``), ``hidden_comm_s`` (communication overlapping compute) and
        ``exposed_comm_s`` (the rest, which lengthens the iteration). ``process=None`` takes
        every process together; pass one (e.g. ``"rank 0"``) for per-rank numbers.

        Args:
            process: one process's events only (default: all).
        """
        comm_s = self.busy_s("comm", process)
        hidden_s = self.overlap_s(COMPUTE_CATEGORIES, "comm", process)
        return {
            "span_s": self.span_s(process),
            "compute_s": self.busy_s(COMPUTE_CATEGORIES, process),
            "comm_s": comm_s,
            "hidden_comm_s": hidden_s,
            # Rounding can leave hidden a hair above comm; exposed time is never negative.
            "exposed_comm_s": max(comm_s - hidden_s, 0.0),
        }

    def caption(self, process: str | None = None) -> str:
        """The summary as one line, e.g. ``"span 40.0 ms: compute 30.0 ms, communication
        22.0 ms, 12.0 ms hidden (55%), 10.0 ms exposed"``.

        Args:
            process: one process's events only (default: all).
        """
        stats = self.summary(process)
        text = (
            f"span {_ms(stats['span_s'])}: compute {_ms(stats['compute_s'])}, "
            if stats["span_s"] > 0
            else f"compute {_ms(stats['compute_s'])}, "
        )
        comm_s = stats["comm_s"]
        if comm_s <= 0:
            return text + "no communication"
        hidden_s = stats["hidden_comm_s"]
        share = round(100 * hidden_s / comm_s)
        return text + (
            f"communication {_ms(comm_s)}, {_ms(hidden_s)} hidden ({share}%), "
            f"{_ms(stats['exposed_comm_s'])} exposed"
        )

    def _start_s(self) -> float:
        return min((event.start_s for event in self.events), default=0.0)

    def _union(
        self, categories: str | Iterable[str], process: str | None
    ) -> list[tuple[float, float]]:
        wanted = _categories(categories)
        intervals = [
            (event.start_s, event.end_s)
            for event in self.events
            if event.category in wanted
            and (process is None or event.process == process)
            and event.end_s > event.start_s
        ]
        return _merge(intervals)

    # ------------------------------------------------------------------ Chrome trace

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write a Chrome trace-event JSON file (open it in https://ui.perfetto.dev).

        Each event becomes a complete (``"ph": "X"``) event with ``ts``/``dur`` in microseconds
        from the earliest event; each process a ``pid`` and each lane a ``tid``, named and ordered
        by metadata events so Perfetto shows them in the order they first appeared. Args that
        JSON cannot hold are written as their ``str()``. The original time origin and the title
        go in ``otherData`` so :meth:`from_chrome_trace` can restore absolute times.

        Args:
            path: the file to write.

        Returns:
            The path written.
        """
        path = Path(path)
        origin_s = self._start_s()
        pids = {process: index + 1 for index, process in enumerate(self.processes())}
        tids: dict[tuple[str, str], int] = {}
        trace: list[dict[str, Any]] = []
        for process, pid in pids.items():
            trace.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": process}})
            trace.append(
                {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}
            )
        # Thread ids are unique across processes so a lane is identified by its tid alone.
        for pair in self._rows():
            process, lane = pair
            tid = len(tids) + 1
            tids[pair] = tid
            order = sum(1 for other in tids if other[0] == process)
            trace.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pids[process],
                    "tid": tid,
                    "args": {"name": lane},
                }
            )
            trace.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": pids[process],
                    "tid": tid,
                    "args": {"sort_index": order},
                }
            )
        for event in self.events:
            trace.append(
                {
                    "name": event.name,
                    "cat": event.category,
                    "ph": "X",
                    "ts": (event.start_s - origin_s) * _US,
                    "dur": event.duration_s * _US,
                    "pid": pids[event.process],
                    "tid": tids[(event.process, event.lane)],
                    "args": _json_safe(event.args),
                }
            )
        document = {
            "traceEvents": trace,
            "displayTimeUnit": "ms",
            "otherData": {"title": self.title, "origin_s": origin_s},
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, allow_nan=False))
        return path

    @classmethod
    def from_chrome_trace(cls, path: str | Path) -> Timeline:
        """Read a trace written by :meth:`to_chrome_trace` back, or any trace's complete events.

        A file from :meth:`to_chrome_trace` comes back with the same names, categories, lanes,
        processes, args (as JSON holds them) and times (to well under a microsecond). Other
        traces (e.g. from ``torch.profiler``) are read as far as they fit: only ``"ph": "X"``
        events, unknown categories as ``"other"``, unnamed processes and threads as
        ``"pid N"``/``"tid N"``.

        Args:
            path: the trace file.
        """
        document = json.loads(Path(path).read_text())
        if isinstance(document, list):  # the bare-array form of the format
            document = {"traceEvents": document}
        raw: list[dict[str, Any]] = document.get("traceEvents", [])
        other: dict[str, Any] = document.get("otherData") or {}
        origin_s = float(other.get("origin_s", 0.0))
        process_names: dict[Any, str] = {}
        lane_names: dict[tuple[Any, Any], str] = {}
        for item in raw:
            if item.get("ph") != "M":
                continue
            name = str(item.get("args", {}).get("name", ""))
            if item.get("name") == "process_name":
                process_names[item.get("pid")] = name
            elif item.get("name") == "thread_name":
                lane_names[(item.get("pid"), item.get("tid"))] = name
        events: list[Event] = []
        for item in raw:
            if item.get("ph") != "X":
                continue
            pid, tid = item.get("pid"), item.get("tid")
            category = str(item.get("cat", "other"))
            start_s = origin_s + float(item["ts"]) / _US
            events.append(
                Event(
                    name=str(item.get("name", "")),
                    category=category if category in CATEGORIES else "other",
                    start_s=start_s,
                    end_s=start_s + float(item.get("dur", 0.0)) / _US,
                    lane=lane_names.get((pid, tid), f"tid {tid}"),
                    process=process_names.get(pid, f"pid {pid}"),
                    args=dict(item.get("args") or {}),
                )
            )
        return cls(events, str(other.get("title", "")))

    # ------------------------------------------------------------------ picture

    def to_png(self, path: str | Path, *, title: str | None = None, width_in: float = 12.0) -> Path:
        """Draw a Gantt chart: one row per lane, bars coloured by category, time in ms.

        Rows are labelled ``"process / lane"`` (just the lane when there is one process) and
        grouped by process. Under the title a caption gives :meth:`caption` (one line per
        process when there are several). Bars narrower than half a pixel are widened to half a
        pixel so that short events stay visible; bars wide enough for their name are labelled.
        ``title=None`` uses the timeline's own title, ``""`` draws none.

        An empty timeline still gives a valid PNG, saying "no events", so a run that recorded
        nothing leaves a picture that says so rather than failing at the end.

        Args:
            path: the file to write.
            title: the chart's title.
            width_in: the figure's width, in inches.

        Returns:
            The path written.
        """
        title = self.title if title is None else title
        processes = self.processes()
        if len(processes) > 1:
            caption = "\n".join(f"{process}: {self.caption(process)}" for process in processes)
        else:
            caption = self.caption()
        return draw_gantt(
            path,
            self.events,
            self._rows(),
            title=title,
            caption=caption,
            categories=[c for c in CATEGORIES if any(e.category == c for e in self.events)],
            origin_s=self._start_s() if self.events else 0.0,
            span_s=self.span_s(),
            width_in=width_in,
        )


# ---------------------------------------------------------------------- helpers


def _categories(categories: str | Iterable[str]) -> frozenset[str]:
    wanted = frozenset([categories] if isinstance(categories, str) else categories)
    unknown = sorted(wanted - set(CATEGORIES))
    if unknown:
        raise ValueError(f"unknown categories {unknown}; allowed: {', '.join(CATEGORIES)}")
    return wanted


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as ``intervals``."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersect(
    a: list[tuple[float, float]], b: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """The intersection of two sorted, disjoint interval lists (a linear sweep)."""
    result: list[tuple[float, float]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start = max(a[i][0], b[j][0])
        end = min(a[i][1], b[j][1])
        if end > start:
            result.append((start, end))
        # Advance whichever interval ends first; the other may still meet the next one.
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return result


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _json_safe(value: object) -> Any:
    """``value`` with everything JSON cannot hold turned into strings (recursively).

    Numbers from numpy and the like are registered as :mod:`numbers` types and stay numbers; NaN
    and infinities become strings because strict JSON readers (Perfetto's) reject them.
    """
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else str(number)
    if isinstance(value, Mapping):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return str(value)


def _ms(seconds: float) -> str:
    """Milliseconds with about three significant digits."""
    value = seconds * _MS
    if value < 0.0005:  # below the last printed digit; "0.000 ms" would suggest false precision
        return "0 ms"
    if value >= 100:
        return f"{value:.0f} ms"
    if value >= 10:
        return f"{value:.1f} ms"
    if value >= 1:
        return f"{value:.2f} ms"
    return f"{value:.3f} ms"
