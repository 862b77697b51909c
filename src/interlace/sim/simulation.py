"""Simulated data-parallel iterations: a strategy's plan from a trace, replayed in time.

A strategy names a planner of :mod:`interlace.comm.planners`; :func:`simulate` plans a trace's
buckets exactly as :class:`interlace.DataParallel` does and replays them with
:func:`interlace.sim.replay.replay`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import Overlap, plan_overlap
from interlace.comm.plan import Plan, ReadyTensor
from interlace.comm.pricing import schedule
from interlace.comm.strategies import PLANNED_STRATEGIES, Strategy, planned_strategy
from interlace.errors import UsageError
from interlace.sim.replay import NO_CONTENTION, Contention, Replay, replay
from interlace.sim.trace import Trace
from interlace.timeline import Timeline


@dataclass(frozen=True)
class SimResult:
    """One strategy on one trace at one worker count.

    Args:
        strategy: The strategy's name.
        workers: The worker count.
        cost: The all-reduce cost the plan was made with.
        plan: The buckets.
        replay: The iteration in time.
        model: The trace's model.
        network: The network's description.
        extra: Strategy-specific numbers for the rows.
    """

    strategy: str
    workers: int
    cost: CostModel
    plan: Plan
    replay: Replay
    model: str = ""
    network: str = ""
    extra: dict[str, float] = field(default_factory=dict, compare=False)

    @property
    def iteration_s(self) -> float:
        return self.replay.iteration_s

    @property
    def buckets(self) -> int:
        return len(self.plan.buckets)

    def timeline(self, process: str = "simulated") -> Timeline:
        """The iteration as a :class:`~interlace.timeline.Timeline` (same PNG and Chrome trace
        renderer as ``interlace profile``): forward, each tensor's backward and the optimizer
        step on the compute lane, each bucket's all-reduce on the communication lane.

        Args:
            process: The process name the events are drawn under.
        """
        replayed = self.replay
        title = f"{self.model or 'trace'}, {self.strategy}, {self.workers} workers, simulated" + (
            f" ({self.network})" if self.network else ""
        )
        timeline = Timeline(title=title)
        pre = replayed.pre_forward_s
        if pre > 0:
            timeline.add("broadcast buffers", "comm", 0.0, pre, lane="all-reduce", process=process)
        origin = pre + replayed.forward_s
        timeline.add("forward", "forward", pre, origin, lane="compute", process=process)
        previous = 0.0
        for tensor, ready in zip(self.plan.tensors, replayed.ready_s, strict=True):
            if ready > previous:
                timeline.add(
                    tensor.name,
                    "backward",
                    origin + previous,
                    origin + ready,
                    lane="compute",
                    process=process,
                )
                previous = ready
        if replayed.backward_end_s > previous:
            timeline.add(
                "backward (rest)",
                "backward",
                origin + previous,
                origin + replayed.backward_end_s,
                lane="compute",
                process=process,
            )
        for number, comm in enumerate(replayed.comms):
            timeline.add(
                f"bucket {number} ({comm.nbytes / 1e6:.2f} MB)",
                "comm",
                origin + comm.start_s,
                origin + comm.end_s,
                lane="all-reduce",
                process=process,
                bytes=comm.nbytes,
                tensors=len(comm.indices),
                ready_ms=round((origin + comm.ready_s) * 1e3, 3),
            )
        end = origin + max(replayed.backward_end_s, replayed.comm_end_s)
        if replayed.sync_s > 0:
            timeline.add(
                "synchronise",
                "comm",
                end,
                end + replayed.sync_s,
                lane="all-reduce",
                process=process,
            )
            end += replayed.sync_s
        if replayed.step_s > 0:
            timeline.add(
                "optimizer step",
                "optimizer",
                end,
                end + replayed.step_s,
                lane="compute",
                process=process,
            )
        return timeline


#: Bytes on the wire per float32 byte under each gradient compression (the names DataParallel's
#: ``compression`` takes: float32 buckets travel as 2-byte floats).
WIRE_SCALES: dict[str, float] = {"fp16": 0.5, "bf16": 0.5}


def wire_tensors(tensors: Sequence[ReadyTensor], compression: str | None) -> list[ReadyTensor]:
    """``tensors`` with the bytes they send under ``compression``, as DataParallel's planner
    sees them (each at least one byte).

    Args:
        tensors: The trace's tensors, float32 bytes.
        compression: None, or a key of :data:`WIRE_SCALES`.

    Raises:
        UsageError: For an unknown compression.
    """
    if compression is None:
        return list(tensors)
    if compression not in WIRE_SCALES:
        raise UsageError(
            f"unknown compression {compression!r}; choose one of {', '.join(WIRE_SCALES)}"
        )
    scale = WIRE_SCALES[compression]
    return [replace(t, nbytes=max(int(t.nbytes * scale), 1)) for t in tensors]


def strategy_named(name: str) -> Strategy:
    """The planned strategy ``name``; a clear error naming the choices otherwise.

    Args:
        name: A key of :data:`~interlace.comm.strategies.PLANNED_STRATEGIES`, optionally
            with ``/k=K`` for ``K`` channels.

    Raises:
        UsageError: For an unknown name, or the optimal planner on several channels.
    """
    chosen = planned_strategy(name)
    if chosen is not None:
        return chosen
    raise UsageError(
        f"unknown strategy {name!r}; choose from {', '.join(PLANNED_STRATEGIES)}, or any of them "
        "with /k=K for K channels (e.g. mgwfbp/k=3)"
    )


def simulate(
    trace: Trace,
    strategy: str | Strategy,
    cost: CostModel,
    *,
    workers: int = 0,
    contention: Contention = NO_CONTENTION,
    per_layer: bool = False,
    network: str = "",
    timing_cost: CostModel | None = None,
    buckets: Sequence[Sequence[str]] | None = None,
    sync_s: float = 0.0,
    compression: str | None = None,
    slice_bytes: float | None = None,
    host_s_per_byte: float = 0.0,
) -> SimResult:
    """One iteration of ``trace`` with ``strategy`` when an all-reduce costs ``cost``.

    The planner decides with ``cost``; the replay times all-reduces with ``timing_cost``, for a
    runtime that plans with one model while its network behaves as another (DataParallel fits
    ``a`` on isolated all-reduces but issues them back to back).

    Args:
        trace: The model's iteration.
        strategy: A :class:`Strategy` or a name :func:`strategy_named` knows.
        cost: The all-reduce cost the planner plans with.
        workers: The worker count, recorded in the result.
        contention: How compute and communication slow each other (default: not at all).
        per_layer: Send a layer's tensors as one message (Caffe's unit, as in the MG-WFBP
            paper's WFBP) instead of one message per tensor (PyTorch's unit).
        network: The network's description, recorded in the result.
        timing_cost: The cost the replay times all-reduces with (default ``cost``).
        buckets: Tensor names per bucket, in launch order: replay a bucketing a run actually
            used instead of planning one (DataParallel keeps whichever candidate plan it
            measured fastest, which the cost model alone cannot foresee).
        sync_s: Seconds added after backward's communication (a measured synchronisation
            cost, :class:`interlace.sim.contention.Calibration`).
        compression: ``"fp16"`` or ``"bf16"``: gradients travel in half the bytes and are
            planned so (:func:`wire_tensors`, DataParallel's ``compression``). A planner's caps
            then count wire bytes: torch DDP's count float32 bytes, so price DDP with a
            compressing hook with its caps scaled by :data:`WIRE_SCALES`.
        slice_bytes: With ``buckets`` and a strategy that overlaps the next forward: the
            largest slice the run cut its buckets into (None: uncut), as
            :func:`~interlace.comm.forward_plan.plan_overlap` takes it.
        host_s_per_byte: Host seconds per byte a bucket costs the compute lane when it goes
            out (the runtime's copy into the bucket and its division;
            :func:`~interlace.sim.replay.replay`).
    """
    chosen = strategy if isinstance(strategy, Strategy) else strategy_named(strategy)
    tensors = wire_tensors(trace.ready_tensors(per_layer=per_layer), compression)
    if buckets is None:
        plan = chosen.plan(
            tensors,
            cost,
            backward_s=trace.backward_s,
            forward_s=trace.forward_s,
            gates=trace.forward_gates(per_layer) if chosen.overlap is Overlap.FORWARD else (),
            step_s=trace.step_s,
        )
    else:
        position = {tensor.name: index for index, tensor in enumerate(tensors)}
        missing = sorted({name for bucket in buckets for name in bucket} - set(position))
        if missing:
            raise ValueError(
                f"the buckets name tensors the trace does not have: {', '.join(missing[:5])}"
            )
        groups = [[position[name] for name in bucket] for bucket in buckets]
        backward_s = max(trace.backward_s, *(t.ready_s for t in tensors))
        if chosen.overlap is Overlap.FORWARD:
            # The run's buckets on into the next forward, sent most urgent first as the
            # runtime sends them.
            plan = plan_overlap(
                tensors,
                trace.forward_gates(per_layer),
                cost,
                groups=groups,
                forward_s=trace.forward_s,
                backward_s=backward_s,
                step_s=trace.step_s,
                channels=chosen.channels,
                slice_bytes=slice_bytes,
                strategy=chosen.name,
            )
        else:
            plan = schedule(
                groups,
                tensors,
                cost,
                backward_s=backward_s,
                forward_s=trace.forward_s,
                strategy=chosen.name,
            )
    replayed = replay(
        plan,
        contention,
        step_s=trace.step_s,
        cost=timing_cost,
        pre_forward_bytes=trace.broadcast_bytes,
        sync_s=sync_s,
        host_s_per_byte=host_s_per_byte,
    )
    return SimResult(chosen.name, workers, cost, plan, replayed, trace.model, network)
