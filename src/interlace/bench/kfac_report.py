"""``interlace bench kfac``, rows and tables: the phase breakdown and the ablation's rows, their
markdown tables, the ablation's header and its stacked bars."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from interlace.bench.kfac_rank import (
    ABLATION_MODES,
    BASELINE_MODE,
    DEFAULT_MODE,
    KFAC_PASSES,
    KFAC_PYTORCH_MODE,
    mode_settings,
)
from interlace.bench.tables import Row, markdown_table, ms, speedup
from interlace.kfac.enums import FactorSync

#: Columns of the table, in order: (key, heading).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("forward_backward", "fwd+bwd"),
    ("gradient_comm", "grad comm"),
    ("factor_compute", "factor compute"),
    ("factor_comm", "factor comm"),
    ("decomposition", "decomposition"),
    ("decomposition_comm", "decomp comm"),
    ("precondition", "precondition"),
    ("precondition_comm", "precond comm"),
    ("optimizer", "step"),
)


@dataclass
class KfacRow(Row):
    """One model's measured breakdown (milliseconds, medians of maxima over ranks)."""

    model: str
    ranks: int
    link: str
    batch: int
    compute_method: str
    grad_worker_fraction: float
    inv_update_steps: int
    placement: str
    layers: int
    iteration_ms: float
    phases_ms: dict[str, float] = field(default_factory=dict)
    factor_update_steps: int = 1
    #: ``real``, or the emulated trace and dilation (times are then undilated).
    compute: str = "real"


@dataclass
class AblationRow(Row):
    """One (model, mode) of the ablation (seconds, medians of maxima over ranks).

    ``phases_s`` holds the :data:`COLUMNS` phases and :data:`KFAC_PASSES`; ``factor_buckets`` is
    the number of pipelined factor all-reduces per factor step (None for bulk), and
    ``local_factors`` how many factors LBP decomposes on every rank (None for greedy).
    """

    model: str
    mode: str
    factor_comm: str
    fusion: str
    placement: str
    ranks: int
    link: str
    batch: int
    factor_update_steps: int
    inv_update_steps: int
    layers: int
    iters: int
    iteration_s: float
    speedup_vs_dkfac: float | None
    phases_s: dict[str, float] = field(default_factory=dict)
    factor_buckets: int | None = None
    local_factors: int | None = None
    #: ``real``, or the emulated trace and dilation (times are then undilated).
    compute: str = "real"
    #: The pipelined factor buckets' trials: each candidate's median and the one kept (None
    #: for bulk, or with no trials).
    factor_tuning: str | None = None
    #: Mean iteration over whole cycles of ``inv_update_steps`` (decompositions included).
    cycle_iteration_s: float | None = None
    #: The speed-up over dkfac in whole-cycle throughput.
    cycle_speedup_vs_dkfac: float | None = None
    #: Each phase's mean over the same whole cycles (seconds; the :data:`COLUMNS` phases and
    #: :data:`KFAC_PASSES`), so that they add up like the whole-cycle iteration does.
    cycle_phases_s: dict[str, float] = field(default_factory=dict)
    #: kfac-pytorch's whole-cycle iteration over this mode's (None without ``--compare``).
    cycle_speedup_vs_peer: float | None = None
    #: kfac-pytorch's median iteration over this mode's (None without ``--compare``).
    speedup_vs_peer: float | None = None
    #: Peak RSS of the contender alone in fresh processes, largest over ranks (MiB; None
    #: without ``--memory``), and how much of it the contender added to the processes' peak
    #: before it was built; ``memory_steps``: the steps it had taken (at least
    #: :data:`~interlace.bench.kfac_rank.MEMORY_STEPS`).
    peak_rss_mb: float | None = None
    added_rss_mb: float | None = None
    memory_steps: int | None = None
    #: When the mode averaged factors across ranks (``KFAC(factor_sync=)``; kfac-pytorch and
    #: rows measured before the choice existed: ``"every-update"``).
    factor_sync: str = "every-update"


def format_table(rows: Sequence[KfacRow]) -> str:
    """The breakdown's markdown table: one line per model, its iteration and phases (ms).

    Args:
        rows: The breakdown rows, in order.
    """
    head = ["model", "ranks", "link", "iteration ms", *(title + " ms" for _, title in COLUMNS)]
    lines = [
        [
            row.model,
            str(row.ranks),
            row.link,
            f"{row.iteration_ms:.1f}",
            *(f"{row.phases_ms.get(key, 0.0):.1f}" for key, _ in COLUMNS),
        ]
        for row in rows
    ]
    return markdown_table(head, "lrl" + "r" * (len(head) - 3), lines)


def _whole(value: float | None) -> int | None:
    return None if value is None else int(value)


def ablation_rows(
    model: str,
    value: dict[str, Any],
    *,
    ranks: int,
    link: str,
    batch: int,
    factor_update_steps: int,
    inv_update_steps: int,
    iters: int,
    compute: str = "real",
) -> list[AblationRow]:
    """One row per mode from an ablation launch's value (:func:`measure_ablation_rank`'s),
    each with its speed-up over :data:`BASELINE_MODE` (None when that mode was not run).

    Args:
        model: The launch's model.
        value: Rank 0's value of the launch.
        ranks: Ranks it ran on.
        link: Its link (or ``"loopback"``).
        batch: Per-rank batch.
        factor_update_steps: Steps between factor updates.
        inv_update_steps: Steps between decompositions.
        iters: Timed iterations.
        compute: What the launch computed on (:meth:`interlace.emulate.Compute.label`).
    """
    medians: dict[str, dict[str, float]] = value["medians"]
    memory: dict[str, dict[str, float]] = value.get("memory", {})
    baseline = medians.get(BASELINE_MODE, {}).get("iteration")
    baseline_cycle = medians.get(BASELINE_MODE, {}).get("cycle_iteration")
    peer = medians.get(KFAC_PYTORCH_MODE, {}).get("iteration")
    peer_cycle = medians.get(KFAC_PYTORCH_MODE, {}).get("cycle_iteration")
    rows: list[AblationRow] = []
    for mode, phases in medians.items():
        factor_comm, fusion, placement = mode_settings(mode)
        iteration = phases["iteration"]
        cycle = phases.get("cycle_iteration")
        rows.append(
            AblationRow(
                model=model,
                mode=mode,
                factor_comm=factor_comm,
                fusion=fusion,
                placement=placement,
                ranks=ranks,
                link=link,
                batch=batch,
                factor_update_steps=factor_update_steps,
                inv_update_steps=inv_update_steps,
                layers=value["layers"],
                iters=iters,
                iteration_s=iteration,
                speedup_vs_dkfac=baseline / iteration if baseline and iteration > 0 else None,
                phases_s={key: phases[key] for key, _ in (*COLUMNS, KFAC_PASSES)},
                factor_buckets=value.get("factor_buckets", {}).get(mode),
                local_factors=value.get("local_factors", {}).get(mode),
                compute=compute,
                factor_tuning=value.get("factor_tuning", {}).get(mode),
                factor_sync=value.get("factor_sync", {}).get(mode, "every-update"),
                cycle_iteration_s=cycle,
                cycle_speedup_vs_dkfac=(
                    baseline_cycle / cycle if baseline_cycle and cycle else None
                ),
                cycle_phases_s={
                    key: phases.get(f"cycle_{key}", phases[key])
                    for key, _ in (*COLUMNS, KFAC_PASSES)
                },
                cycle_speedup_vs_peer=peer_cycle / cycle if peer_cycle and cycle else None,
                speedup_vs_peer=peer / iteration if peer and iteration > 0 else None,
                peak_rss_mb=memory.get(mode, {}).get("peak_rss_mb"),
                added_rss_mb=memory.get(mode, {}).get("added_rss_mb"),
                memory_steps=_whole(memory.get(mode, {}).get("steps")),
            )
        )
    return rows


def format_ablation_table(rows: Sequence[AblationRow]) -> str:
    """One line per (model, mode): iteration, speed-up over dkfac, the phases (ms).

    Args:
        rows: The ablation rows, in order.
    """
    head = [
        "model",
        "mode",
        "iteration ms",
        "vs dkfac",
        *(title + " ms" for _, title in (*COLUMNS, KFAC_PASSES)),
    ]
    lines = [
        [
            row.model,
            row.mode,
            ms(row.iteration_s),
            speedup(row.speedup_vs_dkfac),
            *(ms(row.phases_s.get(key)) for key, _ in (*COLUMNS, KFAC_PASSES)),
        ]
        for row in rows
    ]
    return markdown_table(head, "ll" + "r" * (len(head) - 2), lines)


def factor_comm_share(rows: Sequence[AblationRow]) -> dict[str, float]:
    """Per model, the fraction of dkfac's iteration spent in factor communication.

    Args:
        rows: The ablation rows.
    """
    return {
        row.model: row.phases_s.get("factor_comm", 0.0) / row.iteration_s
        for row in rows
        if row.mode == BASELINE_MODE and row.iteration_s > 0
    }


def format_ablation_header(
    rows: Sequence[AblationRow],
    *,
    ranks: int,
    link: str,
    compute_method: str,
    iters: int,
    compute: str = "real",
) -> str:
    """The regime in a few lines: ranks, link, batches, update intervals, and how much of
    dkfac's iteration factor communication takes (the part the pipelined modes can hide).

    Args:
        rows: The ablation rows.
        ranks: Ranks of the launches.
        link: Their link.
        compute_method: The decomposition (``eigen`` or ``inverse``).
        iters: Timed iterations per launch.
        compute: What the launches computed on (emulated times are undilated).
    """
    first = rows[0] if rows else None
    factor_steps = first.factor_update_steps if first else 1
    inv_steps = first.inv_update_steps if first else 1
    sync = FactorSync(first.factor_sync if first else FactorSync.EVERY_UPDATE)
    averaged = (
        "folded per rank and averaged before each decomposition"
        if sync.holds(factor_steps, inv_steps)
        else "averaged across ranks at every update"
    )
    batches = ", ".join(
        dict.fromkeys(f"{row.model} {row.batch}" for row in rows)  # first-seen order
    )
    modes = "; ".join(
        f"{mode} = {comm} factor all-reduce"
        + (f" ({fusion} buckets)" if comm == "pipelined" else "")
        + f", {placement} placement"
        for mode, (comm, fusion, placement) in ABLATION_MODES.items()
    )
    lines = [
        f"SPD-KFAC ablation: {ranks} ranks on {link}, per-rank batch ({batches or 'none'}); "
        f"factors every {factor_steps} step(s), {averaged}; decomposed ({compute_method}, "
        f"COMM-OPT) every {inv_steps} step(s); medians over {iters} iterations of the maximum "
        "over ranks, the modes interleaved round-robin in one launch per model.",
        f"Modes: {modes}.",
        f"Compute: {compute}"
        + (" (device time; every time divided by the dilation)." if compute != "real" else "."),
    ]
    cycles = [row for row in rows if row.cycle_speedup_vs_dkfac is not None]
    if inv_steps > 1 and cycles:
        lines.append(
            f"Throughput over whole cycles of {inv_steps} iterations (mean iteration, speed-up "
            "over dkfac): "
            + ", ".join(
                f"{row.model} {row.mode} {ms(row.cycle_iteration_s or 0.0)} ms "
                f"({row.cycle_speedup_vs_dkfac:.2f}x)"
                for row in cycles
            )
            + "."
        )
    by_model = {row.model: row for row in rows if row.mode == BASELINE_MODE}
    shares = factor_comm_share(rows)
    if shares:
        lines.append(
            "Factor comm share of dkfac's iteration: "
            + ", ".join(
                f"{model} {share:.0%} ({ms(by_model[model].phases_s.get('factor_comm', 0.0))} "
                f"of {ms(by_model[model].iteration_s)} ms)"
                for model, share in shares.items()
            )
            + "."
        )
    return "\n".join(lines)


def plot_ablation(rows: Sequence[AblationRow], path: str | Path, title: str = "") -> None:
    """Grouped bars: a panel per model, a bar per mode stacked by phase (the medians; what the
    phases leave of the measured iteration is drawn as "other"), the measured iteration as a
    black tick and the speed-up over dkfac above each bar.

    Args:
        rows: The ablation rows (at least one).
        path: Where the PNG goes.
        title: The figure's title (a default when empty).
    """
    import matplotlib  # noqa: PLC0415 - heavy import, only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after choosing the Agg backend

    models = list(dict.fromkeys(row.model for row in rows))
    if not models:
        raise ValueError("no rows to plot")
    modes = list(dict.fromkeys(row.mode for row in rows))
    figure, axes = plt.subplots(
        1, len(models), figsize=(max(6.4, 2.6 * len(models) + 1.6), 4.6), squeeze=False
    )
    colours = plt.get_cmap("tab10")
    stack = [*COLUMNS, ("other", "other (overlap, hooks, noise)")]
    for panel, model in zip(axes[0], models, strict=True):
        highest = 0.0
        for position, mode in enumerate(modes):
            row = next((r for r in rows if r.model == model and r.mode == mode), None)
            if row is None:
                continue
            bottom = 0.0
            for index, (key, label) in enumerate(stack):
                if key == "other":
                    height = max(0.0, row.iteration_s - bottom / 1e3) * 1e3
                    colour: Any = "lightgrey"
                else:
                    height = row.phases_s.get(key, 0.0) * 1e3
                    colour = colours(index % 10)
                panel.bar(
                    position,
                    height,
                    bottom=bottom,
                    width=0.7,
                    color=colour,
                    label=label if position == 0 and model == models[0] else None,
                )
                bottom += height
            top = row.iteration_s * 1e3
            highest = max(highest, top, bottom)
            panel.hlines(top, position - 0.38, position + 0.38, color="black", linewidth=1.5)
            if row.speedup_vs_dkfac is not None:
                panel.annotate(
                    f"{row.speedup_vs_dkfac:.2f}x",
                    (position, max(top, bottom)),
                    textcoords="offset points",
                    xytext=(0, 3),
                    ha="center",
                    fontsize=7,
                )
        panel.set_xticks(range(len(modes)))
        panel.set_xticklabels(modes, fontsize=8)
        panel.set_title(model)
        panel.grid(axis="y", alpha=0.3)
        # Room above the tallest bar for its speed-up label.
        panel.set_ylim(0.0, max(highest, 1e-3) * 1.12)
    axes[0][0].set_ylabel("iteration ms (median of max over ranks)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=5, fontsize=7, frameon=False)
    figure.suptitle(
        (title or "SPD-KFAC ablation: iteration time by phase")
        + "\n(black tick: measured iteration; label: speed-up vs dkfac)",
        fontsize=10,
    )
    figure.tight_layout(rect=(0.0, 0.1, 1.0, 1.0))
    figure.savefig(path, dpi=120)
    plt.close(figure)


#: The head-to-head table's phases (whole-cycle means): (key, heading).
H2H_PHASES: tuple[tuple[str, str], ...] = (
    ("factor_compute", "factor compute"),
    ("factor_comm", "factor comm"),
    ("decomposition", "decomposition"),
    ("decomposition_comm", "broadcast"),
    ("precondition", "precondition"),
    KFAC_PASSES,
)


def format_h2h_table(rows: Sequence[AblationRow]) -> str:
    """The head-to-head table: per (model, link, decomposition interval, mode), the whole-cycle
    mean iteration, the per-step median, both speed-ups over kfac-pytorch, the phases' means
    over the same cycles, and the peak RSS (ms and MiB).

    Args:
        rows: Ablation rows of runs with ``--compare kfac-pytorch``.
    """
    head = [
        "model",
        "link",
        "inv every",
        "mode",
        "whole-cycle ms",
        "median ms",
        "vs kfac-pytorch (cycle)",
        "vs kfac-pytorch (median)",
        *(title + " ms" for _, title in H2H_PHASES),
        "peak RSS MiB",
    ]
    lines = []
    for row in rows:
        cycle = row.cycle_iteration_s if row.cycle_iteration_s is not None else row.iteration_s
        phases = row.cycle_phases_s or row.phases_s
        lines.append(
            [
                row.model,
                row.link,
                str(row.inv_update_steps),
                row.mode,
                ms(cycle),
                ms(row.iteration_s),
                speedup(row.cycle_speedup_vs_peer),
                speedup(row.speedup_vs_peer),
                *(ms(phases.get(key)) for key, _ in H2H_PHASES),
                "-" if row.peak_rss_mb is None else f"{row.peak_rss_mb:.0f}",
            ]
        )
    return markdown_table(head, "llrl" + "r" * (len(head) - 4), lines)


def h2h_verdicts(
    rows: Sequence[AblationRow], default_mode: str = DEFAULT_MODE
) -> list[dict[str, Any]]:
    """Per (model, link, decomposition interval) against kfac-pytorch: interlace's fastest mode
    and its default mode in whole-cycle throughput, the fastest mode's per-step median, and the
    default mode's peak RSS over kfac-pytorch's (None where not measured).

    Args:
        rows: Ablation rows of runs with ``--compare kfac-pytorch``.
        default_mode: The mode :class:`interlace.KFAC`'s defaults select.
    """
    groups: dict[tuple[str, str, int], list[AblationRow]] = {}
    for row in rows:
        groups.setdefault((row.model, row.link, row.inv_update_steps), []).append(row)
    verdicts: list[dict[str, Any]] = []
    for (model, link, inv), group in groups.items():
        peer = next((r for r in group if r.mode == KFAC_PYTORCH_MODE), None)
        ours = [r for r in group if r.mode != KFAC_PYTORCH_MODE]
        if peer is None or not ours:
            continue
        fastest = max(ours, key=lambda r: r.cycle_speedup_vs_peer or 0.0)
        default = next((r for r in ours if r.mode == default_mode), None)
        verdicts.append(
            {
                "model": model,
                "link": link,
                "inv_update_steps": inv,
                "fastest_mode": fastest.mode,
                "fastest_cycle_speedup": fastest.cycle_speedup_vs_peer,
                "fastest_median_speedup": fastest.speedup_vs_peer,
                "default_cycle_speedup": default.cycle_speedup_vs_peer if default else None,
                "default_rss_ratio": (
                    default.peak_rss_mb / peer.peak_rss_mb
                    if default and default.peak_rss_mb and peer.peak_rss_mb
                    else None
                ),
            }
        )
    return verdicts
