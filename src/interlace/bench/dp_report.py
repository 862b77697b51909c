"""``interlace bench dp``, rows and tables: link rates for target ratios, the rows made from a
launch's measurement, the markdown tables and the speed-up plot."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from interlace.bench.dp_rank import Measurement, parse_variant, variant_label
from interlace.bench.harness import quartiles
from interlace.bench.session import format_rate
from interlace.bench.tables import Row as BaseRow
from interlace.bench.tables import markdown_table, ms, number, speedup
from interlace.comm.cost import CostModel
from interlace.errors import UsageError

#: The row that stands for the ideal-overlap bound on emulated compute.
BOUND_ROW = "ideal-bound"
#: The row that stands for the bound of all-reduces that may also overlap the next forward.
OVERLAP_BOUND_ROW = "overlap-bound"


@dataclass(frozen=True)
class RateChoice:
    """The link rate picked for a target ratio; ``wanted_bps`` before clamping (may be inf)."""

    rate_bps: float
    wanted_bps: float

    @property
    def clamped(self) -> bool:
        return self.rate_bps != self.wanted_bps

    @property
    def link(self) -> str:
        """The rate as ``--link`` and ``tc`` spell it."""
        return format_rate(self.rate_bps)


def rate_for_ratio(
    ratio: float,
    compute_s: float,
    ref_rate_bps: float,
    ref_allreduce_s: float,
    *,
    latency_s: float = 0.0,
    min_bps: float = 20e6,
    max_bps: float = 2.5e9,
) -> RateChoice:
    """The link rate at which one all-reduce of all gradients takes ``ratio * compute_s``.

    ``ref_allreduce_s`` was measured at ``ref_rate_bps``. Of it, ``latency_s`` (the time of a
    tiny all-reduce) does not depend on the rate and the rest scales as ``1/rate``:
    ``T(rate) = latency + (T_ref - latency) * ref_rate / rate``; solving ``T = ratio * compute``
    gives ``rate = ref_rate * (T_ref - latency) / (ratio * compute - latency)``. With
    ``latency_s = 0`` that is ``ref_rate * T_ref / (ratio * compute)``. A target below the latency
    cannot be reached at any rate; it asks for an infinite one, clamped to ``max_bps`` like every
    rate outside ``[min_bps, max_bps]``.

    Args:
        ratio: The target communication/compute ratio (> 0).
        compute_s: Seconds of compute per iteration.
        ref_rate_bps: The reference link rate, bits per second.
        ref_allreduce_s: Seconds of one all-reduce of all gradients at that rate.
        latency_s: Seconds of a tiny all-reduce (the rate-independent part).
        min_bps: Slowest rate to choose.
        max_bps: Fastest rate to choose.
    """
    if not ratio > 0 or not math.isfinite(ratio):
        raise UsageError(f"a communication/compute ratio must be > 0, got {ratio}")
    if not compute_s > 0:
        raise ValueError(f"compute time must be > 0 s, got {compute_s}")
    if not ref_rate_bps > 0 or not ref_allreduce_s > 0:
        raise ValueError("the reference rate and all-reduce time must be > 0")
    if not 0 < min_bps <= max_bps:
        raise ValueError(f"need 0 < min_bps <= max_bps, got {min_bps}, {max_bps}")
    latency_s = min(max(latency_s, 0.0), ref_allreduce_s)
    target_s = ratio * compute_s
    wire_s = ref_allreduce_s - latency_s
    wanted = math.inf if target_s <= latency_s else ref_rate_bps * wire_s / (target_s - latency_s)
    if wanted == 0.0:
        # Nothing of the reference time depends on the rate: any rate gives the same ratio.
        wanted = max_bps
    return RateChoice(min(max(wanted, min_bps), max_bps), wanted)


def ideal_bound_s(forward_s: float, backward_s: float, allreduce_s: float, step_s: float) -> float:
    """The ideal-overlap iteration time: ``forward + max(backward, all-reduce) + step``.

    What an iteration would take if one all-reduce of all gradients ran entirely alongside
    backward at no cost to it. The optimizer step is in both this bound and the timed iteration,
    so their ratio compares like with like.

    Args:
        forward_s: Seconds of forward.
        backward_s: Seconds of backward.
        allreduce_s: Seconds of one all-reduce of all gradients.
        step_s: Seconds of the optimizer step.
    """
    return forward_s + max(backward_s, allreduce_s) + step_s


def overlap_bound_s(
    forward_s: float, backward_s: float, allreduce_s: float, step_s: float
) -> float:
    """The bound when all-reduces may run on into the next forward:
    ``max(forward + backward, all-reduce) + step``.

    Every iteration still computes its passes and its step, and the link still carries one
    all-reduce of all gradients per iteration; nothing else need wait.

    Args:
        forward_s: Seconds of forward.
        backward_s: Seconds of backward.
        allreduce_s: Seconds of one all-reduce of all gradients.
        step_s: Seconds of the optimizer step.
    """
    return max(forward_s + backward_s, allreduce_s) + step_s


@dataclass(frozen=True)
class LaunchContext:
    """How a launch was set up: its target ratio (None for a fixed link) and link.

    On emulated compute ``link`` is the target cluster's link and ``emulated_link`` the
    dilated rate the ranks ran on; ``target`` is the target cluster's all-reduce cost at the
    launch's ranks (``--network``), when given.
    """

    ratio: float | None
    link: str
    clamped: bool = False
    wanted_link: str | None = None
    emulated_link: str | None = None
    target: CostModel | None = None
    target_name: str | None = None


@dataclass(frozen=True)
class Row(BaseRow):
    """One line of the results: one strategy on one model at one link."""

    model: str
    batch: int
    ranks: int
    ratio: float | None
    link: str
    clamped: bool
    wanted_link: str | None
    comm_compute: float
    compute_s: float
    forward_s: float
    backward_s: float
    step_s: float
    allreduce_s: float
    strategy: str
    iteration_s: float
    iteration_p25_s: float
    iteration_p75_s: float
    samples: int
    speedup_vs_ddp: float | None
    buckets: int | str
    bound_s: float
    time_over_bound: float
    contended_bound_s: float | None = None
    time_over_contended: float | None = None
    #: The bound of all-reduces that may run on into the next forward (see
    #: :func:`overlap_bound_s`), and this row's time over it.
    overlap_bound_s: float | None = None
    time_over_overlap_bound: float | None = None
    predicted_s: float | None = None
    cost_a: float | None = None
    cost_b: float | None = None
    plan: str | None = None
    #: The strategy's base name, the channels and compression it was asked for, the channels
    #: it used, and its speed-up over the same strategy on one channel in the same launch.
    base_strategy: str = ""
    channels: str = "1"
    compression: str = "none"
    chosen_channels: int | None = None
    channel_choice: str | None = None
    #: What DataParallel's trials of candidate plans measured, and which plan it kept.
    tuning: str | None = None
    speedup_vs_one_channel: float | None = None
    #: What the ranks computed on (:meth:`interlace.emulate.Compute.label`); on emulated
    #: compute every time above is undilated (measured / D).
    compute: str = "real"
    emulated_link: str | None = None
    #: The measured cluster's all-reduce ``a + b*M`` (undilated): ``a`` from an all-reduce of
    #: one float, ``b`` from the all-reduce of all gradients; and the target's, when given.
    startup_s: float | None = None
    per_byte_s: float | None = None
    target_startup_s: float | None = None
    target_per_byte_s: float | None = None
    #: The total norm every strategy clipped its gradients to before its step (None: none).
    clip_grad_norm: float | None = None
    #: The ranks' host CPU per iteration (median, summed over ranks) over the cores times the
    #: median iteration: near 1 the row times the host's cores, not the emulated cluster.
    host_cpu_share: float | None = None


def rows_from_measurement(measurement: Measurement, context: LaunchContext) -> list[Row]:
    """Medians, speed-ups against DDP of the same launch, and the ideal-overlap bound.

    Args:
        measurement: What one launch measured.
        context: Its target ratio and link.
    """
    measurement = measurement.undilated()
    forward = statistics.median(measurement.forward_s)
    backward = statistics.median(measurement.backward_s)
    step = statistics.median(measurement.step_s)
    allreduce = statistics.median(measurement.allreduce_s)
    compute = forward + backward + step
    emulated = measurement.device_forward_s is not None
    if emulated:
        # The bound of the traced device: its forward and backward, not the sleeps' overshoot.
        passes = (measurement.device_forward_s or 0.0, measurement.device_backward_s or 0.0)
    else:
        passes = (forward, backward)
    bound = ideal_bound_s(*passes, allreduce, step)
    ahead = overlap_bound_s(*passes, allreduce, step)
    startup = statistics.median(measurement.latency_s) if measurement.latency_s else None
    per_byte = (
        None
        if startup is None or measurement.gradient_bytes <= 0
        else max(allreduce - startup, 0.0) / measurement.gradient_bytes
    )
    target = context.target
    contended = statistics.median(measurement.overlapped_s) if measurement.overlapped_s else None
    medians = {s.strategy: statistics.median(s.iteration_s) for s in measurement.strategies}
    ddp = medians.get("ddp")
    rows = []
    for samples in measurement.strategies:
        p25, median, p75 = quartiles(samples.iteration_s)
        base, channels, compression = parse_variant(samples.strategy)
        one_channel = medians.get(variant_label(base, 1, compression))
        rows.append(
            Row(
                model=measurement.model,
                batch=measurement.batch,
                ranks=measurement.ranks,
                ratio=context.ratio,
                link=context.link,
                clamped=context.clamped,
                wanted_link=context.wanted_link,
                comm_compute=allreduce / compute,
                compute_s=compute,
                forward_s=forward,
                backward_s=backward,
                step_s=step,
                allreduce_s=allreduce,
                strategy=samples.strategy,
                iteration_s=median,
                iteration_p25_s=p25,
                iteration_p75_s=p75,
                samples=len(samples.iteration_s),
                speedup_vs_ddp=None if ddp is None else ddp / median,
                buckets="-" if samples.buckets is None else samples.buckets,
                bound_s=bound,
                time_over_bound=median / bound,
                contended_bound_s=contended,
                time_over_contended=None if contended is None else median / contended,
                overlap_bound_s=ahead,
                time_over_overlap_bound=median / ahead,
                predicted_s=samples.predicted_s,
                cost_a=samples.cost_a,
                cost_b=samples.cost_b,
                plan=samples.plan,
                base_strategy=base,
                channels=str(channels),
                compression=compression or "none",
                chosen_channels=samples.chosen_channels,
                channel_choice=samples.channel_choice,
                tuning=samples.tuning,
                speedup_vs_one_channel=(
                    None if one_channel is None or channels == 1 else one_channel / median
                ),
                compute=measurement.compute,
                emulated_link=context.emulated_link,
                startup_s=startup,
                per_byte_s=per_byte,
                target_startup_s=None if target is None else target.a,
                target_per_byte_s=None if target is None else target.b,
                host_cpu_share=_host_share(samples.host_cpu_s, median, measurement.cores),
            )
        )
    if emulated and rows:
        for name, value in ((BOUND_ROW, bound), (OVERLAP_BOUND_ROW, ahead)):
            rows.append(
                replace(
                    rows[-1],
                    strategy=name,
                    base_strategy=name,
                    iteration_s=value,
                    iteration_p25_s=value,
                    iteration_p75_s=value,
                    samples=0,
                    speedup_vs_ddp=None if ddp is None else ddp / value,
                    buckets="-",
                    time_over_bound=value / bound,
                    time_over_overlap_bound=value / ahead,
                    predicted_s=None,
                    cost_a=None,
                    cost_b=None,
                    plan=None,
                    channels="1",
                    compression="none",
                    chosen_channels=None,
                    channel_choice=None,
                    tuning=None,
                    speedup_vs_one_channel=None,
                    host_cpu_share=None,
                )
            )
    return rows


def _host_share(cpu_s: list[float] | None, iteration_s: float, cores: int) -> float | None:
    """The ranks' median host CPU per iteration over ``cores`` times ``iteration_s``."""
    if not cpu_s or cores <= 0 or iteration_s <= 0:
        return None
    return statistics.median(cpu_s) / (cores * iteration_s)


def _ratio_text(row: Row) -> str:
    return "-" if row.ratio is None else f"{row.ratio:g}"


def _link_text(row: Row) -> str:
    if row.clamped and row.wanted_link is not None:
        return f"{row.link} (clamped; wanted {row.wanted_link})"
    if row.emulated_link is not None:
        return f"{row.link} (emulated at {row.emulated_link})"
    return row.link


def format_cluster(rows: Sequence[Row]) -> str:
    """One line per launch: the measured cluster's all-reduce ``a`` and ``b`` (undilated on
    emulated compute) beside the target cluster's, where ``--network`` named one.

    ``b`` is also shown as the per-link rate a ring of the launch's ranks would need for it
    (``b = 2(n-1)/n / rate``).

    Args:
        rows: The rows, in order.
    """
    lines = []
    for group in _groups(rows):
        first = group[0]
        if first.startup_s is None or first.per_byte_s is None:
            continue
        line = (
            f"{first.model} at {_link_text(first)}, {first.ranks} ranks, {first.compute}: "
            f"measured a = {first.startup_s * 1e3:.3f} ms, "
            f"b = {_per_byte_text(first.per_byte_s, first.ranks)}"
        )
        if first.target_startup_s is not None and first.target_per_byte_s is not None:
            line += (
                f"; target a = {first.target_startup_s * 1e3:.3f} ms, "
                f"b = {_per_byte_text(first.target_per_byte_s, first.ranks)}"
            )
        lines.append(line)
    return "\n".join(lines)


def _per_byte_text(per_byte_s: float, ranks: int) -> str:
    if per_byte_s <= 0:
        return "0 ns/B"
    link_bps = 2.0 * (ranks - 1) / ranks * 8.0 / per_byte_s
    return f"{per_byte_s * 1e9:.3f} ns/B ({format_rate(link_bps)} per ring link)"


def format_table(rows: Sequence[Row]) -> str:
    """The markdown table: one line per model x ratio x strategy.

    Args:
        rows: The rows, in order.
    """
    head = (
        "model",
        "compute",
        "batch",
        "target ratio",
        "link",
        "comm/compute",
        "strategy",
        "channels",
        "k used",
        "compression",
        "iteration ms (p25-p75)",
        "vs DDP",
        "vs 1 channel",
        "buckets",
        "bound ms",
        "time/bound",
        "overlap bound ms",
        "time/overlap bound",
        "contended bound ms",
        "time/contended",
    )
    lines = [
        (
            row.model,
            row.compute,
            str(row.batch),
            _ratio_text(row),
            _link_text(row),
            number(row.comm_compute),
            row.base_strategy or row.strategy,
            row.channels,
            "-" if row.chosen_channels is None else str(row.chosen_channels),
            row.compression,
            f"{ms(row.iteration_s)} ({ms(row.iteration_p25_s)}-{ms(row.iteration_p75_s)})",
            speedup(row.speedup_vs_ddp),
            speedup(row.speedup_vs_one_channel),
            str(row.buckets),
            ms(row.bound_s),
            number(row.time_over_bound),
            ms(row.overlap_bound_s),
            number(row.time_over_overlap_bound),
            ms(row.contended_bound_s),
            number(row.time_over_contended),
        )
        for row in rows
    ]
    return markdown_table(head, "llrrlrlrrlrrrrrrrrrr", lines)


def format_summary(rows: Sequence[Row]) -> str:
    """One line per model x ratio: each strategy's speed-up vs DDP and its time over both
    bounds.

    Args:
        rows: The rows, in order.
    """
    strategies = list(dict.fromkeys(row.strategy for row in rows))
    head = [
        "model",
        "compute",
        "target ratio",
        "link",
        "comm/compute",
        "bound ms",
        "overlap bound ms",
        "contended bound ms",
        *(f"{s} vs DDP (t/bound, t/overlap bound)" for s in strategies),
    ]
    lines = []
    for group in _groups(rows):
        first = group[0]
        by_strategy = {row.strategy: row for row in group}
        cells = [
            first.model,
            first.compute,
            _ratio_text(first),
            _link_text(first),
            number(first.comm_compute),
            ms(first.bound_s),
            ms(first.overlap_bound_s),
            ms(first.contended_bound_s),
        ]
        for strategy in strategies:
            row = by_strategy.get(strategy)
            cells.append(
                "-"
                if row is None
                else f"{speedup(row.speedup_vs_ddp)} ({number(row.time_over_bound)}, "
                f"{number(row.time_over_overlap_bound)})"
            )
        lines.append(cells)
    return markdown_table(head, "llrlrrrr" + "r" * len(strategies), lines)


def _groups(rows: Sequence[Row]) -> list[list[Row]]:
    """Rows grouped by (model, ratio, link), in first-seen order."""
    grouped: dict[tuple[str, float | None, str], list[Row]] = {}
    for row in rows:
        grouped.setdefault((row.model, row.ratio, row.link), []).append(row)
    return list(grouped.values())


def plot_speedups(rows: Sequence[Row], path: str | Path, title: str = "") -> None:
    """Grouped bars of speed-up vs DDP: one panel per model, a group per ratio, a bar per
    strategy, and a line at 1.0 (DDP's own speed).

    Args:
        rows: The rows (at least one).
        path: Where the PNG goes.
        title: The figure's title (a default when empty).
    """
    import matplotlib  # noqa: PLC0415 - heavy import, only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after choosing the Agg backend

    models = list(dict.fromkeys(row.model for row in rows))
    strategies = list(dict.fromkeys(row.strategy for row in rows))
    if not models:
        raise ValueError("no rows to plot")
    figure, axes = plt.subplots(
        1, len(models), figsize=(3.2 * len(models) + 1.0, 4.0), squeeze=False, sharey=True
    )
    width = 0.8 / max(len(strategies), 1)
    colours = plt.get_cmap("tab10")
    for panel, model in zip(axes[0], models, strict=True):
        groups = [g for g in _groups(rows) if g[0].model == model]
        for index, strategy in enumerate(strategies):
            xs, ys = [], []
            for position, group in enumerate(groups):
                row = next((r for r in group if r.strategy == strategy), None)
                if row is not None and row.speedup_vs_ddp is not None:
                    xs.append(position + (index - (len(strategies) - 1) / 2) * width)
                    ys.append(row.speedup_vs_ddp)
            panel.bar(xs, ys, width=width, label=strategy, color=colours(index % 10))
        panel.axhline(1.0, color="black", linewidth=0.8)
        panel.set_xticks(range(len(groups)))
        panel.set_xticklabels(
            [f"r={_ratio_text(g[0])}\n{g[0].comm_compute:.2f}\n{g[0].link}" for g in groups],
            fontsize=7,
        )
        panel.set_title(model)
        panel.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("speed-up vs DDP")
    handles, labels = axes[0][0].get_legend_handles_labels()
    # Below the panels, so no bar is ever hidden behind it.
    figure.legend(
        handles, labels, loc="lower center", ncol=len(strategies), fontsize=8, frameon=False
    )
    figure.suptitle(title or "speed-up vs DDP (target ratio / measured comm/compute / link)")
    figure.tight_layout(rect=(0.0, 0.07, 1.0, 1.0))
    figure.savefig(path, dpi=120)
    plt.close(figure)


def one_line(rows: Sequence[Row]) -> str:
    """One launch's rows in one line, as the progress bar shows them.

    Args:
        rows: The rows of one launch (at least one).
    """
    first = rows[0]
    parts = ", ".join(
        f"{row.strategy} {row.iteration_s * 1e3:.0f} ms"
        + ("" if row.speedup_vs_ddp is None else f" ({row.speedup_vs_ddp:.2f}x)")
        for row in rows
    )
    return (
        f"{first.model} ({first.compute}) ratio {_ratio_text(first)} at {_link_text(first)} "
        "(measured "
        f"{first.comm_compute:.2f}, bound {ms(first.bound_s, 0)} ms, contended bound "
        f"{ms(first.contended_bound_s)} ms): {parts}"
    )
