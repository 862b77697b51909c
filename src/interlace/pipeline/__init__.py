"""Pipeline model parallelism: partitioning, schedules, weight prediction and the runtime.

``interlace.pipeline.predict_weights(weight, momentum_buffer, lr, s)`` and the other public names
of the submodules are importable from here.
"""

from __future__ import annotations

from interlace.pipeline.partition import (
    PLAN_BY,
    StagePlan,
    balance_stages,
    pipeline_blocks,
    plan_stages,
    profile_block_times,
    stage_module,
)
from interlace.pipeline.predict import (
    check_predictable,
    predict_weights,
    predicted_parameters,
    version_difference,
)
from interlace.pipeline.runtime import (
    SPECTRAIN_BACKWARDS,
    EvalResult,
    PipelineStage,
    StepResult,
)
from interlace.pipeline.schedule import (
    ASYNCHRONOUS,
    SCHEDULES,
    SYNCHRONOUS,
    Action,
    Op,
    Schedule,
    Weights,
    async_one_f_one_b,
    build_schedule,
    gpipe,
    one_f_one_b,
)
from interlace.pipeline.stages import LocalStage, local_stage

__all__ = [
    "ASYNCHRONOUS",
    "PLAN_BY",
    "SCHEDULES",
    "SPECTRAIN_BACKWARDS",
    "SYNCHRONOUS",
    "Action",
    "EvalResult",
    "LocalStage",
    "Op",
    "PipelineStage",
    "Schedule",
    "StagePlan",
    "StepResult",
    "Weights",
    "async_one_f_one_b",
    "balance_stages",
    "build_schedule",
    "check_predictable",
    "gpipe",
    "local_stage",
    "one_f_one_b",
    "pipeline_blocks",
    "plan_stages",
    "predict_weights",
    "predicted_parameters",
    "profile_block_times",
    "stage_module",
    "version_difference",
]
