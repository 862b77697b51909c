"""``interlace bench pipeline`` rows priced as the bench set them up: each row's global batch split
over its replicas, its pieces, its stages x replicas and stage split, its timed block and its
link, by the one pipeline model (:mod:`interlace.sim.pipeline`'s stage programs; replayed, and
walked as the planner walks them), beside its measured iteration.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from interlace.comm.cost import CostModel
from interlace.errors import UsageError
from interlace.pipeline.layout import PipelineLayout
from interlace.sim.network import Link, Network, Ring
from interlace.sim.pipeline import (
    INTERLACE_PIPELINE_SCHEDULES,
    TORCH_PIPELINE_SCHEDULES,
    simulate_pipeline,
    stage_costs,
    with_measured_compute,
)
from interlace.sim.pipeline_price import PipelineConfig, price_block, priced_stages
from interlace.sim.pipeline_walk import walk_block_s, walk_works
from interlace.sim.retime import with_totals
from interlace.sim.simulation import simulate
from interlace.sim.trace import Trace

__all__ = ["BenchRow", "PricedRow", "bench_rows", "planner_choice", "price_row", "summary"]

#: The stage all-reduce each contender runs: interlace's stages average in DataParallel's
#: MG-WFBP buckets, torch's stage modules under DDP (its fixed-size buckets).
STAGE_STRATEGY = {"interlace": "mgwfbp", "torch": "fixed"}
#: ``interlace bench pipeline``'s DataParallel contender: ``bucketing="merged"``.
DP_STRATEGY = "mgwfbp"


@dataclass(frozen=True)
class BenchRow:
    """One measured row of an ``interlace bench pipeline`` JSON, as the bench set it up.

    Args:
        model: The emulated model's trace.
        schedule: The contender (a pipeline schedule, torch's, or ``dp``).
        ranks: Ranks of the launch.
        stages: Stages per pipeline.
        batch: The global batch per mini-batch (every contender's).
        pieces: Micro-batches, or chunks of an asynchronous schedule, per mini-batch.
        block: Mini-batches per timed block.
        bounds: Each stage's ``[start, end)`` blocks, as the run cut the model.
        link_bps: The emulated link's rate (undilated).
        measured_s: The measured seconds per mini-batch (the median block over its size).
        stage_compute_s: Each stage's measured forward, backward and update seconds per
            mini-batch in the same launch (an interlace pipeline's, median over replicas;
            empty where the launch recorded none).
        allreduce_cost: ``(a, b)`` of the all-reduce the row's groups run, as fitted on the
            live ranks (a replicated interlace stage's on its stage group, which torch's stages
            share; DataParallel's on all ranks), median over ranks; None where the launch
            recorded none (then the link's rate prices it).
    """

    model: str
    schedule: str
    ranks: int
    stages: int
    batch: int
    pieces: int
    block: int
    bounds: tuple[tuple[int, int], ...]
    link_bps: float
    measured_s: float
    stage_compute_s: tuple[float, ...] = ()
    allreduce_cost: tuple[float, float] | None = None

    @property
    def replicas(self) -> int:
        """Pipelines (``ranks / stages``)."""
        return self.ranks // self.stages

    @property
    def configuration(self) -> str:
        """What ran, e.g. ``spectrain 4x2`` or ``dp 8``."""
        if self.schedule == "dp":
            return f"dp {self.ranks}"
        return f"{self.schedule} {self.stages}x{self.replicas}"


@dataclass(frozen=True)
class PricedRow:
    """A row priced.

    Args:
        row: The measured row.
        predicted_s: The replay's seconds per mini-batch.
        planned_s: The planner's fast walk of the same programs (its ranking).
    """

    row: BenchRow
    predicted_s: float
    planned_s: float

    @property
    def error(self) -> float:
        """Predicted over measured, less one."""
        return self.predicted_s / self.row.measured_s - 1


def _plan_bounds(plan: str) -> tuple[tuple[int, int], ...]:
    """The block ranges of a stage plan's table (``0``, ``1-7``, ...), for rows recorded before
    the regime kept ``bounds``."""
    found = []
    for line in plan.splitlines():
        match = re.match(r"\s*\d+\s+(\d+)(?:-(\d+))?\s+\d+\s", line)
        if match:
            start = int(match[1])
            found.append((start, int(match[2] or start) + 1))
    return tuple(found)


def bench_rows(rows: Sequence[Mapping[str, Any]]) -> list[BenchRow]:
    """The rows of an ``interlace bench pipeline`` JSON (its ``--json`` list).

    Args:
        rows: The JSON's rows.

    Raises:
        UsageError: For a row without the regime, stage split or link a prediction needs.
    """
    computed: dict[str, tuple[float, ...]] = {}
    for row in rows:  # the launch's interlace pipeline timed each stage's compute
        per_block = row.get("stage_compute_s")
        if per_block and row["model"] not in computed:
            stages = int(row.get("stages") or row["ranks"])
            computed[row["model"]] = tuple(
                statistics.median(per_block[k::stages]) / int(row["block"]) for k in range(stages)
            )
    found = []
    for row in rows:
        regime = row.get("regime") or {}
        fitted = regime.get("allreduce_costs") or {}
        # torch's stages run on the same stage groups as interlace's replicated stages
        source = (
            "dp"
            if row["schedule"] == "dp"
            else next((name for name in fitted if name in INTERLACE_PIPELINE_SCHEDULES), None)
        )
        bounds = tuple(tuple(b) for b in regime.get("bounds") or ()) or _plan_bounds(
            regime.get("plan", "")
        )
        if not bounds or not regime.get("link_bps"):
            raise UsageError(
                f"row {row.get('model')} {row.get('schedule')} records no stage split or link "
                "rate; record it again with `interlace bench pipeline --json`"
            )
        found.append(
            BenchRow(
                model=str(row["model"]),
                schedule=str(row["schedule"]),
                ranks=int(row["ranks"]),
                stages=int(row.get("stages") or regime.get("stages") or row["ranks"]),
                batch=int(row["batch"]),
                pieces=int(row["microbatches"]),
                block=int(row["block"]),
                bounds=bounds,
                link_bps=float(regime["link_bps"]),
                measured_s=float(row["batch"]) / float(row["samples_per_s"]),
                stage_compute_s=computed.get(str(row["model"]), ()),
                allreduce_cost=_median_cost(fitted.get(source) if source else None),
            )
        )
    return found


def _median_cost(per_rank: Sequence[Sequence[float] | None] | None) -> tuple[float, float] | None:
    """The median ``(a, b)`` over the ranks that fitted one."""
    fitted = [cost for cost in per_rank or () if cost is not None]
    if not fitted:
        return None
    return statistics.median(c[0] for c in fitted), statistics.median(c[1] for c in fitted)


@dataclass(frozen=True)
class _Measured(Network):
    """The emulated link's rate for point-to-point messages, and the all-reduce as the launch
    fitted it on its own groups."""

    link: Link
    allreduce: CostModel

    def cost(self, workers: int) -> CostModel:
        return self.allreduce

    def describe(self) -> str:
        return f"{self.link.describe()}; the launch's fitted all-reduce"

    def point_to_point(self, same_node: bool = False) -> Link | None:
        return self.link


def _network(row: BenchRow) -> Network:
    """The emulated link: every rank one rate, the default start-up; the all-reduce as the
    launch fitted it where it recorded that."""
    link = Link.from_rate(row.link_bps)
    if row.allreduce_cost is None:
        return Ring(link)
    return _Measured(link, CostModel(*row.allreduce_cost))


def _config(row: BenchRow) -> PipelineConfig:
    family = "torch" if row.schedule in TORCH_PIPELINE_SCHEDULES else "interlace"
    return PipelineConfig(
        row.stages,
        row.replicas,
        row.schedule,
        row.batch // row.replicas,
        row.pieces,
        strategy=STAGE_STRATEGY[family],
    )


def _dp_s(trace: Trace, row: BenchRow) -> float:
    """DataParallel on every rank with ``batch / ranks`` samples: the trace's layers scaled to
    that batch (the optimizer step does not scale)."""
    scale = row.batch / row.ranks / (trace.batch_size or row.batch)
    scaled = with_totals(trace, trace.forward_s * scale, trace.backward_s * scale, trace.step_s)
    network = _network(row)
    return simulate(scaled, DP_STRATEGY, network.cost(row.ranks), workers=row.ranks).iteration_s


def price_row(trace: Trace, row: BenchRow, *, measured_compute: bool = False) -> PricedRow:
    """``row`` priced as the bench ran it.

    Args:
        trace: The emulated model's trace.
        row: The measured row.
        measured_compute: Take each stage's compute from the launch's measurement
            (:attr:`BenchRow.stage_compute_s`) instead of the trace's device time.

    Raises:
        UsageError: For a contender the simulator does not price, or measured compute asked
            of a launch that timed none.
    """
    if measured_compute and row.schedule != "dp" and not row.stage_compute_s:
        raise UsageError(
            f"the {row.model} launch timed no stage's compute (no interlace pipeline row)"
        )
    if row.schedule == "dp":
        seconds = _dp_s(trace, row)
        return PricedRow(row, seconds, seconds)
    if row.schedule not in (*INTERLACE_PIPELINE_SCHEDULES, *TORCH_PIPELINE_SCHEDULES):
        raise UsageError(f"the simulator does not price the contender {row.schedule!r}")
    config = _config(row)
    network = _network(row)
    costs = stage_costs(trace, row.bounds, config.batch)
    layout = PipelineLayout(row.stages, row.replicas, network.node_size)
    priced, links, _ = priced_stages(trace, config, network, layout, 0, costs, row.bounds)
    if measured_compute:
        priced = with_measured_compute(priced, row.stage_compute_s, config.pieces)
    link = links[0]
    assert link is not None  # two stages at least
    replayed = simulate_pipeline(
        priced,
        row.schedule,
        CostModel(link.alpha, link.beta),
        microbatches=row.pieces,
        block=row.block,
    )
    planned = price_block(trace, config, network, row.block, row.bounds)
    if measured_compute:
        works = walk_works(priced, links, config.pieces)
        planned = walk_block_s(works, row.schedule, pieces=row.pieces, block=row.block)
        planned /= row.block
    return PricedRow(row, replayed.iteration_s, planned)


def planner_choice(priced: Sequence[PricedRow]) -> tuple[PricedRow, PricedRow]:
    """The planner's first choice among the measured configurations it offers (interlace's
    schedules and data parallelism, ranked by its walk per sample), and the fastest measured
    of all.

    Args:
        priced: Rows priced (each configuration once or more: the measured medians are
            compared as they are).

    Raises:
        UsageError: When no row is one the planner offers.
    """
    offered = [p for p in priced if p.row.schedule not in TORCH_PIPELINE_SCHEDULES]
    if not offered:
        raise UsageError("no row is a configuration the planner offers (interlace's or dp)")
    chosen = min(offered, key=lambda p: p.planned_s / p.row.batch)
    fastest = min(priced, key=lambda p: p.row.measured_s / p.row.batch)
    return chosen, fastest


def summary(priced: Sequence[PricedRow]) -> list[str]:
    """The table and its verdicts as lines: each row predicted against measured, the median
    and largest error, and the planner's first choice against the fastest measured.

    Args:
        priced: Rows priced.
    """
    lines = [
        "| configuration | measured ms | predicted ms | error | planner ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for p in priced:
        lines.append(
            f"| {p.row.model} {p.row.configuration} | {p.row.measured_s * 1e3:.2f} | "
            f"{p.predicted_s * 1e3:.2f} | {p.error * 100:+.1f}% | {p.planned_s * 1e3:.2f} |"
        )
    errors = [abs(p.error) for p in priced]
    lines.append(
        f"error: median {statistics.median(errors) * 100:.1f}%, max {max(errors) * 100:.1f}% "
        f"over {len(priced)} rows"
    )
    chosen, fastest = planner_choice(priced)
    within = fastest.row.measured_s / chosen.row.measured_s
    lines.append(
        f"planner's first choice: {chosen.row.configuration} (measured "
        f"{chosen.row.measured_s * 1e3:.2f} ms); fastest measured: {fastest.row.configuration} "
        f"({fastest.row.measured_s * 1e3:.2f} ms); the choice runs at {within * 100:.1f}% of "
        f"the fastest ({'within' if within >= 0.95 else 'NOT within'} 5%)"
    )
    return lines
