"""What every training job does around its loop: resume, keep the run folder, save, finish.

:class:`RunRecords` holds the checkpoint a resumed run continues from, rank 0's run log (opened
with the job's header line), the progress bar and the checkpoint saves, for data-parallel and
pipelined training alike; :func:`finish_run` ends a run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from interlace.distenv import DistContext
from interlace.runlog import METRIC_COLUMNS, RunLog, new_run_dir
from interlace.train.checkpoint import (
    Position,
    Resumed,
    SaveEvery,
    describe_position,
    load_checkpoint,
    save_checkpoint,
)
from interlace.train.config import TrainConfig, applicable_settings
from interlace.train.shared import TrainResult, run_label


class RunRecords:
    """A training job's records on this rank: the checkpoint resumed, the run log, the saves.

    Made before the model (loading a checkpoint is collective, and the model needs its state);
    :meth:`open_log` once the job can describe itself.

    Args:
        config: the run's config (already validated).
        context: this rank's place in the job.
        run_dir: where rank 0 writes its records (made fresh when None).
        resume: continue ``run_dir`` from its latest checkpoint.
    """

    def __init__(
        self, config: TrainConfig, context: DistContext, run_dir: str | None, resume: bool
    ) -> None:
        self.config = config
        self.context = context
        self.run_dir = run_dir
        #: This rank's part of the checkpoint resumed; None for a fresh run.
        self.resumed: Resumed | None = load_checkpoint(run_dir or "", context) if resume else None
        #: Where training starts: the checkpoint's position, or the first step.
        self.start = self.resumed.position if self.resumed is not None else Position(1, 0, 0)
        #: When checkpoints are saved; None: never.
        self.saves = SaveEvery.parse(config.save_every) if config.save_every else None
        #: Rank 0's run log once :meth:`open_log` made it; None on the other ranks.
        self.log: RunLog | None = None
        self._record = asdict(config)

    def open_log(
        self,
        suffix: str,
        data_source: Mapping[str, object] | None,
        header: Callable[[Path], str],
        columns: Sequence[str] = METRIC_COLUMNS,
    ) -> RunLog | None:
        """Open rank 0's run folder and print the job's header, and where it resumes from.

        Args:
            suffix: the last part of a new folder's name, e.g. ``n4``.
            data_source: how a generated data set was made (see :func:`open_run_log`).
            header: the job's first line, given the run folder.
            columns: the metrics' columns.

        Returns:
            The run log on rank 0; None on the other ranks.
        """
        self.log = open_run_log(
            self.config,
            self.context,
            self.run_dir,
            suffix,
            resume_epoch=self.start.epoch if self.resumed is not None else None,
            data_source=data_source,
            columns=columns,
        )
        if self.log is not None:
            print(header(self.log.path), flush=True)
            if self.resumed is not None:
                print(
                    f"resuming from {self.resumed.path} ({describe_position(self.start)})",
                    flush=True,
                )
        return self.log

    def progress_bar(self, total_steps: int) -> tqdm[Any]:
        """Rank 0's progress bar over the run's optimizer steps (off elsewhere, or no terminal).

        Args:
            total_steps: optimizer steps of the whole run.
        """
        show = self.context.is_main and self.config.progress and sys.stderr.isatty()
        return tqdm(
            total=total_steps,
            initial=self.start.global_step,
            disable=not show,
            unit="step",
            dynamic_ncols=True,
        )

    def save(self, position: Position, state: dict[str, Any]) -> None:
        """Save a checkpoint of every rank's ``state`` at ``position``; collective.

        Args:
            position: where in the data the run is.
            state: this rank's state.
        """
        path = self.log.path if self.log is not None else None
        save_checkpoint(path, self.context, position, self._record, state)


def open_run_log(
    config: TrainConfig,
    context: DistContext,
    run_dir: str | None,
    suffix: str,
    resume_epoch: int | None = None,
    *,
    data_source: Mapping[str, object] | None = None,
    columns: Sequence[str] = METRIC_COLUMNS,
) -> RunLog | None:
    """Rank 0's run folder; None on the other ranks.

    Args:
        config: the run's config, recorded in ``config.json`` with the environment.
        context: this rank's place in the job.
        run_dir: the folder to write; None makes a new one named after model, data and
            ``suffix`` under ``config.runs_dir``.
        suffix: the last part of a new folder's name, e.g. ``n4``.
        resume_epoch: continue ``run_dir`` from this epoch (see :meth:`RunLog.resume`).
        data_source: how a generated data set was made (its generator's arguments and seed),
            recorded as ``data_source``; None or empty for fixed data.
        columns: the metrics' columns of a new folder (a resumed one keeps its own).
    """
    if not context.is_main:
        return None
    if resume_epoch is not None:
        assert run_dir is not None
        return RunLog.resume(run_dir, resume_epoch)
    path = (
        Path(run_dir)
        if run_dir
        else new_run_dir(
            config.runs_dir, f"{run_label(config.model)}-{run_label(config.data)}-{suffix}"
        )
    )
    record = _config_record(config, context)
    if data_source:
        record["data_source"] = dict(data_source)
    return RunLog(path, record, columns)


def finish_run_log(
    log: RunLog,
    title: str,
    accuracy: float,
    epochs: int,
    samples_per_s: float,
    perplexities: tuple[float, float] | None = None,
) -> None:
    """Draw the curves and print the final line every training job ends with.

    Args:
        log: rank 0's run log.
        title: the curves' title.
        accuracy: the final test accuracy, in [0, 1].
        epochs: epochs trained.
        samples_per_s: the last epoch's throughput.
        perplexities: a language model's final held-out perplexity and its corpus's unigram
            perplexity; None for a classifier.
    """
    where = f"metrics in {log.metrics_path}, curves in {log.curves_path}"
    if perplexities is None:
        log.plot(title)
        print(
            f"final test accuracy: {100 * accuracy:.2f}% after {epochs} epochs "
            f"({samples_per_s:.1f} samples/s); {where}",
            flush=True,
        )
        return
    held_out, unigram = perplexities
    log.plot(title, reference=(f"unigram {unigram:.2f}", unigram))
    print(
        f"final held-out perplexity: {held_out:.3f} after {epochs} epochs (unigram perplexity "
        f"of the corpus: {unigram:.3f}, ratio {held_out / unigram:.3f}; next-token accuracy "
        f"{100 * accuracy:.2f}%, {samples_per_s:.1f} samples/s); {where}",
        flush=True,
    )


def finish_run(
    log: RunLog | None,
    title: str,
    *,
    accuracy: float,
    train_loss: float,
    samples_per_s: float,
    epochs: int,
    perplexities: tuple[float, float] | None = None,
) -> TrainResult:
    """End a run: rank 0 closes its run folder (:func:`finish_run_log`); every rank reports.

    Args:
        log: rank 0's run log; None on the other ranks.
        title: the curves' title.
        accuracy: the final test accuracy, in [0, 1].
        train_loss: the last epoch's mean training loss.
        samples_per_s: the last epoch's throughput.
        epochs: epochs trained.
        perplexities: a language model's final held-out and unigram perplexities; None for a
            classifier.
    """
    if log is not None:
        finish_run_log(log, title, accuracy, epochs, samples_per_s, perplexities)
    return TrainResult(
        final_test_accuracy=accuracy,
        final_train_loss=train_loss,
        samples_per_s=samples_per_s,
        run_dir=str(log.path) if log is not None else None,
        epochs=epochs,
        final_test_perplexity=perplexities[0] if perplexities else None,
        unigram_perplexity=perplexities[1] if perplexities else None,
    )


def _config_record(config: TrainConfig, context: DistContext) -> dict[str, object]:
    record = applicable_settings(config)
    record.update(
        world_size=context.world_size,
        backend=context.backend,
        device=str(context.device),
        link=os.environ.get("INTERLACE_LINK", "loopback"),
        torch=torch.__version__,
    )
    return record
