"""``interlace.DataParallel``: DDP's interface, with gradient buckets planned from measured times.

The plan in use is :attr:`DataParallel.plan` (``_plans``, :mod:`interlace.dp.planning`, chooses
it); each step's work is :mod:`interlace.dp.averaging`'s; the replicas are kept
alike by :mod:`interlace.dp.replicas` (lifecycle: docs/notes/dp.md).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.distributed_c10d import _get_default_group

from interlace.comm.agree import check_agreement, describe_tensors
from interlace.comm.channels import Channels
from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import GateTiming, Overlap
from interlace.comm.hooks import CommHook, HookSpec
from interlace.comm.plan import Bucketing, Plan
from interlace.distenv import collective_device
from interlace.dp.averaging import Averaging
from interlace.dp.ddp_args import (
    DEFAULT_BUCKET_CAP_MB,
    DdpSettings,
    DeviceLike,
    ddp_settings,
    move_inputs,
)
from interlace.dp.forward_overlap import ForwardOverlap
from interlace.dp.join import JoinState, Shadowed
from interlace.dp.lifetime import Holdings, claim, ensure_unclaimed, unclaim
from interlace.dp.options import (
    check_comm_hook,
    cost_model_kind,
    plan_request,
    trainable_parameters,
)
from interlace.dp.planning import Plans
from interlace.dp.replicas import broadcast_from_first
from interlace.dp.reports import PlanReports
from interlace.errors import UsageError

logger = logging.getLogger("interlace")


class DataParallel(nn.Module, Joinable, PlanReports):
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
        bucket_cap_mb: the cap of ``"fixed"`` buckets and of DDP's candidate plan, in MiB
            (2^20 bytes, as DDP counts); None: 25.
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
        first_bucket_cap_mb: the first ``"fixed"`` bucket's cap, MiB (DDP uses 1 to start early).
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
        single_rank_shortcut: in a group of one rank (one GPU) there is nothing to average: no
            hooks, no buckets, no planning; backward leaves the gradients as the module alone
            would (DDP's numbers), :attr:`plan` is None and :attr:`buckets` empty. Not taken
            with ``compression`` or a communication hook (their rounding is kept, as DDP with
            the hook). False runs the whole machinery on one rank (to measure or test it).

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
        single_rank_shortcut: bool = True,
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
        self.module = module
        self.process_group = ddp.process_group
        self.bucketing = self._request.bucketing
        #: What the all-reduces may overlap (the setting; the runtime is internal).
        self.overlap = self._request.overlap
        #: The bucket caps in bytes (``bucket_cap_mb`` in MiB, as DDP).
        self.bucket_cap_bytes = self._request.cap_bytes
        self.first_bucket_cap_bytes = self._request.first_cap_bytes
        self.broadcast_buffers = ddp.forward_sync_buffers
        self.gradient_as_bucket_view = ddp.gradient_as_bucket_view
        self.device_ids = None if ddp.input_device is None else [ddp.input_device.index]
        self.channels_requested = channels
        self.partition_mb = partition_mb
        self.compression = compression
        self.tune_steps = tune_steps
        self.profile_steps = profile_steps or (5 if self.bucketing is Bucketing.MERGED else 1)
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._cost_model = cost_model
        self._record = False
        self._input_device = ddp.input_device
        self._batched_copy = ddp.batched_grad_copy
        self._join = JoinState(self.process_group)
        self._agree(named, ddp, bucket_cap_mb, first_bucket_cap_mb, cost_model)
        alone = (
            single_rank_shortcut
            and dist.get_world_size(self.process_group) == 1
            and compression is None
        )
        self._begin(ddp, alone=alone)

    def _agree(
        self,
        named: list[tuple[str, nn.Parameter]],
        ddp: DdpSettings,
        bucket_cap_mb: float | None,
        first_bucket_cap_mb: float,
        cost_model: CostModel | None,
    ) -> None:
        """Check that every rank has the same settings and model (collective).

        Before any other collective: ranks that disagree on these would hang or abort in the
        collectives that follow, or average differently laid out tensors.
        """
        settings = {
            "bucketing": self.bucketing,
            "bucket_cap_mb": bucket_cap_mb,
            "first_bucket_cap_mb": first_bucket_cap_mb,
            "profile_steps": self.profile_steps,
            "tune_steps": self.tune_steps,
            "broadcast_buffers": ddp.forward_sync_buffers,
            "init_sync": (ddp.init_sync, ddp.init_sync_buffers),
            "channels": self.channels_requested,
            "partition_mb": self.partition_mb,
            "compression": self.compression,
            "cost_model": cost_model_kind(cost_model),
            "overlap": self.overlap,
        }
        tensors = {
            **describe_tensors("parameter", named),
            **describe_tensors("buffer", self.module.named_buffers()),
        }
        check_agreement("DataParallel", settings, tensors, self.process_group)

    def _begin(self, ddp: DdpSettings, *, alone: bool) -> None:
        """Start averaging, unless ``alone`` (one rank); claim the parameters."""
        module = self.module
        self._channels = Channels(1 if alone else self._request.channel_groups, self.process_group)
        self._holdings = Holdings(self._channels, None)
        # None on one rank (the shortcut): nothing is averaged until a communication hook is.
        self._run: Averaging | None = None
        self._plans: Plans | None = None
        self._forward_overlap: ForwardOverlap | None = None
        if not alone:
            if ddp.init_sync:
                # Every parameter, frozen ones too, as DDP's initial sync.
                buffers = list(module.buffers()) if ddp.init_sync_buffers else []
                broadcast_from_first([*module.parameters(), *buffers], self.process_group)
            self._start_averaging()
        self._ended = weakref.finalize(self, self._holdings.release_quietly)
        self._ended.atexit = False  # at exit there is no module left to hand back
        claim(self._params, self)

    def _start_averaging(self) -> None:
        """The machinery that averages (:class:`~interlace.dp.averaging.Averaging`)."""
        run = Averaging(
            self.module,
            self._names,
            self._params,
            self._request,
            self.process_group,
            self._channels,
            self._join,
            cost_model=self._cost_model,
            profile_steps=self.profile_steps,
            as_views=self.gradient_as_bucket_view,
            batched_copy=self._batched_copy,
            broadcast_buffers=self.broadcast_buffers,
            input_device=self._input_device,
        )
        # What Join's shadowing reads (dp/join.py), and the plan in use (:attr:`plan`).
        self._plans, self._buffer_sync = run.plans, run.buffer_sync
        self._forward_overlap = run.forward_overlap
        self._holdings.forward_overlap = run.forward_overlap
        self._holdings.handles = run.register()
        self._run = run
        self.record_timeline(self._record)

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
        if self._run is not None:
            self._run.closed = True
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
        run = self._run
        if run is None:
            inputs, kwargs = self._before_alone(inputs, kwargs)
            return self.module(*inputs, **kwargs)
        inputs, kwargs, profiling, sends_buffers = self._before_module(run, inputs, kwargs)
        output = run.run_module(inputs, kwargs, profiling)
        self._after_module(run, output, sends_buffers)
        return output

    # Plain Python when the wrapper is compiled: tracing the bookkeeping would guard on (and
    # recompile at) every step of the lifecycle, and planning's object collectives do not trace.
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _before_module(
        self, run: Averaging, inputs: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], bool, bool]:
        self._check_open()
        return run.before_module(self, inputs, kwargs)

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _after_module(self, run: Averaging, output: Any, sends_buffers: bool) -> None:
        run.after_module(output, sends_buffers)

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def _before_alone(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """One rank: what ``Join`` and ``device_ids`` ask of a forward, and nothing else."""
        self._check_open()
        if self._join_config.enable:
            work = Join.notify_join_context(self)
            if work is not None:
                work.wait()
        if self._input_device is not None:
            inputs, kwargs = move_inputs(inputs, kwargs, self._input_device)
        return inputs, kwargs

    def _check_open(self) -> None:
        if not self._ended.alive:
            raise UsageError(
                "this DataParallel was closed; wrap the module in a new DataParallel to train "
                "it data-parallel again"
            )

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
        run = self._run
        if run is None:  # one rank: gradients accumulate, and nothing averages them anyway
            yield
            return
        previous = run.sync
        run.sync = False
        try:
            yield
        finally:
            run.sync = previous

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
        # With averaging on, the shadowing reads _plans and _buffer_sync (set together).
        hook = self._join.hook(cast(Shadowed, self), self.overlap is Overlap.FORWARD, **kwargs)
        return JoinHook() if self._run is None else hook

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
        under DDP (on one rank too: the shortcut is then not taken). Buckets are still planned
        by interlace; the hook sees each bucket when it is launched. Until
        :attr:`planning_done` the layout may change, and PowerSGD's per-bucket memories are
        then started afresh.

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
        self._check_open()
        plans = self._plans
        check_comm_hook(
            hook,
            registered=plans is not None and plans.hook is not None,
            fresh=plans is None or plans.lifecycle.fresh,
            compression=self.compression,
            channels=self.channels_requested,
            overlap=self.overlap,
        )
        if plans is None:
            self._start_averaging()
            plans = self._plans
            assert plans is not None
        plans.attach_hook(HookSpec(state, hook))

    def record_timeline(self, enabled: bool = True) -> None:
        """Keep each iteration's forward, per-tensor backward and per-bucket all-reduce times in
        :attr:`last_timeline` (a little overhead per bucket; on one rank, nothing to record).

        Args:
            enabled: whether to record.
        """
        self._record = enabled
        run = self._run
        if run is not None:
            run.record = enabled
            run.refresh()
            run.plans.engine.recorder = run.on_comm if enabled else None

    @property
    def plan(self) -> Plan | None:
        """The plan in use: its buckets, their launch order and channels, and with
        ``overlap="forward"`` where the next forward waits (a plan with ``overlaps_forward``),
        whichever planner made it (:mod:`interlace.comm.planners`,
        :mod:`interlace.comm.forward_plan`) or :meth:`load_plan_state` loaded it; during the
        trials the candidate being tried (:attr:`planning_done` says when it is final); None
        while profiling, and on one rank (nothing to average)."""
        return None if self._plans is None else self._plans.plan

    @property
    def planning_done(self) -> bool:
        """Whether the buckets are final: planned, and the candidate plans tried if any were
        (at once on one rank)."""
        return self._plans is None or self._plans.lifecycle.settled

    def gate_layout(self) -> list[GateTiming]:
        """Where the next forward waits with ``overlap="forward"``: each gate (a module's name)
        with the parameters (registration indices) that wait there, in module registration
        order, offsets 0 (a fixed plan's gates; profiling measures the real ones); none on one
        rank.

        Raises:
            UsageError: without ``overlap="forward"``.
        """
        if self.overlap is not Overlap.FORWARD:
            raise UsageError("gate_layout() needs overlap='forward': without it nothing waits")
        overlap = self._forward_overlap
        return [] if overlap is None else overlap.gate_layout()

    def plan_state(self) -> dict[str, Any] | None:
        """The final plan as plain data (for a checkpoint); None while profiling or on trial,
        and on one rank."""
        return None if self._plans is None else self._plans.state()

    def load_plan_state(self, state: Mapping[str, Any]) -> None:
        """Use a saved plan from now on, with no profiling and no trials; collective. On one
        rank there is nothing to plan: a plan for this model is accepted and not used.

        Args:
            state: what :meth:`plan_state` returned for the same model (or
                :func:`interlace.dp.plan_state.plan_state_of`'s plan of it).

        Raises:
            UsageError: when the plan is for other parameters or more channels than this
                wrapper has, runs on into the forward without ``overlap="forward"``, or ranks
                load different plans.
        """
        if self._plans is not None:
            self._plans.load(state)
        elif list(state["names"]) != self._names:
            raise UsageError(
                "the saved DataParallel plan is for other parameters than this model's; "
                "load it into the model it was made for"
            )
