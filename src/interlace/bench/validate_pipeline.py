"""Pipeline schedules on emulated compute: measured by ``interlace bench pipeline``'s rank code,
predicted by :mod:`interlace.sim.pipeline` from the trace, the run's stage split, a
point-to-point cost fitted on the live ranks and each stage's host work timed apart.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from interlace.bench.dp_report import format_rate
from interlace.bench.harness import (
    DEFAULT_INPUT_SHAPE,
    NUM_CLASSES,
    launch_on_ranks,
    synthetic_batches,
)
from interlace.bench.pipeline_rank import (
    DEFAULT_LR,
    DEFAULT_MOMENTUM,
    PipelineJob,
    build_pipeline_model,
    measure_rank,
)
from interlace.comm.cost import CostModel
from interlace.emulate import Compute, dilate_rate
from interlace.emulate.pipeline import EmulatedPipelineModel
from interlace.errors import UsageError
from interlace.launch import netem
from interlace.pipeline.messages import Inbox, send_tensor
from interlace.pipeline.partition import pipeline_blocks
from interlace.pipeline.predict import predicted_parameters
from interlace.sim.pipeline import (
    PIPELINE_SCHEDULES,
    HostCost,
    simulate_pipeline,
    stage_costs,
)
from interlace.sim.trace import load_trace
from interlace.sim.validate import ValidationRow

PROG = "interlace simulate --validate (pipeline)"
#: The docs' emulated pipeline runs: a mini-batch of 32 in 4 micro-batches (or chunks).
DEFAULT_BATCH = 32
DEFAULT_MICROBATCHES = 4
#: Message sizes of the point-to-point fit, bytes: around the pieces a stage boundary carries.
P2P_SIZES: tuple[int, ...] = (65_536, 262_144, 1_048_576, 2_097_152, 4_194_304)
P2P_REPEATS = 3
#: Timed repetitions of each host operation (median taken), after one untimed.
HOST_REPEATS = 5


@dataclass(frozen=True)
class PipelineValidationJob:
    """What every rank of a pipeline validation launch does.

    Args:
        bench: The benchmark's job (its rank code measures the schedules).
        p2p_sizes: Message sizes of the point-to-point fit, bytes.
        p2p_repeats: Timed round trips per size.
    """

    bench: PipelineJob
    p2p_sizes: tuple[int, ...] = P2P_SIZES
    p2p_repeats: int = P2P_REPEATS


def _round_trips(sizes: Sequence[int], repeats: int) -> list[float]:
    """Median round trip of each size between ranks 0 and 1 with the pipeline's own messages
    (header and payload, receives posted ahead by an ``Inbox``); rank 0's, others get zeros.
    Collective."""
    rank = dist.get_rank()
    medians = []
    for nbytes in sizes:
        dist.barrier()
        times: list[float] = []
        if rank in (0, 1):
            peer = 1 - rank
            count = repeats + 1  # the first round trip is untimed
            inbox = Inbox(peer, count, None, torch.device("cpu"))
            payload = torch.zeros(max(nbytes // 4, 1))
            sends = []
            for index in range(count):
                if rank == 0:
                    started = time.perf_counter()
                    sends.append(send_tensor(payload, peer, None))
                    inbox.take(index)
                    times.append(time.perf_counter() - started)
                else:
                    sends.append(send_tensor(inbox.take(index), peer, None))
            for works, _ in sends:
                for work in works:
                    work.wait()
            inbox.check_drained()
        medians.append(statistics.median(times[1:]) if times else 0.0)
    dist.barrier()
    return medians


def fit_p2p_cost(sizes: Sequence[int] = P2P_SIZES, repeats: int = P2P_REPEATS) -> CostModel:
    """``a + b * bytes`` of one stage-to-stage message, from round trips between ranks 0 and 1:
    half a round trip per size, fitted by least squares; the same on every rank. Collective.

    Args:
        sizes: Message sizes, bytes (at least two distinct).
        repeats: Timed round trips per size.
    """
    trips = torch.tensor(_round_trips(sizes, repeats), dtype=torch.float64)
    dist.broadcast(trips, 0)
    return CostModel.fit_points([float(s) for s in sizes], [t / 2 for t in trips.tolist()])


def _median_s(fn: Callable[[], object], repeats: int = HOST_REPEATS) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_host_cost(
    module: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor | None,
    pieces: int,
    *,
    first: bool,
) -> HostCost:
    """The host seconds of one stage's operations, its device time taken out (zeroed blocks).

    Each is what the runtime runs: a piece's forward (and loss on the last stage); a piece's
    backward, averaged over ``pieces`` in a row accumulating one gradient; SGD's step with
    ``zero_grad``; a SpecTrain prediction; a copy of the weights; torch's division of the
    gradients.

    Args:
        module: The stage, its blocks' device times zeroed.
        x: One piece's input.
        target: One piece's targets on the last stage, else None.
        pieces: Pieces per mini-batch.
        first: Whether this is the first stage (whose input needs no gradient).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=DEFAULT_LR, momentum=DEFAULT_MOMENTUM)

    def forward() -> torch.Tensor:
        inputs = x.detach().requires_grad_(not first)
        out = module(inputs)
        return functional.cross_entropy(out, target) if target is not None else out

    def backward_pieces() -> float:
        optimizer.zero_grad(set_to_none=True)
        spent = 0.0
        for _ in range(pieces):
            out = forward()
            started = time.perf_counter()
            out.backward(None if target is not None else torch.ones_like(out))
            spent += time.perf_counter() - started
        return spent / pieces

    backward_pieces()
    optimizer.step()  # momentum buffers exist from here on, as after the benchmark's warm-up
    backward_s = statistics.median(backward_pieces() for _ in range(HOST_REPEATS))

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    updates = []
    for _ in range(HOST_REPEATS):
        backward_pieces()
        started = time.perf_counter()
        update()
        updates.append(time.perf_counter() - started)
    backward_pieces()

    def scale() -> None:
        for p in params:
            if p.grad is not None:
                p.grad.div_(pieces)

    return HostCost(
        forward_s=_median_s(forward),
        backward_s=backward_s,
        update_s=statistics.median(updates),
        predict_s=_median_s(lambda: predicted_parameters(module.named_parameters(), optimizer, 1)),
        copy_s=_median_s(lambda: [p.detach().clone().requires_grad_(True) for p in params]),
        scale_s=_median_s(scale),
    )


def _stage_input(
    model: EmulatedPipelineModel, bounds: Sequence[int], inputs: torch.Tensor
) -> torch.Tensor:
    start = bounds[0]
    if start == 0:
        return inputs
    block = model.emulated_blocks()[start - 1]
    return torch.full((inputs.shape[0], *block.output_shape), 0.5)


def validate_pipeline_rank(job: PipelineValidationJob) -> dict[str, Any]:
    """One rank of a pipeline validation launch (collective): fit the point-to-point cost,
    measure the schedules with the benchmark's rank code, then time this rank's stage's host
    work, one rank at a time so that no other rank's work competes for the cores.

    Returns (rank 0's counts) the benchmark's value, the fitted cost and every stage's host
    cost, all in the dilated run's seconds.

    Args:
        job: What to measure; ``job.bench.compute`` is emulated.
    """
    rank, ranks = dist.get_rank(), dist.get_world_size()
    cost = fit_p2p_cost(job.p2p_sizes, job.p2p_repeats)
    value = measure_rank(job.bench)
    bench = job.bench
    model = build_pipeline_model(bench.model, bench.input_shape, bench.compute, bench.num_classes)
    assert isinstance(model, EmulatedPipelineModel)
    for block in model.emulated_blocks():
        block.forward_s = block.backward_s = 0.0
    bounds = value["bounds"][rank]
    module = pipeline_blocks(model)[bounds[0] : bounds[1]]
    inputs, targets = synthetic_batches(
        bench.batch, bench.input_shape, bench.seed, 0, 1, num_classes=bench.num_classes
    )[0]
    piece = bench.batch // bench.microbatches
    x = _stage_input(model, bounds, inputs[:piece])
    host: HostCost | None = None
    for turn in range(ranks):
        dist.barrier()
        if turn == rank:
            last = rank == ranks - 1
            host = measure_host_cost(
                module,
                x,
                targets[:piece] if last else None,
                bench.microbatches,
                first=rank == 0,
            )
    gathered: list[Any] = [None] * ranks
    dist.all_gather_object(gathered, host)
    return {
        "value": value,
        "cost": cost,
        "host": gathered,
        "microbatches": bench.microbatches,
    }


def _undilated_host(host: HostCost, dilation: float) -> HostCost:
    return HostCost(
        forward_s=host.forward_s / dilation,
        backward_s=host.backward_s / dilation,
        update_s=host.update_s / dilation,
        predict_s=host.predict_s / dilation,
        copy_s=host.copy_s / dilation,
        scale_s=host.scale_s / dilation,
    )


def pipeline_validation_rows(
    trace: str,
    compute: Compute,
    stages: int,
    link: str,
    schedules: Sequence[str],
    *,
    iters: int,
    warmup: int,
    rounds: int,
    timeout_s: float,
    collective_timeout_s: float,
    cache_dir: str | None = None,
    note: Callable[[str], None] = print,
    batch_size: int = DEFAULT_BATCH,
    microbatches: int = DEFAULT_MICROBATCHES,
) -> list[ValidationRow]:
    """Predicted against measured per-iteration time of each pipeline schedule on emulated
    compute, one launch of ``stages`` ranks on ``link`` run at its rate / dilation.

    The ranks time ``rounds`` interleaved blocks of ``iters // rounds`` mini-batches per
    schedule (``interlace bench pipeline``'s rank code); the measured iteration is the median
    over blocks of the block's slowest rank over its mini-batches. The prediction replays the
    same block from the trace's device time, the run's stage split, the point-to-point cost
    fitted on the live ranks and each stage's host work timed apart (both / dilation); nothing
    is fitted to the measured schedules.

    Args:
        trace: The model as the rows name it (the trace's name).
        compute: Emulated compute: the trace and the dilation.
        stages: Ranks, one stage each (>= 2).
        link: The target link (``10gbit``); the ranks run at its rate / dilation.
        schedules: Schedules of :data:`interlace.sim.pipeline.PIPELINE_SCHEDULES`.
        iters: Timed mini-batches per schedule, at least ``rounds``.
        warmup: Untimed mini-batches per schedule first.
        rounds: Timed blocks per schedule.
        timeout_s: Seconds allowed for the launch.
        collective_timeout_s: Seconds any one collective may wait for its peers.
        cache_dir: The ranks' cost-model cache folder (None: theirs).
        note: Where progress lines go.
        batch_size: Samples per mini-batch.
        microbatches: Micro-batches (synchronous schedules) or chunks (asynchronous ones) per
            mini-batch.

    Raises:
        UsageError: For real compute, an unknown schedule, bad sizes, or no root for the
            emulated cluster.
        LaunchFailedError: When the launch fails.
    """
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
    if rounds < 1 or iters < rounds or warmup < 0:
        raise UsageError(f"--iters ({iters}) must be >= --rounds ({rounds}) >= 1 and --warmup >= 0")
    if batch_size % microbatches:
        raise UsageError(
            f"batch {batch_size} does not split into {microbatches} micro-batches; use a multiple"
        )
    model_trace = load_trace(compute.trace)
    stage_costs(model_trace, [(0, len(model_trace.layers))], batch_size)  # activations known
    try:
        netem.check_available()
    except netem.NetemUnavailableError as exc:
        raise UsageError(f"{exc}; validation measures on the emulated cluster") from exc
    run_link = format_rate(dilate_rate(link, compute.dilation))
    block = iters // rounds
    job = PipelineValidationJob(
        PipelineJob(
            model=str(compute.trace),
            batch=batch_size,
            microbatches=microbatches,
            input_shape=DEFAULT_INPUT_SHAPE,
            schedules=tuple(schedules),
            block=block,
            iters=rounds,
            warmup=warmup,
            num_classes=NUM_CLASSES,
            compute=compute,
        )
    )
    result = launch_on_ranks(
        validate_pipeline_rank,
        job,
        nprocs=stages,
        link=run_link,
        timeout_s=timeout_s,
        collective_timeout_s=collective_timeout_s,
        cache_dir=cache_dir,
        note=note,
        prog=PROG,
    )
    sample = PipelineSample.from_launch(result, compute.dilation, block)
    shown = f"{link} (emulated at {run_link})"
    rows = sample.rows(model_trace, trace, shown, batch_size)
    bare = sample.rows(model_trace, trace, shown, batch_size, host=False)
    note(sample.describe())
    for row, device_only in zip(rows, bare, strict=True):
        note(
            f"{trace}, {stages} stages, {link}: {row.strategy} predicted "
            f"{row.predicted_s * 1e3:.3f} ms ({device_only.predicted_s * 1e3:.3f} without host "
            f"work), measured {row.measured_s * 1e3:.3f} ms ({row.error * 100:+.1f}%)"
        )
    return rows


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
    """

    bounds: tuple[tuple[int, int], ...]
    cost: CostModel
    host: tuple[HostCost, ...]
    measured_s: dict[str, list[float]]
    block: int
    microbatches: int

    @classmethod
    def from_launch(cls, result: dict[str, Any], dilation: float, block: int) -> PipelineSample:
        """The sample from :func:`validate_pipeline_rank`'s value, its times / ``dilation``.

        Args:
            result: Rank 0's value.
            dilation: The run's dilation.
            block: Mini-batches per timed block.
        """
        value = result["value"]
        cost: CostModel = result["cost"]
        return cls(
            bounds=tuple((int(s), int(e)) for s, e in value["bounds"]),
            cost=CostModel(cost.a / dilation, cost.b / dilation),
            host=tuple(_undilated_host(h, dilation) for h in result["host"]),
            measured_s={
                name: [t / dilation / block for t in times]
                for name, times in value["block_s"].items()
            },
            block=block,
            microbatches=int(result["microbatches"]),
        )

    def rows(
        self, trace: Any, model: str, link: str, batch: int, *, host: bool = True
    ) -> list[ValidationRow]:
        """One row per measured schedule: the replayed block against the median measured one.

        Args:
            trace: The emulated model's :class:`~interlace.sim.trace.Trace`.
            model: The model as the rows name it.
            link: The link as the rows show it.
            batch: Samples per mini-batch.
            host: Include the stages' host work (False: device time and messages alone).
        """
        costs = stage_costs(trace, self.bounds, batch, self.host if host else None)
        rows = []
        for schedule, times in self.measured_s.items():
            predicted = simulate_pipeline(
                costs, schedule, self.cost, microbatches=self.microbatches, block=self.block
            )
            rows.append(
                ValidationRow.of(
                    family="pipeline",
                    model=model,
                    strategy=schedule,
                    ranks=len(self.bounds),
                    link=link,
                    predicted_s=predicted.iteration_s,
                    measured_s=statistics.median(times),
                )
            )
        return rows

    def describe(self) -> str:
        """The stage split, the fitted cost and the host costs, in a few lines."""
        lines = [
            f"stages (blocks): {', '.join(f'{s}-{e - 1}' for s, e in self.bounds)}; "
            f"point-to-point a = {self.cost.a * 1e6:.1f} us, "
            f"{8 / self.cost.b / 1e9 if self.cost.b else float('inf'):.2f} Gbit/s (undilated)"
        ]
        for index, h in enumerate(self.host):
            lines.append(
                f"  stage {index} host (us): forward {h.forward_s * 1e6:.1f}, backward "
                f"{h.backward_s * 1e6:.1f} per piece; update {h.update_s * 1e6:.1f}, predict "
                f"{h.predict_s * 1e6:.1f}, copy {h.copy_s * 1e6:.1f}, scale {h.scale_s * 1e6:.1f}"
            )
        return "\n".join(lines)
