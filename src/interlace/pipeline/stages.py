"""This rank's stage of a model, cut by one plan that every rank agrees on (rank 0's), and the
check that the stages agree on how they run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from interlace.comm.agree import check_agreement
from interlace.comm.cost import CostModel
from interlace.errors import UsageError
from interlace.pipeline.cut import StageCut, stage_cut
from interlace.pipeline.layout import PipelineLayout
from interlace.pipeline.partition import (
    StagePlan,
    pipeline_blocks,
    plan_stages,
    stage_module,
)


@dataclass(frozen=True)
class LocalStage:
    """This rank's part of a pipelined model.

    Args:
        module: this rank's blocks.
        plan: the plan every rank cut by (rank 0's).
        stage: this rank's stage, from 0.
        num_stages: stages in the pipeline.
    """

    module: nn.Sequential
    plan: StagePlan
    stage: int
    num_stages: int


def _block_signature(blocks: nn.Sequential) -> list[tuple[str, int]]:
    return [(type(block).__name__, sum(p.numel() for p in block.parameters())) for block in blocks]


def local_stage(
    model: nn.Module,
    *,
    num_stages: int,
    stage: int,
    by: StageCut | str = StageCut.AUTO,
    sample: Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    data_parallel: dist.ProcessGroup | None = None,
    cost: CostModel | None = None,
    batch: int | None = None,
) -> LocalStage:
    """Cut ``model`` into ``num_stages`` stages by rank 0's plan and return stage ``stage``.

    ``by`` and ``sample`` are :func:`~interlace.pipeline.partition.plan_stages`'s. Every rank of
    ``group`` (the default group when None) must call it; with a one-rank world (no process
    group) the local plan is used. When ``group`` holds more ranks than ``num_stages``, it is
    ``R = size / num_stages`` replicas of the pipeline (:class:`~interlace.pipeline.layout.
    PipelineLayout`'s placement); the default ``by="auto"`` then cuts by time plus each stage's
    all-reduce over its replicas, priced on ``cost`` or on a cost model fitted on the stage's
    replica group (``data_parallel``; when None, groups made here for the fit and destroyed).

    Args:
        model: the whole model, built the same way on every rank.
        num_stages: stages in the pipeline.
        stage: the stage to keep, from 0.
        by: a StageCut or its name ("time", "params", "time+allreduce", "auto").
        sample: a representative micro-batch; required unless by="params".
        group: the process group whose rank 0 plans (the default group when None).
        data_parallel: this rank's stage replica group (``ReplicaGroups.data_parallel``).
        cost: the stage group's all-reduce price (default: fitted, collectively).
        batch: samples per mini-batch through one replica (default: the sample's).
    """
    blocks = pipeline_blocks(model)
    if num_stages > len(blocks):
        raise UsageError(
            f"the model has {len(blocks)} blocks, too few for {num_stages} pipeline stages; "
            "use fewer stages (-n) or a deeper model"
        )
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    size = dist.get_world_size(group) if distributed else 1
    replicas = max(size // num_stages, 1)
    rule = stage_cut(by).resolved(replicas)
    if rule is StageCut.TIME_ALLREDUCE and replicas > 1 and cost is None:
        # Collective on every rank, before rank 0 plans alone.
        cost = _fit_stage_cost(PipelineLayout.for_world(size, num_stages), group, data_parallel)
    plan: StagePlan | None = None
    if not distributed or dist.get_rank(group) == 0:
        plan = plan_stages(
            blocks, num_stages, by=rule, sample=sample, replicas=replicas, cost=cost, batch=batch
        )
    if distributed:
        shared: list[object] = [plan, _block_signature(blocks)]
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0) if group else 0)
        plan = shared[0]  # type: ignore[assignment]
        if shared[1] != _block_signature(blocks):
            raise UsageError(
                f"rank {dist.get_rank()} built a model whose pipeline blocks differ from rank "
                "0's; every rank must build the same model"
            )
    assert isinstance(plan, StagePlan)
    return LocalStage(stage_module(blocks, plan, stage), plan, stage, num_stages)


def _fit_stage_cost(
    layout: PipelineLayout,
    group: dist.ProcessGroup | None,
    data_parallel: dist.ProcessGroup | None,
) -> CostModel:
    """The all-reduce cost model of this rank's stage replica group, as ReplicaAverager fits it.

    Collective over the job (``group`` None) or over ``data_parallel``. Every rank fits on its
    own stage group at once (the comm core's cache makes a repeat instant); rank 0's plan is the
    one broadcast, so the ranks agree whatever they measured.
    """
    from interlace.comm.calibrate import fit_cost_model  # noqa: PLC0415

    if data_parallel is not None:
        return fit_cost_model(data_parallel)
    if group is not None:
        raise UsageError(
            "local_stage: a replicated pipeline cut by time+allreduce over a process group other "
            "than the default one needs data_parallel= (the stage's replica group) or cost="
        )
    members = [layout.stage_ranks(s) for s in range(layout.stages)]
    rank = dist.get_rank()
    # new_group is collective over the job: every rank makes every group, in the same order.
    made = [dist.new_group(ranks) for ranks in members]
    try:
        mine = next(g for g, ranks in zip(made, members, strict=True) if rank in ranks)
        return fit_cost_model(mine)
    finally:
        for made_group in made:
            if made_group is not None and made_group != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(made_group)


def check_stages_agree(
    *,
    stage: int,
    num_stages: int,
    ranks: Sequence[int],
    group: dist.ProcessGroup | None,
    schedule: str,
    synchronous: bool,
    microbatches: int,
    chunks: int,
) -> None:
    """Compare, across the stages, what decides the messages they exchange; collective.

    :class:`~interlace.pipeline.runtime.PipelineStage` calls it at the end of construction, on
    every rank of ``group``: no message is in flight yet and each rank gets there before its
    first send or receive, so the comparison cannot cross the pipeline's own traffic.

    Args:
        stage: this rank's stage.
        num_stages: stages in the pipeline.
        ranks: the global rank of each stage.
        group: the process group the stages talk over (None: the default group).
        schedule: the schedule's name (SpecTrain's backward rule is part of it).
        synchronous: whether the schedule flushes (it then cuts micro-batches, else chunks).
        microbatches: micro-batches per mini-batch (synchronous schedules).
        chunks: pieces per mini-batch (asynchronous schedules).

    Raises:
        UsageError: naming the setting and the ranks that disagree, or the stage or group
            that does not fit the pipeline.
    """
    if not dist.is_initialized():
        raise UsageError(
            f"a pipeline of {num_stages} stages needs a process group; call "
            "torch.distributed.init_process_group (or interlace.distenv.init_distributed) on "
            "every stage first"
        )
    size = dist.get_world_size(group)
    if size != num_stages:
        # Checked before the collective: ranks outside the pipeline would never join it.
        raise UsageError(
            f"PipelineStage: the process group has {size} ranks but num_stages is {num_stages}; "
            "every rank of the group holds one stage (pass group= a group of the stages' ranks)"
        )
    settings: dict[str, Any] = {
        "schedule": schedule,
        "num_stages": num_stages,
        "ranks": list(ranks),
    }
    # Compared only where they count: a synchronous schedule takes no chunks, an asynchronous
    # one no micro-batches.
    if synchronous:
        settings["microbatches"] = microbatches
    else:
        settings["chunks"] = chunks
    check_agreement("PipelineStage", settings, process_group=group)
    rank = dist.get_rank()
    if ranks[stage] != rank:
        raise UsageError(
            f"PipelineStage: rank {rank} was given stage {stage}, which ranks={list(ranks)} puts "
            f"on rank {ranks[stage]}; give each rank its own position in ranks as stage="
        )
