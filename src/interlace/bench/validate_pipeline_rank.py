"""Pipeline validation, rank side: the point-to-point fit with the pipeline's own messages,
each stage's host work timed around its device time, and the rank code that measures the
schedules with ``interlace bench pipeline``'s."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from interlace.bench.harness import make_optimizer
from interlace.bench.pipeline_rank import PipelineJob, measure_rank
from interlace.comm.cost import CostModel
from interlace.emulate.device import DeviceClock
from interlace.emulate.pipeline import EmulatedPipelineModel
from interlace.pipeline.messages import Inbox, send_tensor
from interlace.pipeline.partition import pipeline_blocks
from interlace.pipeline.predict import predicted_parameters
from interlace.sim.pipeline import HostCost

#: Message sizes of the point-to-point fit, bytes: around the pieces a stage boundary carries.
P2P_SIZES: tuple[int, ...] = (65_536, 262_144, 1_048_576, 2_097_152, 4_194_304)
P2P_REPEATS = 3
#: Timed cycles of a stage's host operations (medians taken), after one untimed.
HOST_CYCLES = 5


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


def _round_trips(sizes: Sequence[int], repeats: int) -> tuple[list[float], float]:
    """Median round trip of each size between ranks 0 and 1 with the pipeline's own messages
    (header and payload, receives posted ahead by an ``Inbox``), and the median time a
    ``send_tensor`` call takes; rank 0's, the others get zeros. Collective."""
    rank = dist.get_rank()
    medians = []
    calls: list[float] = []
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
                    if index:
                        calls.append(time.perf_counter() - started)
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
    return medians, statistics.median(calls) if calls else 0.0


def fit_p2p_cost(
    sizes: Sequence[int] = P2P_SIZES, repeats: int = P2P_REPEATS
) -> tuple[CostModel, float]:
    """``a + b * bytes`` of one stage-to-stage message, from round trips between ranks 0 and 1
    (half a round trip each): ``a`` from a one-element tensor, ``b`` fitted on ``sizes`` on top
    (a fit of both lets the shaped link's burst, which lets smaller messages through early,
    pull the start-up below zero); and the seconds the sending call itself takes. The same on
    every rank. Collective.

    Args:
        sizes: Message sizes, bytes.
        repeats: Timed round trips per size.
    """
    medians, call = _round_trips((4, *sizes), repeats)
    measured = torch.tensor([*medians, call], dtype=torch.float64)
    dist.broadcast(measured, 0)
    *trips, send_s = measured.tolist()
    tiny, *rest = (t / 2 for t in trips)
    return CostModel.fit_slope(tiny, [float(s) for s in sizes], rest), send_s


def measure_host_cost(
    module: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor | None,
    pieces: int,
    *,
    first: bool,
    clock: DeviceClock,
    cycles: int = HOST_CYCLES,
) -> HostCost:
    """The host seconds of one stage's operations: each one's wall time less the device time
    it paid for on ``clock``, median over cycles.

    A cycle does what a mini-batch does on the stage (its sends apart, timed with the
    messages): a copy of the weights (PipeDream's stash), a SpecTrain prediction, ``pieces``
    forwards (with the loss on the last stage) and backwards accumulating one gradient, torch's
    division of the gradients, SGD's step with ``zero_grad``. The device time is spent for
    real, as in the run: host work woken from a device sleep takes longer than the same work
    back to back. One untimed cycle comes first.

    Args:
        module: The stage.
        x: One piece's input.
        target: One piece's targets on the last stage, else None.
        pieces: Pieces per mini-batch.
        first: Whether this is the first stage (whose input needs no gradient).
        clock: The device clock the stage's blocks spend on.
        cycles: Timed cycles.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = make_optimizer(module, params)
    samples: dict[str, list[float]] = {
        name: [] for name in HostCost.__dataclass_fields__ if name != "send_s"
    }

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        # Paid, not spent: an overshoot repaid by a later spend belongs to the sleep that made
        # it, not to the operation that repays it.
        paid, started = clock.paid_s, time.perf_counter()
        value = fn()
        samples[name].append(time.perf_counter() - started - (clock.paid_s - paid))
        return value

    def forward() -> torch.Tensor:
        out = module(x.detach().requires_grad_(not first))
        return functional.cross_entropy(out, target) if target is not None else out

    def backward(out: torch.Tensor) -> None:
        out.backward(None if target is not None else torch.ones_like(out))

    def scale() -> None:
        for p in params:
            if p.grad is not None:
                p.grad.div_(pieces)

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def predict() -> object:
        return predicted_parameters(module.named_parameters(), optimizer, 1)

    for cycle in range(cycles + 1):
        if cycle == 1:  # the untimed cycle made the momentum buffers a prediction reads
            for values in samples.values():
                values.clear()
        timed("copy_s", lambda: [p.detach().clone().requires_grad_(True) for p in params])
        if cycle:
            timed("predict_s", predict)
        for _ in range(pieces):
            out: torch.Tensor = timed("forward_s", forward)
            timed("backward_s", partial(backward, out))
        timed("scale_s", scale)
        timed("update_s", update)
    return HostCost(**{name: max(statistics.median(v), 0.0) for name, v in samples.items()})


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
    cost, send_s = fit_p2p_cost(job.p2p_sizes, job.p2p_repeats)
    value = measure_rank(job.bench)
    bench = job.bench
    model = bench.module()
    assert isinstance(model, EmulatedPipelineModel)
    bounds = value["bounds"][rank]
    module = pipeline_blocks(model)[bounds[0] : bounds[1]]
    inputs, targets = bench.batches(0)[0]
    piece = bench.batch // bench.microbatches
    x = _stage_input(model, bounds, inputs[:piece])
    host: HostCost | None = None
    for turn in range(ranks):
        dist.barrier()
        if turn == rank:
            host = replace(
                measure_host_cost(
                    module,
                    x,
                    targets[:piece] if rank == ranks - 1 else None,
                    bench.microbatches,
                    first=rank == 0,
                    clock=model.clock,
                ),
                send_s=send_s,
            )
    gathered: list[Any] = [None] * ranks
    dist.all_gather_object(gathered, host)
    return {
        "value": value,
        "cost": cost,
        "host": gathered,
        "microbatches": bench.microbatches,
    }
