"""Pipeline model parallelism: partitioning, schedules, weight prediction and the runtime.

``interlace.pipeline.predict_weights(weight, momentum_buffer, lr, s)`` and the other public names
of the submodules are importable from here. The torch-backed ones are imported on first use, so
the simulator's use of the schedules and the stage balancing needs no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from interlace.pipeline.balance import balance_stages
from interlace.pipeline.cut import StageCut, cut_stages
from interlace.pipeline.layout import MESH_DIM_NAMES, PipelineLayout
from interlace.pipeline.schedule import (
    ASYNCHRONOUS,
    SCHEDULE_TYPES,
    SCHEDULES,
    SYNCHRONOUS,
    Action,
    AsyncOneFOneB,
    GPipe,
    Naive,
    OneFOneB,
    Op,
    PipeDream,
    Schedule,
    SpecTrain,
    SpecTrainReuse,
    Weights,
    async_one_f_one_b,
    build_schedule,
    gpipe,
    one_f_one_b,
    reuses_forward_graph,
    same_weights,
    schedule_type,
    stashes_weights,
    version_difference,
)

if TYPE_CHECKING:
    from interlace.pipeline.partition import (
        PLAN_BY,
        StagePlan,
        pipeline_blocks,
        plan_stages,
        profile_block_times,
        stage_module,
    )
    from interlace.pipeline.predict import (
        check_predictable,
        predict_weights,
        predicted_parameters,
    )
    from interlace.pipeline.replication import (
        ReplicaAverager,
        ReplicaGroups,
        StageDataParallel,
        replicated,
    )
    from interlace.pipeline.runtime import (
        SPECTRAIN_BACKWARDS,
        EvalResult,
        PipelineStage,
        StepResult,
    )
    from interlace.pipeline.stages import LocalStage, local_stage

__all__ = [
    "ASYNCHRONOUS",
    "MESH_DIM_NAMES",
    "PLAN_BY",
    "SCHEDULES",
    "SCHEDULE_TYPES",
    "SPECTRAIN_BACKWARDS",
    "SYNCHRONOUS",
    "Action",
    "AsyncOneFOneB",
    "EvalResult",
    "GPipe",
    "LocalStage",
    "Naive",
    "OneFOneB",
    "Op",
    "PipeDream",
    "PipelineLayout",
    "PipelineStage",
    "ReplicaAverager",
    "ReplicaGroups",
    "Schedule",
    "SpecTrain",
    "SpecTrainReuse",
    "StageCut",
    "StageDataParallel",
    "StagePlan",
    "StepResult",
    "Weights",
    "async_one_f_one_b",
    "balance_stages",
    "build_schedule",
    "check_predictable",
    "cut_stages",
    "gpipe",
    "local_stage",
    "one_f_one_b",
    "pipeline_blocks",
    "plan_stages",
    "predict_weights",
    "predicted_parameters",
    "profile_block_times",
    "replicated",
    "reuses_forward_graph",
    "same_weights",
    "schedule_type",
    "stage_module",
    "stashes_weights",
    "version_difference",
]

#: The module each torch-backed public name comes from.
_LAZY = {
    **dict.fromkeys(
        (
            "PLAN_BY",
            "StagePlan",
            "pipeline_blocks",
            "plan_stages",
            "profile_block_times",
            "stage_module",
        ),
        "interlace.pipeline.partition",
    ),
    **dict.fromkeys(
        ("check_predictable", "predict_weights", "predicted_parameters"),
        "interlace.pipeline.predict",
    ),
    **dict.fromkeys(
        ("SPECTRAIN_BACKWARDS", "EvalResult", "PipelineStage", "StepResult"),
        "interlace.pipeline.runtime",
    ),
    **dict.fromkeys(("LocalStage", "local_stage"), "interlace.pipeline.stages"),
    **dict.fromkeys(
        ("ReplicaAverager", "ReplicaGroups", "StageDataParallel", "replicated"),
        "interlace.pipeline.replication",
    ),
}


def __getattr__(name: str) -> Any:
    """A torch-backed public name, imported on first use.

    Args:
        name: The attribute asked for.
    """
    if name not in _LAZY:
        raise AttributeError(f"module 'interlace.pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
