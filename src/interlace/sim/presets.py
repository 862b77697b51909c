"""Named set-ups of ``interlace simulate --preset``: a trace read one way, a network, worker
counts and strategies, and the table and checks that go with them.

``mgwfbp-paper`` is the MG-WFBP authors' own simulation (docs/simulate.md says what it relies on).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from interlace.errors import UsageError
from interlace.sim.caffe_log import CaffeMessages
from interlace.sim.experiments import (
    ScalingRow,
    parse_strategies,
    parse_workers,
    scaling_rows,
    simulate_scaling,
)
from interlace.sim.network import parse_network
from interlace.sim.retime import with_forward_ratio
from interlace.sim.trace import Trace, load_trace


@dataclass(frozen=True)
class Preset:
    """What ``--preset NAME`` sets; a flag given beside it wins.

    Args:
        name: The preset's name.
        description: One line saying what it is.
        trace: The trace (a shipped name or a file).
        messages: How a Caffe log's lines become messages.
        iteration: Which logged iteration is read (None: the last complete one).
        network: The ``--network`` spec.
        forward_per_backward: Forward taken as this fraction of backward (None: the trace's).
        workers: The ``--workers`` value.
        strategies: The strategies, the paper's first.
        merge: The strategy whose speed-ups over ``wfbp`` and ``single`` are the headline.
        reference_workers: The worker count the reference speed-ups are given at.
        reference: ``(over WFBP, over SyncEASGD)`` of the model the preset rebuilds.
        published: The same as published, where it differs from ``reference``.
        one_bucket_from: From this worker count on, ``merge`` should send one bucket.
    """

    name: str
    description: str
    trace: str
    messages: CaffeMessages
    iteration: int | None
    network: str
    forward_per_backward: float | None
    workers: str
    strategies: tuple[str, ...]
    merge: str
    reference_workers: int
    reference: tuple[float, float]
    published: tuple[float, float]
    one_bucket_from: int


#: Every preset by name.
PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="mgwfbp-paper",
            description=(
                "MG-WFBP's published simulation: GoogLeNet's K80 trace read as the authors' "
                "simulator read it, their ring cost, their greedy pairwise merge"
            ),
            trace="googlenet-k80",
            messages=CaffeMessages.LOGGED,
            iteration=2,
            network="paper:10gbe",
            forward_per_backward=0.5,
            workers="4..2048",
            strategies=(
                "single",
                "wfbp",
                "pairwise",
                "mgwfbp",
                "optimal",
                "fixed",
                "horovod",
                "overlap",
                "mgwfbp/k=2",
                "wfbp/k=4",
            ),
            merge="pairwise",
            reference_workers=64,
            reference=(1.73, 1.35),
            published=(1.78, 1.35),
            one_bucket_from=256,
        ),
    )
}


def preset_named(name: str) -> Preset:
    """The preset ``name``.

    Args:
        name: A key of :data:`PRESETS`.

    Raises:
        UsageError: Naming the presets, for an unknown name.
    """
    try:
        return PRESETS[name.strip().lower()]
    except KeyError:
        raise UsageError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None


def preset_trace(preset: Preset) -> Trace:
    """The preset's trace, read and retimed as the preset says.

    Args:
        preset: The preset.
    """
    trace = load_trace(preset.trace, iteration=preset.iteration, messages=preset.messages)
    if preset.forward_per_backward is None:
        return trace
    return with_forward_ratio(trace, preset.forward_per_backward)


def simulate_preset(name: str, network: str | None = None) -> list[ScalingRow]:
    """The rows ``interlace simulate --preset NAME [--network SPEC]`` prints.

    Args:
        name: A key of :data:`PRESETS`.
        network: Another ``--network`` spec than the preset's (None: its own).
    """
    preset = preset_named(name)
    trace = preset_trace(preset)
    results = simulate_scaling(
        trace,
        parse_network(network or preset.network),
        parse_workers(preset.workers),
        parse_strategies(",".join(preset.strategies)),
    )
    return scaling_rows(trace, results)


def format_paper_table(rows: Sequence[ScalingRow], merge: str) -> str:
    """The paper's table: per worker count WFBP, SyncEASGD and ``merge``, each iteration with
    its speed-up (throughput over one worker's), and ``merge``'s speed-ups over the two.

    Args:
        rows: Scaling rows with ``wfbp``, ``single`` and ``merge`` at every count.
        merge: The merging strategy's name.
    """
    by_key = {(row.workers, row.strategy): row for row in rows}
    lines = [
        "| workers | a ms | WFBP ms | speed-up | SyncEASGD ms | speed-up | "
        f"{merge} ms | speed-up | buckets | over WFBP | over SyncEASGD |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for workers in sorted({row.workers for row in rows}):
        wfbp, single, mine = (by_key.get((workers, s)) for s in ("wfbp", "single", merge))
        if wfbp is None or single is None or mine is None:
            continue
        lines.append(
            f"| {workers} | {mine.cost_a * 1e3:.2f} | {wfbp.iteration_s * 1e3:.1f} | "
            f"{wfbp.speedup:.1f} | {single.iteration_s * 1e3:.1f} | {single.speedup:.1f} | "
            f"{mine.iteration_s * 1e3:.1f} | {mine.speedup:.1f} | {mine.buckets} | "
            f"{wfbp.iteration_s / mine.iteration_s:.3f}x | "
            f"{single.iteration_s / mine.iteration_s:.3f}x |"
        )
    return "\n".join(lines)


def check_preset(
    rows: Sequence[ScalingRow], preset: Preset, tolerance: float = 0.01, *, own: bool = True
) -> list[str]:
    """The preset's claims on ``rows``, each as 'ok: ...' or 'FAILED: ...': its merge's
    speed-ups at the reference count within ``tolerance`` of the reference, and one bucket
    from ``one_bucket_from`` workers on.

    Args:
        rows: Scaling rows of the preset's strategies.
        preset: The preset.
        tolerance: Relative tolerance of the speed-ups.
        own: Whether the rows are of the preset's own set-up; if not (another network, say),
            each claim is a 'note: ...' to compare with, neither passed nor failed.
    """

    def verdict(held: bool) -> str:
        return ("ok" if held else "FAILED") if own else "note"

    by_key = {(row.workers, row.strategy): row for row in rows}
    notes = []
    mine = by_key.get((preset.reference_workers, preset.merge))
    wfbp = by_key.get((preset.reference_workers, "wfbp"))
    single = by_key.get((preset.reference_workers, "single"))
    if mine is not None and wfbp is not None and single is not None:
        got = (wfbp.iteration_s / mine.iteration_s, single.iteration_s / mine.iteration_s)
        close = all(
            abs(value / want - 1) <= tolerance
            for value, want in zip(got, preset.reference, strict=True)
        )
        notes.append(
            f"{verdict(close)}: {preset.merge} at {preset.reference_workers} workers "
            f"is {got[0]:.3f}x over WFBP and {got[1]:.3f}x over SyncEASGD (the authors' model "
            f"{preset.reference[0]:.2f}x and {preset.reference[1]:.2f}x, within "
            f"{tolerance:.0%}: {'yes' if close else 'no'}; published {preset.published[0]:.2f}x "
            f"and {preset.published[1]:.2f}x)"
        )
    merged = sorted((r for r in rows if r.strategy == preset.merge), key=lambda r: r.workers)
    large = [r for r in merged if r.workers >= preset.one_bucket_from]
    if large:
        one = all(r.buckets == 1 for r in large)
        notes.append(
            f"{verdict(one)}: {preset.merge} buckets by workers "
            + ", ".join(f"{r.workers}:{r.buckets}" for r in merged)
            + f" ({'one' if one else 'not one'} from {preset.one_bucket_from} workers on)"
        )
    counts = [r.buckets for r in merged]
    if counts and any(b > a for a, b in itertools.pairwise(counts)):
        notes.append(f"note: {preset.merge}'s bucket count grows somewhere with workers")
    return notes
