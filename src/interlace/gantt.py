"""Drawing timed events as a PNG Gantt chart: one row per lane, bars coloured by category.

matplotlib is imported only when a chart is drawn; :meth:`interlace.timeline.Timeline.to_png` is
the usual way in.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

#: Okabe-Ito colours, chosen to stay distinguishable under the common colour-vision deficiencies.
#: Communication gets the strongest colour (vermillion) because it is what the chart is about;
#: forward and backward get two blues so compute reads as one family.
COLORS: dict[str, str] = {
    "forward": "#0072B2",
    "backward": "#56B4E9",
    "comm": "#D55E00",
    "factor": "#009E73",
    "decomposition": "#CC79A7",
    "precondition": "#F0E442",
    "optimizer": "#E69F00",
    "idle": "#CCCCCC",
    "other": "#7F7F7F",
}

_MS = 1e3
_DPI = 110


class Bar(Protocol):
    """What a chart needs of an event (:class:`interlace.timeline.Event` has it)."""

    @property
    def name(self) -> str: ...
    @property
    def category(self) -> str: ...
    @property
    def start_s(self) -> float: ...
    @property
    def duration_s(self) -> float: ...
    @property
    def lane(self) -> str: ...
    @property
    def process(self) -> str: ...


def draw_gantt(
    path: str | Path,
    events: Sequence[Bar],
    rows: Sequence[tuple[str, str]],
    *,
    title: str,
    caption: str,
    categories: Sequence[str],
    origin_s: float,
    span_s: float,
    width_in: float = 12.0,
) -> Path:
    """Draw ``events`` on ``rows``, time in ms from ``origin_s``; an empty chart says so.

    Bars narrower than half a pixel are widened to half a pixel so that short events stay
    visible; bars wide enough for their name are labelled.

    Args:
        path: the file to write.
        events: the bars.
        rows: ``(process, lane)`` of each row, top first; labelled ``"process / lane"`` when
            there are several processes.
        title: the chart's title ("" for none).
        caption: the line(s) under the title.
        categories: the legend's categories, in order.
        origin_s: the time drawn as 0.
        span_s: the time axis' length, in seconds.
        width_in: the figure's width, in inches.

    Returns:
        The path written.
    """
    import matplotlib  # noqa: PLC0415 - optional dependency, heavy; only when a chart is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after matplotlib.use("Agg")
    from matplotlib.patches import Patch  # noqa: PLC0415 - optional dependency

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    caption_lines = caption.count("\n") + 1
    height_in = 1.9 + 0.32 * max(len(rows), 1) + 0.18 * (caption_lines - 1) + 0.3 * bool(title)
    figure, axes = plt.subplots(figsize=(width_in, height_in), dpi=_DPI, layout="constrained")
    try:
        if title:
            figure.suptitle(title, fontsize=12, fontweight="bold")
        if not events:
            axes.text(0.5, 0.5, "no events", ha="center", va="center", transform=axes.transAxes)
            axes.set_xticks([])
            axes.set_yticks([])
            figure.savefig(path, dpi=_DPI)
            return path

        span_ms = max(span_s * _MS, 1e-3)  # keep the axis non-degenerate
        axes.set_title(caption, fontsize=9, color="#333333", loc="left")
        # A little room on the right so the last bar does not end flush with the frame.
        axes.set_xlim(0.0, span_ms * 1.01)
        axes.set_ylim(len(rows) - 0.5, -0.5)  # first lane on top
        several = len({process for process, _ in rows}) > 1
        axes.set_yticks(
            range(len(rows)), [f"{p} / {lane}" if several else lane for p, lane in rows]
        )
        axes.tick_params(axis="y", length=0, labelsize=9)
        axes.set_xlabel("time since first event (ms)")
        axes.grid(axis="x", color="#DDDDDD", linewidth=0.8)
        axes.set_axisbelow(True)
        for spine in ("top", "right", "left"):
            axes.spines[spine].set_visible(False)
        # Faint bands on every other row and a rule between processes guide the eye across a
        # wide chart.
        for index in range(1, len(rows), 2):
            axes.axhspan(index - 0.5, index + 0.5, color="#F5F5F5", zorder=0, linewidth=0)
        for index in range(1, len(rows)):
            if rows[index][0] != rows[index - 1][0]:
                axes.axhline(index - 0.5, color="#999999", linewidth=0.8)
        figure.legend(
            handles=[Patch(facecolor=COLORS[c], label=c) for c in categories],
            loc="outside lower center",
            ncols=len(categories),
            frameon=False,
            fontsize=9,
        )

        # Lay the figure out once so the axes' size in pixels is known; freeze that layout
        # before adding bars, whose widths depend on it.
        figure.canvas.draw()
        figure.set_layout_engine("none")
        low_ms, high_ms = axes.get_xlim()
        px_per_ms = axes.get_window_extent().width / (high_ms - low_ms)
        min_width_ms = 0.5 / px_per_ms
        row_of = {pair: index for index, pair in enumerate(rows)}
        label_size = 7.0
        char_px = 0.6 * label_size * _DPI / 72  # an average DejaVu Sans glyph
        for pair, index in row_of.items():
            bars = [e for e in events if (e.process, e.lane) == pair]
            spans = [
                ((e.start_s - origin_s) * _MS, max(e.duration_s * _MS, min_width_ms)) for e in bars
            ]
            faces = [COLORS[e.category] for e in bars]
            # A white outline separates back-to-back bars, but would swallow narrow ones.
            edges = [
                "white" if width * px_per_ms >= 4 else face
                for (_, width), face in zip(spans, faces, strict=True)
            ]
            axes.broken_barh(
                spans, (index - 0.38, 0.76), facecolors=faces, edgecolors=edges, linewidth=0.5
            )
            for position, (event, (left, width)) in enumerate(zip(bars, spans, strict=True)):
                text_ms = (len(event.name) * char_px + 6) / px_per_ms
                if width < text_ms:
                    continue
                # Skip the label where another bar of the lane reaches into it (events that
                # overlap on one lane): it would be covered or collide with that bar's label.
                low, high = left + (width - text_ms) / 2, left + (width + text_ms) / 2
                if any(
                    other_left < high and other_left + other_width > low
                    for other, (other_left, other_width) in enumerate(spans)
                    if other != position
                ):
                    continue
                axes.text(
                    left + width / 2,
                    index,
                    event.name,
                    ha="center",
                    va="center",
                    fontsize=label_size,
                    color=_text_color(COLORS[event.category]),
                    clip_on=True,
                )
        figure.savefig(path, dpi=_DPI)
    finally:
        plt.close(figure)
    return path


def _text_color(face: str) -> str:
    """Black or white, whichever reads better on ``face`` (by relative luminance)."""
    red, green, blue = (int(face[i : i + 2], 16) / 255 for i in (1, 3, 5))
    luminance = 0.2126 * red + 0.7152 * green + 0.0722 * blue
    return "black" if luminance > 0.4 else "white"
