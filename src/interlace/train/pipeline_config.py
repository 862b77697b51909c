"""The pipeline side of a training run's config: ``--parallel``, ``--schedule`` and the other
pipeline flags' choices, and the checks of their settings."""

from __future__ import annotations

from typing import Protocol

from interlace.comm.forward_plan import Overlap
from interlace.comm.strategies import RUNTIME_STRATEGIES, STRATEGIES
from interlace.pipeline import ASYNCHRONOUS, PLAN_BY, SCHEDULES, SPECTRAIN_BACKWARDS, SYNCHRONOUS

#: The ``--parallel`` choices: the model replicated (data parallel) or cut into stages.
PARALLELISMS = ("data", "pipeline")
#: The ``--schedule`` choices of ``--parallel pipeline`` (see interlace.pipeline.schedule).
PIPELINE_SCHEDULES = SCHEDULES
#: The ``--strategy`` choices of a replicated pipeline (``--stages``): interlace's planned buckets
#: that end inside the stage's backward-to-update span.
REPLICATED_PIPELINE_STRATEGIES = tuple(
    name
    for name in RUNTIME_STRATEGIES
    if STRATEGIES[name].bucketing is not None and STRATEGIES[name].overlap is Overlap.BACKWARD
)
#: How ``--parallel pipeline`` balances its stages (see interlace.pipeline.partition).
PARTITION_BY = PLAN_BY


class PipelineSettings(Protocol):
    """The settings of a :class:`~interlace.train.config.TrainConfig` the pipeline checks read."""

    parallel: str
    schedule: str
    microbatches: int
    batch_size: int
    stages: int | None
    strategy: str
    chunks: int
    spectrain_backward: str
    partition_by: str


def pipeline_checks(config: PipelineSettings) -> list[tuple[bool, str]]:
    """The checks of the pipeline flags, each as (passed, the one-line error when not).

    Args:
        config: the run's config.
    """
    return [
        (
            config.parallel in PARALLELISMS,
            f"unknown --parallel '{config.parallel}'; choose one of {', '.join(PARALLELISMS)}",
        ),
        (
            config.schedule in PIPELINE_SCHEDULES,
            f"unknown --schedule '{config.schedule}'; choose one of "
            f"{', '.join(PIPELINE_SCHEDULES)}",
        ),
        (config.microbatches >= 1, f"--microbatches must be >= 1, got {config.microbatches}"),
        (
            config.parallel != "pipeline"
            or config.schedule not in SYNCHRONOUS
            or config.batch_size >= config.microbatches,
            f"--batch-size {config.batch_size} cannot be cut into {config.microbatches} "
            "micro-batches; raise --batch-size or lower --microbatches",
        ),
        (
            config.stages is None or config.stages >= 1,
            f"--stages must be >= 1, got {config.stages}",
        ),
        (
            config.stages is None or config.parallel == "pipeline",
            "--stages applies to --parallel pipeline; add --parallel pipeline or drop it",
        ),
        (
            config.stages is None or config.strategy in REPLICATED_PIPELINE_STRATEGIES,
            f"--strategy {config.strategy}: a replicated pipeline averages each stage with "
            f"interlace's buckets; choose one of {', '.join(REPLICATED_PIPELINE_STRATEGIES)}",
        ),
        (config.chunks >= 1, f"--chunks must be >= 1, got {config.chunks}"),
        (
            config.chunks == 1 or config.schedule not in SYNCHRONOUS,
            f"--chunks applies to {', '.join(ASYNCHRONOUS)}; {config.schedule} cuts a "
            "mini-batch with --microbatches",
        ),
        (
            config.parallel != "pipeline"
            or config.schedule in SYNCHRONOUS
            or config.batch_size >= config.chunks,
            f"--batch-size {config.batch_size} cannot be cut into {config.chunks} chunks; raise "
            "--batch-size or lower --chunks",
        ),
        (
            config.spectrain_backward in SPECTRAIN_BACKWARDS,
            f"unknown --spectrain-backward '{config.spectrain_backward}'; choose recompute or "
            "reuse",
        ),
        (
            config.partition_by in PARTITION_BY,
            f"unknown --partition-by '{config.partition_by}'; choose one of "
            f"{', '.join(PARTITION_BY)}",
        ),
    ]
