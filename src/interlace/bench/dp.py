"""``interlace bench dp``: every data-parallel strategy against PyTorch DDP, at chosen regimes.

Whether overlapping gradient communication with backward pays depends on the regime: how long
one all-reduce of all gradients takes compared with the computation of an iteration. This
benchmark states the regime of every row and sets it on purpose. For each model it first
measures, on the emulated cluster at a reference link, the compute time of one iteration
(forward + backward + optimizer step of the plain module, under the same contention of N ranks
on this machine's cores) and the time of one all-reduce of all gradients. Communication time
scales as ``1/rate``, so the link rate that gives a communication/compute ratio ``r`` follows
(:func:`rate_for_ratio`); rates are clamped to what the emulation reproduces faithfully.

Then one launch per (model, ratio) builds every strategy's wrapper (:func:`wrap_model`) on its
own copy of the model (same seed) with its own SGD optimizer, warms each up until its buckets
are final (DataParallel's plan is built; DDP has rebuilt its buckets), and times iterations in
round-robin blocks over the strategies, so that slow phases of a noisy shared machine hit all of
them alike. An iteration (forward + backward + step, wall clock) lasts until its slowest rank is
done, so each iteration's time is the maximum over ranks; a row gives the median. The same
rounds also re-measure the plain module's forward, backward and step and the all-reduce of all
gradients at the row's link, which give the row's measured ratio and its ideal-overlap bound:
``forward + max(backward, all-reduce) + step``, what perfect overlap of one all-reduce of
everything with the whole backward would take. On CPUs that bound is out of reach for every
strategy, since gloo and the kernel's network stack compute on the same cores as the ranks; so
the rounds also time the plain iteration with that one all-reduce running alongside backward,
the *contended bound*: perfect overlap as these cores can run it.

Inputs are synthetic batches generated once per rank and reused, so data loading is never
timed. The default per-rank batch differs per model (:data:`DEFAULT_BATCH`): it keeps each
model's compute near 0.05-0.5 s on a 2-core machine, which both bounds the run time and puts the
rates for ratios 0.5..2 inside the range the emulation reproduces.

MG-WFBP fits its cost model on the live group the first time it plans; fitted models are cached
per (backend, world size, link). Every run of this benchmark uses a fresh cache folder, so a
model fitted on an earlier machine state can never stand in for a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from interlace.cliutil import standalone_main
from interlace.errors import UsageError

PROG = "interlace bench dp"

DEFAULT_MODELS: tuple[str, ...] = ("mlp", "resnet20", "resnet56", "vgg11", "transformer")
DEFAULT_STRATEGIES: tuple[str, ...] = ("ddp", "wfbp", "fixed", "single", "mgwfbp")
DEFAULT_RATIOS: tuple[float, ...] = (0.5, 1.0, 2.0)
DEFAULT_INPUT_SHAPE: tuple[int, ...] = (3, 32, 32)
NUM_CLASSES = 10

#: Per-rank batch of each zoo model on CIFAR-10 shapes, chosen so that compute per iteration is
#: 0.05-0.5 s with 4 ranks on 2 cores: long enough that the mlp is not all per-operation overhead
#: (it needs a large batch for that), short enough that the default run fits in 15 minutes and
#: that ratio 2 does not ask for links slower than :data:`MIN_LINK`; vgg11 needs 8 so that ratio
#: 0.5 does not ask for more than :data:`MAX_LINK`.
DEFAULT_BATCH: dict[str, int] = {
    "mlp": 512,
    "resnet20": 8,
    "resnet32": 8,
    "resnet56": 4,
    "vgg11": 8,
    "transformer": 8,
}
#: Batch of a model not in :data:`DEFAULT_BATCH` (a user's own ``package.module:callable``).
FALLBACK_BATCH = 32

#: The link the calibration runs at: fast enough to be quick, slow enough to be faithful.
REF_LINK = "1gbit"
#: Slowest link chosen: below it, tbf's 96 KiB bucket is a visible share of a transfer.
MIN_LINK = "20mbit"
#: Fastest link chosen: on a 2-core machine faster shaping is not reproduced faithfully.
MAX_LINK = "2.5gbit"

DEFAULT_ITERS = 12
DEFAULT_WARMUP = 2
DEFAULT_ROUNDS = 3
DEFAULT_NPROCS = 4
DEFAULT_TIMEOUT_S = 900.0

#: ``--quick``: two models at one ratio and fewer iterations, about two minutes.
QUICK_MODELS: tuple[str, ...] = ("mlp", "resnet20")
QUICK_RATIOS: tuple[float, ...] = (1.0,)
QUICK_ITERS = 8
QUICK_WARMUP = 1
QUICK_ROUNDS = 2

#: Distinct synthetic batches cycled through, so no strategy trains on one batch only.
_BATCHES = 4
#: Upper bound on warm-up steps spent waiting for a wrapper's plan; a wrapper that never plans
#: is a bug, reported instead of looping forever.
_MAX_PLAN_STEPS = 200
#: DDP rebuilds its buckets in gradient-ready order during its second iteration.
_DDP_REBUILD_STEPS = 2

_T = TypeVar("_T")


# ================================================================================ pure parts


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


def format_rate(rate_bps: float) -> str:
    """``rate_bps`` as a ``tc``/``--link`` rate with 3 significant digits (``87.5mbit``)."""
    if not rate_bps > 0 or not math.isfinite(rate_bps):
        raise ValueError(f"a rate must be a finite number > 0, got {rate_bps}")
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate_bps >= scale or unit == "kbit":
            value = rate_bps / scale
            text = f"{value:.3g}" if value < 1000 else f"{value:.0f}"
            return f"{text}{unit}"
    raise AssertionError("unreachable")


def ideal_bound_s(forward_s: float, backward_s: float, allreduce_s: float, step_s: float) -> float:
    """The ideal-overlap iteration time: ``forward + max(backward, all-reduce) + step``.

    What an iteration would take if one all-reduce of all gradients ran entirely alongside
    backward at no cost to it. The optimizer step is in both this bound and the timed iteration,
    so their ratio compares like with like.
    """
    return forward_s + max(backward_s, allreduce_s) + step_s


def parse_ratios(text: str) -> tuple[float, ...]:
    """``"0.5,1,2"`` -> ``(0.5, 1.0, 2.0)``; every ratio must be a finite number > 0."""
    ratios: list[float] = []
    for part in text.split(","):
        item = part.strip()
        try:
            value = float(item)
        except ValueError:
            raise UsageError(
                f"--ratios: {item!r} is not a number; give comma-separated communication/compute "
                "ratios such as 0.5,1,2"
            ) from None
        if not value > 0 or not math.isfinite(value):
            raise UsageError(f"--ratios: every ratio must be > 0, got {item}")
        ratios.append(value)
    return tuple(dict.fromkeys(ratios))


def parse_names(text: str, allowed: Sequence[str] | None, what: str, one: str) -> tuple[str, ...]:
    """Comma-separated names for ``--{what}``, each in ``allowed`` (any when None), duplicates
    dropped; ``one`` names a single item in messages."""
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not names:
        raise UsageError(f"--{what}: name at least one")
    if allowed is not None:
        for name in names:
            if name not in allowed:
                raise UsageError(
                    f"--{what}: unknown {one} {name!r}; choose from {', '.join(allowed)}"
                )
    return names


def variant_label(strategy: str, channels: int | str = 1, compression: str | None = None) -> str:
    """The name of a strategy run with ``channels`` and ``compression``: ``mgwfbp``,
    ``mgwfbp/k=auto``, ``mgwfbp/k=2/fp16``, ``ddp/fp16``."""
    label = strategy
    if channels != 1:
        label += f"/k={channels}"
    if compression is not None:
        label += f"/{compression}"
    return label


def parse_variant(label: str) -> tuple[str, int | str, str | None]:
    """``(strategy, channels, compression)`` of a :func:`variant_label`."""
    strategy, *options = label.split("/")
    channels: int | str = 1
    compression = None
    for option in options:
        if option.startswith("k="):
            value = option[2:]
            channels = value if value == "auto" else int(value)
        else:
            compression = option
    return strategy, channels, compression


def parse_shape(text: str) -> tuple[int, ...]:
    """``"3,32,32"`` (or ``3x32x32``) -> ``(3, 32, 32)``; every size a positive int."""
    parts = text.replace("x", ",").split(",")
    try:
        shape = tuple(int(part) for part in parts)
    except ValueError:
        raise UsageError(f"--input-shape: expected sizes such as 3,32,32, got {text!r}") from None
    if not shape or min(shape) < 1:
        raise UsageError(f"--input-shape: sizes must be positive, got {text!r}")
    return shape


@dataclass(frozen=True)
class StrategySamples:
    """What one strategy's ranks measured in one launch."""

    strategy: str
    #: Seconds per timed iteration, each the maximum over ranks.
    iteration_s: list[float]
    #: Buckets per iteration (DDP's from its logging data), None where unknown.
    buckets: int | None
    warmup_steps: int
    #: DataParallel's predicted iteration time (without the step) and its cost model.
    predicted_s: float | None = None
    cost_a: float | None = None
    cost_b: float | None = None
    plan: str | None = None
    #: Channels the plan uses (``channels="auto"``: the ones it chose) and why.
    chosen_channels: int | None = None
    channel_choice: str | None = None
    #: The final plan's buckets as tensor names, in launch order (DataParallel only), and what
    #: its trials of candidate plans measured.
    bucket_tensors: list[list[str]] | None = None
    tuning: str | None = None


@dataclass(frozen=True)
class Measurement:
    """Everything one (model, link) launch measured; per-sample values are maxima over ranks."""

    model: str
    batch: int
    ranks: int
    gradient_bytes: int
    tensors: int
    strategies: list[StrategySamples]
    forward_s: list[float]
    backward_s: list[float]
    step_s: list[float]
    allreduce_s: list[float]
    #: Iterations of the plain module with one all-reduce of all gradients running alongside
    #: backward (see :func:`_overlapped_sample`); empty when not measured.
    overlapped_s: list[float] = field(default_factory=list)
    #: The simulator's contention probes (a :class:`interlace.sim.contention.ContentionSamples`)
    #: when the job asked for them.
    contention: Any = None


@dataclass(frozen=True)
class LaunchContext:
    """How a launch was set up: its target ratio (None for a fixed link) and link."""

    ratio: float | None
    link: str
    clamped: bool = False
    wanted_link: str | None = None


@dataclass(frozen=True)
class Row:
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _quartiles(samples: Sequence[float]) -> tuple[float, float, float]:
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    q1, q2, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, q2, q3


def rows_from_measurement(measurement: Measurement, context: LaunchContext) -> list[Row]:
    """Medians, speed-ups against DDP of the same launch, and the ideal-overlap bound."""
    forward = statistics.median(measurement.forward_s)
    backward = statistics.median(measurement.backward_s)
    step = statistics.median(measurement.step_s)
    allreduce = statistics.median(measurement.allreduce_s)
    compute = forward + backward + step
    bound = ideal_bound_s(forward, backward, allreduce, step)
    contended = statistics.median(measurement.overlapped_s) if measurement.overlapped_s else None
    medians = {s.strategy: statistics.median(s.iteration_s) for s in measurement.strategies}
    ddp = medians.get("ddp")
    rows = []
    for samples in measurement.strategies:
        p25, median, p75 = _quartiles(samples.iteration_s)
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
            )
        )
    return rows


def _ratio_text(row: Row) -> str:
    return "-" if row.ratio is None else f"{row.ratio:g}"


def _link_text(row: Row) -> str:
    if row.clamped and row.wanted_link is not None:
        return f"{row.link} (clamped; wanted {row.wanted_link})"
    return row.link


def format_table(rows: Sequence[Row]) -> str:
    """The markdown table: one line per model x ratio x strategy."""
    lines = [
        "| model | batch | target ratio | link | comm/compute | strategy | channels | k used | "
        "compression | iteration ms (p25-p75) | vs DDP | vs 1 channel | buckets | bound ms | "
        "time/bound | contended bound ms | time/contended |",
        "|---|---:|---:|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        speedup = "-" if row.speedup_vs_ddp is None else f"{row.speedup_vs_ddp:.2f}x"
        versus_one = (
            "-" if row.speedup_vs_one_channel is None else f"{row.speedup_vs_one_channel:.2f}x"
        )
        used = "-" if row.chosen_channels is None else str(row.chosen_channels)
        lines.append(
            f"| {row.model} | {row.batch} | {_ratio_text(row)} | {_link_text(row)} | "
            f"{row.comm_compute:.2f} | {row.base_strategy or row.strategy} | {row.channels} | "
            f"{used} | {row.compression} | {row.iteration_s * 1e3:.1f} "
            f"({row.iteration_p25_s * 1e3:.1f}-{row.iteration_p75_s * 1e3:.1f}) | {speedup} | "
            f"{versus_one} | {row.buckets} | {row.bound_s * 1e3:.1f} | {row.time_over_bound:.2f} | "
            f"{_ms(row.contended_bound_s)} | {_ratio(row.time_over_contended)} |"
        )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_summary(rows: Sequence[Row]) -> str:
    """One line per model x ratio: each strategy's speed-up vs DDP and its time/bound."""
    strategies = list(dict.fromkeys(row.strategy for row in rows))
    groups = _groups(rows)
    header = (
        "| model | target ratio | link | comm/compute | bound ms | contended bound ms | "
        + " | ".join(f"{s} vs DDP (t/bound)" for s in strategies)
    )
    lines = [header + " |", "|---|---:|---|---:|---:|---:|" + "---:|" * len(strategies)]
    for group in groups:
        first = group[0]
        by_strategy = {row.strategy: row for row in group}
        cells = []
        for strategy in strategies:
            row = by_strategy.get(strategy)
            if row is None:
                cells.append("-")
                continue
            speedup = "-" if row.speedup_vs_ddp is None else f"{row.speedup_vs_ddp:.2f}x"
            cells.append(f"{speedup} ({row.time_over_bound:.2f})")
        lines.append(
            f"| {first.model} | {_ratio_text(first)} | {_link_text(first)} | "
            f"{first.comm_compute:.2f} | {first.bound_s * 1e3:.1f} | "
            f"{_ms(first.contended_bound_s)} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def _groups(rows: Sequence[Row]) -> list[list[Row]]:
    """Rows grouped by (model, ratio, link), in first-seen order."""
    grouped: dict[tuple[str, float | None, str], list[Row]] = {}
    for row in rows:
        grouped.setdefault((row.model, row.ratio, row.link), []).append(row)
    return list(grouped.values())


def plot_speedups(rows: Sequence[Row], path: str | Path, title: str = "") -> None:
    """Grouped bars of speed-up vs DDP: one panel per model, a group per ratio, a bar per
    strategy, and a line at 1.0 (DDP's own speed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


# ================================================================================ rank side


@dataclass(frozen=True)
class CalibrationJob:
    """Measure compute and all-reduce times of ``models`` (one per-rank batch each)."""

    models: tuple[str, ...]
    batches: tuple[int, ...]
    input_shape: tuple[int, ...]
    seed: int = 0
    iters: int = 5
    warmup: int = 2


@dataclass(frozen=True)
class Calibration:
    """One model's compute time per iteration and all-reduce times at the calibration link."""

    model: str
    compute_s: float
    allreduce_s: float
    latency_s: float


@dataclass(frozen=True)
class MeasureJob:
    """Time ``strategies`` on ``model`` in round-robin blocks after a warm-up."""

    model: str
    batch: int
    input_shape: tuple[int, ...]
    strategies: tuple[str, ...]
    iters: int
    warmup: int
    rounds: int
    seed: int = 0
    #: Also take the simulator's contention probes (:mod:`interlace.sim.contention`) in every
    #: round: the start-up and synchronisation probes as a block of their own, the bytes probe
    #: in the reference slot.
    probe_contention: bool = False


@dataclass
class _Contender:
    strategy: str
    wrapper: Any
    optimizer: Any
    times: list[float] = field(default_factory=list)
    warmup_steps: int = 0


def rank_entry(fn: Callable[[_T], Any], job: _T, collective_timeout_s: float) -> Any:
    """One rank: join the gloo group from torchrun's environment, run ``fn(job)``, leave."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    # Models that fit their batches drive gradients towards denormal floats, which run an order
    # of magnitude slower on CPUs and would slow late iterations for no reason a GPU shares.
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=collective_timeout_s))
    value = fn(job)
    # Leave together: a rank tearing its group down while a peer still finishes the last
    # collective can abort that peer.
    dist.barrier()
    dist.destroy_process_group()
    return value


def _synthetic_batches(
    batch: int, input_shape: tuple[int, ...], seed: int, rank: int
) -> list[tuple[Any, Any]]:
    import torch

    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    return [
        (
            torch.randn(batch, *input_shape, generator=generator),
            torch.randint(0, NUM_CLASSES, (batch,), generator=generator),
        )
        for _ in range(_BATCHES)
    ]


def _compute_sample(
    model: Any, optimizer: Any, inputs: Any, targets: Any
) -> tuple[float, float, float]:
    """Forward, backward and step seconds of the plain module, started together on all ranks."""
    import torch.distributed as dist
    from torch.nn import functional

    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad()
    loss = functional.cross_entropy(model(inputs), targets)
    forward_end = time.perf_counter()
    loss.backward()
    backward_end = time.perf_counter()
    optimizer.step()
    return forward_end - start, backward_end - forward_end, time.perf_counter() - backward_end


def _overlapped_sample(
    model: Any, optimizer: Any, inputs: Any, targets: Any, flat: Any
) -> tuple[float, float, float]:
    """One plain iteration with an all-reduce of ``flat`` (all gradients' bytes) launched as
    backward starts and awaited before the step: seconds of the iteration, of its backward, and
    from backward's start to the all-reduce's end.

    The ideal-overlap bound assumes communication costs compute nothing. On a CPU that is false:
    gloo and the kernel's network stack run on the cores the ranks compute on. This is the
    ideal overlap as the machine can actually run it (every byte sendable from the start of
    backward, one start-up), so a strategy's distance from it is the strategy's own doing. The
    simulator's contention calibration reads the other two times.
    """
    import torch.distributed as dist
    from torch.nn import functional

    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad()
    loss = functional.cross_entropy(model(inputs), targets)
    backward_start = time.perf_counter()
    handle = dist.all_reduce(flat, async_op=True)
    ends = record_completion(handle)
    loss.backward()
    backward_end = time.perf_counter()
    if handle is not None:
        handle.wait()
    comm_end = ends[0] if ends else time.perf_counter()
    optimizer.step()
    return (
        time.perf_counter() - start,
        backward_end - backward_start,
        comm_end - backward_start,
    )


def record_completion(handle: Any) -> list[float]:
    """A list that receives ``time.perf_counter()`` when the async collective ``handle``
    completes (empty until then; stays empty for a None handle).

    Read after waiting on it, the time is the collective's own end, which may lie before the
    wait: an end read when a wait after backward returns is never earlier than backward's.
    """
    ends: list[float] = []
    if handle is not None:
        # The callback runs on the backend's thread as the collective completes.
        handle.get_future().then(lambda _future: ends.append(time.perf_counter()))
    return ends


def _allreduce_sample(flat: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(flat)
    return time.perf_counter() - start


def _max_over_ranks(samples: Sequence[float]) -> list[float]:
    """Element-wise maximum across ranks (an event ends when its slowest rank is done)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(list(samples), dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    values: list[float] = tensor.tolist()
    return values


def _plain(model_name: str, input_shape: tuple[int, ...], seed: int) -> tuple[Any, Any]:
    import torch

    from interlace.zoo import build_model

    torch.manual_seed(seed)
    model = build_model(model_name, input_shape, NUM_CLASSES)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _flat_gradients(model: Any) -> Any:
    import torch

    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return torch.zeros(numel, dtype=torch.float32)


def calibrate_rank(job: CalibrationJob) -> list[Calibration]:
    """Per model: median compute time per iteration, all-reduce of all gradients, tiny
    all-reduce (the rate-independent part); every sample is a maximum over ranks."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    results = []
    for name, batch in zip(job.models, job.batches, strict=True):
        model, optimizer = _plain(name, job.input_shape, job.seed)
        batches = _synthetic_batches(batch, job.input_shape, job.seed, rank)
        computes = []
        for index in range(job.warmup + job.iters):
            sample = _compute_sample(model, optimizer, *batches[index % len(batches)])
            if index >= job.warmup:
                computes.append(sum(sample))
        flat = _flat_gradients(model)
        _allreduce_sample(flat)
        allreduces = [_allreduce_sample(flat) for _ in range(job.iters)]
        tiny = torch.zeros(1)
        for _ in range(2):
            _allreduce_sample(tiny)
        latencies = [_allreduce_sample(tiny) for _ in range(2 * job.iters)]
        results.append(
            Calibration(
                name,
                statistics.median(_max_over_ranks(computes)),
                statistics.median(_max_over_ranks(allreduces)),
                statistics.median(_max_over_ranks(latencies)),
            )
        )
    return results


def _train_step(contender: _Contender, inputs: Any, targets: Any) -> None:
    from torch.nn import functional

    contender.optimizer.zero_grad()
    loss = functional.cross_entropy(contender.wrapper(inputs), targets)
    loss.backward()
    contender.optimizer.step()


def _wrap(model: Any, label: str) -> Any:
    """The wrapper of ``model`` a :func:`variant_label` names; DDP with its own defaults (1 MB
    first bucket)."""
    from interlace.strategies import wrap_model

    strategy, channels, compression = parse_variant(label)
    return wrap_model(model, strategy, channels=channels, compression=compression)


def _is_final(contender: _Contender, steps: int) -> bool:
    """Whether the wrapper's buckets are what it will use from now on."""
    if parse_variant(contender.strategy)[0] == "ddp":
        return steps >= _DDP_REBUILD_STEPS
    return bool(getattr(contender.wrapper, "planning_done", False))


def _ddp_buckets(wrapper: Any) -> int | None:
    """DDP's bucket count after its rebuild, from its logging data (a private API: None if it
    is missing or changed)."""
    try:
        data = wrapper._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
    except Exception:
        return None
    if not isinstance(sizes, str) or not sizes.strip():
        return None
    return len(sizes.split(","))


def _blocks(iters: int, rounds: int) -> list[int]:
    """``iters`` split into ``rounds`` blocks as even as possible (no empty block)."""
    rounds = max(1, min(rounds, iters))
    return [iters // rounds + (1 if index < iters % rounds else 0) for index in range(rounds)]


def _round_order(slots: int, round_index: int) -> list[int]:
    """The order of ``slots`` in round ``round_index``: rows of a balanced Latin square
    (Williams design). Over ``slots`` rounds (twice that for an odd count) every slot runs once
    in every position and right after every other slot equally often.

    What a block follows changes how it runs (small all-reduces right after a bulk one pace up
    to 2x slower on the emulated cluster); a plain rotation keeps each slot behind the same one
    every round, so that carry-over would land on the same slot every time.
    """
    first = [0]
    low, high = 1, slots - 1
    while low <= high:
        first.append(low)
        low += 1
        if low <= high:
            first.append(high)
            high -= 1
    row = [(slot + round_index) % slots for slot in first]
    if slots % 2 == 1 and (round_index // slots) % 2 == 1:
        row.reverse()
    return row


def measure_rank(job: MeasureJob) -> Measurement:
    """Warm every strategy up, then time them all in round-robin blocks (a new order every
    round), with the plain module's compute and the all-reduce of all gradients measured in the
    same rounds."""
    import torch
    import torch.distributed as dist

    from interlace.zoo import build_model

    rank = dist.get_rank()
    batches = _synthetic_batches(job.batch, job.input_shape, job.seed, rank)
    contenders = []
    for strategy in job.strategies:
        torch.manual_seed(job.seed)
        model = build_model(job.model, job.input_shape, NUM_CLASSES)
        wrapper = _wrap(model, strategy)
        optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.01, momentum=0.9)
        contenders.append(_Contender(strategy, wrapper, optimizer))
    plain, plain_optimizer = _plain(job.model, job.input_shape, job.seed)
    flat = _flat_gradients(plain)
    alongside = _flat_gradients(plain)

    counter = 0

    def next_batch() -> tuple[Any, Any]:
        nonlocal counter
        counter += 1
        return batches[counter % len(batches)]

    for contender in contenders:
        steps = 0
        while not _is_final(contender, steps):
            if steps >= _MAX_PLAN_STEPS:
                raise RuntimeError(
                    f"{contender.strategy} had no plan after {steps} warm-up steps; "
                    "it never finished profiling"
                )
            _train_step(contender, *next_batch())
            steps += 1
        for _ in range(job.warmup):
            _train_step(contender, *next_batch())
        contender.warmup_steps = steps + job.warmup
    for _ in range(max(job.warmup, 1)):
        _compute_sample(plain, plain_optimizer, *next_batch())
    _allreduce_sample(flat)
    _overlapped_sample(plain, plain_optimizer, *next_batch(), alongside)
    from interlace.bench.probes import ContentionProbe

    probe = ContentionProbe(plain, plain_optimizer, flat) if job.probe_contention else None

    forwards: list[float] = []
    backwards: list[float] = []
    steps_s: list[float] = []
    allreduces: list[float] = []
    overlapped: list[float] = []
    # None: the reference measurements; the probe: its own block, timed like a strategy's.
    slots: list[_Contender | ContentionProbe | None] = [*contenders, None]
    if probe is not None:
        slots.append(probe)
    for round_index, block in enumerate(_blocks(job.iters, job.rounds)):
        # A new order every round, so no strategy always runs first or after the same one.
        for slot in (slots[index] for index in _round_order(len(slots), round_index)):
            if isinstance(slot, ContentionProbe):
                slot.block(block, next_batch)
                continue
            if slot is None:
                for _ in range(block):
                    forward_s, backward_s, step_s = _compute_sample(
                        plain, plain_optimizer, *next_batch()
                    )
                    forwards.append(forward_s)
                    backwards.append(backward_s)
                    steps_s.append(step_s)
                    allreduces.append(_allreduce_sample(flat))
                    iteration_s, overlapped_backward_s, overlapped_done_s = _overlapped_sample(
                        plain, plain_optimizer, *next_batch(), alongside
                    )
                    overlapped.append(iteration_s)
                    if probe is not None:
                        probe.add_bulk(overlapped_backward_s, overlapped_done_s)
                continue
            dist.barrier()
            for _ in range(block):
                inputs, targets = next_batch()
                start = time.perf_counter()
                _train_step(slot, inputs, targets)
                slot.times.append(time.perf_counter() - start)

    samples = []
    for contender in contenders:
        plan = getattr(contender.wrapper, "plan", None)
        cost = getattr(contender.wrapper, "cost_model", None)
        samples.append(
            StrategySamples(
                strategy=contender.strategy,
                iteration_s=_max_over_ranks(contender.times),
                buckets=(_ddp_buckets(contender.wrapper) if plan is None else len(plan.buckets)),
                warmup_steps=contender.warmup_steps,
                predicted_s=None if plan is None else plan.predicted_s,
                cost_a=None if cost is None else cost.a,
                cost_b=None if cost is None else cost.b,
                plan=(
                    plan.describe()
                    if plan is not None and parse_variant(contender.strategy)[0] == "mgwfbp"
                    else None
                ),
                chosen_channels=None if plan is None else plan.channels,
                channel_choice=getattr(contender.wrapper, "channel_choice", None) or None,
                bucket_tensors=(
                    None
                    if plan is None
                    else [[plan.tensors[i].name for i in bucket.indices] for bucket in plan.buckets]
                ),
                tuning=getattr(contender.wrapper, "tuning_summary", None) or None,
            )
        )
    return Measurement(
        model=job.model,
        batch=job.batch,
        ranks=dist.get_world_size(),
        gradient_bytes=flat.numel() * flat.element_size(),
        tensors=sum(1 for p in plain.parameters() if p.requires_grad),
        strategies=samples,
        forward_s=_max_over_ranks(forwards),
        backward_s=_max_over_ranks(backwards),
        step_s=_max_over_ranks(steps_s),
        allreduce_s=_max_over_ranks(allreduces),
        overlapped_s=_max_over_ranks(overlapped),
        contention=None if probe is None else probe.finish(),
    )


# ================================================================================ the command


@dataclass(frozen=True)
class BenchConfig:
    """A validated benchmark run."""

    models: tuple[str, ...]
    strategies: tuple[str, ...]
    ratios: tuple[float, ...]
    nprocs: int
    iters: int
    warmup: int
    rounds: int
    input_shape: tuple[int, ...]
    batch_size: int | None
    link: str | None
    netem: bool
    timeout_s: float
    ref_link: str
    min_link: str
    max_link: str
    seed: int
    json_path: str | None
    png_path: str | None

    def batch_for(self, model: str) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return DEFAULT_BATCH.get(model, FALLBACK_BATCH)

    @property
    def calibrates(self) -> bool:
        return self.netem and self.link is None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``interlace bench dp``."""
    parser.add_argument(
        "--models",
        help=f"comma-separated zoo models or package.module:callable "
        f"(default {','.join(DEFAULT_MODELS)}; --quick: {','.join(QUICK_MODELS)})",
    )
    parser.add_argument(
        "--strategies",
        help=f"comma-separated strategies (default {','.join(DEFAULT_STRATEGIES)})",
    )
    parser.add_argument(
        "--channels",
        default="1",
        help="comma-separated channel settings each interlace strategy runs with, e.g. 1,auto "
        "or 1,2,4 (default 1); the table gains the channels asked for and used",
    )
    parser.add_argument(
        "--compression",
        default="none",
        help="comma-separated compressions each strategy runs with: none, fp16, bf16 "
        "(default none)",
    )
    parser.add_argument(
        "--ratios",
        help="target communication/compute ratios; each picks a link rate per model "
        f"(default {','.join(f'{r:g}' for r in DEFAULT_RATIOS)}; --quick: "
        f"{','.join(f'{r:g}' for r in QUICK_RATIOS)})",
    )
    parser.add_argument(
        "-n",
        "--nprocs",
        type=int,
        default=DEFAULT_NPROCS,
        help=f"ranks (default {DEFAULT_NPROCS})",
    )
    parser.add_argument(
        "--iters",
        type=int,
        help=f"timed iterations per strategy and launch (default {DEFAULT_ITERS}; "
        f"--quick: {QUICK_ITERS})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        help="untimed iterations per strategy after its buckets are final "
        f"(default {DEFAULT_WARMUP}; --quick: {QUICK_WARMUP})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="round-robin blocks the timed iterations are split into "
        f"(default {DEFAULT_ROUNDS}; --quick: {QUICK_ROUNDS})",
    )
    parser.add_argument(
        "--input-shape",
        default=",".join(map(str, DEFAULT_INPUT_SHAPE)),
        help="input shape of the synthetic batches (default 3,32,32; 1,8,8 is the digits shape)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        help="per-rank batch for every model (default: per model, "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_BATCH.items())
        + ")",
    )
    parser.add_argument(
        "--link",
        help="use this link for every row instead of calibrating one per ratio "
        "(e.g. 100mbit, 1gbit, 300mbit)",
    )
    parser.add_argument(
        "--no-netem",
        action="store_true",
        help="run on loopback without an emulated network (no root needed; no ratios)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a ~2-minute run: fewer models, one ratio, fewer iterations",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds allowed per launch (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--ref-link",
        default=REF_LINK,
        help=f"link of the calibration launch (default {REF_LINK})",
    )
    parser.add_argument(
        "--min-link",
        default=MIN_LINK,
        help=f"slowest link a ratio may pick (default {MIN_LINK})",
    )
    parser.add_argument(
        "--max-link",
        default=MAX_LINK,
        help=f"fastest link a ratio may pick (default {MAX_LINK})",
    )
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument("--png", metavar="PATH", help="plot speed-ups vs DDP")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Resolve ``--quick`` and defaults and check every value; raises UsageError."""
    from interlace.comm.links import parse_link
    from interlace.strategies import STRATEGIES
    from interlace.zoo import MODEL_NAMES

    quick = bool(args.quick)
    models = (
        parse_names(args.models, None, "models", "model")
        if args.models
        else (QUICK_MODELS if quick else DEFAULT_MODELS)
    )
    for model in models:
        if ":" not in model and model not in MODEL_NAMES:
            raise UsageError(
                f"--models: unknown model {model!r}; choose from {', '.join(MODEL_NAMES)} or give "
                "package.module:callable"
            )
    strategies = (
        parse_names(args.strategies, STRATEGIES, "strategies", "strategy")
        if args.strategies
        else DEFAULT_STRATEGIES
    )
    strategies = expand_variants(strategies, args.channels, args.compression)
    ratios = (
        parse_ratios(args.ratios) if args.ratios else (QUICK_RATIOS if quick else DEFAULT_RATIOS)
    )
    iters = args.iters if args.iters is not None else (QUICK_ITERS if quick else DEFAULT_ITERS)
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if quick else DEFAULT_WARMUP)
    rounds = args.rounds if args.rounds is not None else (QUICK_ROUNDS if quick else DEFAULT_ROUNDS)
    if args.nprocs < 2:
        raise UsageError(
            f"-n must be >= 2 (data parallelism needs ranks to average), got {args.nprocs}"
        )
    if iters < 1:
        raise UsageError(f"--iters must be >= 1, got {iters}")
    if warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {warmup}")
    if rounds < 1:
        raise UsageError(f"--rounds must be >= 1, got {rounds}")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.no_netem and args.link is not None:
        raise UsageError("--link and --no-netem contradict each other; give one of them")
    for value in (args.link, args.ref_link, args.min_link, args.max_link):
        if value is not None:
            parse_link(value)
    if parse_link(args.min_link) > parse_link(args.max_link):
        raise UsageError(f"--min-link {args.min_link} is faster than --max-link {args.max_link}")
    return BenchConfig(
        models=models,
        strategies=strategies,
        ratios=ratios,
        nprocs=args.nprocs,
        iters=iters,
        warmup=warmup,
        rounds=rounds,
        input_shape=parse_shape(args.input_shape),
        batch_size=args.batch_size,
        link=args.link,
        netem=not args.no_netem,
        timeout_s=float(args.timeout),
        ref_link=args.ref_link,
        min_link=args.min_link,
        max_link=args.max_link,
        seed=args.seed,
        json_path=args.json,
        png_path=args.png,
    )


def expand_variants(
    strategies: Sequence[str], channels_text: str, compression_text: str
) -> tuple[str, ...]:
    """Every strategy with every channel setting and compression (DDP: one channel only)."""
    from interlace.strategies import parse_channels

    channel_settings = [parse_channels(part.strip()) for part in channels_text.split(",")]
    compressions: list[str | None] = []
    for part in (piece.strip() for piece in compression_text.split(",")):
        if part not in ("none", "fp16", "bf16"):
            raise UsageError(f"--compression: unknown {part!r}; choose none, fp16 or bf16")
        compressions.append(None if part == "none" else part)
    labels: list[str] = []
    for strategy in strategies:
        for compression in compressions:
            for channels in channel_settings if strategy != "ddp" else [1]:
                labels.append(variant_label(strategy, channels, compression))
    return tuple(dict.fromkeys(labels))


def _check_models_build(config: BenchConfig) -> None:
    """Build each model once here, so a bad model or shape is one line, not N tracebacks."""
    from interlace.zoo import build_model

    for model in config.models:
        build_model(model, config.input_shape, NUM_CLASSES)


class LaunchFailedError(RuntimeError):
    """A benchmark launch failed for good: the message names the rank, its traceback and the
    ranks' last lines of output (or the timeout)."""


#: A launch whose rank was killed by a signal is run once more: one in a few dozen launches on
#: the emulated cluster loses a rank to a SIGABRT inside gloo ("terminate called without an
#: active exception") that no rerun repeats, and a long benchmark should not lose a row to it.
SIGNAL_RETRIES = 1


def launch_on_ranks(
    fn: Callable[[_T], Any],
    job: _T,
    *,
    nprocs: int,
    link: str | None,
    timeout_s: float,
    env: dict[str, str] | None = None,
    note: Callable[[str], None] = print,
    prog: str = PROG,
) -> Any:
    """Run ``fn(job)`` on ``nprocs`` gloo ranks (on the emulated ``link``, or loopback when
    None); rank 0's value, or :class:`LaunchFailedError` with the cause. Every benchmark's
    launches go through here, so all of them share the one retry rule (:data:`SIGNAL_RETRIES`).
    """
    from interlace import launch

    detail = ""
    for attempt in range(SIGNAL_RETRIES + 1):
        sink = io.StringIO()
        result = launch.run(
            rank_entry,
            nprocs,
            link,
            args=(fn, job, timeout_s),
            timeout=timeout_s,
            env=env,
            output=sink,
        )
        if result.ok:
            return result.values[0]
        if result.timed_out:
            detail = f"timed out after {timeout_s:g} s (--timeout)"
        else:
            rank = result.failed_rank
            trace = result.tracebacks.get(rank, "") if rank is not None else ""
            detail = f"rank {rank} failed with status {result.returncode}\n{trace.rstrip()}"
        output = sink.getvalue().strip()
        if output:
            detail += "\n--- output of the ranks (last lines) ---\n" + "\n".join(
                output.splitlines()[-20:]
            )
        killed = result.returncode > 128 and not result.timed_out
        if not killed or attempt == SIGNAL_RETRIES:
            break
        note(f"{prog}: a rank was killed by a signal; running the launch again\n{detail}")
    raise LaunchFailedError(detail)


def _launch(
    fn: Callable[[_T], Any],
    job: _T,
    config: BenchConfig,
    link: str | None,
    cache_dir: str,
    *,
    note: Callable[[str], None] = print,
) -> Any:
    """:func:`launch_on_ranks` with this benchmark's ranks, timeout and fresh cost-model cache."""
    return launch_on_ranks(
        fn,
        job,
        nprocs=config.nprocs,
        link=link,
        timeout_s=config.timeout_s,
        env={"INTERLACE_CACHE_DIR": cache_dir},
        note=note,
    )


@dataclass
class _Plan:
    model: str
    context: LaunchContext


def _launch_plan(config: BenchConfig, calibrations: dict[str, Calibration] | None) -> list[_Plan]:
    from interlace.comm.links import parse_link

    plans = []
    for model in config.models:
        if not config.netem:
            plans.append(_Plan(model, LaunchContext(None, "loopback")))
            continue
        if config.link is not None:
            plans.append(_Plan(model, LaunchContext(None, config.link)))
            continue
        assert calibrations is not None
        calibration = calibrations[model]
        for ratio in config.ratios:
            choice = rate_for_ratio(
                ratio,
                calibration.compute_s,
                parse_link(config.ref_link),
                calibration.allreduce_s,
                latency_s=calibration.latency_s,
                min_bps=parse_link(config.min_link),
                max_bps=parse_link(config.max_link),
            )
            wanted = (
                "inf" if not math.isfinite(choice.wanted_bps) else format_rate(choice.wanted_bps)
            )
            context = LaunchContext(
                ratio, choice.link, choice.clamped, wanted if choice.clamped else None
            )
            plans.append(_Plan(model, context))
    return plans


def describe_conditions(config: BenchConfig) -> str:
    """One paragraph saying when, where and how the rows were measured."""
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    try:
        load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        load = "n/a"
    import torch

    network = (
        "loopback (no emulated network)"
        if not config.netem
        else f"emulated cluster, fixed link {config.link}"
        if config.link is not None
        else f"emulated cluster, links chosen per model from a calibration at {config.ref_link} "
        f"(clamped to {config.min_link}..{config.max_link})"
    )
    return (
        f"{now}; {platform.node()} ({os.cpu_count()} CPUs, load {load} at the end), torch "
        f"{torch.__version__}, gloo; {config.nprocs} ranks on {network}; input "
        f"{'x'.join(map(str, config.input_shape))}; per strategy {config.warmup} warm-up "
        f"iterations after its buckets are final, then {config.iters} timed in "
        f"{len(_blocks(config.iters, config.rounds))} round-robin rounds; iteration = forward + "
        "backward + SGD step, wall clock, maximum over ranks per iteration, median over "
        "iterations; bound = forward + max(backward, one all-reduce of all gradients) + step of "
        "the plain module, measured in the same rounds; contended bound = the same iteration run "
        "with that all-reduce launched as backward starts (what perfect overlap costs on these "
        "cores)."
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see :func:`add_arguments`); the exit status."""
    config = config_from_args(args)
    _check_models_build(config)
    if config.netem:
        from interlace.launch import netem

        try:
            netem.check_available()
        except netem.NetemUnavailableError as exc:
            raise UsageError(
                f"{exc}; run as root, or pass --no-netem to measure on loopback"
            ) from exc
    from tqdm import tqdm

    cache_dir = tempfile.mkdtemp(prefix="interlace-bench-dp-")
    rows: list[Row] = []
    failures: list[str] = []
    try:
        total = (1 if config.calibrates else 0) + len(_launch_plan_shape(config))
        with tqdm(total=total, unit="launch", desc=PROG, dynamic_ncols=True) as bar:
            calibrations = None
            if config.calibrates:
                bar.set_postfix_str(f"calibrating at {config.ref_link}")
                job = CalibrationJob(
                    config.models,
                    tuple(config.batch_for(m) for m in config.models),
                    config.input_shape,
                    config.seed,
                )
                try:
                    found = _launch(
                        calibrate_rank, job, config, config.ref_link, cache_dir, note=bar.write
                    )
                except LaunchFailedError as exc:
                    print(f"{PROG}: calibration failed: {exc}", file=sys.stderr)
                    return 1
                calibrations = {c.model: c for c in found}
                bar.update(1)
                for c in found:
                    bar.write(
                        f"calibration {c.model}: compute {c.compute_s * 1e3:.1f} ms, all-reduce "
                        f"of all gradients {c.allreduce_s * 1e3:.1f} ms at {config.ref_link} "
                        f"(tiny all-reduce {c.latency_s * 1e3:.2f} ms)"
                    )
            for plan in _launch_plan(config, calibrations):
                ratio = "-" if plan.context.ratio is None else f"{plan.context.ratio:g}"
                bar.set_postfix_str(f"{plan.model} ratio {ratio} at {plan.context.link}")
                measure = MeasureJob(
                    plan.model,
                    config.batch_for(plan.model),
                    config.input_shape,
                    config.strategies,
                    config.iters,
                    config.warmup,
                    config.rounds,
                    config.seed,
                )
                link = plan.context.link if config.netem else None
                try:
                    measurement = _launch(
                        measure_rank, measure, config, link, cache_dir, note=bar.write
                    )
                except LaunchFailedError as exc:
                    message = f"{plan.model} at {plan.context.link}: {exc}"
                    failures.append(message)
                    bar.write(f"{PROG}: launch failed: {message}")
                else:
                    new_rows = rows_from_measurement(measurement, plan.context)
                    rows.extend(new_rows)
                    bar.write(_one_line(new_rows))
                    for row in new_rows:
                        if row.tuning:
                            bar.write(f"  {row.strategy} {row.tuning}")
                bar.update(1)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)

    print(f"\n{PROG}: {describe_conditions(config)}\n")
    if rows:
        print(format_summary(rows))
        print()
        print(format_table(rows))
    if config.json_path:
        Path(config.json_path).write_text(
            json.dumps([row.to_dict() for row in rows], indent=1) + "\n"
        )
    if config.png_path and rows:
        plot_speedups(rows, config.png_path)
    if failures:
        print(f"\n{PROG}: {len(failures)} launch(es) failed:", file=sys.stderr)
        for message in failures:
            print(f"  {message.splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


def _launch_plan_shape(config: BenchConfig) -> list[tuple[str, float | None]]:
    """The launches a run makes, before calibration (for the progress bar's total)."""
    if config.calibrates:
        return [(m, r) for m in config.models for r in config.ratios]
    return [(m, None) for m in config.models]


def _one_line(rows: Sequence[Row]) -> str:
    first = rows[0]
    parts = ", ".join(
        f"{row.strategy} {row.iteration_s * 1e3:.0f} ms"
        + ("" if row.speedup_vs_ddp is None else f" ({row.speedup_vs_ddp:.2f}x)")
        for row in rows
    )
    return (
        f"{first.model} ratio {_ratio_text(first)} at {first.link} (measured "
        f"{first.comm_compute:.2f}, bound {first.bound_s * 1e3:.0f} ms, contended bound "
        f"{_ms(first.contended_bound_s)} ms): {parts}"
    )


def main(argv: list[str] | None = None) -> int:
    """``interlace bench dp`` on its own (``python benchmarks/dp.py``); the exit status."""
    return standalone_main(
        PROG,
        "Compare data-parallel strategies with PyTorch DDP on the emulated cluster, "
        "at link rates chosen for target communication/compute ratios.",
        add_arguments,
        run,
        argv,
    )
