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


@dataclass
class StageOps:
    """One stage's operations in a mini-batch, as the runtime does them (its sends apart).

    Args:
        module: The stage.
        x: One piece's input.
        target: One piece's targets on the last stage, else None.
        pieces: Pieces per mini-batch.
        first: Whether this is the first stage (whose input needs no gradient).
    """

    module: nn.Module
    x: torch.Tensor
    target: torch.Tensor | None
    pieces: int
    first: bool

    def __post_init__(self) -> None:
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.module, self.params)

    def forward(self) -> torch.Tensor:
        """One piece's forward (with the loss on the last stage)."""
        out = self.module(self.x.detach().requires_grad_(not self.first))
        return functional.cross_entropy(out, self.target) if self.target is not None else out

    def backward(self, out: torch.Tensor) -> None:
        """One piece's backward, accumulating the gradients."""
        out.backward(None if self.target is not None else torch.ones_like(out))

    def scale(self) -> None:
        """torch's division of the accumulated gradients by the piece count."""
        for p in self.params:
            if p.grad is not None:
                p.grad.div_(self.pieces)

    def update(self) -> None:
        """SGD's step with ``zero_grad``."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def predict(self) -> object:
        """A SpecTrain prediction of the weights one step ahead."""
        return predicted_parameters(self.module.named_parameters(), self.optimizer, 1)

    def copy(self) -> object:
        """A copy of the weights (PipeDream's stash)."""
        return [p.detach().clone().requires_grad_(True) for p in self.params]

    def mini_batch(self) -> None:
        """Every piece's forward and backward, the division and the update."""
        for _ in range(self.pieces):
            self.backward(self.forward())
        self.scale()
        self.update()


def measure_host_cost(ops: StageOps, *, clock: DeviceClock, cycles: int = HOST_CYCLES) -> HostCost:
    """The host seconds of one stage's operations: each one's wall time less the device time
    it paid for on ``clock``, median over cycles.

    A cycle does what a mini-batch does on the stage (its sends apart, timed with the
    messages): a copy of the weights (PipeDream's stash), a SpecTrain prediction, the pieces'
    forwards (with the loss on the last stage) and backwards accumulating one gradient, torch's
    division of the gradients, SGD's step with ``zero_grad``. The device time is spent for
    real, as in the run: host work woken from a device sleep takes longer than the same work
    back to back. One untimed cycle comes first.

    Args:
        ops: The stage's operations.
        clock: The device clock the stage's blocks spend on.
        cycles: Timed cycles.
    """
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

    for cycle in range(cycles + 1):
        if cycle == 1:  # the untimed cycle made the momentum buffers a prediction reads
            for values in samples.values():
                values.clear()
        timed("copy_s", ops.copy)
        if cycle:
            timed("predict_s", ops.predict)
        for _ in range(ops.pieces):
            out: torch.Tensor = timed("forward_s", ops.forward)
            timed("backward_s", partial(ops.backward, out))
        timed("scale_s", ops.scale)
        timed("update_s", ops.update)
    return HostCost(**{name: max(statistics.median(v), 0.0) for name, v in samples.items()})


def _median_mini_batch_s(ops: StageOps, cycles: int) -> float:
    times = []
    for _ in range(cycles):
        started = time.perf_counter()
        ops.mini_batch()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_slowdown(ops: StageOps, cycles: int = HOST_CYCLES) -> list[float]:
    """How many times longer a stage's mini-batch (device time and host work, no messages)
    takes while 1, 2, ..., all ranks run theirs at once, as the ranks share the host's cores.

    Each rank first times its mini-batch alone, one rank at a time; then the first ``k`` ranks
    time theirs together, for every ``k`` from 2. Entry ``k - 1`` is the median over those ranks
    of their time together over their time alone (entry 0 is 1). Collective; every rank gets
    the same list.

    Args:
        ops: This rank's stage operations.
        cycles: Timed mini-batches of each phase (medians taken), after one untimed.
    """
    rank, ranks = dist.get_rank(), dist.get_world_size()
    ops.mini_batch()
    times = torch.zeros(ranks + 1, dtype=torch.float64)  # alone, then together with k ranks
    for turn in range(ranks):
        dist.barrier()
        if turn == rank:
            times[0] = _median_mini_batch_s(ops, cycles)
    for together in range(2, ranks + 1):
        dist.barrier()
        if rank < together:
            times[together] = _median_mini_batch_s(ops, cycles)
    gathered = [torch.zeros_like(times) for _ in range(ranks)]
    dist.all_gather(gathered, times)
    return slowdowns([t.tolist() for t in gathered])


def slowdowns(times: Sequence[Sequence[float]]) -> list[float]:
    """Entry ``k - 1``: the median over ranks ``0 .. k - 1`` of their time with ``k`` ranks at
    once over their time alone (at least 1: sharing cores slows down, noise aside).

    Args:
        times: Per rank, its time alone, then (at index ``k``) with ``k`` ranks at once;
            unused entries are ignored.
    """
    result = [1.0]
    for together in range(2, len(times) + 1):
        ratios = [t[together] / t[0] for t in times[:together] if t[0] > 0]
        result.append(max(statistics.median(ratios), 1.0) if ratios else 1.0)
    return result


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
    measure the schedules with the benchmark's rank code, time this rank's stage's host work,
    one rank at a time so that no other rank's work competes for the cores, then how much the
    stages' mini-batches slow each other down when they run at once
    (:func:`measure_slowdown`).

    Returns (rank 0's counts) the benchmark's value, the fitted cost, every stage's host
    cost (in the dilated run's seconds) and the slowdowns.

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
    ops = StageOps(
        module,
        _stage_input(model, bounds, inputs[:piece]),
        targets[:piece] if rank == ranks - 1 else None,
        bench.microbatches,
        first=rank == 0,
    )
    host: HostCost | None = None
    for turn in range(ranks):
        dist.barrier()
        if turn == rank:
            host = replace(measure_host_cost(ops, clock=model.clock), send_s=send_s)
    gathered: list[Any] = [None] * ranks
    dist.all_gather_object(gathered, host)
    slowdown = measure_slowdown(ops)
    return {
        "value": value,
        "cost": cost,
        "host": gathered,
        "slowdown": slowdown,
        "microbatches": bench.microbatches,
    }
