"""Scaling experiments on a trace: every strategy at every worker count, the table, the JSON
rows and the scaling-efficiency plot; K-FAC strategies add a table of their phases.

Scaling efficiency is one worker's iteration over the iteration on N workers (docs/notes/sim.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from interlace.comm.strategies import PLANNED_STRATEGIES, planned_strategy
from interlace.errors import UsageError
from interlace.sim.kfac import KFAC_STRATEGIES, PHASES, check_trace, simulate_kfac
from interlace.sim.kfac_costs import KfacCosts
from interlace.sim.network import Network
from interlace.sim.simulation import SimResult, simulate, strategy_named
from interlace.sim.trace import Trace

DEFAULT_WORKERS: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_STRATEGIES: tuple[str, ...] = ("single", "wfbp", "fixed", "horovod", "mgwfbp", "optimal")

#: What the MG-WFBP paper reports for its simulated GoogLeNet at 64 workers (ring all-reduce).
PAPER_64 = {"workers": 64, "vs_wfbp": 1.78, "vs_single": 1.35}


def check_strategy(name: str) -> None:
    """Refuse a name that is neither a data-parallel strategy nor a K-FAC one.

    Args:
        name: A key of :data:`~interlace.sim.kfac.KFAC_STRATEGIES`, or a name
            :func:`~interlace.sim.simulation.strategy_named` knows.

    Raises:
        UsageError: Naming every choice, K-FAC strategies included.
    """
    if name in KFAC_STRATEGIES:
        return
    if planned_strategy(name) is None:
        raise UsageError(
            f"unknown strategy {name!r}; choose from {', '.join(PLANNED_STRATEGIES)}, "
            "or any of them with /k=K for K channels (e.g. mgwfbp/k=3), or a K-FAC strategy "
            f"({', '.join(KFAC_STRATEGIES)})"
        )
    strategy_named(name)


def parse_strategies(text: str | None) -> tuple[str, ...]:
    """``--strategy``: comma-separated names, duplicates dropped, each checked.

    Args:
        text: The flag's value; None or empty gives every data-parallel strategy.

    Raises:
        UsageError: For an empty list or an unknown name (:func:`check_strategy`).
    """
    if not text:
        return tuple(PLANNED_STRATEGIES)
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not names:
        raise UsageError("--strategy: name at least one")
    for name in names:
        check_strategy(name)
    return names


def simulate_scaling(
    trace: Trace,
    network: Network,
    workers: Sequence[int],
    strategies: Sequence[str],
    *,
    per_layer: bool = False,
    kfac_costs: KfacCosts | None = None,
    compression: str | None = None,
) -> list[SimResult]:
    """Every strategy at every worker count, the network priced at each count.

    Args:
        trace: The model's iteration.
        network: Prices an all-reduce at each worker count.
        workers: The worker counts.
        strategies: Data-parallel strategies (:func:`~interlace.sim.simulation.simulate`) and K-FAC
            ones (:func:`~interlace.sim.kfac.simulate_kfac`, which need the trace's factor
            sizes).
        per_layer: Send a layer's tensors as one message.
        kfac_costs: What K-FAC strategies take beyond the trace (default
            :class:`~interlace.sim.kfac_costs.KfacCosts`).
        compression: The data-parallel strategies' gradient compression (``"fp16"`` or
            ``"bf16"``: half the bytes on the wire), or None.

    Raises:
        UsageError: For an unknown strategy, or K-FAC on a trace without factor sizes.
    """
    chosen = {name: strategy_named(name) for name in strategies if name not in KFAC_STRATEGIES}
    if len(chosen) < len(strategies):
        check_trace(trace)
    results: list[SimResult] = []
    for count in workers:
        cost = network.cost(count)
        for name in strategies:
            if name in KFAC_STRATEGIES:
                results.append(
                    simulate_kfac(
                        trace,
                        name,
                        cost,
                        count,
                        costs=kfac_costs,
                        per_layer=per_layer,
                        network=network.spec,
                    )
                )
                continue
            results.append(
                simulate(
                    trace,
                    chosen[name],
                    cost,
                    workers=count,
                    per_layer=per_layer,
                    network=network.spec,
                    compression=compression,
                )
            )
    return results


@dataclass(frozen=True)
class ScalingRow:
    """One strategy at one worker count (times in seconds).

    Args:
        model: The trace's model.
        network: The network's description.
        workers: The worker count.
        strategy: The strategy's name.
        iteration_s: The simulated iteration.
        buckets: All-reduces per iteration.
        speedup_vs_wfbp: WFBP's iteration over this one at the same count (None without WFBP).
        speedup_vs_single: SyncEASGD's iteration over this one (None without it).
        scaling_efficiency: One worker's iteration over this one.
        cost_a: The all-reduce start-up at this count, seconds.
        cost_b: The all-reduce seconds per byte at this count.
        extra: Strategy-specific numbers, flattened into the JSON row: a K-FAC strategy's
            phases (``<phase>_s``), bucket counts and one worker's iteration.
    """

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
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        """Throughput over one worker's, as the MG-WFBP paper measures speed-up: ``workers``
        batches per iteration against one batch per one worker's iteration."""
        return self.workers * self.scaling_efficiency

    def to_dict(self) -> dict[str, Any]:
        """The row as a flat JSON object (with :attr:`speedup`)."""
        data = asdict(self)
        data.update(data.pop("extra"))
        data["speedup"] = self.speedup
        return data


def scaling_rows(trace: Trace, results: Sequence[SimResult]) -> list[ScalingRow]:
    """Rows of ``results`` with speed-ups against WFBP and SyncEASGD at the same count.

    A result that knows its own one-worker iteration (``extra["single_worker_s"]``, a K-FAC
    strategy's) is scaled against that; the others against the trace's compute.

    Args:
        trace: The trace the results simulated.
        results: :func:`simulate_scaling`'s results.
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
    """The markdown table: one line per worker count and strategy.

    Args:
        rows: The rows to show, in order.
    """
    lines = [
        "| workers | a ms | strategy | iteration ms | vs WFBP | vs SyncEASGD | scaling eff. "
        "| speed-up | buckets |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.workers} | {row.cost_a * 1e3:.2f} | {row.strategy} | "
            f"{row.iteration_s * 1e3:.1f} | {_x(row.speedup_vs_wfbp)} | "
            f"{_x(row.speedup_vs_single)} | {row.scaling_efficiency:.2f} | {row.speedup:.1f} | "
            f"{row.buckets} |"
        )
    return "\n".join(lines)


def format_paper_comparison(rows: Sequence[ScalingRow]) -> str | None:
    """MG-WFBP's speed-ups at 64 workers beside the paper's, or None without such rows.

    Args:
        rows: Scaling rows.
    """
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

    Args:
        rows: Scaling rows; an empty list without MG-WFBP rows.
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


def plot_scaling(
    rows: Sequence[ScalingRow], path: str | Path, title: str = "", *, speedup: bool = False
) -> Path:
    """Scaling efficiency (or speed-up) against workers (log scale), one line per strategy.

    Args:
        rows: The rows to draw.
        path: Where the PNG goes (folders are made).
        title: The plot's title (default: the model and network).
        speedup: Draw :attr:`ScalingRow.speedup` on a log scale, beside the ideal ``N``.

    Raises:
        UsageError: Without rows.
    """
    # A bare Figure, no pyplot: half the import time, and no GUI backend to choose.
    from matplotlib.figure import Figure  # noqa: PLC0415 - heavy import, only for a plot

    if not rows:
        raise UsageError("no rows to plot")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    strategies = list(dict.fromkeys(r.strategy for r in rows))
    figure = Figure(figsize=(7.0, 4.2), dpi=120)
    axes = figure.add_axes((0.1, 0.12, 0.87, 0.8))
    markers = "osD^vP*X"
    for index, strategy in enumerate(strategies):
        mine = sorted((r for r in rows if r.strategy == strategy), key=lambda r: r.workers)
        axes.plot(
            [r.workers for r in mine],
            [r.speedup if speedup else r.scaling_efficiency for r in mine],
            marker=markers[index % len(markers)],
            label=strategy,
            linewidth=1.5,
            markersize=4,
        )
    axes.set_xscale("log", base=2)
    axes.set_xlabel("workers")
    if speedup:
        counts = sorted({r.workers for r in rows})
        axes.plot(counts, counts, color="grey", linestyle=":", linewidth=1, label="ideal")
        axes.set_yscale("log", base=2)
        axes.set_ylabel("speed-up (throughput over one worker's)")
    else:
        axes.set_ylabel("scaling efficiency (1 worker's time / N workers' time)")
        # Distributed K-FAC shares out work one worker does alone: it can exceed 1.
        axes.set_ylim(0, max(1.05, 1.05 * max(r.scaling_efficiency for r in rows)))
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, ncols=2)
    first = rows[0]
    axes.set_title(title or f"{first.model}, {first.network}: simulated", fontsize=10)
    figure.savefig(path)
    return path


def parse_workers(text: str) -> tuple[int, ...]:
    """``"4,8,16"`` -> ``(4, 8, 16)``; ``"4..2048"`` is every power of two from 4 to 2048.

    Args:
        text: The ``--workers`` value.

    Raises:
        UsageError: For anything but positive integers or ``LOW..HIGH``.
    """
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


#: Column headings of :data:`PHASES` in :func:`format_phase_table`.
_HEADINGS = {
    "buffer_comm": "buffers",
    "forward_backward": "fwd+bwd",
    "factor_compute": "factor",
    "gradient_comm": "grad comm",
    "factor_comm": "factor comm",
    "decomposition": "decomp",
    "decomposition_comm": "decomp comm",
    "precondition": "precond",
    "step": "step",
    "host": "host",
}


def format_phase_table(rows: Sequence[ScalingRow]) -> str | None:
    """The K-FAC rows' phases in milliseconds, with each row's speed-up over ``dkfac`` at the
    same worker count; None without K-FAC rows.

    Args:
        rows: Scaling rows; only the K-FAC strategies' are shown.
    """
    mine = [row for row in rows if row.strategy in KFAC_STRATEGIES]
    if not mine:
        return None
    baseline = {row.workers: row.iteration_s for row in mine if row.strategy == "dkfac"}
    lines = [
        "| workers | strategy | iteration ms | vs dkfac | "
        + " | ".join(_HEADINGS[phase] for phase in PHASES)
        + " | grad/factor buckets | broadcasts | local |",
        "|---:|---|---:|---:|" + "---:|" * len(PHASES) + "---:|---:|---:|",
    ]
    for row in mine:
        base = baseline.get(row.workers)
        versus = "-" if base is None else f"{base / row.iteration_s:.2f}x"
        cells = " | ".join(f"{row.extra[f'{phase}_s'] * 1e3:.1f}" for phase in PHASES)
        lines.append(
            f"| {row.workers} | {row.strategy} | {row.iteration_s * 1e3:.1f} | {versus} | "
            f"{cells} | {int(row.extra['gradient_buckets'])}/{int(row.extra['factor_buckets'])} "
            f"| {int(row.extra['broadcasts'])} | {int(row.extra['local_factors'])} |"
        )
    return "\n".join(lines)
