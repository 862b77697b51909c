"""``overlap="forward"``: averages still in flight when backward returns, each applied (gradient and
optimizer update) only when the next forward reaches a layer that needs it.

:class:`ForwardOverlap` owns what is pending between one backward and the next forward: the
bucket engine's all-reduces, the deferred optimizer steps, the pending gradients and the guard
on the parameters (docs/notes/dp.md). :meth:`ForwardOverlap.close` applies them and takes every
hook off.
"""

from __future__ import annotations

import statistics
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import Optimizer

from interlace.clock import Mark, StreamClock
from interlace.comm.engine import BucketEngine
from interlace.comm.forward_plan import GateTiming
from interlace.dp.deferred import DeferredStep, listen_to_steps, stop_listening
from interlace.dp.gates import ROOT, Gates
from interlace.dp.pending import DeferredMarks, PendingGrad

__all__ = ["ForwardOverlap"]


class ForwardOverlap:
    """The pending part of an iteration under ``overlap="forward"``.

    Args:
        module: The wrapped model.
        params: Its trainable parameters, in registration order (the engine's tensors).
    """

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self._ids = {id(param): number for number, param in enumerate(self.params)}
        self._clock = StreamClock(self.params[0].device)
        self.gates = Gates(module, self.params, self._at_gate, self._clock)
        self._engine: BucketEngine | None = None
        self._unapplied: set[int] = set()
        self._wrapped: list[PendingGrad | None] = []
        self._had_none: list[bool] = []
        #: Each gate's buckets, for the engine and the gate layout they were worked out for.
        self._due_at: dict[str, set[int]] = {}
        self._due_for: tuple[BucketEngine, dict[str, list[int]]] | None = None
        #: The parameters waiting at gates the forward may not reach (unused when checked).
        self._idle: list[nn.Parameter] = []
        self._deferred: list[DeferredStep] = []
        self._hidden: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        self._marks = DeferredMarks(self)
        self._hooked: weakref.WeakKeyDictionary[Optimizer, list[Any]] = weakref.WeakKeyDictionary()
        #: Whether the optimizer steps over these parameters are timed (while profiling).
        self.timing_steps = False
        self._step_marks: list[tuple[Mark, Mark]] = []
        self._step_started: Mark | None = None
        self._handles = [
            module.register_state_dict_pre_hook(self._complete_hook),
            module.register_load_state_dict_pre_hook(self._complete_hook),
        ]
        listen_to_steps(self)

    def profiled_call(
        self, module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], *, first: bool
    ) -> Any:
        """``module``'s forward with its gates timed (a profiled pass).

        Args:
            module: the wrapped module.
            inputs: its positional inputs.
            kwargs: its keyword inputs.
            first: the warm-up pass: also check where each parameter is used.
        """
        self.gates.time_pass()
        try:
            if first:
                return self.gates.checked_call(module, inputs, kwargs)
            return module(*inputs, **kwargs)
        finally:
            self.gates.stop_timing()

    def gate_layout(self) -> list[GateTiming]:
        """Each gate (a module's name) with the parameters that wait there, offsets 0."""
        waits = self.gates.waits
        return [GateTiming(name, tuple(indices), 0.0) for name, indices in waits.items() if indices]

    @property
    def pending(self) -> bool:
        """Whether averages of the last backward are still to be applied."""
        return self._engine is not None

    # ------------------------------------------------------------------ the iteration

    def begin(self, engine: BucketEngine) -> None:
        """Backward is over and ``engine`` has every all-reduce out: mark its gradients pending.

        Args:
            engine: The closed engine (its buffers stay in use until every bucket is applied).
        """
        self._engine = engine
        self._unapplied = set(range(len(engine.groups)))
        waits = self.gates.waits
        if self._due_for is None or self._due_for[0] is not engine or self._due_for[1] is not waits:
            # Once per plan and gate layout, not at every gate of every forward.
            self._due_at = {
                name: {engine.bucket_of(index) for index in params}
                for name, params in waits.items()
            }
            self._due_for = (engine, waits)
            self._idle = [self.params[index] for index in self.gates.idle]
        self._wrapped = []
        self._had_none = []
        for number, param in enumerate(self.params):
            grad = param.grad
            self._had_none.append(grad is None)
            if grad is None:
                # Another rank may have produced one: a read must still wait for the average.
                grad = torch.zeros_like(param)
            wrapped = PendingGrad.wrap(grad, self, number)
            param.grad = wrapped
            self._wrapped.append(wrapped)

    def complete(self) -> None:
        """Wait for every average in flight and apply every deferred update."""
        if self._engine is not None:
            self._apply(sorted(self._unapplied))

    def discard(self, grad: PendingGrad) -> None:
        """The user zeroes a pending gradient: it becomes their plain tensor again.

        Args:
            grad: The pending gradient.
        """
        param = self.params[grad.param_index]
        if self._engine is not None and param.grad is grad:
            param.grad = grad.plain

    def _at_gate(self, name: str) -> None:
        if name == ROOT and self._marks.marked:
            # The forward has begun: each layer's gate brings its parameters up to date. Those
            # whose layers may not run stay marked: a use elsewhere still applies them first.
            self._marks.keep_only(self._idle)
        engine = self._engine
        if engine is None:
            return
        due = self._due_at[name] & self._unapplied
        if due:
            self._apply(sorted(due))

    def _apply(self, buckets: Sequence[int]) -> None:
        """Wait for ``buckets``, give their parameters the averaged gradients, run the deferred
        updates on them."""
        engine = self._engine
        assert engine is not None
        members = sorted(index for bucket in buckets for index in engine.groups[bucket])
        if self._marks.marked:
            # These parameters are being brought up to date: the updates below must not set
            # their marks off again.
            self._marks.unmark([self.params[index] for index in members])
        engine.wait(buckets)
        averaged = engine.averaged(members)
        keep: list[torch.Tensor | None] = []
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for index, mean in zip(members, averaged, strict=True):
            param = self.params[index]
            current = param.grad
            if current is not None and current is self._wrapped[index]:
                # Left as backward made it: from now on it is the averaged gradient; one no
                # rank produced stays as it was (None, or what earlier passes accumulated).
                assert isinstance(current, PendingGrad)
                plain = None if mean is None and self._had_none[index] else current.plain
                if plain is not None and mean is not None:
                    targets.append(plain)
                    sources.append(mean)
                keep.append(plain)
                param.grad = plain if mean is not None else None
            else:
                # Zeroed or dropped by the user since: the update uses the average, the
                # gradient stays as the user left it.
                keep.append(current)
                param.grad = None if mean is None else mean
        if targets:
            # One batched copy: a copy per parameter costs more than the copying on models of
            # many small tensors.
            torch._foreach_copy_(targets, sources)
        if self._deferred:
            updated = [self.params[index] for index in members]
            for step in self._deferred:
                step.apply(updated)
        for index, value in zip(members, keep, strict=True):
            self.params[index].grad = value
        self._unapplied.difference_update(buckets)
        if not self._unapplied:
            self._finish(engine)

    def _finish(self, engine: BucketEngine) -> None:
        self._engine = None
        self._wrapped = []
        self._deferred = []
        self._marks.clear()
        engine.begin()

    # ------------------------------------------------------------------ optimizer steps

    def holds(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` steps any of these parameters.

        Args:
            optimizer: The optimizer.
        """
        return any(
            id(param) in self._ids for group in optimizer.param_groups for param in group["params"]
        )

    def before_step(self, optimizer: Optimizer, closure: bool) -> None:
        """Defer ``optimizer``'s update of the parameters still waiting for their averages.

        Args:
            optimizer: The optimizer about to step.
            closure: Whether the step was given a closure (it then recomputes gradients, so
                the averages are completed first and the step runs as usual).
        """
        engine = self._engine
        if engine is None and not self.timing_steps:
            return
        mine = [
            param
            for group in optimizer.param_groups
            for param in group["params"]
            if id(param) in self._ids
        ]
        if not mine:
            return
        if engine is None:
            self._step_started = self._clock.mark()
            return
        if closure:
            self.complete()
            return
        waiting = [
            param for param in mine if engine.bucket_of(self._ids[id(param)]) in self._unapplied
        ]
        if not waiting:
            return
        self._deferred.append(DeferredStep(optimizer, waiting))
        self._watch(optimizer)
        # Hidden from this call (optimizers skip a parameter without a gradient), updated later.
        self._hidden = [(param, param.grad) for param in waiting]
        for param in waiting:
            param.grad = None

    def after_step(self, optimizer: Optimizer) -> None:
        """Give back the gradients hidden from the step, and mark the parameters whose update
        waits.

        Args:
            optimizer: The optimizer that stepped.
        """
        if self._step_started is not None:
            self._step_marks.append((self._step_started, self._clock.mark()))
            self._step_started = None
        if not self._hidden:
            return
        for param, grad in self._hidden:
            param.grad = grad
        self._hidden = []
        if self._engine is not None:
            self._marks.mark(self._waiting_params())

    def step_s(self) -> float:
        """The median optimizer step over these parameters while :attr:`timing_steps` was on
        (0 if none was seen)."""
        if not self._step_marks:
            return 0.0
        return statistics.median(self._clock.seconds(a, b) for a, b in self._step_marks)

    def _waiting_params(self) -> Iterable[torch.Tensor]:
        engine = self._engine
        assert engine is not None
        return [self.params[index] for bucket in self._unapplied for index in engine.groups[bucket]]

    def _watch(self, optimizer: Optimizer) -> None:
        """A checkpoint of ``optimizer`` (or one loaded into it) waits for its deferred updates."""
        if optimizer in self._hooked:
            return
        reference = weakref.ref(self)

        def complete(*_: Any) -> None:
            owner = reference()
            if owner is not None:
                owner.complete()

        self._hooked[optimizer] = [
            optimizer.register_state_dict_pre_hook(complete),
            optimizer.register_load_state_dict_pre_hook(complete),
        ]

    def _complete_hook(self, *_: Any) -> None:
        self.complete()

    def close(self) -> None:
        """Apply what is pending, then take every hook off (the module's, the optimizers', the
        step hooks); a second call does nothing."""
        self.complete()
        self.gates.remove()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for handles in self._hooked.values():
            for handle in handles:
                handle.remove()
        self._hooked = weakref.WeakKeyDictionary()
        self._step_marks = []
        stop_listening(self)
