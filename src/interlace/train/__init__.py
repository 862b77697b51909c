"""The training job above the libraries: config, data-parallel and pipelined training on ranks."""

from __future__ import annotations

from interlace.train.config import (
    DEFAULT_LR,
    OPTIMIZERS,
    PRECISIONS,
    TrainConfig,
    applicable_settings,
)
from interlace.train.data_parallel import evaluate, make_kfac, train_data_parallel
from interlace.train.job import train_rank
from interlace.train.pipeline import train_pipeline
from interlace.train.pipeline_config import PARALLELISMS, PARTITION_BY, PIPELINE_SCHEDULES
from interlace.train.records import RunRecords, finish_run, finish_run_log, open_run_log
from interlace.train.schedule import optimizer_with_schedule, steps_in_epoch, warmup_steps_of
from interlace.train.shared import TrainResult, WarmupCosine, run_label

__all__ = [
    "DEFAULT_LR",
    "OPTIMIZERS",
    "PARALLELISMS",
    "PARTITION_BY",
    "PIPELINE_SCHEDULES",
    "PRECISIONS",
    "RunRecords",
    "TrainConfig",
    "TrainResult",
    "WarmupCosine",
    "applicable_settings",
    "evaluate",
    "finish_run",
    "finish_run_log",
    "make_kfac",
    "open_run_log",
    "optimizer_with_schedule",
    "run_label",
    "steps_in_epoch",
    "train_data_parallel",
    "train_pipeline",
    "train_rank",
    "warmup_steps_of",
]
