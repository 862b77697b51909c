"""What a training run is asked to do: the config, its checks, and the settings that apply.

The pipeline flags' choices and checks live in :mod:`interlace.train.pipeline_config`, the result,
learning-rate shape and run labels in :mod:`interlace.train.shared`; both are importable from here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from interlace.comm.engine import COMPRESSIONS
from interlace.comm.strategies import RUNTIME_STRATEGIES
from interlace.errors import UsageError
from interlace.kfac import AssignmentStrategy, ComputeMethod, DampingAdaptation
from interlace.kfac.enums import FactorCommChoice, FactorSync, LayerRule, PlacementChoice
from interlace.kfac.factor_modes import Pipelined
from interlace.kfac.fusion import FUSIONS, fusion_from
from interlace.kfac.options import G_NORMALIZATIONS
from interlace.pipeline import ASYNCHRONOUS, SCHEDULES, SYNCHRONOUS
from interlace.train.checkpoint import SaveEvery
from interlace.train.kfac_options import (
    Choice,
    Count,
    DType,
    Fraction,
    Names,
    Real,
    Switch,
    check_kfac_options,
    kfac_option,
)
from interlace.train.pipeline_config import (
    PARALLELISMS,
    PARTITION_BY,
    PIPELINE_SCHEDULES,
    REPLICATED_PIPELINE_STRATEGIES,
    pipeline_checks,
)
from interlace.train.shared import TrainResult, WarmupCosine, run_label
from interlace.wrapping import parse_channels
from interlace.zoo.text import TEXT_FILE, TEXT_NAMES

__all__ = [
    "DEFAULT_LR",
    "LARGE_BATCH_KL_CLIP",
    "LARGE_GLOBAL_BATCH",
    "OPTIMIZERS",
    "PARALLELISMS",
    "PARTITION_BY",
    "PIPELINE_SCHEDULES",
    "PRECISIONS",
    "REPLICATED_PIPELINE_STRATEGIES",
    "SMALL_BATCH_KL_CLIP",
    "TrainConfig",
    "TrainResult",
    "WarmupCosine",
    "applicable_settings",
    "default_kfac_kl_clip",
    "run_label",
]

#: The ``--optimizer`` choices: SGD with momentum, K-FAC in front of that SGD, or AdamW.
OPTIMIZERS = ("sgd", "kfac", "adamw")
#: ``--lr`` when not given, by optimizer.
DEFAULT_LR = {"sgd": 0.1, "kfac": 0.1, "adamw": 1e-3}
#: The ``--precision`` choices: float32 throughout, or the forward under bfloat16 autocast.
PRECISIONS = ("fp32", "bf16")
#: ``--kfac-kl-clip`` when not given (:func:`default_kfac_kl_clip`): KFAC's own 0.001 below a
#: global batch of 1,024, 0.01 from there, the settings the MNIST-1D races found safe at each.
SMALL_BATCH_KL_CLIP = 0.001
LARGE_BATCH_KL_CLIP = 0.01
LARGE_GLOBAL_BATCH = 1024


def default_kfac_kl_clip(global_batch: int) -> float:
    """``--kfac-kl-clip``'s default for a job's global batch (per-rank batch x ranks).

    At a global batch of 1,024 the race's KL-clip 0.01 reached the target sooner than 0.001 in 10
    of 12 paired configurations and none of its runs collapsed; at 100, 0.01 collapsed every MLP
    and CNN run under fixed damping, so smaller batches keep 0.001 (docs/kfac/race.md).

    Args:
        global_batch: samples per optimizer step over all ranks.
    """
    return LARGE_BATCH_KL_CLIP if global_batch >= LARGE_GLOBAL_BATCH else SMALL_BATCH_KL_CLIP


@dataclass
class TrainConfig:
    """Every option of a training run; saved as the run folder's ``config.json``.

    The fields are the ``interlace train`` flags of the same name (``num_classes`` is
    ``--classes``); :meth:`validate` names the flag of any impossible setting.

    Args:
        model: a zoo name or ``package.module:callable``.
        data: digits, mnist1d, synthetic-cifar10, synthetic-imagenet, a CIFAR-10 folder, or
            text: pydoc-topics, or ``text`` for ``data_file``.
        data_file: the text file of ``data="text"``.
        seq_len: tokens per sample of text data (None: 128).
        strategy: how gradients are averaged (one of
            ``interlace.comm.strategies.RUNTIME_STRATEGIES``).
        bucket_cap_mb: bucket cap of the ddp and fixed strategies, MiB (as torch DDP).
        channels: communication channels, an integer >= 1 or ``"auto"``.
        compression: ``"fp16"`` or ``"bf16"`` gradient buckets, or None.
        epochs: epochs to train.
        batch_size: per-rank batch size (data parallel) or the mini-batch (pipeline).
        lr: peak learning rate.
        momentum: SGD momentum.
        weight_decay: weight decay (SGD's L2 term, AdamW's decoupled decay).
        warmup_epochs: epochs of linear warm-up before the cosine decay.
        warmup_steps: optimizer steps of warm-up instead (None: ``warmup_epochs``).
        clip_grad_norm: clip the gradients' global norm to this before each update (None:
            no clipping).
        precision: ``"fp32"``, or ``"bf16"`` to run forward and loss under bfloat16 autocast.
        seed: seeds the model, the shuffle and synthetic data.
        input_shape: the shape the model expects; must match the data's.
        num_classes: the classes the model predicts; must match the data's.
        synthetic_size: training samples of a generated data set (synthetic-* or mnist1d).
        max_steps_per_epoch: cut every epoch short (throughput runs).
        runs_dir: where new run folders are made.
        progress: show a progress bar on rank 0 (when stderr is a terminal).
        optimizer: one of :data:`OPTIMIZERS`.
        kfac_*: ``interlace.KFAC``'s keyword of the same name, as the command line spells
            it (each field's help says how): e.g. ``kfac_damping``, ``kfac_factor_comm``
            (``"bulk"`` or ``"pipelined"``), ``kfac_inv_dtype`` (``"float32"``),
            ``kfac_skip_layers`` (comma-separated), ``kfac_kl_clip`` (0: no clip; None: by
            the global batch, :func:`default_kfac_kl_clip`) and
            ``kfac_lr`` (None: the SGD's scheduled rate).
        parallel: one of :data:`PARALLELISMS`.
        schedule: one of :data:`PIPELINE_SCHEDULES`.
        microbatches: micro-batches per mini-batch of gpipe and 1f1b.
        partition_by: one of :data:`PARTITION_BY` (``auto``: by time with one replica, by
            time+allreduce with several).
        spectrain_backward: ``"recompute"`` or ``"reuse"``.
        chunks: pieces each mini-batch travels in through an asynchronous schedule.
        stages: stages per pipeline under ``parallel="pipeline"``; the ranks form ``-n / stages``
            replicas, each stage's gradients averaged over them with ``strategy``'s buckets,
            ``channels`` and ``compression`` (None: one pipeline of ``-n`` stages).
        save_every: save a checkpoint every ``N`` optimizer steps (``"500"``) or epochs
            (``"2ep"``), and at the end; None saves none.
        deterministic: fix DataParallel's buckets before training instead of planning them
            from measured times, so the same seed gives the same numbers at any rank count.
        replan: on resume, drop the checkpoint's DataParallel plan and profile and plan again
            (a run resumed on another machine or network).
        extra: free-form notes recorded with the run.
    """

    model: str = "resnet20"
    data: str = "digits"
    data_file: str | None = None
    seq_len: int | None = None
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
    warmup_steps: int | None = None
    clip_grad_norm: float | None = None
    precision: str = "fp32"
    seed: int = 0
    input_shape: tuple[int, ...] | None = None
    num_classes: int | None = None
    synthetic_size: int | None = None
    max_steps_per_epoch: int | None = None
    runs_dir: str = "runs"
    progress: bool = True
    optimizer: str = "sgd"
    # K-FAC's options (used when optimizer == "kfac"): one declaration per keyword of
    # interlace.KFACPreconditioner (KFAC's, kfac-pytorch's, a policy object's setting spelt flat),
    # its default the keyword's unless the help says why not; the flag and the keyword in the
    # call follow from it, and the library checks the values (train/kfac_options.py). A K-FAC
    # run keeps every SGD option above: lr, momentum, weight decay and the schedule apply to the
    # preconditioned gradients.
    kfac_factor_update_steps: int = kfac_option(
        "factor_update_steps", Count(), "update the Kronecker factors every N steps"
    )
    kfac_inv_update_steps: int = kfac_option(
        "inv_update_steps", Count(), "decompose (or invert) the factors every N steps"
    )
    kfac_damping: float = kfac_option(
        "damping", Real(), "Tikhonov damping (the starting value under levenberg-marquardt)"
    )
    kfac_damping_adaptation: str = kfac_option(
        "damping_adaptation",
        Choice(DampingAdaptation),
        "fixed (kfac-pytorch's) or levenberg-marquardt (adapted every 5 steps from the loss, "
        "so that small damping cannot make K-FAC diverge)",
    )
    kfac_factor_decay: float = kfac_option(
        "factor_decay", Real(), "running-average decay of the factors, in [0, 1)"
    )
    kfac_kl_clip: float | None = kfac_option(
        "kl_clip",
        Real(zero_is_none=True),
        "KL-clip bound on the preconditioned step (0: no clip); not given, it follows the global "
        "batch: the MNIST-1D race at 1,024 found 0.01 faster than 0.001 and never collapsing, "
        "while 0.01 collapsed at batch 100 under fixed damping (docs/kfac/race.md)",
        default=None,
        unset=f"{LARGE_BATCH_KL_CLIP:g} at a global batch of {LARGE_GLOBAL_BATCH:,} or more, "
        f"else {SMALL_BATCH_KL_CLIP:g}",
    )
    kfac_lr: float | None = kfac_option(
        "lr",
        Real(name="LR"),
        "learning rate the KL-clip assumes, fixed (KFAC's own default, 0.1, would not follow "
        "the schedule)",
        default=None,
        unset="the SGD's current rate: --lr through its warm-up and cosine schedule",
    )
    kfac_compute_method: str = kfac_option(
        "compute_method",
        Choice(ComputeMethod),
        "eigen (eigendecompositions) or inverse (damped inverses)",
    )
    kfac_grad_worker_fraction: float | str = kfac_option(
        "grad_worker_fraction",
        Fraction(),
        "share of ranks preconditioning each layer: 1 or comm-opt (COMM-OPT), 0, 1/n or "
        "mem-opt (MEM-OPT), between (HYBRID; hybrid-opt is 1/2), rounded to whole ranks",
    )
    kfac_skip_layers: str = kfac_option(
        "skip_layers",
        Names(),
        "modules left to SGD, by their name in the model, an enclosing module's name or their "
        "class name (case-insensitive; under --kfac-layer-rule kfac-pytorch, regular "
        "expressions searched in the name or class name, case-sensitive)",
    )
    kfac_layer_rule: str = kfac_option(
        "layer_rule",
        Choice(LayerRule),
        "which modules K-FAC preconditions: interlace (Linear, Conv1d, Conv2d, Embedding, "
        "transformers' Conv1D; KFAC's rule, the job's default so that its convolutions and "
        "embeddings stay preconditioned) or kfac-pytorch (leaf Linear and Conv2d whose "
        "parameters are all trainable, plus --kfac-extra-layers)",
        default=LayerRule.INTERLACE.value,
    )
    kfac_extra_layers: str = kfac_option(
        "extra_layers",
        Names(),
        "layer kinds added to --kfac-layer-rule kfac-pytorch: conv1d, embedding, "
        "transformers-conv1d, custom",
    )
    kfac_factor_dtype: str | None = kfac_option(
        "factor_dtype", DType(), "dtype the factors are computed in", unset="the layer's"
    )
    kfac_inv_dtype: str = kfac_option(
        "inv_dtype", DType(), "dtype the decompositions are computed and kept in"
    )
    # Not given (None) by default: kfac-pytorch's allreduce_bucket_cap_mb, colocate_factors and
    # update_factors_in_hook may set these, and a value given here would contradict them.
    kfac_bucket_cap_mb: float | None = kfac_option(
        "bucket_cap_mb",
        Real(name="MB"),
        "largest bulk factor all-reduce (and --kfac-fusion fixed bucket), MiB; 0: one "
        "all-reduce per factor",
        default=None,
        unset="25 MiB",
        aliases=("allreduce_bucket_cap_mb",),
    )
    kfac_placement: str | None = kfac_option(
        "placement",
        Choice(PlacementChoice),
        "where the factors are decomposed: auto (lbp under comm-opt on 2-64 ranks, greedy "
        "otherwise), greedy (SC20 / KAISA), round-robin, or lbp (SPD-KFAC; comm-opt only)",
        default=None,
        unset="auto; greedy with --kfac-colocate-factors true, lbp with false",
    )
    kfac_factor_comm: str | None = kfac_option(
        "factor_comm",
        Choice(FactorCommChoice),
        "bulk (step() all-reduces the factors in buckets) or pipelined (SPD-KFAC: each factor "
        "as soon as its hook computes it)",
        default=None,
        unset="pipelined; bulk with --kfac-update-factors-in-hook false",
    )
    kfac_factor_sync: str = kfac_option(
        "factor_sync",
        Choice(FactorSync),
        "when factors are averaged across ranks: at-decomposition (each rank folds its own "
        "into its running averages, which are averaged before each decomposition: the same "
        "averages, one all-reduce per decomposition) or every-update (kfac-pytorch's)",
    )
    # Pipelined's settings, spelt flat; their defaults are Pipelined's.
    kfac_fusion: str = kfac_option(
        "fusion",
        Choice(values=FUSIONS),
        "pipelined buckets: none (one per factor), fixed (up to --kfac-bucket-cap-mb in ready "
        "order) or merged (MG-WFBP's rule)",
        default=fusion_from(Pipelined().fusion).value,  # a string: checkpoints load unpickled
    )
    kfac_profile_steps: int = kfac_option(
        "profile_steps",
        Count(),
        "factor steps profiled before --kfac-fusion merged plans",
        default=Pipelined().profile_steps,
    )
    kfac_tune_steps: int = kfac_option(
        "tune_steps",
        Count(minimum=0),
        "factor steps timed per candidate plan and round when --kfac-fusion merged weighs its "
        "buckets against coarser ones (0: the cost model's plan alone)",
        default=Pipelined().tune_steps,
    )
    kfac_g_normalization: str = kfac_option(
        "g_normalization",
        Choice(values=G_NORMALIZATIONS),
        "G from gradients of the mean loss (kfac-pytorch) or of each example's loss (the "
        "per-example Fisher: G times the squared global batch)",
    )
    kfac_assignment_strategy: str = kfac_option(
        "assignment_strategy",
        Choice(AssignmentStrategy),
        "what greedy placement balances: compute (decomposition work, n^3) or memory (n^2)",
    )
    kfac_colocate_factors: bool | None = kfac_option(
        "colocate_factors",
        Switch(),
        "kfac-pytorch's switch: true keeps a layer's two factors on one rank (greedy, "
        "round-robin), false places them apart (lbp)",
        unset="as --kfac-placement places them",
    )
    kfac_compute_eigenvalue_outer_product: bool = kfac_option(
        "compute_eigenvalue_outer_product",
        Switch(),
        "kfac-pytorch's switch, accepted (results do not depend on it); with eigen it needs "
        "colocated factors",
    )
    kfac_symmetry_aware: bool = kfac_option(
        "symmetry_aware",
        Switch(),
        "bulk factor all-reduces send upper triangles only (pipelined ones always do)",
    )
    kfac_update_factors_in_hook: bool | None = kfac_option(
        "update_factors_in_hook",
        Switch(),
        "kfac-pytorch's switch: true is --kfac-factor-comm pipelined, false is bulk",
        unset="as --kfac-factor-comm says",
    )
    kfac_loglevel: str = kfac_option(
        "loglevel",
        Choice(values=("debug", "info", "warning", "error"), levels=True),
        "level of K-FAC's messages (layers registered, placement) on the interlace.kfac "
        "logger; warning prints them",
    )
    # Pipeline parallelism (used when parallel == "pipeline"; see interlace.pipeline). There
    # --batch-size is the mini-batch that goes through the pipeline, so also the global batch.
    parallel: str = "data"
    schedule: str = "spectrain"
    microbatches: int = 4
    partition_by: str = "auto"
    spectrain_backward: str = "recompute"
    # Pieces each mini-batch travels in through an asynchronous schedule (1: whole).
    chunks: int = 1
    # Stages per pipeline; the ranks are cut into -n / stages replicas (None: -n stages, one).
    stages: int | None = None
    save_every: str | None = None
    deterministic: bool = False
    replan: bool = False
    extra: dict[str, str] = field(default_factory=dict)

    def _text_and_step_checks(self) -> list[tuple[bool, str]]:
        """The checks of the text data's flags, and of the update's extras under a pipeline."""
        text = self.data in (*TEXT_NAMES, TEXT_FILE)
        return [
            (
                self.data_file is None or self.data == TEXT_FILE,
                f"--data-file is the text file of --data {TEXT_FILE}; add --data {TEXT_FILE} "
                f"(not --data {self.data})",
            ),
            (
                self.data != TEXT_FILE or self.data_file is not None,
                f"--data {TEXT_FILE} trains on your own file: add --data-file PATH",
            ),
            (
                self.seq_len is None or text,
                f"--seq-len applies to text data ({', '.join((*TEXT_NAMES, TEXT_FILE))}), not "
                f"to --data {self.data}",
            ),
            (
                self.seq_len is None or self.seq_len >= 1,
                f"--seq-len must be >= 1, got {self.seq_len}",
            ),
            (
                not text or self.parallel != "pipeline",
                f"--parallel pipeline trains the image models; the language-model job (--data "
                f"{self.data}) trains data parallel: drop --parallel pipeline",
            ),
            (
                self.parallel != "pipeline"
                or (self.clip_grad_norm is None and self.precision == "fp32"),
                "--clip-grad-norm and --precision bf16 apply to --parallel data; drop them or "
                "--parallel pipeline",
            ),
        ]

    def _channel_and_save_checks(self) -> list[tuple[bool, str]]:
        """The checks of the channels, the saves and the plan's flags (``--channels`` is
        written in its parsed form first)."""
        self.channels = parse_channels(self.channels)
        checks = [
            (
                self.channels == 1 or self.strategy not in ("ddp", "optimal"),
                f"--strategy {self.strategy} sends on one channel; --channels needs mgwfbp, "
                "wfbp, fixed or single",
            )
        ]
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
            (
                not self.replan or (self.parallel == "data" and self.strategy != "ddp"),
                "--replan plans DataParallel's buckets again; this run has none to plan "
                f"(--parallel {self.parallel}, --strategy {self.strategy})",
            ),
            (
                not (self.replan and self.deterministic),
                "--replan measures a new plan, and this run is --deterministic (its plan is "
                "fixed, not measured): drop --replan",
            ),
        ]
        return checks

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
                self.warmup_steps is None or self.warmup_steps >= 0,
                f"--warmup-steps must be >= 0, got {self.warmup_steps}",
            ),
            (
                self.clip_grad_norm is None
                or (self.clip_grad_norm > 0 and math.isfinite(self.clip_grad_norm)),
                f"--clip-grad-norm must be > 0, got {self.clip_grad_norm}",
            ),
            (
                self.precision in PRECISIONS,
                f"unknown --precision '{self.precision}'; choose one of {', '.join(PRECISIONS)}",
            ),
            (
                self.max_steps_per_epoch is None or self.max_steps_per_epoch >= 1,
                "--max-steps-per-epoch must be >= 1",
            ),
            (
                self.optimizer in OPTIMIZERS,
                f"unknown --optimizer '{self.optimizer}'; choose one of {', '.join(OPTIMIZERS)}",
            ),
            (
                self.optimizer == "sgd" or self.parallel != "pipeline",
                f"--optimizer {self.optimizer} trains data parallel; --parallel pipeline "
                "trains with SGD: drop one of the two",
            ),
        ]
        checks += self._text_and_step_checks()
        checks += pipeline_checks(self)
        checks += self._channel_and_save_checks()
        for ok, message in checks:
            if not ok:
                raise UsageError(message)
        check_kfac_options(self)


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
    if config.parallel != "pipeline" or config.stages is None:
        del record["stages"]
    if config.parallel == "pipeline" and config.stages is None:
        # A replicated pipeline averages each stage's gradients with these.
        for name in _DATA_PARALLEL_ONLY:
            del record[name]
    if config.optimizer != "kfac":
        for name in [key for key in record if key.startswith("kfac_")]:
            del record[name]
    if config.optimizer == "adamw":
        del record["momentum"]
    for name in ("data_file", "seq_len", "warmup_steps", "clip_grad_norm"):
        if record[name] is None:
            del record[name]
    return record
