"""Scaling experiments on a trace: the table, the JSON rows and the scaling-efficiency plot.

A row is one strategy at one worker count: its simulated iteration time, its speed-up over WFBP
and over SyncEASGD at the same count, its scaling efficiency and its number of buckets. Scaling
efficiency is weak scaling with a fixed per-worker batch: the iteration time of one worker,
which communicates nothing (forward + backward + step of the trace; for a K-FAC strategy also
its factors, every decomposition and the preconditioning), over the iteration time on N
workers; 1.0 means N workers deliver N times one worker's throughput. Distributed K-FAC shares
the decompositions out, so its efficiency can exceed 1.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from interlace.errors import UsageError
from interlace.sim.engine import SimResult
from interlace.sim.trace import Trace

DEFAULT_WORKERS: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_STRATEGIES: tuple[str, ...] = ("single", "wfbp", "fixed", "horovod", "mgwfbp", "optimal")

#: What the MG-WFBP paper reports for its simulated GoogLeNet at 64 workers (ring all-reduce).
PAPER_64 = {"workers": 64, "vs_wfbp": 1.78, "vs_single": 1.35}


@dataclass(frozen=True)
class ScalingRow:
    """One strategy at one worker count (times in seconds)."""

    model: str
    network: str
    workers: int
    strategy: str
    iteration_s: float
    buckets: int
    speedup_vs_wfbp: float | None
    speedup_vs_single: float | None
    scaling_efficiency: float
    cost_a: float
    cost_b: float
    #: Strategy-specific numbers, flattened into the JSON row: a K-FAC strategy's phases
    #: (``<phase>_s``), bucket counts and one worker's iteration (see :mod:`interlace.sim.kfac`).
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(data.pop("extra"))
        return data


def scaling_rows(trace: Trace, results: Sequence[SimResult]) -> list[ScalingRow]:
    """Rows of ``results`` with speed-ups against WFBP and SyncEASGD at the same count.

    A result that knows its own one-worker iteration (``extra["single_worker_s"]``, a K-FAC
    strategy's) is scaled against that; the others against the trace's compute.
    """
    compute = trace.forward_s + trace.backward_s + trace.step_s
    by_key = {(r.workers, r.strategy): r for r in results}
    rows = []
    for result in results:
        wfbp = by_key.get((result.workers, "wfbp"))
        single = by_key.get((result.workers, "single"))
        alone = result.extra.get("single_worker_s", compute)
        rows.append(
            ScalingRow(
                model=trace.model,
                network=result.network,
                workers=result.workers,
                strategy=result.strategy,
                iteration_s=result.iteration_s,
                buckets=result.buckets,
                speedup_vs_wfbp=None if wfbp is None else wfbp.iteration_s / result.iteration_s,
                speedup_vs_single=(
                    None if single is None else single.iteration_s / result.iteration_s
                ),
                scaling_efficiency=alone / result.iteration_s,
                cost_a=result.cost.a,
                cost_b=result.cost.b,
                extra=dict(result.extra),
            )
        )
    return rows


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_table(rows: Sequence[ScalingRow]) -> str:
    """The markdown table: one line per worker count and strategy."""
    lines = [
        "| workers | a ms | strategy | iteration ms | vs WFBP | vs SyncEASGD | scaling eff. "
        "| buckets |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.workers} | {row.cost_a * 1e3:.2f} | {row.strategy} | "
            f"{row.iteration_s * 1e3:.1f} | {_x(row.speedup_vs_wfbp)} | "
            f"{_x(row.speedup_vs_single)} | {row.scaling_efficiency:.2f} | {row.buckets} |"
        )
    return "\n".join(lines)


def format_paper_comparison(rows: Sequence[ScalingRow]) -> str | None:
    """MG-WFBP's speed-ups at 64 workers beside the paper's, or None without such rows."""
    row = next(
        (r for r in rows if r.workers == PAPER_64["workers"] and r.strategy == "mgwfbp"), None
    )
    if row is None or row.speedup_vs_wfbp is None or row.speedup_vs_single is None:
        return None
    return (
        f"MG-WFBP at 64 workers: {row.speedup_vs_wfbp:.2f}x over WFBP (paper "
        f"{PAPER_64['vs_wfbp']:.2f}x), {row.speedup_vs_single:.2f}x over SyncEASGD (paper "
        f"{PAPER_64['vs_single']:.2f}x); {row.buckets} bucket(s)"
    )


def check_claims(rows: Sequence[ScalingRow]) -> list[str]:
    """What the issue asks of MG-WFBP on a scaling run, each as 'ok: ...' or 'FAILED: ...'.

    MG-WFBP is never slower than WFBP or SyncEASGD; its bucket count never grows with workers
    and is 1 at the largest count.
    """
    mg = sorted((r for r in rows if r.strategy == "mgwfbp"), key=lambda r: r.workers)
    if not mg:
        return []
    by_key = {(r.workers, r.strategy): r for r in rows}
    notes = []
    slower = [
        r.workers
        for r in mg
        if any(
            (r.workers, other) in by_key
            and r.iteration_s > by_key[(r.workers, other)].iteration_s * (1 + 1e-9)
            for other in ("wfbp", "single")
        )
    ]
    notes.append(
        "ok: MG-WFBP <= min(WFBP, SyncEASGD) at every size"
        if not slower
        else f"FAILED: MG-WFBP slower than WFBP or SyncEASGD at {slower} workers"
    )
    counts = [r.buckets for r in mg]
    monotone = all(b <= a for a, b in itertools.pairwise(counts))
    notes.append(
        f"{'ok' if monotone else 'FAILED'}: MG-WFBP buckets by workers "
        + ", ".join(f"{r.workers}:{r.buckets}" for r in mg)
        + (" (never growing" if monotone else " (grows somewhere")
        + (", 1 at the largest size)" if counts[-1] == 1 else ", not 1 at the largest size)")
    )
    return notes


def plot_scaling(rows: Sequence[ScalingRow], path: str | Path, title: str = "") -> Path:
    """Scaling efficiency against workers (log scale), one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise UsageError("no rows to plot")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    strategies = list(dict.fromkeys(r.strategy for r in rows))
    figure, axes = plt.subplots(figsize=(7.0, 4.2), dpi=120, layout="constrained")
    try:
        markers = "osD^vP*X"
        for index, strategy in enumerate(strategies):
            mine = sorted((r for r in rows if r.strategy == strategy), key=lambda r: r.workers)
            axes.plot(
                [r.workers for r in mine],
                [r.scaling_efficiency for r in mine],
                marker=markers[index % len(markers)],
                label=strategy,
                linewidth=1.5,
                markersize=4,
            )
        axes.set_xscale("log", base=2)
        axes.set_xlabel("workers")
        axes.set_ylabel("scaling efficiency (1 worker's time / N workers' time)")
        # Distributed K-FAC shares out work one worker does alone: it can exceed 1.
        axes.set_ylim(0, max(1.05, 1.05 * max(r.scaling_efficiency for r in rows)))
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8, ncols=2)
        first = rows[0]
        axes.set_title(title or f"{first.model}, {first.network}: simulated", fontsize=10)
        figure.savefig(path)
    finally:
        plt.close(figure)
    return path


def parse_workers(text: str) -> tuple[int, ...]:
    """``"4,8,16"`` -> ``(4, 8, 16)``; ``"4..2048"`` is every power of two from 4 to 2048."""
    text = text.strip()
    if ".." in text:
        low_text, _, high_text = text.partition("..")
        try:
            low, high = int(low_text), int(high_text)
        except ValueError:
            raise UsageError(f"--workers: {text!r} is not LOW..HIGH of integers") from None
        if not 1 <= low <= high:
            raise UsageError(f"--workers: need 1 <= LOW <= HIGH, got {text!r}")
        counts = []
        count = 1
        while count <= high:
            if count >= low:
                counts.append(count)
            count *= 2
        if not counts:
            raise UsageError(f"--workers: no power of two in {text!r}")
        return tuple(counts)
    counts = []
    for part in text.split(","):
        try:
            count = int(part)
        except ValueError:
            raise UsageError(
                f"--workers: {part.strip()!r} is not an integer; give e.g. 4,8,16 or 4..2048"
            ) from None
        if count < 1:
            raise UsageError(f"--workers: worker counts must be >= 1, got {count}")
        counts.append(count)
    return tuple(dict.fromkeys(counts))
