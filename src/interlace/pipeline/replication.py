"""Replicated pipelines: the job's ranks as stages x replicas, and each stage's gradients averaged
over its replicas by the comm core's bucket engine while the stage's backward runs.

:func:`replicated` makes the process groups of a :class:`~interlace.pipeline.layout.PipelineLayout`
(a torch ``DeviceMesh`` with dimensions ``("dp", "pp")``); :class:`StageDataParallel` is what
:class:`~interlace.pipeline.runtime.PipelineStage` takes as ``data_parallel=``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from interlace.comm.channels import Channels
from interlace.comm.choose import Candidate, PlanRequest, Timings, best_plan
from interlace.comm.cost import CostModel
from interlace.comm.engine import BucketEngine
from interlace.comm.plan import Bucketing
from interlace.distenv import collective_device
from interlace.dp.options import plan_request
from interlace.dp.replicas import broadcast_from_first
from interlace.errors import UsageError
from interlace.pipeline.layout import MESH_DIM_NAMES, PipelineLayout

__all__ = ["ReplicaAverager", "ReplicaGroups", "StageDataParallel", "replicated"]


@dataclass(frozen=True)
class ReplicaGroups:
    """This rank's place in a replicated pipeline and the process groups it talks over.

    Args:
        layout: The stages x replicas of the job.
        rank: This rank (global).
        pipeline: The group of this rank's pipeline (its stages' messages, its scores); None
            for the default group (one replica).
        data_parallel: The group of this stage's replicas (its gradient all-reduces); None with
            one replica.
        mesh: The torch ``DeviceMesh`` the groups come from, or None when made by hand.
    """

    layout: PipelineLayout
    rank: int
    pipeline: dist.ProcessGroup | None
    data_parallel: dist.ProcessGroup | None
    mesh: Any = None

    @property
    def stage(self) -> int:
        """The stage this rank holds."""
        return self.layout.stage_of(self.rank)

    @property
    def replica(self) -> int:
        """The pipeline replica this rank belongs to."""
        return self.layout.replica_of(self.rank)

    @property
    def ranks(self) -> list[int]:
        """The global ranks of this rank's pipeline, stage 0 first (``PipelineStage(ranks=)``)."""
        return self.layout.pipeline_ranks(self.replica)

    @property
    def is_first(self) -> bool:
        """Whether this rank holds stage 0 (it reads the inputs)."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (it reads the targets)."""
        return self.stage == self.layout.stages - 1


def replicated(
    stages: int | PipelineLayout, *, gpus_per_node: int | None = None, use_mesh: bool = True
) -> ReplicaGroups:
    """Cut the job's ranks into pipelines of ``stages`` stages and make their process groups.

    Collective over the whole job: every rank calls it at the same point with the same
    arguments. Rank ``r`` holds stage ``r % stages`` of replica ``r // stages`` (torch's
    ``DeviceMesh`` convention, dimensions ``("dp", "pp")``): a pipeline's stages on
    neighbouring ranks, a stage's replicas ``stages`` ranks apart.

    Args:
        stages: Stages per pipeline (dividing the ranks), or a layout for the job's ranks.
        gpus_per_node: Ranks per node, recorded in the layout (for its description).
        use_mesh: Make the groups with ``torch.distributed.device_mesh.init_device_mesh``; with
            False, by ``torch.distributed.new_group`` for each pipeline and each stage, in
            the same order on every rank.

    Raises:
        UsageError: Without a process group, or when the stages or the layout do not fit the
            ranks.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError(
            "a replicated pipeline needs a process group: call "
            "torch.distributed.init_process_group() first (torchrun or `interlace launch`)"
        )
    world = dist.get_world_size()
    if isinstance(stages, PipelineLayout):
        layout = PipelineLayout.from_mesh((stages.replicas, stages.stages), world)
        layout = PipelineLayout(layout.stages, layout.replicas, stages.gpus_per_node)
    else:
        layout = PipelineLayout.for_world(world, stages, gpus_per_node)
    rank = dist.get_rank()
    if layout.replicas == 1:
        return ReplicaGroups(layout, rank, None, None)
    if use_mesh:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

        mesh = init_device_mesh(
            collective_device().type,
            (layout.replicas, layout.stages),
            mesh_dim_names=MESH_DIM_NAMES,
        )
        return ReplicaGroups(layout, rank, mesh.get_group("pp"), mesh.get_group("dp"), mesh)
    pipeline_group: dist.ProcessGroup | None = None
    stage_group: dist.ProcessGroup | None = None
    # Every rank creates every group, in the same order: new_group is collective over the job.
    for replica in range(layout.replicas):
        made = dist.new_group(layout.pipeline_ranks(replica))
        if replica == layout.replica_of(rank):
            pipeline_group = made
    for stage in range(layout.stages):
        made = dist.new_group(layout.stage_ranks(stage))
        if stage == layout.stage_of(rank):
            stage_group = made
    return ReplicaGroups(layout, rank, pipeline_group, stage_group)


@dataclass(frozen=True)
class StageDataParallel:
    """How a stage averages its gradients over its replicas: DataParallel's bucket options.

    The first update sends every gradient in one bucket after the stage's backward, timing when
    each gradient is ready; from the second on the buckets are ``bucketing``'s plan for those
    times under the cost model (fitted on ``group`` when None), as DataParallel plans its own.

    With ``broadcast_buffers`` (DataParallel's and DDP's option, on by default) every update
    also copies replica 0's buffers (BatchNorm statistics) to the other replicas, in one
    broadcast, so the replicas evaluate alike and any replica's checkpoint is the same. Once per
    update rather than before every forward as DDP does: a stage runs many micro-batch forwards
    per update, a training forward normalises with its batch's own statistics, and after the
    last update of :meth:`~interlace.pipeline.runtime.PipelineStage.run` no forward is left,
    so the replicas leave every ``run`` with replica 0's buffers.

    Args:
        group: The stage's replicas (``ReplicaGroups.data_parallel``).
        bucketing: The bucket planner (a :class:`~interlace.comm.plan.Bucketing` or its name:
            ``merged`` is MG-WFBP, ``fixed`` DDP's caps).
        bucket_cap_mb: The cap of ``fixed`` buckets, MB.
        first_bucket_cap_mb: The first ``fixed`` bucket's cap, MB.
        channels: Process groups the buckets travel on, or ``"auto"``.
        partition_mb: Split buckets above this many MB across channels; None or ``"auto"``.
        compression: ``"fp16"`` or ``"bf16"``: float32 buckets travel in that type; None.
        cost_model: The all-reduce's price (None: fitted on ``group`` at the first update).
        broadcast_buffers: Replica 0's buffers to every replica at construction and at every
            update; False leaves each replica's buffers its own, from construction on.
    """

    group: dist.ProcessGroup | None
    bucketing: Bucketing | str = Bucketing.MERGED
    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    channels: int | str = 1
    partition_mb: float | str | None = "auto"
    compression: str | None = None
    cost_model: CostModel | None = None
    broadcast_buffers: bool = True

    def request(self) -> PlanRequest:
        """The options checked, as the comm core's plan choice takes them.

        Raises:
            UsageError: Naming the option that is wrong.
        """
        if not isinstance(self.broadcast_buffers, bool):
            raise UsageError(
                f"broadcast_buffers must be True or False, got {self.broadcast_buffers!r}"
            )
        return plan_request(
            bucketing=self.bucketing,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_cap_mb=self.first_bucket_cap_mb,
            channels=self.channels,
            partition_mb=self.partition_mb,
            compression=self.compression,
            tune_steps=0,
            profile_steps=None,
        )


class ReplicaAverager:
    """One stage's gradient average over its replicas, bucket by bucket during its backward.

    :class:`~interlace.pipeline.runtime.PipelineStage` calls :meth:`arm` before the last
    backward ahead of an update (hooks on the tensors that backward's gradients land on: the
    parameters, or the weight copies a prediction or a stash made), :meth:`disarm` after it
    (every bucket not yet sent goes out), both through :meth:`armed`, and :meth:`apply` at the
    update, which waits for the averages and puts them in the parameters' ``.grad``.

    Args:
        module: The stage's module.
        options: The bucket options and the replicas' group.
    """

    def __init__(self, module: nn.Module, options: StageDataParallel) -> None:
        self.options = options
        self.request = options.request()
        self.group = options.group
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise UsageError("a replicated pipeline stage needs trainable parameters")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.channels = Channels(self.request.channel_groups, self.group)
        self.cost_model = options.cost_model
        # The buffers replica 0 sends at every update (none without ``broadcast_buffers``),
        # written through ``.data``: a graph still in flight saved them (BatchNorm's backward
        # takes its running statistics, unread in training mode), and a write to the tensors
        # themselves would fail that backward's version check, as BatchNorm's own update does not.
        self.buffers = [b.data for b in module.buffers()] if options.broadcast_buffers else []
        # The replicas start from replica 0's weights and buffers, as DDP's wrapper does.
        broadcast_from_first([*(p.data for p in module.parameters()), *self.buffers], self.group)
        #: The plan in use (None until the first update has been timed).
        self.candidate: Candidate | None = None
        self.engine = self._engine([list(reversed(range(len(self.params))))], None)
        self._handles: list[Any] = []
        self._arrived: set[int] = set()
        self._ready: list[float] = [0.0] * len(self.params)
        self._armed_at = 0.0
        self._backward_s = 0.0

    def _engine(self, groups: Sequence[Sequence[int]], launches: Any) -> BucketEngine:
        return BucketEngine(
            self.params,
            groups,
            self.group,
            channels=self.channels.groups,
            launches=launches,
            compression=self.request.compression,
        )

    @property
    def buckets(self) -> list[list[str]]:
        """The parameters' names in each bucket, in launch order."""
        return [[self.names[i] for i in group] for group in self.engine.groups]

    def arm(self, tensors: Sequence[Tensor]) -> None:
        """Send each gradient to its bucket as the coming backward accumulates it.

        Args:
            tensors: Where each parameter's gradient lands (the parameter or its copy), in
                the parameters' order.
        """
        self._arrived = set()
        self._armed_at = time.perf_counter()
        for index, tensor in enumerate(tensors):
            self._handles.append(tensor.register_post_accumulate_grad_hook(self._hook(index)))

    @contextmanager
    def armed(self, leaves: dict[str, Tensor] | None) -> Iterator[None]:
        """:meth:`arm` for the backward run inside the block, :meth:`disarm` after it.

        Args:
            leaves: the weight copies that backward's graph is over, by parameter name (None:
                the parameters themselves).
        """
        tensors = self.params if leaves is None else [leaves[n] for n in self.names]
        self.arm(tensors)
        try:
            yield
        finally:
            self.disarm(tensors)

    def _hook(self, index: int) -> Any:
        def hook(tensor: Tensor) -> None:
            self._ready[index] = time.perf_counter() - self._armed_at
            self._arrived.add(index)
            assert tensor.grad is not None
            self.engine.add(index, tensor.grad)

        return hook

    def disarm(self, tensors: Sequence[Tensor]) -> None:
        """The backward is over: gradients that came earlier (and not in this backward) join
        their buckets, and every bucket not sent yet goes out.

        Args:
            tensors: As given to :meth:`arm`.
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._backward_s = time.perf_counter() - self._armed_at
        for index, tensor in enumerate(tensors):
            if index in self._arrived:
                continue
            self._ready[index] = self._backward_s
            if tensor.grad is not None:
                self.engine.add(index, tensor.grad)
        self.engine.close()

    def apply(self) -> None:
        """Wait for every bucket and write the averages into the parameters' ``.grad`` (None
        where no replica had a gradient); copy replica 0's buffers to the others (with
        ``broadcast_buffers``); then plan the buckets if not planned yet."""
        averaged = self.engine.finish()
        broadcast_from_first(self.buffers, self.group)
        for param, grad in zip(self.params, averaged, strict=True):
            if grad is None:
                param.grad = None
            elif param.grad is None or param.grad.shape != grad.shape:
                param.grad = grad.clone()
            else:
                param.grad.copy_(grad)
        if self.candidate is None:
            self._plan()
        self.engine.begin()

    def _plan(self) -> None:
        """Plan the buckets on the slowest replica's ready times (rank 0 of the group's plan)."""
        timings = torch.tensor(
            [*self._ready, self._backward_s],
            dtype=torch.float64,
            device=collective_device(self.group),
        )
        dist.all_reduce(timings, op=dist.ReduceOp.MAX, group=self.group)
        *ready, backward_s = timings.tolist()
        if self.cost_model is None:
            from interlace.comm.calibrate import fit_cost_model  # noqa: PLC0415

            self.cost_model = fit_cost_model(self.group, device=self.params[0].device)
        measured = Timings(
            tuple(self.names),
            tuple(p.numel() * p.element_size() for p in self.params),
            0.0,
            backward_s,
            tuple(ready),
        )
        shared: list[Any] = [best_plan(self.request, measured, self.cost_model)]
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(shared, src=source, group=self.group)
        self.candidate = shared[0]
        assert self.candidate is not None
        self.engine = self._engine(self.candidate.groups, self.candidate.plan.launches)

    def close(self) -> None:
        """Destroy the channels' process groups made here."""
        self.channels.close()


def stage_data_parallel(
    value: StageDataParallel | dist.ProcessGroup | None,
) -> StageDataParallel | None:
    """``PipelineStage(data_parallel=)`` as options: a group alone takes the defaults.

    Args:
        value: Options, a process group of the stage's replicas, or None.
    """
    if value is None or isinstance(value, StageDataParallel):
        return value
    if isinstance(value, dist.ProcessGroup):
        return StageDataParallel(value)
    raise UsageError(
        f"data_parallel must be a StageDataParallel, a process group or None, got "
        f"{type(value).__name__}"
    )
