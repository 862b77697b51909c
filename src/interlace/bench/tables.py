"""What a benchmark's report is made of: rows that are JSON records, the JSON list and the
timeline files, the machine line of a header, and the cells and markdown of its tables."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from interlace.timeline import Timeline


class Row:
    """A row of results: a dataclass whose fields are its JSON record's."""

    def to_dict(self) -> dict[str, Any]:
        """The row as its JSON record."""
        return dataclasses.asdict(cast(Any, self))


def write_json(path: str | Path, records: Sequence[dict[str, Any]]) -> None:
    """Write ``records`` as a JSON list to ``path`` (its folder made) and say so.

    Args:
        path: Where they go.
        records: The rows' records.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(list(records), indent=1) + "\n")
    print(f"\nrows written to {target}")


def write_timeline(timeline: Timeline, path: str | Path) -> str:
    """Draw ``timeline`` to ``path`` and save its Chrome trace beside it (``.json``).

    Args:
        timeline: The timeline.
        path: The PNG's path.

    Returns:
        A line saying what was written where.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    timeline.to_png(target)
    trace = target.with_suffix(".json")
    timeline.to_chrome_trace(trace)
    return f"timeline written to {target} (Chrome trace: {trace})"


def machine() -> str:
    """This machine as a header names it: host, CPUs, load averages, torch and the backend."""
    try:
        load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        load = "n/a"
    return (
        f"{platform.node()} ({os.cpu_count()} CPUs, load {load} at the end), torch "
        f"{torch.__version__}, gloo"
    )


def ms(seconds: float | None, digits: int = 1) -> str:
    """Seconds as milliseconds for a table cell; ``-`` for None.

    Args:
        seconds: A time, or None where there is none.
        digits: Decimals.
    """
    return "-" if seconds is None else f"{seconds * 1e3:.{digits}f}"


def number(value: float | None, digits: int = 2) -> str:
    """A number for a table cell; ``-`` for None.

    Args:
        value: The number, or None where there is none.
        digits: Decimals.
    """
    return "-" if value is None else f"{value:.{digits}f}"


def speedup(value: float | None) -> str:
    """A speed-up for a table cell (``1.25x``); ``-`` for None.

    Args:
        value: The ratio, or None where there is none.
    """
    return "-" if value is None else f"{value:.2f}x"


def markdown_table(head: Sequence[str], align: str, lines: Iterable[Sequence[str]]) -> str:
    """A markdown table.

    Args:
        head: The columns' headings.
        align: Per column, ``l`` (left) or ``r`` (right).
        lines: Each row's cells.
    """
    rule = "|" + "".join("---:|" if side == "r" else "---|" for side in align)
    rows = ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(["| " + " | ".join(head) + " |", rule, *rows])
