"""``interlace.DataParallel``: DDP's interface, with gradient buckets planned from measured times.

The wrapper owns the hooks and the bucket engine; the plan in use is :attr:`DataParallel.plan`
(chosen by :mod:`interlace.dp.planning`); the replicas are kept alike by
:mod:`interlace.dp.replicas` (lifecycle: docs/notes/dp.md).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable, JoinHook
from torch.distributed.distributed_c10d import _get_default_group

from interlace.clock import StreamClock
from interlace.comm.agree import check_agreement, describe_tensors
from interlace.comm.channels import Channels
from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import GateTiming, Overlap
from interlace.comm.hooks import CommHook, HookSpec
from interlace.comm.plan import Bucketing, Plan
from interlace.distenv import collective_device
from interlace.dp.backward_pass import BackwardPass, tensors_in
from interlace.dp.ddp_args import DEFAULT_BUCKET_CAP_MB, DeviceLike, ddp_settings, move_inputs
from interlace.dp.forward_overlap import ForwardOverlap
from interlace.dp.gradients import Arrivals, write_averages
from interlace.dp.iteration import CommRecord, DevicePass, iteration_timeline
from interlace.dp.join import JoinState, sync_buffers
from interlace.dp.lifetime import Holdings, claim, ensure_unclaimed, unclaim, weak_method
from interlace.dp.options import (
    check_comm_hook,
    cost_model_kind,
    plan_request,
    trainable_parameters,
)
from interlace.dp.planning import Plans
from interlace.dp.replicas import BufferBroadcast, broadcast_from_first
from interlace.errors import UsageError
from interlace.timeline import Timeline

logger = logging.getLogger("interlace")


class DataParallel(nn.Module, Joinable):
    """Wrap ``module`` for data-parallel training over ``process_group`` (default: the world).

    Used like :class:`torch.nn.parallel.DistributedDataParallel`, with its arguments in its
    order (each one's handling: docs/data-parallel.md, "Coming from DDP"): forward,
    ``loss.backward()`` returns with gradients averaged over the ranks, ``no_sync()``
    accumulates, ``with Join([model]):`` trains on uneven inputs. With ``overlap="forward"``
    the averages run on into the next forward instead (see ``overlap``). interlace's own
    arguments, from ``bucketing`` on, are keyword-only. :meth:`close` (or the end of a ``with``
    block, or garbage collection) ends the wrapper and leaves the module as it was.

    Args:
        module: the model, already on this rank's device.
        device_ids: None, or the model's one CUDA device (inputs are then moved there).
        output_device: None, or the model's device (outputs stay where the model makes them).
        dim: 0 (DDP's scatter dimension; neither scatters over devices).
        broadcast_buffers: DDP's deprecated ``forward_sync_buffers``; False also keeps the
            buffers out of the broadcast at wrap time.
        init_sync: broadcast rank 0's parameters (and buffers) at wrap time; False skips it,
            the check that the ranks built the same model stays.
        process_group: the group to average over.
        bucket_cap_mb: the cap of ``"fixed"`` buckets and of DDP's candidate plan, in MB
            (10^6 bytes; DDP counts MiB); None: 25.
        find_unused_parameters: True or False alike: unused parameters are always handled as
            DDP does with True, without walking the graph.
        check_reduction: deprecated in DDP, where it does nothing; a FutureWarning.
        gradient_as_bucket_view: each ``.grad`` is a view into its bucket (no memory of its own).
        static_graph: True or False alike: each backward's gradients are found anew.
        delay_all_reduce_named_params: None only (interlace plans when buckets go out).
        param_to_hook_all_reduce: None only, likewise.
        mixed_precision: None only: use ``torch.autocast`` and ``compression``.
        device_mesh: a 1-D DeviceMesh whose group is averaged over.
        skip_all_reduce_unused_params: True or False alike: unused gradients stay unchanged.
        bucket_cap_mb_list: None only (interlace sizes the buckets).
        batched_grad_copy: copy a bucket's gradients in at once when it is complete.
        forward_sync_buffers: one rank's buffers (BatchNorm statistics) before every training
            forward and any forward after one (rank 0's; under ``Join`` the highest rank still
            training); None: ``broadcast_buffers``, else True.
        bucketing: a :class:`~interlace.comm.plan.Bucketing` or its string: ``"merged"``
            (MG-WFBP), ``"per-tensor"`` (WFBP), ``"fixed"`` (DDP-style caps), ``"single"`` (one
            all-reduce after backward) or ``"optimal"`` (the exact best contiguous bucketing
            under the cost model, by dynamic programming); or an alias of
            :data:`~interlace.comm.strategies.BUCKETING_ALIASES`.
        first_bucket_cap_mb: the first ``"fixed"`` bucket's cap (DDP uses 1 MB to start early).
        profile_steps: backward passes timed before planning (after one warm-up pass);
            default 5 for ``"merged"`` and 1 (just the ready order) for the others.
        cost_model: price of an all-reduce; default: fitted on ``process_group`` (cached).
        channels: process groups used at once: an int ``k >= 1`` or ``"auto"`` (``k`` in 1..4
            chosen by measured iteration time, the partition threshold for each ``k`` by
            predicted time from the concurrency measured on the live group). Creating channels
            is collective: every rank of ``process_group`` wraps with the same value.
        partition_mb: buckets larger than this are split into slices sent at once on different
            channels; ``None`` never splits, ``"auto"`` lets the planner choose.
        compression: ``None``, ``"fp16"`` or ``"bf16"``: float32 buckets are averaged in float32,
            sent in the smaller type and cast back (half the bytes, about 3 significant digits).
        tune_steps: timed iterations per candidate plan and round when several plans are
            weighed (the cost model's plan, the merge rule with larger start-ups, DDP's
            buckets, and with ``channels="auto"`` the best plan for each channel count, with
            ``overlap="forward"`` the best overlap plans); the fastest measured is kept. 0
            keeps the cost model's plan untried (with ``overlap="forward"``, its best overlap
            plan).
        overlap: an :class:`~interlace.comm.forward_plan.Overlap` or its string. ``"backward"``
            (default): all-reduces overlap backward, which returns with the gradients averaged.
            ``"forward"``: they may also run on into the next forward. ``loss.backward()``
            then returns at once; ``optimizer.step()`` (any ``torch.optim`` optimizer) is
            deferred per parameter, and each layer of the next forward waits for its own
            parameters' averages and applies their update right before it runs, while the
            all-reduces the later layers need are still in flight, the ones needed first sent
            first. Code that reads gradients before the step (``clip_grad_norm_``, a
            ``GradScaler``, K-FAC) or parameters after it (an EMA, a checkpoint) gets the
            averaged values: it waits for every all-reduce first, as without the overlap.
            The trials keep a backward-only plan where the overlap is measured slower.

    Raises:
        UsageError: for a bad setting, a DDP argument interlace cannot honour, an uninitialised
            process group, a model without trainable parameters or on several devices, a model
            another live DataParallel wraps, or ranks that differ in model or settings (on
            every rank, instead of a hang later).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        bucketing: Bucketing | str = Bucketing.MERGED,
        first_bucket_cap_mb: float = 1.0,
        profile_steps: int | None = None,
        cost_model: CostModel | None = None,
        channels: int | str = 1,
        partition_mb: float | str | None = "auto",
        compression: str | None = None,
        tune_steps: int = 2,
        overlap: Overlap | str = Overlap.BACKWARD,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise UsageError(
                "cost_model must be an interlace CostModel or None, got "
                f"{type(cost_model).__name__}"
            )
        named = trainable_parameters(module)
        ensure_unclaimed([param for _, param in named])
        ddp = ddp_settings(
            named[0][1].device,
            forward_overlap=overlap == Overlap.FORWARD,
            device_ids=device_ids,
            output_device=output_device,
            dim=dim,
            broadcast_buffers=broadcast_buffers,
            init_sync=init_sync,
            process_group=process_group,
            find_unused_parameters=find_unused_parameters,
            check_reduction=check_reduction,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            mixed_precision=mixed_precision,
            device_mesh=device_mesh,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            bucket_cap_mb_list=bucket_cap_mb_list,
            batched_grad_copy=batched_grad_copy,
            forward_sync_buffers=forward_sync_buffers,
        )
        self._request = plan_request(
            bucketing=bucketing,
            bucket_cap_mb=DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            channels=channels,
            partition_mb=partition_mb,
            compression=compression,
            tune_steps=tune_steps,
            profile_steps=profile_steps,
            overlap=overlap,
        )
        process_group = ddp.process_group
        self.module = module
        self.bucketing = self._request.bucketing
        self.overlap = self._request.overlap
        self.bucket_cap_bytes = self._request.cap_bytes
        self.first_bucket_cap_bytes = self._request.first_cap_bytes
        self.process_group = process_group
        self.broadcast_buffers = ddp.forward_sync_buffers
        self.gradient_as_bucket_view = ddp.gradient_as_bucket_view
        self.device_ids = None if ddp.input_device is None else [ddp.input_device.index]
        self.channels_requested = channels
        self.partition_mb = partition_mb
        self.compression = compression
        self.tune_steps = tune_steps
        self.profile_steps = profile_steps or (5 if self.bucketing is Bucketing.MERGED else 1)
        self.last_timeline: Timeline | None = None
        """The latest iteration's timeline while :meth:`record_timeline` is on."""
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]

        # Before any other collective: ranks that disagree on these would hang or abort in the
        # collectives that follow, or average differently laid out tensors.
        check_agreement(
            "DataParallel",
            {
                "bucketing": self.bucketing,
                "bucket_cap_mb": bucket_cap_mb,
                "first_bucket_cap_mb": first_bucket_cap_mb,
                "profile_steps": self.profile_steps,
                "tune_steps": tune_steps,
                "broadcast_buffers": ddp.forward_sync_buffers,
                "init_sync": (ddp.init_sync, ddp.init_sync_buffers),
                "channels": channels,
                "partition_mb": partition_mb,
                "compression": compression,
                "cost_model": cost_model_kind(cost_model),
                "overlap": self.overlap,
            },
            {
                **describe_tensors("parameter", named),
                **describe_tensors("buffer", module.named_buffers()),
            },
            process_group,
        )
        if ddp.init_sync:
            # Every parameter, frozen ones too, as DDP's initial sync.
            buffers = list(module.buffers()) if ddp.init_sync_buffers else []
            broadcast_from_first([*module.parameters(), *buffers], process_group)
        self._buffer_sync = BufferBroadcast(module, process_group)
        self._join = JoinState(process_group)
        self._input_device = ddp.input_device
        self._batched_copy = ddp.batched_grad_copy
        self._arrivals = Arrivals(len(named))
        self._channels = Channels(self._request.channel_groups, process_group)
        self._forward_overlap = (
            ForwardOverlap(module, self._params) if self.overlap is Overlap.FORWARD else None
        )
        self._plans = Plans(
            self._request,
            self._names,
            self._params,
            process_group,
            self._channels,
            profile_steps=self.profile_steps,
            cost_model=cost_model,
            forward_overlap=self._forward_overlap,
            batched_copy=self._batched_copy,
        )
        self._sync = True
        self._buffers_due = True
        self._entered = 0.0
        self._forward_start = 0.0
        self._forward_s = 0.0
        self._backward = BackwardPass(weak_method(self, DataParallel._finish_backward))
        #: Each gradient's arrival in the current backward (inf: not arrived).
        self._ready_times: list[float] = [math.inf] * len(self._params)
        # On a GPU, profiled passes read ready times from the stream, not the host clock.
        self._clock = StreamClock(self._params[0].device if self._params else "cpu")
        self._device_pass: DevicePass | None = None
        self._record = False
        self._comm_events: list[CommRecord] = []
        # Whatever outlives a forward (the parameters' hooks, the outputs' hooks) holds the
        # wrapper weakly: dropping it frees it, and the finalizer takes the hooks off.
        self._on_output_grad = weak_method(self, DataParallel._mark_backward_start)
        holdings = Holdings(self._channels, self._forward_overlap)
        holdings.handles = [
            param.register_post_accumulate_grad_hook(self._make_hook(index))
            for index, param in enumerate(self._params)
        ]
        if self._forward_overlap is not None:
            self._forward_overlap.timing_steps = True
        self._ended = weakref.finalize(self, holdings.release_quietly)
        self._ended.atexit = False  # at exit there is no module left to hand back
        self._holdings = holdings
        claim(self._params, self)

    # ------------------------------------------------------------------ public API

    def close(self) -> None:
        """End the wrapper: apply the updates still pending (``overlap="forward"``), take every
        hook off the module, its parameters and the optimizers, destroy the process groups
        created for ``channels``. The module is then as before wrapping (wrap it again to go on
        training data-parallel); closing again does nothing. Also at the end of a ``with``
        block, and when the wrapper is garbage-collected."""
        if not self._ended.alive:
            return
        self._ended.detach()
        try:
            self._holdings.release()
        finally:
            unclaim(self._params, self)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ended the wrapper."""
        return not self._ended.alive

    def __enter__(self) -> DataParallel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; the backward of its output averages the gradients over the ranks."""
        inputs, kwargs, profiling, sends_buffers = self._before_module(inputs, kwargs)
        output = self._run_module(inputs, kwargs, profiling)
        self._after_module(output, sends_buffers)
        return output

    # Plain Python when the wrapper is compiled: tracing the bookkeeping would guard on (and
    # recompile at) every step of the lifecycle, and planning's object collectives do not trace.
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _before_module(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], bool, bool]:
        """The lifecycle, Join and the buffers before the module runs; returns the inputs, whether
        this pass is profiled and whether the buffers are sent after it."""
        if not self._ended.alive:
            raise UsageError(
                "this DataParallel was closed; wrap the module in a new DataParallel to train "
                "it data-parallel again"
            )
        entered = time.perf_counter()
        training = torch.is_grad_enabled() and self.module.training
        due = self._plans.lifecycle.at_forward(entered, training=training, sync=self._sync)
        will_sync = torch.is_grad_enabled() and self._sync
        # One rank's buffers before every training forward, and, as DDP, before any forward
        # after a synchronising one (an evaluation then sees rank 0's statistics).
        syncs_buffers = self.broadcast_buffers and (training or self._buffers_due)
        self._buffers_due = will_sync
        joining = self._join_config.enable
        if joining:
            shared = self._join.begin(
                self,
                will_sync=will_sync,
                due=due,
                recorded=self._plans.lifecycle.recorded,
                syncs_buffers=syncs_buffers,
            )
            syncs_buffers = shared.syncs_buffers
        self._plans.on_due(due)
        self._entered = entered
        if self._input_device is not None:
            inputs, kwargs = move_inputs(inputs, kwargs, self._input_device)
        if syncs_buffers and joining:
            sync_buffers(self, shared.src)
        elif syncs_buffers:
            self._buffer_sync.receive()
        elif self.module.training:
            # A training-mode pass without gradients may update the buffers too: the snapshot
            # in flight would be stale, so the next training forward broadcasts afresh.
            self._buffer_sync.discard()
        profiling = self._plans.lifecycle.profiling and torch.is_grad_enabled() and self._sync
        self._device_pass = (
            DevicePass(self._clock, len(self._params))
            if profiling and self._clock.uses_events
            else None
        )
        self._forward_start = time.perf_counter()
        return inputs, kwargs, profiling, syncs_buffers and not joining

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _after_module(self, output: Any, sends_buffers: bool) -> None:
        self._forward_s = time.perf_counter() - self._forward_start
        if self._forward_overlap is not None:
            # Parameters no gate waited for (unused in this forward): their averages too.
            self._forward_overlap.complete()
        if self._device_pass is not None:
            self._device_pass.forward_ended()
        if sends_buffers:
            self._buffer_sync.send()
        self._backward.forward_ended()
        if torch.is_grad_enabled() and self._sync:
            for tensor in tensors_in(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._on_output_grad)

    def _run_module(self, inputs: tuple[Any, ...], kwargs: dict[str, Any], profiling: bool) -> Any:
        """The module's forward; its gates timed while profiling with ``overlap="forward"``."""
        overlap = self._forward_overlap
        if overlap is None or not profiling:
            return self.module(*inputs, **kwargs)
        warming_up = self._plans.lifecycle.warming_up
        return overlap.profiled_call(self.module, inputs, kwargs, first=warming_up)

    def synchronize(self) -> None:
        """Wait for every all-reduce still in flight and apply the optimizer updates deferred
        until then (``overlap="forward"``; nothing to do otherwise). Code that reads gradients
        or parameters gets there by itself; this is for timing a step, or before handing the
        model to code that bypasses torch's operators."""
        if self._forward_overlap is not None:
            self._forward_overlap.complete()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside the block averages them all."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """What ``torch.distributed.algorithms.join.Join`` runs on a rank out of inputs: each
        iteration of the others shadowed (their collectives in their order, this rank's
        gradients zero), and, once every rank has joined, the last joiner's model everywhere.

        Args:
            **kwargs: ``Join``'s keyword arguments; ``divide_by_initial_world_size`` as DDP's
                (default True: the average divides by the whole group's size; False: by the
                ranks still training).

        Raises:
            UsageError: with ``overlap="forward"``, whose all-reduces cannot be shadowed.
        """
        return self._join.hook(self, self._forward_overlap is not None, **kwargs)

    @property
    def join_device(self) -> torch.device:
        """Where ``Join``'s own all-reduces run."""
        return collective_device(self.process_group)

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The group ``Join`` counts ranks in: this wrapper's."""
        return self.process_group if self.process_group is not None else _get_default_group()

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Average each bucket with a DDP communication hook instead of interlace's all-reduce.

        As :meth:`torch.nn.parallel.DistributedDataParallel.register_comm_hook`: ``hook(state,
        bucket)`` gets a bucket with ``torch.distributed.GradBucket``'s methods (``buffer()``,
        ``index()``, ``is_last()``, ``gradients()``, ``parameters()``, ``set_buffer()``) and
        returns a future of the averaged flat buffer, which is waited on at the end of backward
        and written into the gradients. Torch's ``allreduce_hook``, ``fp16_compress_hook``,
        ``bf16_compress_hook`` and ``powerSGD_hook`` (with a ``PowerSGDState``) run as they do
        under DDP. Buckets are still planned by interlace; the hook sees each bucket when it is
        launched. Until :attr:`planning_done` the layout may change, and PowerSGD's per-bucket
        memories are then started afresh.

        Args:
            state: the hook's first argument: the process group (or None) for the default hooks,
                a ``PowerSGDState`` for PowerSGD.
            hook: the hook.

        Raises:
            UsageError: when a hook is registered already, when a backward pass has run, with
                ``compression`` or ``channels`` other than 1 (a hook sends the bucket itself,
                so interlace's own compression and channels would not apply), or with
                ``overlap="forward"`` (a hook's future is waited for at the end of backward).
        """
        check_comm_hook(
            hook,
            registered=self._plans.hook is not None,
            fresh=self._plans.lifecycle.fresh,
            compression=self.compression,
            channels=self.channels_requested,
            overlap=self.overlap,
        )
        self._plans.attach_hook(HookSpec(state, hook))

    def record_timeline(self, enabled: bool = True) -> None:
        """Keep each iteration's forward, per-tensor backward and per-bucket all-reduce times in
        :attr:`last_timeline` (a little overhead per bucket).

        Args:
            enabled: whether to record.
        """
        self._record = enabled
        self._plans.engine.recorder = weak_method(self, DataParallel._on_comm) if enabled else None

    @property
    def plan(self) -> Plan | None:
        """The plan in use: its buckets, their launch order and channels, and with
        ``overlap="forward"`` where the next forward waits (a plan with ``overlaps_forward``),
        whichever planner made it (:mod:`interlace.comm.plan`,
        :mod:`interlace.comm.forward_plan`) or :meth:`load_plan_state` loaded it; during the
        trials the candidate being tried (:attr:`planning_done` says when it is final); None
        while profiling."""
        return self._plans.plan

    @property
    def channel_choice(self) -> str:
        """Why the plan uses the channels it does (set when planned)."""
        return self._plans.channel_choice

    @property
    def tuning_summary(self) -> str:
        """The candidate plans' measured iteration times and which was kept (set when done)."""
        return self._plans.tuning_summary

    @property
    def tuning_results(self) -> list[tuple[str, int, float]]:
        """Per candidate tried: its label, its bucket count, its median iteration seconds on
        the slowest rank (set when the trials end)."""
        return self._plans.tuning_results

    @property
    def planning_done(self) -> bool:
        """Whether the buckets are final: planned, and the candidate plans tried if any were."""
        return self._plans.lifecycle.settled

    @property
    def last_forward_start(self) -> float:
        """``time.perf_counter()`` at the start of the latest forward: :attr:`last_timeline`'s
        time origin."""
        return self._forward_start

    @property
    def cost_model(self) -> CostModel | None:
        """The cost model the plans are priced with (fitted at planning time if not given)."""
        return self._plans.cost_model

    @property
    def parameter_names(self) -> list[str]:
        """The trainable parameters' names, in registration order."""
        return list(self._names)

    @property
    def buckets(self) -> list[list[str]]:
        """The parameters of each bucket in use, in plan order (a bucket mixing dtypes counts
        as one per dtype)."""
        return [[self._names[i] for i in group] for group in self._plans.engine.groups]

    @property
    def bucket_channels(self) -> list[list[int]]:
        """The channel of each slice of each bucket in use (one entry unless partitioned)."""
        return [list(channels) for channels in self._plans.engine.assignment]

    @property
    def waited_buckets(self) -> list[int]:
        """The buckets (indices into :attr:`buckets`) of the latest backward whose averages this
        rank has waited for so far: with ``overlap="forward"``, a layer's forward pre-hook sees
        the ones the forward has needed up to that layer; empty once all are applied."""
        return self._plans.engine.waited_buckets()

    def gate_layout(self) -> list[GateTiming]:
        """Where the next forward waits with ``overlap="forward"``: each gate (a module's name)
        with the parameters (registration indices) that wait there, in module registration
        order, offsets 0 (a fixed plan's gates; profiling measures the real ones).

        Raises:
            UsageError: without ``overlap="forward"``.
        """
        if self._forward_overlap is None:
            raise UsageError("gate_layout() needs overlap='forward': without it nothing waits")
        return self._forward_overlap.gate_layout()

    def plan_state(self) -> dict[str, Any] | None:
        """The final plan as plain data (for a checkpoint); None while profiling or on trial."""
        return self._plans.state()

    def load_plan_state(self, state: Mapping[str, Any]) -> None:
        """Use a saved plan from now on, with no profiling and no trials; collective.

        Args:
            state: what :meth:`plan_state` returned for the same model (or
                :func:`interlace.dp.plan_state.plan_state_of`'s plan of it).

        Raises:
            UsageError: when the plan is for other parameters or more channels than this
                wrapper has, runs on into the forward without ``overlap="forward"``, or ranks
                load different plans.
        """
        self._plans.load(state)

    # ------------------------------------------------------------------ hooks

    def _make_hook(self, index: int) -> Any:
        reference = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            wrapper = reference()
            if wrapper is None or param.grad is None:
                return
            if not wrapper._sync:
                wrapper._arrivals.accumulated.add(index)
                return
            now = time.perf_counter()
            wrapper._backward.gradient_arrived(now)
            wrapper._ready_times[index] = now
            if wrapper._device_pass is not None:
                wrapper._device_pass.tensor_ready(index)
            if not wrapper._arrivals.complete(index, counting=wrapper._plans.lifecycle.warming_up):
                return
            if wrapper._arrivals.overdue(index) and wrapper._plans.engine.sent(index):
                raise UsageError(
                    f"parameter {wrapper._names[index]!r} got more gradients in one backward than "
                    "in the first, after its bucket was sent: keep the graph's reentrant "
                    "checkpoints fixed, or use use_reentrant=False"
                )
            wrapper._plans.engine.add(index, param.grad)

        return hook

    def _mark_backward_start(self, grad: torch.Tensor) -> None:
        if not self._ended.alive:
            return
        if self._forward_overlap is not None and self._forward_overlap.pending:
            # Before autograd accumulates into the gradients the averages are still owed to.
            self._forward_overlap.complete()
        self._backward.output_reached()
        if self._device_pass is not None:
            self._device_pass.backward_started()

    def _finish_backward(self, backward_end: float) -> None:
        if self._device_pass is not None:
            self._device_pass.backward_ended()
        self._arrivals.finish(
            self._plans.engine, self._params, counting=self._plans.lifecycle.warming_up
        )
        plan = self.plan
        if plan is not None and plan.overlaps_forward and self._forward_overlap is not None:
            # Everything goes out now; the next forward applies each average where it is needed.
            self._plans.engine.close()
            self._forward_overlap.begin(self._plans.engine)
            self._after_backward(backward_end)
            return
        averaged = self._plans.engine.finish()
        if self._plans.hook is None:
            self._join.rescale(averaged)
        write_averages(self._params, averaged, as_views=self.gradient_as_bucket_view)
        self._after_backward(backward_end)
        self._plans.engine.begin()

    def _after_backward(self, backward_end: float) -> None:
        start = self._backward.start if self._backward.start is not None else backward_end
        # A gradient that never came is ready when backward ends: its bucket goes out only then,
        # so the plan must not put it before the others.
        ready = [min(t, backward_end) for t in self._ready_times]
        self._ready_times = [math.inf] * len(ready)
        if self._device_pass is not None:
            # Waits for this pass's last event: profiling passes only, a few per run.
            self._plans.lifecycle.passed(*self._device_pass.seconds())
        else:
            self._plans.lifecycle.passed(
                self._forward_s, backward_end - start, [t - start for t in ready]
            )
        self._device_pass = None
        # The iteration that began at this forward synchronised: the next forward ends it.
        self._plans.lifecycle.synchronised(self._entered)
        if self._record:
            self.last_timeline = iteration_timeline(
                f"DataParallel ({self.bucketing})",
                self._names,
                forward_start=self._forward_start,
                forward_s=self._forward_s,
                backward_start=start,
                backward_end=backward_end,
                ready_s=ready,
                comm_events=self._comm_events,
                channels=len(self._channels),
            )
        self._comm_events = []

    def _on_comm(
        self, bucket: int, channel: int, nbytes: int, launched: float, done: float
    ) -> None:
        self._comm_events.append((bucket, channel, nbytes, launched, done))
