"""Executing a pipeline schedule on one rank: one stage, point-to-point messages, weight policies.

A :class:`PipelineStage` holds one stage's module and optimizer and runs, in order, the actions
of the program that its :class:`~interlace.pipeline.schedule.Schedule` lowers for it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.func import functional_call

from interlace.distenv import collective_device
from interlace.errors import UsageError
from interlace.pipeline.block import block_plan, piece_of
from interlace.pipeline.layout import averaging_points
from interlace.pipeline.link import StageLink
from interlace.pipeline.messages import Inbox
from interlace.pipeline.pieces import (
    Batch,
    InFlight,
    Piece,
    cut_pieces,
    end_backward,
    next_batch,
    split_microbatches,
    unit_batches,
)
from interlace.pipeline.predict import check_predictable, predicted_parameters
from interlace.pipeline.replication import ReplicaAverager, StageDataParallel, stage_data_parallel
from interlace.pipeline.results import EvalResult, StepResult
from interlace.pipeline.schedule import (
    ASYNCHRONOUS,
    Action,
    Op,
    Schedule,
    Weights,
    schedule_type,
)
from interlace.pipeline.stages import check_stages_agree
from interlace.timeline import Event

#: Values of ``PipelineStage(spectrain_backward=...)``: which weights SpecTrain's backward uses.
SPECTRAIN_BACKWARDS = ("recompute", "reuse")

__all__ = ["SPECTRAIN_BACKWARDS", "EvalResult", "PipelineStage", "StepResult"]

LossFn = Callable[[Tensor, Tensor], Tensor]


class PipelineStage:
    """One rank's stage of a pipeline: its module, its optimizer, and the schedule it runs.

    Construction is collective over ``group`` when there are several stages: every rank of the
    group holds one stage and builds it at the same point, where the stages compare the
    settings that decide which messages flow (``check_stages_agree`` in
    :mod:`interlace.pipeline.stages`): ranks built differently raise one error naming the
    setting and the ranks, rather than hang or train apart.

    Args:
        module: this stage's blocks.
        optimizer: updates ``module``'s parameters; a schedule that predicts weights
            (``spectrain``) needs :class:`torch.optim.SGD` with momentum (it predicts from the
            momentum buffer).
        stage: this rank's position among the stages, from 0.
        num_stages: stages in the pipeline.
        schedule: a schedule's name (a key of
            :data:`~interlace.pipeline.schedule.SCHEDULE_TYPES`) or its class. With a
            synchronous one (``gpipe``, ``1f1b``) each mini-batch is cut into ``microbatches``
            micro-batches and the loss is the mini-batch mean, so the update equals the
            unpipelined model's on that mini-batch.
        loss_fn: the last stage's loss; it must average over its batch, as torch's losses do by
            default.
        microbatches: micro-batches per mini-batch of ``gpipe`` and ``1f1b``.
        ranks: ``ranks[k]`` is the global rank that holds stage ``k`` (default: rank ``k``).
        group: the process group the stages talk over (the default group when None); its
            ranks are the pipeline's stages, one each.
        device: where the stage computes.
        on_update: called after every optimizer step (a learning-rate scheduler's ``step``, a
            progress bar); the asynchronous schedules take those steps inside :meth:`run`.
        spectrain_backward: which weights SpecTrain's backward uses: ``"recompute"`` (the
            paper's rule: predicted ``floor(k/2)`` updates ahead of the weights at backward time,
            which with autograd means computing the stage again on the saved input) or
            ``"reuse"`` (the forward's prediction and graph: both aim at the same future version
            of the weights, and the forward is not run twice, for the memory of one graph per
            batch in flight, as PipeDream's stashing needs). ``schedule="spectrain"`` with
            ``"reuse"`` runs the ``spectrain-reuse`` schedule.
        chunks: pieces along the batch each mini-batch of an asynchronous schedule travels in,
            all with the mini-batch's weights and one update: a stage starts on the first piece
            while the others are in transit, so a round trip stops paying every link's full
            transfer in turn. The update is the same as with one piece, except that BatchNorm
            normalises each piece with its own statistics (as GPipe's micro-batches do).
        data_parallel: the stage's replicas in a replicated pipeline (a process group, or a
            :class:`~interlace.pipeline.replication.StageDataParallel` with bucket options):
            the stage's gradients are averaged over them, each bucket's all-reduce starting as
            the last backward before an update produces it and waited for at the update, which
            stays where the schedule puts it. Construction then also copies replica 0's
            weights to the others, and (``broadcast_buffers``, the default) its buffers, at
            construction and at every update. None: one replica.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        stage: int,
        num_stages: int,
        schedule: str | type[Schedule],
        loss_fn: LossFn | None = None,
        microbatches: int = 4,
        ranks: Sequence[int] | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        on_update: Callable[[], object] | None = None,
        spectrain_backward: str = "recompute",
        chunks: int = 1,
        data_parallel: StageDataParallel | dist.ProcessGroup | None = None,
    ) -> None:
        if spectrain_backward not in SPECTRAIN_BACKWARDS:
            raise UsageError(
                f"spectrain_backward must be one of {', '.join(SPECTRAIN_BACKWARDS)}, "
                f"got {spectrain_backward!r}"
            )
        kind = _schedule_kind(schedule, spectrain_backward)
        if not 0 <= stage < num_stages:
            raise UsageError(f"stage {stage} is out of range for {num_stages} stages")
        if microbatches < 1:
            raise UsageError(f"microbatches must be >= 1, got {microbatches}")
        if chunks < 1:
            raise UsageError(f"chunks must be >= 1, got {chunks}")
        if chunks > 1 and kind.synchronous:
            raise UsageError(
                f"chunks applies to the asynchronous schedules ({', '.join(ASYNCHRONOUS)}); "
                f"{kind.name} cuts a mini-batch with microbatches="
            )
        if stage == num_stages - 1 and loss_fn is None:
            raise UsageError("the last pipeline stage needs a loss_fn")
        if kind(num_stages, max(num_stages, microbatches)).predicts:
            check_predictable(optimizer)
        self.spectrain_backward = spectrain_backward
        self.module = module
        self.optimizer = optimizer
        self.stage = stage
        self.num_stages = num_stages
        #: The schedule this stage runs: its class, built afresh for every call of :meth:`run`.
        self.kind = kind
        self.schedule_name = schedule if isinstance(schedule, str) else kind.name
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.chunks = chunks
        self.ranks = list(ranks) if ranks is not None else list(range(num_stages))
        if len(self.ranks) != num_stages:
            raise UsageError(f"ranks lists {len(self.ranks)} ranks for {num_stages} stages")
        self.group = group
        self.device = device or next((p.device for p in module.parameters()), torch.device("cpu"))
        self.on_update = on_update
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self._events: list[Event] = []
        self._process = f"stage {stage}"
        self._link = StageLink(stage, self.ranks, group, self.device, self._record)
        self._schedules: dict[int, Schedule] = {}  # by number of batches
        options = stage_data_parallel(data_parallel)
        #: The gradient average over the stage's replicas, or None with one replica.
        self.averager = None if options is None else ReplicaAverager(module, options)
        if num_stages > 1:
            check_stages_agree(
                stage=stage,
                num_stages=num_stages,
                ranks=self.ranks,
                group=group,
                schedule=kind.name,
                synchronous=kind.synchronous,
                microbatches=microbatches,
                chunks=chunks,
            )

    # ---------------------------------------------------------------------------------------
    # public API
    # ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the process groups this stage made for its replicas' channels (a second call
        does nothing). The groups it was given stay the caller's."""
        if self.averager is not None:
            self.averager.close()

    def __enter__(self) -> PipelineStage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def asynchronous(self) -> bool:
        """True for the schedules that update after every backward (no flush)."""
        return not self.kind.synchronous

    def run(self, batches: Iterable[Batch] | None, num_batches: int) -> StepResult:
        """Train on ``num_batches`` mini-batches from ``batches``; every stage calls it together.

        Synchronous schedules run one step (one update) per mini-batch; the asynchronous ones
        run all of them as one stream, filling and draining the pipeline once.

        Args:
            batches: ``(input, target)`` pairs; stage 0 uses the inputs and the last stage the
                targets, the stages in between may pass ``None``.
            num_batches: mini-batches to train on (>= 1).
        """
        if num_batches < 1:
            raise UsageError(f"num_batches must be >= 1, got {num_batches}")
        if batches is None and (self.is_first or self.is_last):
            raise UsageError(f"pipeline stage {self.stage} needs the batches (inputs or targets)")
        started = time.perf_counter()
        result = StepResult()
        source = iter(batches) if batches is not None else None
        self.module.train()
        plan = block_plan(
            self.kind, num_batches, microbatches=self.microbatches, chunks=self.chunks
        )
        schedule = self._schedule(plan.units)
        if self.asynchronous:
            units = (next_batch(source, self.stage) for _ in range(num_batches))
            self._execute(schedule, unit_batches(units), result)
        else:
            for _ in range(plan.steps):
                batch = next_batch(source, self.stage)
                self._execute(schedule, split_microbatches(batch, self.microbatches), result)
        result.seconds = time.perf_counter() - started
        return result

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch] | None, num_batches: int) -> EvalResult:
        """Forward-only pass over ``num_batches`` batches, scored on the last stage.

        The last stage counts correct arg-max predictions and sums the loss; the result is then
        sent to every stage, so all ranks return the same :class:`EvalResult`.

        Args:
            batches: ``(input, target)`` pairs, as :meth:`run` takes them.
            num_batches: batches to score.
        """
        source = iter(batches) if batches is not None else None
        self.module.eval()
        inbox = self._link.inbox(self.stage - 1, num_batches) if not self.is_first else None
        correct = total = 0
        loss_sum = 0.0
        for index in range(num_batches):
            batch = next_batch(source, self.stage)
            x = batch[0] if self.is_first and batch is not None else None
            if inbox is not None:
                x = inbox.take(index)
            assert x is not None
            out = self.module(x.to(self.device))
            if self.is_last:
                assert batch is not None and self.loss_fn is not None
                target = batch[1].to(self.device)
                correct += int((out.argmax(dim=-1) == target).sum())
                total += int(target.numel())
                loss_sum += float(self.loss_fn(out, target)) * int(target.numel())
            else:
                self._link.send(out.detach(), self.stage + 1)
        self._link.finish_sends()
        if inbox is not None:
            inbox.check_drained()
        counts = torch.tensor(
            [correct, total, loss_sum], dtype=torch.float64, device=collective_device(self.group)
        )
        dist.broadcast(counts, self.ranks[-1], group=self.group)
        self.module.train()
        seen = int(counts[1])
        return EvalResult(int(counts[0]), seen, float(counts[2]) / max(seen, 1))

    def state_dict(self) -> dict[str, Any]:
        """This stage's weights and optimizer state, and where it sits in which pipeline.

        Between calls of :meth:`run` no batch is in flight, so this is all the stage holds.
        """
        return {
            "stage": self.stage,
            "num_stages": self.num_stages,
            "schedule": self.schedule_name,
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into this stage.

        Args:
            state: what :meth:`state_dict` returned on the same stage of the same pipeline.

        Raises:
            UsageError: when ``state`` is another stage's, or from another pipeline or schedule.
        """
        saved = (state["stage"], state["num_stages"], state["schedule"])
        if saved != (self.stage, self.num_stages, self.schedule_name):
            raise UsageError(
                f"the saved pipeline state is stage {saved[0]} of {saved[1]} ({saved[2]}); this "
                f"is stage {self.stage} of {self.num_stages} ({self.schedule_name}): load each "
                "stage's own state into the same pipeline"
            )
        self.module.load_state_dict(state["module"])
        # A copy: the optimizer would otherwise adopt the saved tensors themselves, which may be
        # another live stage's momentum buffers (state_dict() hands out references).
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))

    def take_events(self) -> list[Event]:
        """The timed actions since the last call (forward, backward, comm, optimizer)."""
        events, self._events = self._events, []
        return events

    # ---------------------------------------------------------------------------------------
    # executing a schedule
    # ---------------------------------------------------------------------------------------

    def _schedule(self, num_batches: int) -> Schedule:
        """The schedule over ``num_batches`` batches, built once (it keeps its programs)."""
        if num_batches not in self._schedules:
            self._schedules[num_batches] = self.kind(self.num_stages, num_batches)
        return self._schedules[num_batches]

    def _execute(
        self,
        schedule: Schedule,
        units: Sequence[tuple[Batch | None, float]] | Iterator[tuple[Batch | None, float]],
        result: StepResult,
    ) -> None:
        """Run this stage's program of ``schedule``, action by action."""
        program = schedule.program(self.stage, self._pieces_per_unit())
        keep = schedule.reuses_forward_graph(self.stage)
        backward_ends = {
            a.batch: position
            for position, a in enumerate(program)
            if a.op in (Op.RECOMPUTE, Op.RECV_GRAD, Op.BACKWARD, Op.SEND_GRAD)
        }
        averaged = (
            {point.backward for point in averaging_points(program)}
            if self.averager is not None
            else set()
        )
        inboxes: dict[Op, Inbox] = {}
        posted: dict[tuple[Op, int, int], int] = {}  # (POST op, batch, piece) -> message index
        unit_iter = iter(units)
        flight: dict[int, InFlight] = {}
        for position, action in enumerate(program):
            op = action.op
            if op in (Op.POST_ACT, Op.POST_GRAD):
                if op not in inboxes:
                    peer = self.stage - 1 if op is Op.POST_ACT else self.stage + 1
                    inboxes[op] = self._link.inbox(peer, 0)
                posted[(op, action.batch, piece_of(action))] = inboxes[op].post()
            elif op is Op.UPDATE:
                self._update(action, result)
            elif op is Op.WAIT_SENDS:
                self._link.finish_sends()
            else:
                state = flight.get(action.batch)
                if state is None:
                    state = flight[action.batch] = self._start(unit_iter, result)
                if position in averaged:
                    # The last backward before an update: each gradient goes to its bucket
                    # as it lands (on the parameter, or on the copy the graph is over).
                    assert self.averager is not None
                    with self.averager.armed(state.graph_leaves):
                        self._run(action, state, keep, inboxes, posted, result)
                else:
                    self._run(action, state, keep, inboxes, posted, result)
                if backward_ends.get(action.batch) == position:
                    end_backward(self.module, flight.pop(action.batch))
        for inbox in inboxes.values():
            inbox.check_drained()

    def _start(self, units: Iterator[tuple[Batch | None, float]], result: StepResult) -> InFlight:
        """The next unit's pieces, as its first forward-side action needs them."""
        batch, scale = next(units)
        if self.is_last:
            assert batch is not None
            result.samples += int(batch[1].shape[0])
        pieces = cut_pieces(
            batch,
            scale,
            self._pieces_per_unit(),
            self.device,
            is_first=self.is_first,
            is_last=self.is_last,
        )
        return InFlight(pieces)

    def _run(
        self,
        action: Action,
        state: InFlight,
        keep: bool,
        inboxes: dict[Op, Inbox],
        posted: dict[tuple[Op, int, int], int],
        result: StepResult,
    ) -> None:
        """One action of a batch: make weights, receive, compute or send one piece."""
        op = action.op
        if op in (Op.PREDICT, Op.STASH):
            state.leaves = self._weights(action)
            return
        piece = state.pieces[piece_of(action)]
        if op in (Op.RECV_ACT, Op.RECV_GRAD):
            post = Op.POST_ACT if op is Op.RECV_ACT else Op.POST_GRAD
            index = posted[(post, action.batch, piece_of(action))]
            what = "act" if post is Op.POST_ACT else "grad"
            tensor = self._link.take(inboxes[post], index, action.batch, what)
            if op is Op.RECV_ACT:
                piece.input = tensor
            else:
                piece.grad = tensor
        elif op is Op.FORWARD:
            self._forward(action, state, piece, keep, result)
        elif op is Op.RECOMPUTE:
            self._recompute(action, state, piece)
        elif op is Op.BACKWARD:
            self._backward(action, piece)
        elif op in (Op.SEND_ACT, Op.SEND_GRAD):
            assert piece.outgoing is not None
            self._link.send(piece.outgoing, self.stage + (1 if op is Op.SEND_ACT else -1))
            piece.outgoing = None
        else:
            raise ValueError(f"a pipeline stage cannot run {action}")

    def _pieces_per_unit(self) -> int:
        return block_plan(self.kind, 1, microbatches=self.microbatches, chunks=self.chunks).pieces

    def _weights(self, action: Action) -> dict[str, Tensor]:
        """The weight tensors a PREDICT or STASH makes, used in place of the parameters.

        A prediction is a new tensor; a stash is a copy taken at the forward, which the kept
        graph then holds.
        """
        if action.op is Op.PREDICT:
            predicted = predicted_parameters(
                self.module.named_parameters(), self.optimizer, action.ahead
            )
            return {name: t.requires_grad_(True) for name, t in predicted.items()}
        return {
            name: p.detach().clone().requires_grad_(True)
            for name, p in self.module.named_parameters()
        }

    def _call(self, leaves: dict[str, Tensor] | None, x: Tensor) -> Tensor:
        out = self.module(x) if leaves is None else functional_call(self.module, leaves, (x,))
        if not isinstance(out, Tensor):
            raise UsageError(
                f"pipeline stage {self.stage} returned {type(out).__name__}; every stage must "
                "return one tensor"
            )
        return out

    def _forward(
        self, action: Action, state: InFlight, piece: Piece, keep: bool, result: StepResult
    ) -> None:
        """One piece's forward with the batch's weights; with a graph when ``keep``."""
        started = time.perf_counter()
        assert piece.input is not None
        x = piece.input
        if keep and not self.is_first:
            x.requires_grad_(True)
        if not keep:
            piece.rng_state = torch.get_rng_state()
        with torch.set_grad_enabled(keep):
            out = self._call(state.leaves, x)
            if self.is_last:
                assert self.loss_fn is not None and piece.target is not None
                loss = self.loss_fn(out, piece.target)
                result.losses.append(float(loss.detach()))
                out = loss * piece.scale
        if keep:
            piece.output = out
            state.graph_leaves = state.leaves
        self._record("forward", "forward", started, action.batch)
        if not self.is_last:
            piece.outgoing = out.detach()

    def _recompute(self, action: Action, state: InFlight, piece: Piece) -> None:
        """One piece's output again on its saved input with the backward's weights, with a
        graph, drawing the forward's random numbers; ahead of its gradient, which may still be
        in transit."""
        if state.saved_buffers is None:
            # The first piece: keep the forward's buffers (BatchNorm's running statistics),
            # which the recomputation moves again, and take the backward's weights.
            state.saved_buffers = [b.detach().clone() for b in self.module.buffers()]
            made = action.predicted or action.weights is Weights.STASHED
            state.graph_leaves = state.leaves if made else None
        started = time.perf_counter()
        assert piece.input is not None
        x = piece.input
        if not self.is_first:
            x.requires_grad_(True)
        with torch.random.fork_rng(devices=[]):
            if piece.rng_state is not None:
                torch.set_rng_state(piece.rng_state)
            with torch.enable_grad():
                out = self._call(state.graph_leaves, x)
                if self.is_last:  # the loss again, already counted by the forward
                    assert self.loss_fn is not None and piece.target is not None
                    out = self.loss_fn(out, piece.target) * piece.scale
        piece.output = out
        self._record("recompute", "forward", started, action.batch)

    def _backward(self, action: Action, piece: Piece) -> None:
        """One piece's backward; the input's gradient is then ready to send back."""
        out = piece.output
        assert out is not None
        started = time.perf_counter()
        if self.is_last:
            out.backward()
        else:
            assert piece.grad is not None
            out.backward(piece.grad)
        self._record("backward", "backward", started, action.batch)
        piece.output = piece.grad = None
        if not self.is_first:
            assert piece.input is not None
            grad_in = piece.input.grad
            if grad_in is None:
                raise UsageError(
                    f"pipeline stage {self.stage}'s output does not depend on its input; "
                    "every stage after the first must use the activation it receives"
                )
            piece.outgoing = grad_in

    def _update(self, action: Action, result: StepResult) -> None:
        if self.averager is not None:
            waited = time.perf_counter()
            self.averager.apply()
            self._record("allreduce wait", "comm", waited, action.batch)
        started = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        result.updates += 1
        if self.on_update is not None:
            self.on_update()
        self._record("update", "optimizer", started, action.batch)

    def _record(self, name: str, category: str, started: float, batch: int | None = None) -> None:
        args: dict[str, object] = {} if batch is None else {"batch": batch}
        lane = "comm" if category == "comm" else "compute"
        self._events.append(
            Event(name, category, started, time.perf_counter(), lane, self._process, args)
        )


def _schedule_kind(schedule: str | type[Schedule], spectrain_backward: str) -> type[Schedule]:
    """The schedule class ``schedule`` names (SpecTrain's ``reuse`` backward is a schedule)."""
    if isinstance(schedule, type) and issubclass(schedule, Schedule):
        return schedule
    if not isinstance(schedule, str):
        raise UsageError(f"schedule must be a name or a Schedule class, got {schedule!r}")
    if schedule == "spectrain" and spectrain_backward == "reuse":
        schedule = "spectrain-reuse"
    try:
        return schedule_type(schedule)
    except ValueError as error:
        raise UsageError(str(error)) from None
