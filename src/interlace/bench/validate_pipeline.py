"""Pipeline schedules on emulated compute: measured by ``interlace bench pipeline``'s rank code,
predicted by :mod:`interlace.sim.pipeline` from the trace, the run's stage split, a
point-to-point cost fitted on the live ranks, each stage's host work timed apart and how much
the stages slow each other down when they compute at once.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from interlace.bench.harness import DEFAULT_INPUT_SHAPE, undilated
from interlace.bench.pipeline_rank import PipelineJob
from interlace.bench.session import VALIDATION_NEEDS_ROOT, LaunchOptions, check_netem, shown_link
from interlace.bench.validate_pipeline_rank import PipelineValidationJob, validate_pipeline_rank
from interlace.comm.cost import CostModel
from interlace.emulate import Compute, undilate_cost
from interlace.errors import UsageError
from interlace.sim.pipeline import (
    PIPELINE_SCHEDULES,
    HostCost,
    simulate_pipeline,
    stage_costs,
    with_measured_compute,
)
from interlace.sim.trace import Trace, load_trace
from interlace.sim.validate import ValidationRow

PROG = "interlace simulate --validate (pipeline)"
#: The docs' emulated pipeline runs: a mini-batch of 32 in 4 micro-batches (or chunks).
DEFAULT_BATCH = 32
DEFAULT_MICROBATCHES = 4


def _check_request(
    compute: Compute,
    stages: int,
    schedules: Sequence[str],
    *,
    options: LaunchOptions,
    batch_size: int,
    microbatches: int,
) -> Trace:
    """The emulated model's trace, once the request is known to be measurable; UsageError."""
    if not compute.emulated or compute.trace is None:
        raise UsageError("pipeline validation runs on emulated compute: --compute emulated:TRACE")
    unknown = [s for s in schedules if s not in PIPELINE_SCHEDULES]
    if unknown or not schedules:
        raise UsageError(
            f"unknown pipeline schedule(s) {', '.join(unknown) or '(none given)'}; choose from "
            f"{', '.join(PIPELINE_SCHEDULES)}"
        )
    if stages < 2:
        raise UsageError(f"a pipeline needs at least 2 stages (-n), got {stages}")
    options.check()
    if microbatches < 1 or batch_size % microbatches:
        raise UsageError(
            f"batch {batch_size} does not split into {microbatches} micro-batches; use a multiple"
        )
    trace = load_trace(compute.trace)
    stage_costs(trace, [(0, len(trace.layers))], batch_size)  # refuses a trace without sizes
    return trace


def pipeline_validation_rows(
    trace: str,
    compute: Compute,
    stages: int,
    link: str,
    schedules: Sequence[str],
    *,
    options: LaunchOptions,
    batch_size: int = DEFAULT_BATCH,
    microbatches: int = DEFAULT_MICROBATCHES,
) -> list[ValidationRow]:
    """Predicted against measured per-iteration time of each pipeline schedule on emulated
    compute, one launch of ``stages`` ranks on ``link`` run at its rate / dilation.

    The ranks time ``options.rounds`` interleaved blocks of ``options.iters`` mini-batches
    per schedule (``interlace bench pipeline``'s rank code); the measured iteration is the median
    over blocks of the block's slowest rank over its mini-batches. The prediction replays the
    same block from the trace's device time, the run's stage split, the point-to-point cost
    fitted on the live ranks and each stage's host work timed apart (both / dilation); nothing
    is fitted to the measured schedules. ``note`` gets the split, the costs, the prediction
    without host work and each stage's measured compute against the replay's.

    Args:
        trace: The model as the rows name it (the trace's name).
        compute: Emulated compute: the trace and the dilation.
        stages: Ranks, one stage each (>= 2).
        link: The target link (``10gbit``); the ranks run at its rate / dilation.
        schedules: Schedules of :data:`interlace.sim.pipeline.PIPELINE_SCHEDULES`.
        options: The launch: mini-batches per timed block (``iters``), untimed mini-batches
            per schedule first (``warmup``), timed blocks per schedule (``rounds``), limits,
            cache folder and where progress lines go.
        batch_size: Samples per mini-batch.
        microbatches: Micro-batches (synchronous schedules) or chunks (asynchronous ones) per
            mini-batch.

    Raises:
        UsageError: For real compute, an unknown schedule, bad sizes, a trace without
            activation sizes, or no root for the emulated cluster.
        LaunchFailedError: When the launch fails.
    """
    model_trace = _check_request(
        compute,
        stages,
        schedules,
        options=options,
        batch_size=batch_size,
        microbatches=microbatches,
    )
    check_netem(VALIDATION_NEEDS_ROOT)
    job = PipelineJob(
        model=compute.name,
        batch=batch_size,
        input_shape=DEFAULT_INPUT_SHAPE,
        iters=options.rounds,
        warmup=options.warmup,
        compute=compute,
        microbatches=microbatches,
        schedules=tuple(schedules),
        block=options.iters,
    )
    result = options.launch(
        validate_pipeline_rank,
        PipelineValidationJob(job),
        nprocs=stages,
        link=link,
        compute=compute,
        prog=PROG,
    )
    sample = PipelineSample.from_launch(
        result, compute.dilation, job.block, link=shown_link(link, compute)
    )
    options.note(sample.describe())
    for line in sample.compare(model_trace, batch_size):
        options.note(f"{trace}, {stages} stages, {link}: {line}")
    return sample.rows(model_trace, trace, batch_size)


@dataclass(frozen=True)
class PipelineSample:
    """One pipeline validation launch, undilated.

    Args:
        bounds: Each stage's block range, as the run cut the model.
        cost: The fitted point-to-point cost.
        host: Each stage's host cost.
        measured_s: Each schedule's per-iteration time of every timed block (slowest rank).
        block: Mini-batches per timed block.
        microbatches: Pieces per mini-batch.
        link: The link as rows show it.
        stage_compute_s: interlace's schedules: each stage's median seconds per mini-batch in
            its forward, backward and update (device time and host work, as it ran).
        slowdown: How many times longer a stage's mini-batch took while 1, 2, ... stages ran
            theirs at once (the ranks sharing the host's cores); empty: not measured.
    """

    bounds: tuple[tuple[int, int], ...]
    cost: CostModel
    host: tuple[HostCost, ...]
    measured_s: dict[str, list[float]]
    block: int
    microbatches: int
    link: str = ""
    stage_compute_s: dict[str, list[float]] = field(default_factory=dict)
    slowdown: tuple[float, ...] = ()

    @classmethod
    def from_launch(
        cls, result: dict[str, Any], dilation: float, block: int, *, link: str = ""
    ) -> PipelineSample:
        """The sample from :func:`validate_pipeline_rank`'s value, its times / ``dilation``.

        Args:
            result: Rank 0's value.
            dilation: The run's dilation.
            block: Mini-batches per timed block.
            link: The link as rows show it.
        """
        value = result["value"]
        per_iteration = dilation * block
        return cls(
            bounds=tuple((int(s), int(e)) for s, e in value["bounds"]),
            cost=undilate_cost(result["cost"], dilation),
            host=tuple(undilated(h, dilation) for h in result["host"]),
            measured_s=undilated(value["block_s"], per_iteration),
            block=block,
            microbatches=int(result["microbatches"]),
            link=link,
            stage_compute_s={
                name: undilated(stats["compute_s"], per_iteration)
                for name, stats in value.get("stage_stats", {}).items()
            },
            slowdown=tuple(float(s) for s in result.get("slowdown", ())),
        )

    def predict(
        self,
        trace: Trace,
        schedule: str,
        batch: int,
        *,
        host: bool = True,
        contention: bool = True,
        factors: Sequence[float] | None = None,
    ) -> Any:
        """The replayed block of ``schedule`` (a :class:`~interlace.sim.pipeline.PipelineResult`).

        Args:
            trace: The emulated model's trace.
            schedule: The schedule.
            batch: Samples per mini-batch.
            host: Include the stages' host work (False: device time and messages alone).
            contention: Slow the stages computing at once down by the measured
                :attr:`slowdown` (False: each computes as fast as alone).
            factors: Each stage's compute as the run measured it, over the trace's
                (:meth:`compute_factors`); None: the trace's.
        """
        costs = stage_costs(trace, self.bounds, batch, self.host if host else None)
        if factors is not None:
            pieces = self.microbatches
            seconds = [
                factor * (cost.forward_s + cost.backward_s + cost.host_s(pieces))
                for cost, factor in zip(costs, factors, strict=True)
            ]
            costs = with_measured_compute(costs, seconds, pieces)
        return simulate_pipeline(
            costs,
            schedule,
            self.cost,
            microbatches=self.microbatches,
            block=self.block,
            slowdown=self.slowdown if contention else (),
        )

    def busy_s(self, result: Any) -> list[float]:
        """Each stage's computing per mini-batch in a replayed block, as the runtime times it.

        Args:
            result: A :meth:`predict` result.
        """
        # The replay's busy time counts the predictions and stashes, which the runtime does
        # outside its timed forward and backward.
        return [
            math.fsum(
                s.end_s - s.start_s
                for s in result.replay.computations
                if s.stage == k and s.label not in ("predict", "stash")
            )
            / self.block
            for k in range(len(self.bounds))
        ]

    def compute_factors(self, trace: Trace, batch: int, *, host: bool = True) -> list[float] | None:
        """Each stage's compute in the run over the model's: for each of interlace's schedules
        measured, the stage's compute per mini-batch (:attr:`stage_compute_s`) over its busy
        time in the replay from the trace (stages slowing each other included); the median
        over the schedules, 1 where none was measured (None when no schedule timed its
        stages). torch's schedules time no stage, so theirs take these factors too.

        Args:
            trace: The emulated model's trace.
            batch: Samples per mini-batch.
            host: Include the stages' host work in the model's.
        """
        if not self.stage_compute_s:
            return None
        ratios: list[list[float]] = [[] for _ in self.bounds]
        for schedule, measured in self.stage_compute_s.items():
            replayed = self.predict(trace, schedule, batch, host=host)
            for stage, (run_s, model_s) in enumerate(
                zip(measured, self.busy_s(replayed), strict=True)
            ):
                if model_s > 0:
                    ratios[stage].append(run_s / model_s)
        return [statistics.median(r) if r else 1.0 for r in ratios]

    def rows(
        self, trace: Trace, model: str, batch: int, *, host: bool = True
    ) -> list[ValidationRow]:
        """One row per measured schedule: the replayed block against the median measured one.

        Args:
            trace: The emulated model's trace.
            model: The model as the rows name it.
            batch: Samples per mini-batch.
            host: Include the stages' host work (False: device time and messages alone).
        """
        factors = self.compute_factors(trace, batch, host=host)
        return [
            replace(
                ValidationRow.of(
                    family="pipeline",
                    model=model,
                    strategy=schedule,
                    ranks=len(self.bounds),
                    link=self.link,
                    predicted_s=self.predict(
                        trace, schedule, batch, host=host, factors=factors
                    ).iteration_s,
                    measured_s=statistics.median(times),
                ),
                predicted_uncontended_s=self.predict(
                    trace, schedule, batch, host=host, contention=False
                ).iteration_s,
                compute_slowdown=self.slowdown[-1] if self.slowdown else 1.0,
            )
            for schedule, times in self.measured_s.items()
        ]

    def compare(self, trace: Trace, batch: int) -> list[str]:
        """A line per schedule: predicted (and from the trace's device time, without the
        stages slowing each other, without host work) against measured, and for interlace's
        schedules each stage's measured compute against the replay's from the trace.

        Args:
            trace: The emulated model's trace.
            batch: Samples per mini-batch.
        """
        lines = []
        factors = self.compute_factors(trace, batch)
        for schedule, times in self.measured_s.items():
            result = self.predict(trace, schedule, batch, factors=factors)
            traced = self.predict(trace, schedule, batch)
            alone = self.predict(trace, schedule, batch, contention=False)
            bare = self.predict(trace, schedule, batch, host=False, contention=False)
            measured = statistics.median(times)
            line = (
                f"{schedule} predicted {result.iteration_s * 1e3:.3f} ms "
                f"({traced.iteration_s * 1e3:.3f} from the trace's device time, "
                f"{alone.iteration_s * 1e3:.3f} without the stages slowing each other, "
                f"{bare.iteration_s * 1e3:.3f} without host work either), measured "
                f"{measured * 1e3:.3f} ms ({(result.iteration_s / measured - 1) * 100:+.1f}%)"
            )
            if schedule in self.stage_compute_s:
                traced_busy = self.busy_s(traced)
                line += "; stage compute per mini-batch measured/replayed " + ", ".join(
                    f"{m * 1e3:.3f}/{b * 1e3:.3f}"
                    for m, b in zip(self.stage_compute_s[schedule], traced_busy, strict=True)
                )
            lines.append(line)
        return lines

    def describe(self) -> str:
        """The stage split, the fitted cost and the host costs, in a few lines."""
        lines = [
            f"stages (blocks): {', '.join(f'{s}-{e - 1}' for s, e in self.bounds)}; "
            f"point-to-point a = {self.cost.a * 1e6:.1f} us, "
            f"{8 / self.cost.b / 1e9 if self.cost.b else float('inf'):.2f} Gbit/s (undilated)"
        ]
        if self.slowdown:
            lines.append(
                "stages computing at once 1, 2, ...: each mini-batch "
                + ", ".join(f"{s:.3f}x" for s in self.slowdown)
                + " as long as alone"
            )
        for index, h in enumerate(self.host):
            lines.append(
                f"  stage {index} host (us): forward {h.forward_s * 1e6:.1f}, backward "
                f"{h.backward_s * 1e6:.1f} per piece; update {h.update_s * 1e6:.1f}, predict "
                f"{h.predict_s * 1e6:.1f}, copy {h.copy_s * 1e6:.1f}, scale {h.scale_s * 1e6:.1f}, "
                f"send {h.send_s * 1e6:.1f}"
            )
        return "\n".join(lines)
