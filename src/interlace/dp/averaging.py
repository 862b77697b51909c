"""DataParallel's work per step when it averages: the lifecycle, Join and the buffers around
each forward; each gradient into its bucket as it arrives; at the end of backward the averages
written back (or left to the next forward with ``overlap="forward"``).

One plain object per wrapper holds the per-step state: its hooks run once per parameter per
step, so nothing there goes through ``nn.Module``'s attribute machinery (docs/notes/dp.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable

from interlace.clock import StreamClock
from interlace.comm.channels import Channels
from interlace.comm.choose import PlanRequest
from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import Overlap
from interlace.dp.backward_pass import BackwardPass, tensors_in
from interlace.dp.ddp_args import move_inputs
from interlace.dp.forward_overlap import ForwardOverlap
from interlace.dp.gradients import Arrivals, write_averages
from interlace.dp.iteration import CommRecord, DevicePass, iteration_timeline
from interlace.dp.join import JoinState, Shadowed, sync_buffers
from interlace.dp.lifetime import weak_method
from interlace.dp.planning import Plans
from interlace.dp.replicas import BufferBroadcast
from interlace.errors import UsageError
from interlace.timeline import Timeline

__all__ = ["Averaging"]


class Averaging:
    """The per-step runtime of one DataParallel that averages: its plans, its forward overlap,
    the buffers' broadcast and the hooks that feed the bucket engine.

    Args:
        module: The wrapped model.
        names: The trainable parameters' names.
        params: The parameters, in the same order.
        request: The wrapper's settings, as the plan choice takes them.
        process_group: The group averaged over.
        channels: The process groups buckets travel on.
        join: The wrapper's part in ``Join`` (rescales the averages of uneven inputs).
        cost_model: The all-reduce cost model (None: fitted when planning).
        profile_steps: Timed backward passes before planning.
        as_views: Each ``.grad`` becomes a view into its bucket (``gradient_as_bucket_view``).
        batched_copy: Copy a bucket's gradients in at once when it is complete.
        broadcast_buffers: One rank's buffers before every training forward.
        input_device: Where forward moves the inputs, or None.
    """

    def __init__(
        self,
        module: nn.Module,
        names: Sequence[str],
        params: Sequence[nn.Parameter],
        request: PlanRequest,
        process_group: dist.ProcessGroup | None,
        channels: Channels,
        join: JoinState,
        *,
        cost_model: CostModel | None,
        profile_steps: int,
        as_views: bool,
        batched_copy: bool,
        broadcast_buffers: bool,
        input_device: torch.device | None,
    ) -> None:
        self.module = module
        self.names = list(names)
        self.params = list(params)
        self.join = join
        self.buffer_sync = BufferBroadcast(module, process_group)
        self.forward_overlap = (
            ForwardOverlap(module, self.params) if request.overlap is Overlap.FORWARD else None
        )
        self.plans = Plans(
            request,
            self.names,
            self.params,
            process_group,
            channels,
            profile_steps=profile_steps,
            cost_model=cost_model,
            forward_overlap=self.forward_overlap,
            batched_copy=batched_copy,
        )
        if self.forward_overlap is not None:
            self.forward_overlap.timing_steps = True
        self.as_views = as_views
        self.broadcast_buffers = broadcast_buffers
        self.input_device = input_device
        self.label = f"DataParallel ({request.bucketing})"
        self.channels = len(channels)
        # On a GPU, profiled passes read ready times from the stream, not the host clock.
        self.clock = StreamClock(self.params[0].device)
        #: Whether the next forward starts from one rank's buffers even if it does not train.
        self.buffers_due = True
        self.arrivals = Arrivals(len(self.params))
        #: False inside ``no_sync()``: gradients accumulate locally.
        self.sync = True
        #: Set once the wrapper is closed: an output's hook left behind does nothing.
        self.closed = False
        #: Whether the current pass is the warm-up (its arrivals are only counted).
        self.warming_up = self.plans.lifecycle.warming_up
        #: Whether each gradient's arrival time is read (profiling, or a timeline recorded).
        self.timing = True
        #: ``time.perf_counter()`` when the latest forward was entered, its module started.
        self.entered = 0.0
        self.forward_start = 0.0
        self.forward_s = 0.0
        #: On a GPU, a profiled pass's marks on the stream; None otherwise.
        self.device_pass: DevicePass | None = None
        #: Whether each iteration's timeline is kept in :attr:`last_timeline`.
        self.record = False
        self.last_timeline: Timeline | None = None
        self.comm_events: list[CommRecord] = []
        #: Each gradient's arrival in the current backward (inf: not arrived).
        self.ready_times: list[float] = [math.inf] * len(self.params)
        self.backward = BackwardPass(weak_method(self, Averaging._finish_backward))
        # Outputs may outlive the wrapper: their hooks hold this object weakly.
        self.on_output_grad: Callable[..., Any] = weak_method(self, Averaging._output_reached)

    def register(self) -> list[Any]:
        """Put the gradient hook on every parameter; returns the removable handles."""
        return [
            param.register_post_accumulate_grad_hook(self._hook(index))
            for index, param in enumerate(self.params)
        ]

    def refresh(self) -> None:
        """Read again what the hooks take from the lifecycle (it moves at forwards and at the
        end of backward only)."""
        lifecycle = self.plans.lifecycle
        self.warming_up = lifecycle.warming_up
        self.timing = lifecycle.profiling or self.record

    def before_module(
        self, wrapper: Joinable, inputs: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], bool, bool]:
        """The lifecycle, Join and the buffers before the module runs; returns the inputs, whether
        this pass is profiled and whether the buffers are sent after it.

        Args:
            wrapper: The DataParallel (``Join`` counts it).
            inputs: The forward's positional inputs.
            kwargs: Its keyword inputs.
        """
        plans = self.plans
        entered = time.perf_counter()
        grad_enabled = torch.is_grad_enabled()
        training = grad_enabled and self.module.training
        will_sync = grad_enabled and self.sync
        due = plans.lifecycle.at_forward(entered, training=training, sync=self.sync)
        # One rank's buffers before every training forward, and, as DDP, before any forward
        # after a synchronising one (an evaluation then sees rank 0's statistics).
        syncs_buffers = self.broadcast_buffers and (training or self.buffers_due)
        self.buffers_due = will_sync
        joining = wrapper._join_config.enable
        if joining:
            shared = self.join.begin(
                wrapper,
                will_sync=will_sync,
                due=due,
                recorded=plans.lifecycle.recorded,
                syncs_buffers=syncs_buffers,
            )
            syncs_buffers = shared.syncs_buffers
        plans.on_due(due)
        self.refresh()
        self.entered = entered
        if self.input_device is not None:
            inputs, kwargs = move_inputs(inputs, kwargs, self.input_device)
        if syncs_buffers and joining:
            sync_buffers(cast(Shadowed, wrapper), shared.src)
        elif syncs_buffers:
            self.buffer_sync.receive()
        elif self.module.training:
            # A training-mode pass without gradients may update the buffers too: the snapshot
            # in flight would be stale, so the next training forward broadcasts afresh.
            self.buffer_sync.discard()
        profiling = plans.lifecycle.profiling and will_sync
        if profiling and self.clock.uses_events:
            self.device_pass = DevicePass(self.clock, len(self.params))
        self.forward_start = time.perf_counter()
        return inputs, kwargs, profiling, syncs_buffers and not joining

    def run_module(self, inputs: tuple[Any, ...], kwargs: dict[str, Any], profiling: bool) -> Any:
        """The module's forward; its gates timed while profiling with ``overlap="forward"``.

        Args:
            inputs: The forward's positional inputs.
            kwargs: Its keyword inputs.
            profiling: Whether this pass is profiled.
        """
        overlap = self.forward_overlap
        if overlap is None or not profiling:
            return self.module(*inputs, **kwargs)
        warming_up = self.plans.lifecycle.warming_up
        return overlap.profiled_call(self.module, inputs, kwargs, first=warming_up)

    def after_module(self, output: Any, sends_buffers: bool) -> None:
        """The module ran: time it, start the buffers' broadcast, watch its outputs.

        Args:
            output: What the module returned.
            sends_buffers: Whether this rank's buffers go out now for the next forward.
        """
        self.forward_s = time.perf_counter() - self.forward_start
        if self.forward_overlap is not None:
            # Parameters no gate waited for (unused in this forward): their averages too.
            self.forward_overlap.complete()
        if self.device_pass is not None:
            self.device_pass.forward_ended()
        if sends_buffers:
            self.buffer_sync.send()
        self.backward.forward_ended()
        if not self.sync or not torch.is_grad_enabled():
            return
        if isinstance(output, torch.Tensor):
            if output.requires_grad:
                output.register_hook(self.on_output_grad)
            return
        for tensor in tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(self.on_output_grad)

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        path = self

        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            if not path.sync:
                path.arrivals.accumulated.add(index)
                return
            backward = path.backward
            if path.timing:
                now = time.perf_counter()
                path.ready_times[index] = now
                if not backward.running:
                    backward.gradient_arrived(now)
                if path.device_pass is not None:
                    path.device_pass.tensor_ready(index)
            elif not backward.running:
                backward.gradient_arrived(time.perf_counter())
            arrivals = path.arrivals
            hits = arrivals.hits[index] = arrivals.hits[index] + 1
            needed = arrivals.needed[index]
            if hits < needed or path.warming_up:
                arrivals.late.append(index)
                return
            engine = path.plans.engine
            if hits > needed and engine.sent(index):
                raise UsageError(
                    f"parameter {path.names[index]!r} got more gradients in one backward than "
                    "in the first, after its bucket was sent: keep the graph's reentrant "
                    "checkpoints fixed, or use use_reentrant=False"
                )
            engine.add(index, grad)

        return hook

    def _output_reached(self, grad: torch.Tensor) -> None:
        if self.closed:
            return
        overlap = self.forward_overlap
        if overlap is not None and overlap.pending:
            # Before autograd accumulates into the gradients the averages are still owed to.
            overlap.complete()
        self.backward.output_reached()
        if self.device_pass is not None:
            self.device_pass.backward_started()

    def _finish_backward(self, backward_end: float) -> None:
        if self.device_pass is not None:
            self.device_pass.backward_ended()
        plans = self.plans
        self.arrivals.finish(plans.engine, self.params, counting=self.warming_up)
        plan = plans.plan
        overlap = self.forward_overlap
        if plan is not None and plan.overlaps_forward and overlap is not None:
            # Everything goes out now; the next forward applies each average where it is needed.
            plans.engine.close()
            overlap.begin(plans.engine)
            self._after_backward(backward_end)
            return
        averaged = plans.engine.finish()
        if plans.hook is None:
            self.join.rescale(averaged)
        write_averages(self.params, averaged, as_views=self.as_views)
        self._after_backward(backward_end)
        plans.engine.begin()

    def _after_backward(self, backward_end: float) -> None:
        lifecycle = self.plans.lifecycle
        start = self.backward.start if self.backward.start is not None else backward_end
        # A gradient that never came is ready when backward ends: its bucket goes out only then,
        # so the plan must not put it before the others.
        ready = [min(t, backward_end) for t in self.ready_times] if self.timing else []
        if self.timing:
            self.ready_times = [math.inf] * len(ready)
        if self.device_pass is not None:
            # Waits for this pass's last event: profiling passes only, a few per run.
            lifecycle.passed(*self.device_pass.seconds())
        else:
            lifecycle.passed(self.forward_s, backward_end - start, [t - start for t in ready])
        self.device_pass = None
        # The iteration that began at this forward synchronised: the next forward ends it.
        lifecycle.synchronised(self.entered)
        if self.record:
            self.last_timeline = iteration_timeline(
                self.label,
                self.names,
                forward_start=self.forward_start,
                forward_s=self.forward_s,
                backward_start=start,
                backward_end=backward_end,
                ready_s=ready,
                comm_events=self.comm_events,
                channels=self.channels,
            )
            self.comm_events = []
        self.refresh()

    def on_comm(self, bucket: int, channel: int, nbytes: int, launched: float, done: float) -> None:
        """One all-reduce finished (the engine's recorder, while recording).

        Args:
            bucket: Its bucket.
            channel: Its channel.
            nbytes: Its bytes.
            launched: ``time.perf_counter()`` at its launch.
            done: At its completion.
        """
        self.comm_events.append((bucket, channel, nbytes, launched, done))
