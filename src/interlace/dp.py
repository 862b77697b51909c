"""``interlace.DataParallel``: data parallelism whose gradient buckets are planned, not guessed.

Used exactly like :class:`torch.nn.parallel.DistributedDataParallel`: wrap, forward,
``loss.backward()`` returns with gradients averaged over the ranks, ``optimizer.step()``;
``no_sync()`` for gradient accumulation. What differs is how gradients are grouped into
all-reduces: by one of the planners of :mod:`interlace.comm.plan`, fed with the gradient ready
times this very model shows during its first iterations and a cost model fitted on the live
process group. With ``bucketing="merged"`` that is MG-WFBP's optimal merge.

Lifecycle: the first ``profile_steps`` backward passes send all gradients in one all-reduce at the
end (so the measured ready times are not disturbed by communication), then the ranks agree on
the slowest rank's timings, rank 0 plans, every rank receives the same plan, and the buckets are
rebuilt. Where several plans are worth weighing (``bucketing="merged"`` or ``"optimal"``, or
``channels="auto"``), the ranks then try each candidate for ``tune_steps`` real iterations per
round (:mod:`interlace.comm.tuning`) and keep the one measured fastest: the cost model prices an
all-reduce alone, but not what it costs the backward pass it overlaps when both need the same
cores.

With ``channels=k`` (AIACC-Training) buckets travel on ``k`` process groups at once, each on the
channel the plan gives it, and buckets above the partition threshold are split across channels;
``channels="auto"`` measures what concurrency costs on the live group, lets the planner's
predicted iteration time choose the threshold for each ``k`` in 1..4, and the trials choose
``k``. ``compression="fp16"|"bf16"`` sends float32 buckets in half precision.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves

from interlace.comm.calibrate import fit_concurrency, fit_cost_model
from interlace.comm.channels import (
    MAX_AUTO_CHANNELS,
    Channels,
    assignment_of,
    check_same_everywhere,
)
from interlace.comm.cost import CostModel
from interlace.comm.engine import COMPRESSIONS, BucketEngine
from interlace.comm.plan import Plan, ReadyTensor, make_plan
from interlace.comm.tuning import (
    START_UP_SCALES,
    PlanTrials,
    describe_trials,
    fastest,
    scale_start_up,
)
from interlace.distenv import collective_device
from interlace.errors import UsageError

if TYPE_CHECKING:
    from interlace.timeline import Timeline

BUCKETINGS = ("merged", "per-tensor", "fixed", "single", "optimal")
_ALIASES = {"mgwfbp": "merged", "wfbp": "per-tensor", "syncesgd": "single", "synceasgd": "single"}
EVEN_BUCKET_COUNTS = (4, 8)
"""With ``"merged"``/``"optimal"``, the trials also weigh gradients cut into about this many
buckets of equal bytes (DDP-style caps of total/count): on the emulated cluster a few even
buckets beat both DDP's default 25 MB and the merge rule's uneven ones on small models."""
PARTITION_CANDIDATES_MB = (0.25, 1.0, 4.0)
"""Partition thresholds the planner weighs (besides none) when ``partition_mb="auto"``."""
AUTO_MARGIN = 0.10
"""``channels="auto"`` takes more channels only for a predicted gain above this fraction. On the
emulated cluster, predicted gains of about 5% from splitting one bucket over four channels
measured as 5-8% losses (concurrent all-reduces share the ranks' CPU as well as the link), so a
smaller predicted gain is inside the model's error; fewer channels also cost fewer threads."""

logger = logging.getLogger("interlace")


class DataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training over ``process_group`` (default: the world).

    Args:
        module: the model, already on this rank's device.
        bucketing: ``"merged"`` (MG-WFBP), ``"per-tensor"`` (WFBP), ``"fixed"`` (DDP-style caps),
            ``"single"`` (one all-reduce after backward) or ``"optimal"`` (the exact best
            contiguous bucketing under the cost model, by dynamic programming).
        bucket_cap_mb: the cap of ``"fixed"`` buckets, in MB (10^6 bytes), as DDP's.
        first_bucket_cap_mb: the first ``"fixed"`` bucket's cap (DDP uses 1 MB to start early).
        process_group: the group to average over.
        profile_steps: backward passes timed before planning (after one warm-up pass);
            default 5 for ``"merged"`` and 1 (just the ready order) for the others.
        cost_model: price of an all-reduce; default: fitted on ``process_group`` (cached).
        tune_steps: timed iterations per candidate plan and round when several plans are
            weighed (the cost model's plan, the merge rule with larger start-ups, DDP's
            buckets, and with ``channels="auto"`` the best plan for each channel count); the
            fastest measured is kept. 0 keeps the cost model's plan untried.
        broadcast_buffers: re-send rank 0's buffers (BatchNorm statistics) before every forward,
            as DDP does by default.
        channels: process groups used at once: an int ``k >= 1`` or ``"auto"`` (``k`` in 1..4
            chosen by measured iteration time, the partition threshold for each ``k`` by
            predicted time from the concurrency measured on the live group). Creating channels
            is collective: every rank of ``process_group`` wraps with the same value.
        partition_mb: buckets larger than this are split into slices sent at once on different
            channels; ``None`` never splits, ``"auto"`` lets the planner choose.
        compression: ``None``, ``"fp16"`` or ``"bf16"``: float32 buckets are averaged in float32,
            sent in the smaller type and cast back (half the bytes, about 3 significant digits).
    """

    def __init__(
        self,
        module: nn.Module,
        bucketing: str = "merged",
        bucket_cap_mb: float = 25.0,
        *,
        first_bucket_cap_mb: float = 1.0,
        process_group: dist.ProcessGroup | None = None,
        profile_steps: int | None = None,
        cost_model: CostModel | None = None,
        broadcast_buffers: bool = True,
        channels: int | str = 1,
        partition_mb: float | str | None = "auto",
        compression: str | None = None,
        tune_steps: int = 2,
    ) -> None:
        super().__init__()
        bucketing = _ALIASES.get(bucketing, bucketing)
        if bucketing not in BUCKETINGS:
            raise UsageError(
                f"unknown bucketing '{bucketing}'; choose one of {', '.join(BUCKETINGS)} "
                f"(or the aliases {', '.join(_ALIASES)})"
            )
        if not bucket_cap_mb > 0 or not first_bucket_cap_mb > 0:
            raise UsageError(
                f"bucket caps must be > 0 MB, got bucket_cap_mb={bucket_cap_mb}, "
                f"first_bucket_cap_mb={first_bucket_cap_mb}"
            )
        if channels != "auto" and not (isinstance(channels, int) and channels >= 1):
            raise UsageError(f"channels must be an integer >= 1 or 'auto', got {channels!r}")
        if partition_mb not in ("auto", None) and (
            isinstance(partition_mb, str) or not partition_mb > 0
        ):
            raise UsageError(
                f"partition_mb must be > 0, None (never split) or 'auto', got {partition_mb!r}"
            )
        if compression is not None and compression not in COMPRESSIONS:
            raise UsageError(
                f"unknown compression {compression!r}; choose one of "
                f"{', '.join(COMPRESSIONS)} (or None)"
            )
        if bucketing == "optimal" and channels != 1:
            raise UsageError(
                "bucketing='optimal' is exact on one channel only; use bucketing='merged' with "
                f"channels={channels!r}"
            )
        if tune_steps < 0:
            raise UsageError(
                f"tune_steps must be >= 0 (0: keep the cost model's plan), got {tune_steps}"
            )
        if profile_steps is not None and profile_steps < 1:
            raise UsageError(f"profile_steps must be >= 1, got {profile_steps}")
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError(
                "torch.distributed is not initialised: call "
                "torch.distributed.init_process_group() before wrapping the model "
                "(torchrun and `interlace launch` provide the environment it needs)"
            )
        self.module = module
        self.bucketing = bucketing
        self.bucket_cap_bytes = bucket_cap_mb * 1e6
        self.first_bucket_cap_bytes = first_bucket_cap_mb * 1e6
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.channels_requested = channels
        self.partition_mb = partition_mb
        self.compression = compression
        self.channel_choice = ""
        """Why the plan uses the channels it does (set when planned)."""
        self.tune_steps = tune_steps
        self.tuning_summary = ""
        """The candidate plans' measured iteration times and which was kept (set when done)."""
        self.tuning_results: list[tuple[str, int, float]] = []
        """Per candidate tried: its label, its bucket count, its median iteration seconds on
        the slowest rank (set when the trials end)."""
        self._candidates: list[tuple[Plan, list[int], str, str]] = []
        self._trials: PlanTrials | None = None
        self._entered = 0.0
        self._timed_from: float | None = None
        self._buffers_in_flight: tuple[dist.Work | None, list[torch.Tensor], torch.Tensor] | None
        self._buffers_in_flight = None
        self.profile_steps = profile_steps or (5 if bucketing == "merged" else 1)
        self._cost_model = cost_model
        self._rank = dist.get_rank(process_group)
        self._src = 0 if process_group is None else dist.get_global_rank(process_group, 0)

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise UsageError(
                "the model has no trainable parameters (none with requires_grad=True); "
                "there is nothing to average across ranks"
            )
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        devices = {p.device for p in self._params}
        if len(devices) > 1:
            raise UsageError(
                "DataParallel needs every parameter on one device, found "
                f"{sorted(map(str, devices))}"
            )
        self._check_same_model_everywhere()
        # Checked before any group is created: ranks that disagree here would hang there.
        check_same_everywhere(
            {
                "bucketing": bucketing,
                "channels": channels,
                "partition_mb": partition_mb,
                "compression": compression,
            },
            "DataParallel's communication settings",
            process_group,
        )
        self._broadcast_state()
        self._channels = Channels(
            MAX_AUTO_CHANNELS if channels == "auto" else int(channels), process_group
        )

        # Until profiling is over: everything in one bucket, sent after backward.
        self._engine = BucketEngine(
            self._params,
            [list(reversed(range(len(self._params))))],
            process_group,
            channels=self._channels.groups,
            compression=compression,
        )
        self.plan: Plan | None = None
        self._sync = True
        self._in_backward = False
        self._backward_passes = 0
        self._profiled: list[list[float]] = []
        self._profiled_forward: list[float] = []
        self._profiled_backward: list[float] = []
        self._forward_start = 0.0
        self._forward_s = 0.0
        self._backward_start: float | None = None
        self._ready_times: list[float] = [0.0] * len(self._params)
        self._record = False
        self._comm_events: list[tuple[int, int, int, float, float]] = []
        self.last_timeline: Timeline | None = None
        for index, param in enumerate(self._params):
            param.register_post_accumulate_grad_hook(self._make_hook(index))

    # ------------------------------------------------------------------ public API

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        entered = time.perf_counter()
        if self._plan_due():
            self._replan()
        elif self._trials is not None:
            self._tune(entered)
        self._entered = entered
        syncs_buffers = self.broadcast_buffers and torch.is_grad_enabled() and self.module.training
        if syncs_buffers:
            self._receive_buffers()
        elif self._buffers_in_flight is not None and self.module.training:
            # A training-mode pass without gradients may update the buffers too: the snapshot
            # in flight would be stale, so the next training forward broadcasts afresh.
            handle = self._buffers_in_flight[0]
            if handle is not None:
                handle.wait()
            self._buffers_in_flight = None
        self._forward_start = time.perf_counter()
        output = self.module(*inputs, **kwargs)
        self._forward_s = time.perf_counter() - self._forward_start
        if syncs_buffers:
            self._send_buffers()
        self._backward_start = None
        if torch.is_grad_enabled() and self._sync:
            for tensor in _tensors_in(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._mark_backward_start)
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside the block averages them all."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def record_timeline(self, enabled: bool = True) -> None:
        """Keep each iteration's forward, per-tensor backward and per-bucket all-reduce times in
        :attr:`last_timeline` (a little overhead per bucket)."""
        self._record = enabled
        self._engine.recorder = self._on_comm if enabled else None

    @property
    def planning_done(self) -> bool:
        """Whether the buckets are final: planned, and the candidate plans tried if any were."""
        return self.plan is not None and self._trials is None

    @property
    def last_forward_start(self) -> float:
        """``time.perf_counter()`` at the start of the latest forward: :attr:`last_timeline`'s
        time origin."""
        return self._forward_start

    @property
    def cost_model(self) -> CostModel | None:
        return self._cost_model

    @property
    def parameter_names(self) -> list[str]:
        return list(self._names)

    # ------------------------------------------------------------------ hooks

    def _make_hook(self, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            if not self._sync or param.grad is None:
                return
            now = time.perf_counter()
            if not self._in_backward:
                self._in_backward = True
                if self._backward_start is None:
                    self._backward_start = now
                Variable._execution_engine.queue_callback(self._finish_backward)
            self._ready_times[index] = now
            self._engine.add(index, param.grad)

        return hook

    def _mark_backward_start(self, grad: torch.Tensor) -> None:
        now = time.perf_counter()
        if self._backward_start is None or now < self._backward_start:
            self._backward_start = now

    def _finish_backward(self) -> None:
        backward_end = time.perf_counter()
        self._in_backward = False
        averaged = self._engine.finish()
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for param, grad in zip(self._params, averaged, strict=True):
            if grad is None:
                param.grad = None
            elif param.grad is None:
                param.grad = grad.clone()
            else:
                targets.append(param.grad)
                sources.append(grad)
        # One batched copy: a Python-level copy per parameter costs more than the copying on
        # models of many small tensors.
        if targets:
            torch._foreach_copy_(targets, sources)
        self._after_backward(backward_end)
        self._engine.begin()

    def _after_backward(self, backward_end: float) -> None:
        start = self._backward_start if self._backward_start is not None else backward_end
        self._backward_passes += 1
        if self.plan is None and self._backward_passes > 1:
            # Pass 1 is a warm-up (allocator, lazy init); later ones are measured.
            self._profiled.append([t - start for t in self._ready_times])
            self._profiled_forward.append(self._forward_s)
            self._profiled_backward.append(backward_end - start)
        if self._trials is not None:
            # The iteration that began at this forward synchronised: the next forward ends it.
            self._timed_from = self._entered
        if self._record:
            self.last_timeline = self._build_timeline(start, backward_end)
        self._comm_events = []

    def _on_comm(
        self, bucket: int, channel: int, nbytes: int, launched: float, done: float
    ) -> None:
        self._comm_events.append((bucket, channel, nbytes, launched, done))

    # ------------------------------------------------------------------ planning

    def _plan_due(self) -> bool:
        return self.plan is None and len(self._profiled) >= self.profile_steps and self._sync

    def _replan(self) -> None:
        """Take the slowest rank's timings, plan on rank 0, share the plan, rebuild buckets."""
        count = len(self._params)
        local = [
            statistics.median(self._profiled_forward),
            statistics.median(self._profiled_backward),
            *[statistics.median(step[i] for step in self._profiled) for i in range(count)],
        ]
        timings = torch.tensor(
            local, dtype=torch.float64, device=collective_device(self.process_group)
        )
        # The slowest rank's times: a bucket's all-reduce completes only once every rank has
        # produced it, so the plan must fit the rank that gets there last.
        dist.all_reduce(timings, op=dist.ReduceOp.MAX, group=self.process_group)
        forward_s, backward_s, *ready = timings.tolist()
        device = self._params[0].device
        if self._cost_model is None:
            self._cost_model = fit_cost_model(self.process_group, device=device)
        if len(self._channels) > 1 and len(self._cost_model.concurrency) < len(self._channels) - 1:
            self._cost_model = fit_concurrency(
                self._channels.groups, self._cost_model, device=device
            )
        shared: list[Any] = [None]
        if self._rank == 0:
            shared[0] = self._candidate_plans(forward_s, backward_s, ready)
        dist.broadcast_object_list(shared, src=self._src, group=self.process_group)
        self._candidates = shared[0]
        self._profiled.clear()
        if len(self._candidates) > 1:
            self._trials = PlanTrials([label for *_, label in self._candidates], self.tune_steps)
            # A candidate on trial is not a choice: nothing to announce until the trials end.
            self._adopt(*self._candidates[0][:2], "")
        else:
            self._adopt(*self._candidates[0][:3])
        if self._trials is None:
            self._candidates = []

    def _adopt(self, plan: Plan, order: list[int], why: str) -> None:
        """Rebuild the buckets for ``plan`` (identical on every rank, checked), unless it is the
        plan in use already; record and announce ``why`` it was chosen."""
        if plan is not self.plan:
            self._rebuild(plan, order)
        self.channel_choice = why
        if self._rank == 0 and why:
            logger.info("interlace.DataParallel: %s", why)

    def _rebuild(self, plan: Plan, order: list[int]) -> None:
        groups = [[order[i] for i in group] for group in plan.groups]
        assignment = [list(bucket.channels) for bucket in plan.buckets]
        # The plan came from rank 0, so this holds unless a rank was built differently; if it
        # fails, every rank raises here instead of hanging on a collective later.
        check_same_everywhere(
            (plan.channels, plan.partition_bytes, assignment_of(groups, assignment)),
            "the channel plan (channels, partition threshold, bucket -> channel)",
            self.process_group,
        )
        recorder = self._engine.recorder
        self._engine = BucketEngine(
            self._params,
            groups,
            self.process_group,
            channels=self._channels.groups,
            assignment=assignment,
            compression=self.compression,
        )
        self._engine.recorder = recorder
        self.plan = plan

    # ------------------------------------------------------------------ trials

    def _tune(self, entered: float) -> None:
        """At the start of a forward: time the iteration that just ended, and switch to the next
        candidate (or the winner) when the trials say so. Every rank runs the same iterations,
        so every rank switches at the same forward."""
        assert self._trials is not None
        if not (torch.is_grad_enabled() and self.module.training):
            self._timed_from = None  # an evaluation pass in between: that span is not training
            return
        if self._timed_from is None or not self._sync:
            return
        seconds = entered - self._timed_from
        self._timed_from = None
        if not self._trials.record(seconds):
            return
        if not self._trials.finished:
            self._adopt(*self._candidates[self._trials.current][:2], "")
            return
        # The slowest rank's medians: an iteration is over only when every rank is done.
        medians = torch.tensor(
            self._trials.medians(),
            dtype=torch.float64,
            device=collective_device(self.process_group),
        )
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=self.process_group)
        labels = [label for *_, label in self._candidates]
        chosen = fastest(medians.tolist())
        self.tuning_summary = describe_trials(labels, medians.tolist(), chosen)
        self.tuning_results = [
            (label, len(plan.buckets), median)
            for (plan, *_), label, median in zip(
                self._candidates, labels, medians.tolist(), strict=True
            )
        ]
        plan, order, why, _ = self._candidates[chosen]
        if self.channels_requested == "auto":
            why = (
                f"channels='auto' kept {plan.channels} channel(s) by measured iteration time "
                f"(the planner's prediction: {why or 'one channel'})"
            )
        self._adopt(plan, order, why)
        self._trials = None
        self._candidates = []
        if self._rank == 0:
            logger.info("interlace.DataParallel: %s", self.tuning_summary)

    def _candidate_plans(
        self, forward_s: float, backward_s: float, ready: list[float]
    ) -> list[tuple[Plan, list[int], str, str]]:
        """The plans worth trying, the cost model's own first, without duplicates: with
        ``"merged"``/``"optimal"`` the same rule with larger start-ups (each bucket launched
        during backward costs that backward more than the idle-network fit knows) and DDP's
        buckets; with ``channels="auto"`` the best plan for each channel count."""
        cost = self._cost_model
        assert cost is not None
        found = [(*self._make_plan(forward_s, backward_s, ready), "the cost model's plan")]
        if self.tune_steps > 0:
            if self.bucketing in ("merged", "optimal"):
                for factor in START_UP_SCALES:
                    scaled = self._make_plan(
                        forward_s, backward_s, ready, scale_start_up(cost, factor)
                    )
                    found.append((*scaled, f"start-up x{factor:g}"))
                fixed = self._make_plan(forward_s, backward_s, ready, bucketing="fixed")
                found.append(
                    (
                        *fixed,
                        f"DDP's buckets ({self.first_bucket_cap_bytes / 1e6:g} MB first, "
                        f"{self.bucket_cap_bytes / 1e6:g} MB)",
                    )
                )
                total = sum(p.numel() * p.element_size() for p in self._params)
                for count in EVEN_BUCKET_COUNTS:
                    even = self._make_plan(
                        forward_s,
                        backward_s,
                        ready,
                        bucketing="fixed",
                        caps=(total / count, total / count),
                    )
                    found.append((*even, f"{count} even buckets"))
            if self.channels_requested == "auto":
                for count in range(1, len(self._channels) + 1):
                    on_count = self._make_plan(forward_s, backward_s, ready, channel_counts=[count])
                    found.append((*on_count, f"{count} channel(s)"))
        # One trial per distinct bucketing; a candidate found twice carries both names.
        distinct: dict[Any, tuple[Plan, list[int], str, str]] = {}
        for plan, order, why, label in found:
            key = (
                tuple(tuple(group) for group in plan.groups),
                tuple(bucket.channels for bucket in plan.buckets),
                plan.partition_bytes,
            )
            if key in distinct:
                first = distinct[key]
                distinct[key] = (*first[:3], f"{first[3]} = {label}")
            else:
                distinct[key] = (plan, order, why, label)
        return list(distinct.values())

    def _make_plan(
        self,
        forward_s: float,
        backward_s: float,
        ready: list[float],
        cost: CostModel | None = None,
        *,
        bucketing: str | None = None,
        channel_counts: list[int] | None = None,
        caps: tuple[float, float] | None = None,
    ) -> tuple[Plan, list[int], str]:
        """The plan ``bucketing`` (default: this wrapper's) makes under ``cost`` (default: the
        fitted model): over ``channel_counts`` (default: as requested), the fastest predicted,
        or one with fewer channels within :data:`AUTO_MARGIN` of it."""
        cost = cost or self._cost_model
        assert cost is not None
        bucketing = bucketing or self.bucketing
        # Ready order; ties (and tensors that never got a gradient, ready at the end) keep the
        # reverse registration order, which is how backward usually visits them.
        clamped = [min(max(value, 0.0), backward_s) for value in ready]
        order = sorted(range(len(ready)), key=lambda i: (clamped[i], -i))
        wire_scale = 0.5 if self.compression is not None else 1.0
        tensors = [
            ReadyTensor(
                self._names[i],
                int(self._params[i].numel() * self._params[i].element_size() * wire_scale),
                clamped[i],
            )
            for i in order
        ]
        if channel_counts is not None:
            counts: list[int] = channel_counts
        elif self.channels_requested == "auto":
            counts = list(range(1, len(self._channels) + 1))
        else:
            counts = [len(self._channels)]
        if self.partition_mb == "auto":
            partitions: list[float | None] = [None, *(mb * 1e6 for mb in PARTITION_CANDIDATES_MB)]
        else:
            partitions = [None if self.partition_mb is None else float(self.partition_mb) * 1e6]
        candidates = [
            make_plan(
                bucketing,
                tensors,
                cost,
                cap_bytes=caps[1] if caps else self.bucket_cap_bytes,
                first_cap_bytes=caps[0] if caps else self.first_bucket_cap_bytes,
                backward_s=max(backward_s, tensors[-1].ready_s),
                forward_s=forward_s,
                channels=count,
                partition_bytes=partition if count > 1 else None,
            )
            for count in counts
            for partition in (partitions if count > 1 else [None])
        ]
        plan = _fewest_channels_within_margin(candidates)
        return plan, order, _explain_choice(plan, candidates, self.channels_requested)

    # ------------------------------------------------------------------ wrap-time checks

    def _check_same_model_everywhere(self) -> None:
        signature = [
            (name, tuple(p.shape), str(p.dtype))
            for name, p in zip(self._names, self._params, strict=True)
        ]
        world = dist.get_world_size(self.process_group)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, signature, group=self.process_group)
        reference = gathered[0]
        for rank, theirs in enumerate(gathered):
            if theirs == reference:
                continue
            if len(theirs) != len(reference):
                raise UsageError(
                    f"rank {rank} has {len(theirs)} trainable parameters but rank 0 has "
                    f"{len(reference)}; every rank must build the same model"
                )
            for mine, other in zip(reference, theirs, strict=True):
                if mine != other:
                    raise UsageError(
                        f"parameter '{other[0]}' has shape {other[1]} ({other[2]}) on rank "
                        f"{rank} but '{mine[0]}' has shape {mine[1]} ({mine[2]}) on rank 0; "
                        "every rank must build the same model"
                    )

    def _broadcast_state(self) -> None:
        self._broadcast([*self._params, *self.module.buffers()])

    def _send_buffers(self) -> None:
        """Start broadcasting rank 0's buffers as this forward left them, for the next forward.

        DDP re-sends the buffers before every forward and waits for them. Nothing changes them
        between the end of one training forward and the start of the next (evaluation passes
        read them, they do not update them), so the same values can travel during backward,
        where the link has time, instead of in front of the next forward, where it would cost
        a start-up every iteration. A snapshot travels, so the next forward may update the
        buffers while it is in flight."""
        buffers = list(self.module.buffers())
        if not buffers:
            return
        ordered, flat = _pack_bytes(buffers)
        handle = dist.broadcast(flat, src=self._src, group=self.process_group, async_op=True)
        self._buffers_in_flight = (handle, ordered, flat)

    def _receive_buffers(self) -> None:
        """Before a training forward: rank 0's buffers, from the broadcast started after the
        previous one (or now, the first time)."""
        if self._buffers_in_flight is None:
            self._broadcast(list(self.module.buffers()))
            return
        handle, ordered, flat = self._buffers_in_flight
        self._buffers_in_flight = None
        if handle is not None:
            handle.wait()
        if self._rank != 0:
            _unpack_bytes(ordered, flat)

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values into ``tensors``, now, in one broadcast of their bytes whatever their
        dtypes (every collective pays a start-up): the state at wrap time, and the buffers when
        no snapshot is in flight."""
        if not tensors:
            return
        ordered, flat = _pack_bytes(tensors)
        dist.broadcast(flat, src=self._src, group=self.process_group)
        _unpack_bytes(ordered, flat)

    # ------------------------------------------------------------------ timeline

    def _build_timeline(self, backward_start: float, backward_end: float) -> Timeline:
        from interlace.timeline import Timeline

        timeline = Timeline(title=f"DataParallel ({self.bucketing})")
        origin = self._forward_start
        timeline.add("forward", "forward", 0.0, self._forward_s, lane="compute")
        previous = backward_start
        for index in sorted(range(len(self._params)), key=lambda i: self._ready_times[i]):
            ready = self._ready_times[index]
            if ready < backward_start:
                continue
            timeline.add(
                self._names[index], "backward", previous - origin, ready - origin, lane="compute"
            )
            previous = ready
        # A bar runs from when its all-reduce could start (launched, and the one before it on
        # the same channel done) to its completion: the time it had that channel. Time spent
        # queued behind earlier all-reduces is not drawn, so a lane reads as a channel's busy
        # periods.
        channel_free: dict[int, float] = {}
        for bucket, channel, nbytes, launched, done in sorted(self._comm_events):
            start = max(launched, channel_free.get(channel, 0.0))
            channel_free[channel] = max(done, start)
            timeline.add(
                f"bucket {bucket} ({nbytes / 1e6:.2f} MB)",
                "comm",
                start - origin,
                channel_free[channel] - origin,
                lane="all-reduce" if len(self._channels) == 1 else f"all-reduce ch{channel}",
                bytes=nbytes,
                channel=channel,
                launched_ms=round((launched - origin) * 1e3, 3),
            )
        if backward_end > previous:
            timeline.add(
                "backward (rest)",
                "backward",
                previous - origin,
                backward_end - origin,
                lane="compute",
            )
        return timeline


def _fewest_channels_within_margin(candidates: list[Plan]) -> Plan:
    """The fastest predicted plan, unless one with fewer channels is within :data:`AUTO_MARGIN`
    of it (candidates come ordered by channel count)."""
    best = min(candidates, key=lambda plan: plan.predicted_s)
    for plan in candidates:
        if plan.predicted_s <= best.predicted_s * (1 + AUTO_MARGIN):
            return plan
    return best


def _explain_choice(plan: Plan, candidates: list[Plan], requested: int | str) -> str:
    """One line: the channels and threshold chosen, and what they were weighed against."""
    split = "off" if plan.partition_bytes is None else f"{plan.partition_bytes / 1e6:g} MB"
    chosen = (
        f"{plan.channels} channel(s), partition {split}: predicted "
        f"{plan.predicted_s * 1e3:.2f} ms per iteration with {len(plan.buckets)} bucket(s)"
    )
    if requested != "auto":
        return chosen if plan.channels > 1 else ""
    best_by_count: dict[int, Plan] = {}
    for candidate in candidates:
        known = best_by_count.get(candidate.channels)
        if known is None or candidate.predicted_s < known.predicted_s:
            best_by_count[candidate.channels] = candidate
    weighed = ", ".join(
        f"k={count}: {candidate.predicted_s * 1e3:.2f} ms"
        for count, candidate in sorted(best_by_count.items())
    )
    a_terms = plan.cost.concurrency
    measured = ", ".join(
        f"a({j})={a_j * 1e3:.2f} ms c({j})={c_j:.2f}"
        for j, (a_j, c_j) in enumerate(a_terms, start=2)
    )
    return (
        f"channels='auto' chose {chosen} (weighed {weighed}; measured concurrency "
        f"{measured or 'none'}; more channels only for a predicted gain above "
        f"{AUTO_MARGIN:.0%}; a(1)={plan.cost.a * 1e3:.2f} ms)"
    )


def _pack_bytes(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``tensors``, widest elements first (so each starts at an offset its dtype can be viewed
    at), and a copy of all their bytes in one flat tensor."""
    ordered = sorted(tensors, key=lambda t: -t.element_size())
    with torch.no_grad():
        flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in ordered])
    return ordered, flat


def _unpack_bytes(ordered: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat``'s bytes back into ``ordered`` (as :func:`_pack_bytes` laid them out)."""
    pieces = torch.split(flat, [t.numel() * t.element_size() for t in ordered])
    with torch.no_grad():
        torch._foreach_copy_(
            ordered,
            [piece.view(t.dtype).view_as(t) for piece, t in zip(pieces, ordered, strict=True)],
        )


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a (possibly nested) model output."""
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            yield leaf
