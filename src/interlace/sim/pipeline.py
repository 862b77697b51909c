"""Pipeline schedules predicted in time: interlace's schedules, each stage's lowered program
(:meth:`interlace.pipeline.schedule.Schedule.program`, what the runtime runs) priced, and torch's
``ScheduleGPipe`` and ``Schedule1F1B``, replayed against the messages that cross the stage
boundaries (:mod:`interlace.sim.pipeline_events`), as ``interlace bench pipeline`` times them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from interlace.comm.cost import CostModel
from interlace.errors import UsageError
from interlace.pipeline.balance import balance_stages
from interlace.pipeline.block import HEADER_BYTES, BlockPlan, block_plan, piece_of
from interlace.pipeline.layout import averaging_points
from interlace.pipeline.schedule import SCHEDULE_TYPES, Op, Schedule, one_f_one_b_order
from interlace.sim.pipeline_events import (
    Compute,
    Instruction,
    Join,
    Message,
    Post,
    ProgramReplay,
    Reduce,
    Send,
    Wait,
    replay_programs,
)
from interlace.sim.trace import Trace

#: interlace's schedules, then torch's, as ``interlace bench pipeline`` names its contenders.
INTERLACE_PIPELINE_SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_TYPES)
TORCH_PIPELINE_SCHEDULES: tuple[str, ...] = ("torch-gpipe", "torch-1f1b")
PIPELINE_SCHEDULES: tuple[str, ...] = (*INTERLACE_PIPELINE_SCHEDULES, *TORCH_PIPELINE_SCHEDULES)
#: The per-rank batch a trace's times stand for when it records none (as the emulated
#: pipeline model assumes).
FALLBACK_TRACE_BATCH = 32
#: Bytes of one activation element: emulated blocks output float32.
ACTIVATION_BYTES = 4


@dataclass(frozen=True)
class HostCost:
    """Host (CPU) seconds a stage spends around its device time, as the runtime does them.

    Args:
        forward_s: Per piece (micro-batch or chunk) forward: building the graph, the output.
        backward_s: Per piece backward: making and accumulating the parameters' gradients.
        update_s: One optimizer step with ``zero_grad``.
        predict_s: One SpecTrain prediction of the stage's weights (``W - s lr v``).
        copy_s: One copy of the stage's weights (PipeDream's stash).
        scale_s: torch's division of the accumulated gradients by the micro-batch count.
        send_s: One call that sends a tensor (``send_tensor``, torch's ``batch_isend_irecv``).
    """

    forward_s: float = 0.0
    backward_s: float = 0.0
    update_s: float = 0.0
    predict_s: float = 0.0
    copy_s: float = 0.0
    scale_s: float = 0.0
    send_s: float = 0.0


@dataclass(frozen=True)
class StageCost:
    """One stage's costs for one whole mini-batch.

    Args:
        forward_s: Device seconds of its forward over the mini-batch.
        backward_s: Device seconds of its backward.
        output_bytes: Bytes of its output over the mini-batch, sent to the next stage (as many
            gradient bytes come back); 0 on the last stage.
        host: Host work around the device time.
        reduce_s: With replicas, from the start of the backward that launches the stage's
            gradient all-reduce to its end (:func:`interlace.sim.pipeline_price.stage_reduce_s`);
            the update waits for it. 0: one replica.
    """

    forward_s: float
    backward_s: float
    output_bytes: float
    host: HostCost = field(default_factory=HostCost)
    reduce_s: float = 0.0

    def host_s(self, pieces: int) -> float:
        """Host seconds of one mini-batch: each piece's forward and backward, the division of
        the gradients and the update.

        Args:
            pieces: Pieces per mini-batch.
        """
        h = self.host
        return pieces * (h.forward_s + h.backward_s) + h.scale_s + h.update_s


@dataclass(frozen=True)
class PipelineResult:
    """One schedule's predicted block of mini-batches.

    Args:
        schedule: The schedule.
        block: Mini-batches in the block.
        block_s: From the block's start until the last stage ends it.
        replay: Every computation and transfer in time.
    """

    schedule: str
    block: int
    block_s: float
    replay: ProgramReplay

    @property
    def iteration_s(self) -> float:
        """Seconds per mini-batch, as the benchmark reports it: the block over its size."""
        return self.block_s / self.block


def _forward_layers(trace: Trace) -> list[tuple[float, float, int]]:
    """``(forward_s, backward_s, output numel per sample)`` of each traced layer, forward order,
    with the passes' time outside the layers spread over them (:attr:`Trace.pass_scales`)."""
    forward_scale, backward_scale = trace.pass_scales
    layers = []
    for name, indices in reversed(trace.layers):
        activation = trace.activation(name)
        if activation is None:
            raise UsageError(
                f"trace {trace.model!r} records no activation size for layer {name}; a pipeline "
                "needs them: profile the model with `interlace profile --trace-out`"
            )
        tensor = trace.tensors[indices[0]]
        layers.append(
            (
                tensor.layer_forward_s * forward_scale,
                tensor.layer_backward_s * backward_scale,
                activation.numel,
            )
        )
    return layers


def trace_bounds(trace: Trace, stages: int) -> list[tuple[int, int]]:
    """The stages, as block ranges, that balancing the traced layers' times gives.

    The emulated pipeline model has one block per traced layer and the library cuts it by the
    blocks' measured forward and backward time (``plan_stages(by="time")``); with no host
    overhead those are the traced times, whose exact balance this is. A run's plan, measured,
    can differ: predict a run from its own bounds.

    Args:
        trace: A trace with activation sizes.
        stages: Pipeline stages (1 to the number of layers).
    """
    costs = [f + b for f, b, _ in _forward_layers(trace)]
    if not 1 <= stages <= len(costs):
        raise UsageError(
            f"trace {trace.model!r} has {len(costs)} layers, too few for {stages} stages; "
            "use fewer stages"
        )
    return balance_stages(costs, stages)


def stage_costs(
    trace: Trace,
    bounds: Sequence[tuple[int, int]],
    batch: int,
    host: Sequence[HostCost] | None = None,
) -> list[StageCost]:
    """Each stage's device time and boundary bytes for a mini-batch of ``batch`` samples.

    A layer's traced time scales with the samples (``batch / trace.batch_size``), as the emulated
    blocks spend it.

    Args:
        trace: A trace with activation sizes.
        bounds: Each stage's ``[start, end)`` range of layers, in forward order, contiguous.
        batch: Samples per mini-batch.
        host: Each stage's host costs (default none).
    """
    layers = _forward_layers(trace)
    if not bounds or bounds[0][0] != 0 or bounds[-1][1] != len(layers):
        raise UsageError(
            f"stage bounds {list(bounds)} must cover the {len(layers)} layers of "
            f"{trace.model!r} from 0"
        )
    if any(end <= start for start, end in bounds) or any(
        end != start for (_, end), (start, _) in itertools.pairwise(bounds)
    ):
        raise UsageError(f"stage bounds {list(bounds)} must be contiguous and non-empty")
    if host is not None and len(host) != len(bounds):
        raise UsageError(f"{len(host)} host costs for {len(bounds)} stages; give one per stage")
    if batch < 1:
        raise UsageError(f"batch must be >= 1, got {batch}")
    scale = batch / (trace.batch_size or FALLBACK_TRACE_BATCH)
    result = []
    for index, (start, end) in enumerate(bounds):
        last = index == len(bounds) - 1
        result.append(
            StageCost(
                forward_s=math.fsum(f for f, _, _ in layers[start:end]) * scale,
                backward_s=math.fsum(b for _, b, _ in layers[start:end]) * scale,
                output_bytes=0 if last else layers[end - 1][2] * ACTIVATION_BYTES * batch,
                host=host[index] if host is not None else HostCost(),
            )
        )
    return result


def with_measured_compute(
    stages: Sequence[StageCost], seconds: Sequence[float], pieces: int
) -> list[StageCost]:
    """Each stage's device time scaled so that its mini-batch, with the host work around it
    (each piece's forward and backward, the division, the update), takes the measured
    ``seconds``; the trace's split between forward and backward is kept.

    Args:
        stages: Each stage's costs (:func:`stage_costs`).
        seconds: Each stage's measured mini-batch, device time and host work.
        pieces: Pieces per mini-batch.

    Raises:
        UsageError: When the counts of stages and measurements differ.
    """
    if len(seconds) != len(stages):
        raise UsageError(f"{len(seconds)} measured stage times for {len(stages)} stages")
    scaled = []
    for cost, measured in zip(stages, seconds, strict=True):
        device = cost.forward_s + cost.backward_s
        factor = max(measured - cost.host_s(pieces), 0.0) / device if device > 0 else 1.0
        scaled.append(
            replace(cost, forward_s=cost.forward_s * factor, backward_s=cost.backward_s * factor)
        )
    return scaled


# ------------------------------------------------------------------------------ programs


class _Builder:
    """Messages and computations of one stage, named so that sender and receiver agree."""

    def __init__(self, stages: Sequence[StageCost], stage: int, pieces: int) -> None:
        self.stages = stages
        self.stage = stage
        self.cost = stages[stage]
        self.pieces = pieces
        self.first = stage == 0
        self.last = stage == len(stages) - 1
        self.ops: list[Instruction] = []

    def act(self, step: int, unit: int, piece: int, into: int) -> Message:
        """The activation of ``(step, unit, piece)`` that stage ``into`` receives."""
        nbytes = self.stages[into - 1].output_bytes / self.pieces
        return Message(("act", step, unit, piece, into), into - 1, into, nbytes)

    def grad(self, step: int, unit: int, piece: int, into: int) -> Message:
        """The gradient of ``(step, unit, piece)`` that stage ``into`` receives."""
        nbytes = self.stages[into].output_bytes / self.pieces
        return Message(("grad", step, unit, piece, into), into + 1, into, nbytes)

    @staticmethod
    def headed(payload: Message) -> tuple[Message, Message]:
        """The runtime's two messages for one tensor: a header, and the payload whose receive
        the receiver's ``Inbox`` posts when the header lands."""
        header = Message(
            (f"{payload.key[0]}-header", *payload.key[1:]), payload.src, payload.dst, HEADER_BYTES
        )
        return header, Message(payload.key, payload.src, payload.dst, payload.nbytes, header)

    def send_headed(self, payload: Message) -> tuple[Message, Message]:
        """Send a tensor as the runtime does (``send_tensor``: header and payload together)."""
        pair = self.headed(payload)
        self.sending()
        self.ops.extend(Send(m) for m in pair)
        return pair

    def sending(self) -> None:
        """The host call that starts a send."""
        self.ops.append(Compute(self.cost.host.send_s, "send", "comm"))

    def forward(self, label: str = "forward") -> None:
        seconds = self.cost.forward_s / self.pieces + self.cost.host.forward_s
        self.ops.append(Compute(seconds, label, "forward"))

    def backward(self) -> None:
        seconds = self.cost.backward_s / self.pieces + self.cost.host.backward_s
        self.ops.append(Compute(seconds, "backward", "backward"))

    def host(self, seconds: float, label: str) -> None:
        self.ops.append(Compute(seconds, label, "optimizer"))

    def launch(self) -> None:
        """The stage's gradient all-reduce starts (replicated stages only)."""
        if self.cost.reduce_s > 0:
            self.ops.append(Reduce(self.cost.reduce_s))

    def ddp_backward(self, *, last: bool) -> None:
        """A backward of torch's stage module under DDP: every micro-batch's but the last runs
        under ``no_sync``; the last launches the all-reduce and, as DDP's reducer waits for its
        buckets at the end of the backward that launched them, returns once it has ended (before
        the stage sends that micro-batch's gradient on)."""
        if last:
            self.launch()
        self.backward()
        if last:
            self.join()

    def join(self) -> None:
        """The update waits for the stage's all-reduce (replicated stages only)."""
        if self.cost.reduce_s > 0:
            self.ops.append(Join())


def _lowered(
    kind: type[Schedule], stages: int, block: int, microbatches: int
) -> tuple[BlockPlan, Schedule]:
    """The block's plan and the one schedule every stage lowers its program from (a schedule
    keeps what it expanded: the stages share it)."""
    # The runtime's chunks are the micro-batch count here (``interlace bench pipeline``'s).
    plan = block_plan(kind, block, microbatches=microbatches, chunks=microbatches)
    return plan, kind(stages, plan.units)


def _interlace_program(
    stages: Sequence[StageCost],
    stage: int,
    lowered: tuple[BlockPlan, Schedule],
    microbatches: int,
) -> list[Instruction]:
    """What :class:`interlace.pipeline.runtime.PipelineStage` runs on ``stage`` for one block:
    the schedule's lowered program (:meth:`~interlace.pipeline.schedule.Schedule.program`),
    priced action by action; a replicated stage launches its all-reduce where
    :func:`~interlace.pipeline.layout.averaging_points` says and updates once it has ended.

    A synchronous schedule runs one step per mini-batch, of ``microbatches`` micro-batches; an
    asynchronous one streams the block once, each mini-batch in ``microbatches`` chunks. Each
    tensor is a header and a payload whose receive is posted as its header lands (the
    ``Inbox``).
    """
    plan, schedule = lowered
    # Every step runs the same lowered program.
    actions = schedule.program(stage, plan.pieces)
    launches = {point.backward for point in averaging_points(actions)}
    b = _Builder(stages, stage, microbatches)
    host = b.cost.host
    for step in range(plan.steps):
        sends: list[Message] = []
        for index, action in enumerate(actions):
            op = action.op
            if op in (Op.POST_ACT, Op.RECV_ACT, Op.POST_GRAD, Op.RECV_GRAD):
                kind_of = b.act if op in (Op.POST_ACT, Op.RECV_ACT) else b.grad
                header, payload = b.headed(kind_of(step, action.batch, piece_of(action), stage))
                posting = op in (Op.POST_ACT, Op.POST_GRAD)
                b.ops.append(Post(header) if posting else Wait((payload,)))
            elif op is Op.SEND_ACT:
                sends += b.send_headed(b.act(step, action.batch, piece_of(action), stage + 1))
            elif op is Op.SEND_GRAD:
                sends += b.send_headed(b.grad(step, action.batch, piece_of(action), stage - 1))
            elif op is Op.WAIT_SENDS:
                b.ops.append(Wait(tuple(sends)))
                sends = []
            elif op is Op.FORWARD:
                b.forward()
            elif op is Op.RECOMPUTE:
                b.forward("recompute")
            elif op is Op.BACKWARD:
                if index in launches:
                    b.launch()
                b.backward()
            elif op is Op.PREDICT:
                b.host(host.predict_s, "predict")
            elif op is Op.STASH:
                b.host(host.copy_s, "stash")
            elif op is Op.UPDATE:
                b.join()
                b.host(host.update_s, "update")
            else:
                raise ValueError(f"the simulator cannot price {action}")
    return b.ops


def _torch_gpipe_program(
    stages: Sequence[StageCost], stage: int, microbatches: int, block: int
) -> list[Instruction]:
    """``ScheduleGPipe.step`` then ``optimizer.step()`` per mini-batch: each receive posted and
    waited on just before its computation, the forward sends waited on before the backwards
    and the backward sends at the end, then the gradients divided by the micro-batch count."""
    b = _Builder(stages, stage, microbatches)
    for step in range(block):
        for op in (Op.FORWARD, Op.BACKWARD):
            sends = []
            for i in range(microbatches):
                incoming = (
                    (b.act(step, i, 0, stage) if not b.first else None)
                    if op is Op.FORWARD
                    else (b.grad(step, i, 0, stage) if not b.last else None)
                )
                if incoming is not None:
                    b.ops += [Post(incoming), Wait((incoming,))]
                if op is Op.FORWARD:
                    b.forward()
                    outgoing = b.act(step, i, 0, stage + 1) if not b.last else None
                else:
                    b.ddp_backward(last=i == microbatches - 1)
                    outgoing = b.grad(step, i, 0, stage - 1) if not b.first else None
                if outgoing is not None:
                    sends.append(outgoing)
                    b.sending()
                    b.ops.append(Send(outgoing))
            b.ops.append(Wait(tuple(sends)))
        b.host(b.cost.host.scale_s, "scale")
        b.host(b.cost.host.update_s, "update")
    return b.ops


def _torch_1f1b_program(
    stages: Sequence[StageCost], stage: int, microbatches: int, block: int
) -> list[Instruction]:
    """``Schedule1F1B.step`` then ``optimizer.step()`` per mini-batch, as torch runs it: a
    warm-up forward's send waits for the one before; the last warm-up send goes out with the
    first backward's receive, and each backward's send with the next forward's receive, each
    pair waited on together; the cool-down waits for each backward send before the next."""
    b = _Builder(stages, stage, microbatches)

    def act_in(step: int, i: int) -> list[Message]:
        return [] if b.first else [b.act(step, i, 0, stage)]

    def act_out(step: int, i: int) -> list[Message]:
        return [] if b.last else [b.act(step, i, 0, stage + 1)]

    def grad_in(step: int, i: int) -> list[Message]:
        return [] if b.last else [b.grad(step, i, 0, stage)]

    def grad_out(step: int, i: int) -> list[Message]:
        return [] if b.first else [b.grad(step, i, 0, stage - 1)]

    def fire(sends: list[Message]) -> None:
        if sends:
            b.sending()
        b.ops.extend(Send(m) for m in sends)

    def batch(sends: list[Message], receives: list[Message]) -> None:
        """``_batch_p2p`` then ``_wait_batch_p2p``: fire, post, wait for all of them."""
        fire(sends)
        b.ops += [Post(m) for m in receives]
        b.ops.append(Wait(tuple(sends + receives)))

    order = one_f_one_b_order(len(stages), microbatches)[stage]  # torch's Schedule1F1B order
    warmup = order.index((Op.BACKWARD, 0))  # forwards before the first backward
    for step in range(block):
        in_flight: list[Message] = []
        for i in range(warmup):
            batch([], act_in(step, i))
            b.forward()
            b.ops.append(Wait(tuple(in_flight)))
            in_flight = []
            if i != warmup - 1:
                in_flight = act_out(step, i)
                fire(in_flight)
        forward, backward = warmup, 0
        pending_sends = act_out(step, warmup - 1)
        while True:
            batch(pending_sends, grad_in(step, backward))
            b.ddp_backward(last=backward == microbatches - 1)
            pending_sends = grad_out(step, backward)
            backward += 1
            if forward == microbatches:
                break
            batch(pending_sends, act_in(step, forward))
            b.forward()
            pending_sends = act_out(step, forward)
            forward += 1
        fire(pending_sends)
        in_flight = pending_sends
        while backward < microbatches:
            batch([], grad_in(step, backward))
            b.ddp_backward(last=backward == microbatches - 1)
            b.ops.append(Wait(tuple(in_flight)))
            in_flight = grad_out(step, backward)
            fire(in_flight)
            backward += 1
        b.ops.append(Wait(tuple(in_flight)))
        b.host(b.cost.host.scale_s, "scale")
        b.host(b.cost.host.update_s, "update")
    return b.ops


def stage_programs(
    stages: Sequence[StageCost],
    schedule: str | type[Schedule],
    *,
    microbatches: int,
    block: int,
) -> list[list[Instruction]]:
    """Every stage's operations for one timed block of ``block`` mini-batches.

    Args:
        stages: Each stage's costs.
        schedule: One of :data:`PIPELINE_SCHEDULES`, or a schedule class (as the runtime
            takes it).
        microbatches: Pieces per mini-batch: micro-batches of the synchronous schedules, chunks
            each mini-batch of an asynchronous one is streamed in.
        block: Mini-batches in the block.
    """
    if isinstance(schedule, str) and schedule not in PIPELINE_SCHEDULES:
        raise UsageError(
            f"unknown pipeline schedule {schedule!r}; choose from {', '.join(PIPELINE_SCHEDULES)}"
        )
    if len(stages) < 2:
        raise UsageError(f"a pipeline needs at least 2 stages, got {len(stages)}")
    if microbatches < 1 or block < 1:
        raise UsageError(f"microbatches and block must be >= 1, got {microbatches} and {block}")
    if schedule == "torch-1f1b" and microbatches < len(stages):
        raise UsageError(
            f"torch's Schedule1F1B needs at least as many micro-batches as stages; "
            f"got {microbatches} for {len(stages)}"
        )
    programs = []
    lowered = None
    if schedule not in TORCH_PIPELINE_SCHEDULES:
        kind = SCHEDULE_TYPES[schedule] if isinstance(schedule, str) else schedule
        lowered = _lowered(kind, len(stages), block, microbatches)
    for stage in range(len(stages)):
        if schedule == "torch-gpipe":
            programs.append(_torch_gpipe_program(stages, stage, microbatches, block))
        elif schedule == "torch-1f1b":
            programs.append(_torch_1f1b_program(stages, stage, microbatches, block))
        else:
            assert lowered is not None
            programs.append(_interlace_program(stages, stage, lowered, microbatches))
    return programs


def simulate_pipeline(
    stages: Sequence[StageCost],
    schedule: str | type[Schedule],
    cost: CostModel,
    *,
    microbatches: int,
    block: int = 1,
    slowdown: Sequence[float] = (),
) -> PipelineResult:
    """One timed block of ``schedule``, as ``interlace bench pipeline`` times it.

    Every stage starts the block together (the benchmark's barrier) and the block ends when the
    last stage has returned; :attr:`PipelineResult.iteration_s` is the block per mini-batch, the
    benchmark's per-iteration time. An asynchronous schedule fills and drains once per block.

    Args:
        stages: Each stage's costs (:func:`stage_costs`).
        schedule: One of :data:`PIPELINE_SCHEDULES`, or a schedule class.
        cost: ``a + b * bytes`` of one point-to-point message alone on a link.
        microbatches: Pieces per mini-batch (micro-batches, or an asynchronous schedule's
            chunks).
        block: Mini-batches in the block.
        slowdown: How many times longer a computation takes while 1, 2, ... stages compute at
            once (:func:`~interlace.sim.pipeline_events.replay_programs`); empty: never.
    """
    programs = stage_programs(stages, schedule, microbatches=microbatches, block=block)
    replay = replay_programs(programs, cost, slowdown=slowdown)
    name = schedule if isinstance(schedule, str) else schedule.name
    return PipelineResult(name, block, replay.makespan_s, replay)
