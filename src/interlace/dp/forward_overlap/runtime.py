"""The forward overlap's algorithm: what is pending after backward, where the next forward waits,
when each update lands (docs/notes/dp.md).

One iteration, in the order it happens:

1. :meth:`ForwardOverlap.begin`: backward has ended with every bucket's all-reduce in flight.
   Each parameter's ``.grad`` becomes a pending gradient: a read of it waits for every average.
2. :meth:`ForwardOverlap.before_step` and :meth:`~ForwardOverlap.after_step`: the user's
   ``optimizer.step()`` updates the parameters whose buckets have landed and is deferred for
   the others, which stay marked until updated: a use of one outside the forward lands all.
3. :meth:`ForwardOverlap.at_gate`: a layer of the next forward is about to run. It waits for the
   buckets :class:`~interlace.comm.forward_plan.GateDues` says are due at its gate and lands
   them: every member gets its averaged gradient and its deferred updates.
4. :meth:`ForwardOverlap.complete`: anything else that needs the values (a checkpoint, a step
   with a closure, the next backward) lands every bucket still in flight.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.optim.optimizer import Optimizer

from interlace.clock import StreamClock
from interlace.comm.engine import BucketEngine
from interlace.comm.forward_plan import GateDues, GateTiming
from interlace.dp.forward_overlap.gates import ROOT, Gates
from interlace.dp.forward_overlap.pending import DeferredMarks, PendingGrad, PendingGrads
from interlace.dp.forward_overlap.steps import (
    DeferredStep,
    StepTimes,
    listen_to_steps,
    stop_listening,
)

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
        clock = StreamClock(self.params[0].device)
        #: Where the next forward waits: a pre-hook on every module holding parameters.
        self.gates = Gates(module, self.params, self.at_gate, clock)
        #: The engine whose averages are in flight (None: nothing pending), and its buckets
        #: that have not landed.
        self._engine: BucketEngine | None = None
        self._in_flight: set[int] = set()
        #: What lands at which gate, for one engine and one gate layout (:meth:`_dues_of`).
        self._dues = GateDues((), ())
        self._dues_for: tuple[BucketEngine, dict[str, list[int]]] | None = None
        self._gate_number: dict[str, int] = {}
        #: Parameters waiting at gates the forward may not reach (unused when checked).
        self._idle: list[nn.Parameter] = []
        self._grads = PendingGrads(self.params, self)
        self._deferred: list[DeferredStep] = []
        self._marks = DeferredMarks(self)
        #: Whether the optimizer steps over these parameters are timed (while profiling).
        self.timing_steps = False
        self._step_times = StepTimes(clock)
        self._hooked: weakref.WeakKeyDictionary[Optimizer, list[Any]] = weakref.WeakKeyDictionary()
        self._handles = [
            module.register_state_dict_pre_hook(self._complete_hook),
            module.register_load_state_dict_pre_hook(self._complete_hook),
        ]
        listen_to_steps(self)

    @property
    def pending(self) -> bool:
        """Whether averages of the last backward are still to be applied."""
        return self._engine is not None

    # ------------------------------------------------------------------ 1. backward is over

    def begin(self, engine: BucketEngine) -> None:
        """Backward is over and ``engine`` has every all-reduce out: mark its gradients pending.

        Args:
            engine: The closed engine (its buffers stay in use until every bucket has landed).
        """
        self._engine = engine
        self._in_flight = set(range(len(engine.groups)))
        self._dues_of(engine)
        self._grads.wrap()

    def _dues_of(self, engine: BucketEngine) -> None:
        """What lands at each gate for ``engine``'s buckets; worked out once per plan and gate
        layout, not at every gate of every forward."""
        waits = self.gates.waits
        known = self._dues_for
        if known is not None and known[0] is engine and known[1] is waits:
            return
        self._dues = GateDues.of(engine.groups, waits.values())
        self._gate_number = {name: number for number, name in enumerate(waits)}
        self._dues_for = (engine, waits)
        self._idle = [self.params[index] for index in self.gates.idle]

    # ------------------------------------------------------------------ 2. the user steps

    def holds(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` steps any of these parameters.

        Args:
            optimizer: The optimizer.
        """
        return any(
            id(param) in self._ids for group in optimizer.param_groups for param in group["params"]
        )

    def before_step(self, optimizer: Optimizer, closure: bool) -> None:
        """Defer ``optimizer``'s update of the parameters whose buckets are still in flight.

        Args:
            optimizer: The optimizer about to step.
            closure: Whether the step was given a closure (it then recomputes gradients, so
                every bucket lands first and the step runs as usual).
        """
        engine = self._engine
        if engine is None:
            if self.timing_steps and self.holds(optimizer):
                self._step_times.start()
            return
        if closure:
            self.complete()
            return
        waiting = [
            param
            for group in optimizer.param_groups
            for param in group["params"]
            if id(param) in self._ids and engine.bucket_of(self._ids[id(param)]) in self._in_flight
        ]
        if not waiting:
            return
        step = DeferredStep(optimizer, waiting)
        self._deferred.append(step)
        self._watch(optimizer)
        step.hide()

    def after_step(self, optimizer: Optimizer) -> None:
        """The optimizer's own call is over: give back what the deferred step hid from it and
        mark the parameters whose update waits.

        Args:
            optimizer: The optimizer that stepped.
        """
        self._step_times.stop()
        step = self._deferred[-1] if self._deferred else None
        if step is None or step.optimizer is not optimizer or not step.hiding:
            return
        step.unhide()
        if self._engine is not None:
            waiting = self._dues.landing(self._in_flight)
            self._marks.mark([self.params[index] for index in waiting])

    # ------------------------------------------------------------------ 3. a layer runs

    def at_gate(self, name: str) -> None:
        """The module ``name`` is about to run: land the buckets due at its gate.

        Args:
            name: The gate (the module's name; :data:`~interlace.dp.forward_overlap.gates.ROOT`
                for the start of the forward).
        """
        if name == ROOT and self._marks.marked:
            # The forward has begun: each layer's gate brings its parameters up to date. Those
            # whose layers may not run stay marked: a use elsewhere still lands them first.
            self._marks.keep_only(self._idle)
        if self._engine is None:
            return
        due = self._dues.due(self._gate_number[name], self._in_flight)
        if due:
            self._land(due)

    def _land(self, buckets: Sequence[int]) -> None:
        """Wait for ``buckets``; give every member its averaged gradient and its deferred
        updates."""
        engine = self._engine
        assert engine is not None
        members = self._dues.landing(buckets)
        params = [self.params[index] for index in members]
        if self._marks.marked:
            # Being brought up to date: the updates below must not set their marks off again.
            self._marks.unmark(params)
        engine.wait(buckets)
        after = self._grads.land(members, engine.averaged(members))
        for step in self._deferred:
            step.apply(params)
        self._grads.restore(members, after)
        self._in_flight.difference_update(buckets)
        if not self._in_flight:
            self._engine = None
            self._grads.clear()
            self._deferred = []
            self._marks.clear()
            engine.begin()

    # ------------------------------------------------------------------ 4. everything now

    def complete(self) -> None:
        """Wait for every average in flight and apply every deferred update."""
        if self._engine is not None:
            self._land(sorted(self._in_flight))

    def discard(self, grad: PendingGrad) -> None:
        """The user zeroes a pending gradient: it becomes their plain tensor again.

        Args:
            grad: The pending gradient.
        """
        if self._engine is not None:
            self._grads.discard(grad)

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

    # ------------------------------------------------------------------ profiling, the end

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

    def step_s(self) -> float:
        """The median optimizer step over these parameters while :attr:`timing_steps` was on
        (0 if none was seen)."""
        return self._step_times.median_s()

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
        self._step_times.clear()
        stop_listening(self)
