"""What a training run is asked to do and what it reports, and the pieces every job shares.

The config and its checks, the result, the warm-up + cosine learning-rate schedule, the run
folder's opening and closing, and folder-safe labels of model and data specs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from interlace.comm.engine import COMPRESSIONS
from interlace.comm.strategies import RUNTIME_STRATEGIES
from interlace.distenv import DistContext
from interlace.errors import UsageError
from interlace.kfac.decomp import COMPUTE_METHODS
from interlace.pipeline import ASYNCHRONOUS, PLAN_BY, SCHEDULES, SPECTRAIN_BACKWARDS, SYNCHRONOUS
from interlace.runlog import RunLog, new_run_dir
from interlace.strategies import parse_channels
from interlace.train.checkpoint import SaveEvery

#: The ``--optimizer`` choices: plain SGD with momentum, or K-FAC in front of it.
OPTIMIZERS = ("sgd", "kfac")
#: The ``--parallel`` choices: the model replicated (data parallel) or cut into stages.
PARALLELISMS = ("data", "pipeline")
#: The ``--schedule`` choices of ``--parallel pipeline`` (see interlace.pipeline.schedule).
PIPELINE_SCHEDULES = SCHEDULES
#: How ``--parallel pipeline`` balances its stages (see interlace.pipeline.partition).
PARTITION_BY = PLAN_BY


@dataclass
class TrainConfig:
    """Every option of a training run; saved as the run folder's ``config.json``.

    The fields are the ``interlace train`` flags of the same name (``num_classes`` is
    ``--classes``); :meth:`validate` names the flag of any impossible setting.

    Args:
        model: a zoo name or ``package.module:callable``.
        data: digits, synthetic-cifar10, synthetic-imagenet, or a CIFAR-10 folder.
        strategy: how gradients are averaged (one of ``interlace.strategies.RUNTIME_STRATEGIES``).
        bucket_cap_mb: bucket cap of the ddp and fixed strategies, MB.
        channels: communication channels, an integer >= 1 or ``"auto"``.
        compression: ``"fp16"`` or ``"bf16"`` gradient buckets, or None.
        epochs: epochs to train.
        batch_size: per-rank batch size (data parallel) or the mini-batch (pipeline).
        lr: peak learning rate.
        momentum: SGD momentum.
        weight_decay: SGD weight decay.
        warmup_epochs: epochs of linear warm-up before the cosine decay.
        seed: seeds the model, the shuffle and synthetic data.
        input_shape: the shape the model expects; must match the data's.
        num_classes: the classes the model predicts; must match the data's.
        synthetic_size: training samples of a synthetic data set.
        max_steps_per_epoch: cut every epoch short (throughput runs).
        runs_dir: where new run folders are made.
        progress: show a progress bar on rank 0 (when stderr is a terminal).
        optimizer: one of :data:`OPTIMIZERS`.
        kfac_factor_update_steps: K-FAC updates the Kronecker factors every N steps.
        kfac_inv_update_steps: K-FAC decomposes the factors every N steps.
        kfac_damping: K-FAC's Tikhonov damping.
        kfac_factor_decay: running-average decay of the factors, in [0, 1).
        kfac_kl_clip: the KL-clip bound; 0 turns the clip off.
        kfac_compute_method: ``"eigen"`` or ``"inverse"``.
        kfac_grad_worker_fraction: share of ranks preconditioning each layer, in (0, 1].
        kfac_g_normalization: ``"kfac-pytorch"`` or ``"per-example"``.
        parallel: one of :data:`PARALLELISMS`.
        schedule: one of :data:`PIPELINE_SCHEDULES`.
        microbatches: micro-batches per mini-batch of gpipe and 1f1b.
        partition_by: one of :data:`PARTITION_BY`.
        spectrain_backward: ``"recompute"`` or ``"reuse"``.
        chunks: pieces each mini-batch travels in through an asynchronous schedule.
        save_every: save a checkpoint every ``N`` optimizer steps (``"500"``) or epochs
            (``"2ep"``), and at the end; None saves none.
        deterministic: fix DataParallel's buckets before training instead of planning them
            from measured times, so the same seed gives the same numbers at any rank count.
        extra: free-form notes recorded with the run.
    """

    model: str = "resnet20"
    data: str = "digits"
    strategy: str = "mgwfbp"
    bucket_cap_mb: float | None = None
    channels: int | str = 1
    compression: str | None = None
    epochs: int = 15
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_epochs: float = 1.0
    seed: int = 0
    input_shape: tuple[int, ...] | None = None
    num_classes: int | None = None
    synthetic_size: int | None = None
    max_steps_per_epoch: int | None = None
    runs_dir: str = "runs"
    progress: bool = True
    optimizer: str = "sgd"
    # K-FAC's options (used when optimizer == "kfac"), with kfac-pytorch's defaults; see
    # interlace.KFAC. A K-FAC run keeps every SGD option above: lr, momentum, weight decay and
    # the warm-up + cosine schedule apply to the preconditioned gradients.
    kfac_factor_update_steps: int = 1
    kfac_inv_update_steps: int = 1
    kfac_damping: float = 0.001
    kfac_factor_decay: float = 0.95
    #: The KL-clip bound; 0 turns the clip off (kfac-pytorch's ``kl_clip=None``).
    kfac_kl_clip: float = 0.001
    kfac_compute_method: str = "eigen"
    kfac_grad_worker_fraction: float = 1.0
    kfac_g_normalization: str = "kfac-pytorch"
    # Pipeline parallelism (used when parallel == "pipeline"; see interlace.pipeline). There
    # --batch-size is the mini-batch that goes through the pipeline, so also the global batch.
    parallel: str = "data"
    schedule: str = "spectrain"
    microbatches: int = 4
    partition_by: str = "time"
    spectrain_backward: str = "recompute"
    # Pieces each mini-batch travels in through an asynchronous schedule (1: whole).
    chunks: int = 1
    save_every: str | None = None
    deterministic: bool = False
    extra: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """Reject impossible settings before any process starts.

        Raises:
            UsageError: naming the flag of the first impossible setting.
        """
        checks = [
            (self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}"),
            (
                self.strategy in RUNTIME_STRATEGIES,
                f"unknown --strategy '{self.strategy}'; "
                f"choose one of {', '.join(RUNTIME_STRATEGIES)}",
            ),
            (
                self.bucket_cap_mb is None or self.bucket_cap_mb > 0,
                f"--bucket-cap-mb must be > 0, got {self.bucket_cap_mb}",
            ),
            (
                self.compression in (None, *COMPRESSIONS),
                f"unknown --compression '{self.compression}'; choose one of "
                f"{', '.join(COMPRESSIONS)}",
            ),
            (self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}"),
            (self.lr > 0 and math.isfinite(self.lr), f"--lr must be > 0, got {self.lr}"),
            (0 <= self.momentum < 1, f"--momentum must be in [0, 1), got {self.momentum}"),
            (self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}"),
            (self.warmup_epochs >= 0, "--warmup-epochs must be >= 0"),
            (
                self.max_steps_per_epoch is None or self.max_steps_per_epoch >= 1,
                "--max-steps-per-epoch must be >= 1",
            ),
            (
                self.optimizer in OPTIMIZERS,
                f"unknown --optimizer '{self.optimizer}'; choose one of {', '.join(OPTIMIZERS)}",
            ),
            (
                self.kfac_factor_update_steps >= 1,
                f"--kfac-factor-update-steps must be >= 1, got {self.kfac_factor_update_steps}",
            ),
            (
                self.kfac_inv_update_steps >= 1,
                f"--kfac-inv-update-steps must be >= 1, got {self.kfac_inv_update_steps}",
            ),
            (
                self.kfac_damping >= 0 and math.isfinite(self.kfac_damping),
                f"--kfac-damping must be >= 0, got {self.kfac_damping}",
            ),
            (
                0 <= self.kfac_factor_decay < 1,
                f"--kfac-factor-decay must be in [0, 1), got {self.kfac_factor_decay}",
            ),
            (
                self.kfac_kl_clip >= 0 and math.isfinite(self.kfac_kl_clip),
                f"--kfac-kl-clip must be >= 0 (0 turns the clip off), got {self.kfac_kl_clip}",
            ),
            (
                self.kfac_compute_method in COMPUTE_METHODS,
                f"unknown --kfac-compute-method '{self.kfac_compute_method}'; choose one of "
                f"{', '.join(COMPUTE_METHODS)}",
            ),
            (
                0 < self.kfac_grad_worker_fraction <= 1,
                "--kfac-grad-worker-fraction must be in (0, 1] (1 COMM-OPT, 1/n MEM-OPT), got "
                f"{self.kfac_grad_worker_fraction}",
            ),
        ]
        checks += [
            (
                self.parallel in PARALLELISMS,
                f"unknown --parallel '{self.parallel}'; choose one of {', '.join(PARALLELISMS)}",
            ),
            (
                self.schedule in PIPELINE_SCHEDULES,
                f"unknown --schedule '{self.schedule}'; choose one of "
                f"{', '.join(PIPELINE_SCHEDULES)}",
            ),
            (self.microbatches >= 1, f"--microbatches must be >= 1, got {self.microbatches}"),
            (
                self.parallel != "pipeline"
                or self.schedule not in SYNCHRONOUS
                or self.batch_size >= self.microbatches,
                f"--batch-size {self.batch_size} cannot be cut into {self.microbatches} "
                "micro-batches; raise --batch-size or lower --microbatches",
            ),
            (self.chunks >= 1, f"--chunks must be >= 1, got {self.chunks}"),
            (
                self.chunks == 1 or self.schedule not in SYNCHRONOUS,
                f"--chunks applies to {', '.join(ASYNCHRONOUS)}; {self.schedule} cuts a "
                "mini-batch with --microbatches",
            ),
            (
                self.parallel != "pipeline"
                or self.schedule in SYNCHRONOUS
                or self.batch_size >= self.chunks,
                f"--batch-size {self.batch_size} cannot be cut into {self.chunks} chunks; raise "
                "--batch-size or lower --chunks",
            ),
            (
                self.spectrain_backward in SPECTRAIN_BACKWARDS,
                f"unknown --spectrain-backward '{self.spectrain_backward}'; choose recompute or "
                "reuse",
            ),
            (
                self.partition_by in PARTITION_BY,
                f"unknown --partition-by '{self.partition_by}'; choose one of "
                f"{', '.join(PARTITION_BY)}",
            ),
        ]
        self.channels = parse_channels(self.channels)
        checks.append(
            (
                self.channels == 1 or self.strategy not in ("ddp", "optimal"),
                f"--strategy {self.strategy} sends on one channel; --channels needs mgwfbp, "
                "wfbp, fixed or single",
            )
        )
        saves = None if self.save_every is None else SaveEvery.parse(self.save_every)
        checks += [
            (
                saves is None or saves.epochs or self.parallel != "pipeline",
                "--parallel pipeline saves between epochs (a pipeline drains only there): give "
                f"--save-every in epochs, e.g. {saves.count if saves else 1}ep",
            ),
            (
                not self.deterministic or self.channels != "auto",
                "--deterministic fixes the plan before training, and --channels auto chooses "
                "the channels by measuring: give --channels a number",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)


@dataclass(frozen=True)
class TrainResult:
    """What a finished run reports back: its final numbers and where its folder is.

    Args:
        final_test_accuracy: test accuracy after the last epoch, in [0, 1].
        final_train_loss: mean training loss of the last epoch.
        samples_per_s: training throughput of the last epoch.
        run_dir: the run folder on rank 0; None on the other ranks.
        epochs: epochs trained.
    """

    final_test_accuracy: float
    final_train_loss: float
    samples_per_s: float
    run_dir: str | None
    epochs: int


class WarmupCosine:
    """Linear warm-up then cosine decay to zero: the usual recipe for SGD with momentum.

    A multiplier of the peak rate for :class:`torch.optim.lr_scheduler.LambdaLR`. A class rather
    than a closure so the config and schedule pickle across processes.

    Args:
        total_steps: optimizer steps of the whole run.
        warmup_steps: steps of the linear warm-up (cut to leave at least one cosine step).
    """

    def __init__(self, total_steps: int, warmup_steps: int) -> None:
        self.total_steps = max(total_steps, 1)
        self.warmup_steps = max(min(warmup_steps, self.total_steps - 1), 0)

    def __call__(self, step: int) -> float:
        """The multiplier of the peak learning rate at optimizer step ``step`` (from 0)."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        progress = (step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def steps_in_epoch(config: TrainConfig, loader_steps: int, too_small: str) -> int:
    """Steps per epoch: the loader's, cut to ``--max-steps-per-epoch``.

    Args:
        config: the run's config.
        loader_steps: batches the training loader yields per epoch.
        too_small: the error message when not even one batch fits.

    Raises:
        UsageError: ``too_small``, when the epoch has no step.
    """
    steps = loader_steps
    if config.max_steps_per_epoch is not None:
        steps = min(steps, config.max_steps_per_epoch)
    if steps == 0:
        raise UsageError(too_small)
    return steps


def sgd_with_schedule(
    parameters: Iterable[torch.nn.Parameter], config: TrainConfig, steps_per_epoch: int
) -> tuple[torch.optim.SGD, torch.optim.lr_scheduler.LambdaLR]:
    """The job's SGD with momentum and its warm-up + cosine schedule, stepped once per update.

    Args:
        parameters: the parameters to train.
        config: lr, momentum, weight decay, epochs and warm-up epochs come from here.
        steps_per_epoch: optimizer steps per epoch.
    """
    optimizer = torch.optim.SGD(
        parameters,
        lr=config.lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
    )
    total_steps = config.epochs * steps_per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(total_steps, round(config.warmup_epochs * steps_per_epoch))
    )
    return optimizer, schedule


def run_label(spec: str) -> str:
    """A folder-name-safe short form of a model or data spec.

    Args:
        spec: a zoo or data name, a ``package.module:callable`` or a folder path.

    Returns:
        Its last path part, with ``:`` as ``.`` and any other unsafe character as ``_``.
    """
    tail = spec.rstrip("/").replace(":", ".").split("/")[-1]
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in tail) or "run"


def open_run_log(
    config: TrainConfig,
    context: DistContext,
    run_dir: str | None,
    suffix: str,
    resume_epoch: int | None = None,
    *,
    data_source: Mapping[str, object] | None = None,
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
    return RunLog(path, record)


def finish_run_log(
    log: RunLog, title: str, accuracy: float, epochs: int, samples_per_s: float
) -> None:
    """Draw the curves and print the final line every training job ends with.

    Args:
        log: rank 0's run log.
        title: the curves' title.
        accuracy: the final test accuracy, in [0, 1].
        epochs: epochs trained.
        samples_per_s: the last epoch's throughput.
    """
    log.plot(title)
    print(
        f"final test accuracy: {100 * accuracy:.2f}% after {epochs} epochs "
        f"({samples_per_s:.1f} samples/s); metrics in {log.metrics_path}, curves in "
        f"{log.curves_path}",
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
) -> TrainResult:
    """End a run: rank 0 closes its run folder (:func:`finish_run_log`); every rank reports.

    Args:
        log: rank 0's run log; None on the other ranks.
        title: the curves' title.
        accuracy: the final test accuracy, in [0, 1].
        train_loss: the last epoch's mean training loss.
        samples_per_s: the last epoch's throughput.
        epochs: epochs trained.
    """
    if log is not None:
        finish_run_log(log, title, accuracy, epochs, samples_per_s)
    return TrainResult(
        final_test_accuracy=accuracy,
        final_train_loss=train_loss,
        samples_per_s=samples_per_s,
        run_dir=str(log.path) if log is not None else None,
        epochs=epochs,
    )


#: Settings that only a data-parallel run uses.
_DATA_PARALLEL_ONLY = ("strategy", "bucket_cap_mb", "channels", "compression")
#: Settings that only a pipelined run uses, and the schedules each one applies to.
_PIPELINE_ONLY = {
    "schedule": SCHEDULES,
    "partition_by": SCHEDULES,
    "microbatches": SYNCHRONOUS,
    "chunks": ASYNCHRONOUS,
    "spectrain_backward": ("spectrain",),
}


def applicable_settings(config: TrainConfig) -> dict[str, object]:
    """``config``'s settings that apply to its run, as plain data (``config.json``'s part).

    A data-parallel run has no pipeline settings, a pipelined one no gradient-averaging ones,
    and only a K-FAC run has ``kfac_*`` ones.

    Args:
        config: the run's config.
    """
    record: dict[str, object] = asdict(config)
    for name, schedules in _PIPELINE_ONLY.items():
        if config.parallel != "pipeline" or config.schedule not in schedules:
            del record[name]
    if config.parallel == "pipeline":
        for name in _DATA_PARALLEL_ONLY:
            del record[name]
    if config.optimizer != "kfac":
        for name in [key for key in record if key.startswith("kfac_")]:
            del record[name]
    return record


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
