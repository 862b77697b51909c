"""The training job's entry point on each rank: data parallel or pipelined, as the config says."""

from __future__ import annotations

from interlace.distenv import finish_distributed, init_distributed
from interlace.train.config import TrainConfig
from interlace.train.data_parallel import train_data_parallel
from interlace.train.pipeline import train_pipeline
from interlace.train.shared import TrainResult


def train_rank(
    config: TrainConfig, run_dir: str | None = None, resume: bool = False
) -> TrainResult:
    """Train on this rank; the job's ranks cooperate through torch.distributed.

    ``interlace train -n N`` starts N ranks through the launcher; the same function runs
    unchanged under ``torchrun``. Rank 0 shows a progress bar, prints one line per epoch and
    writes the run folder.

    Args:
        config: the run's config; validated here first.
        run_dir: where rank 0 writes its records (made fresh when None).
        resume: continue ``run_dir`` from its latest checkpoint; ``config`` must be the one
            saved in it (:func:`interlace.train.checkpoint.read_header` reads it).

    Returns:
        The same :class:`TrainResult` on every rank (``run_dir`` set on rank 0 only).
    """
    config.validate()
    context = init_distributed()
    try:
        if config.parallel == "pipeline":
            return train_pipeline(config, context, run_dir, resume)
        return train_data_parallel(config, context, run_dir, resume)
    finally:
        finish_distributed()
