"""``interlace train`` and ``interlace demo``: the training job's flags, and starting its ranks."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path

from torch import nn

from interlace import launch
from interlace.cliutil import (
    add_channel_arguments,
    add_collective_timeout_argument,
    add_model_shape_arguments,
    collective_timeout_of,
    report_failure,
)
from interlace.comm.links import parse_link
from interlace.comm.strategies import RUNTIME_STRATEGIES, STRATEGIES
from interlace.distenv import in_launched_job, set_collective_timeout
from interlace.errors import UsageError
from interlace.pipeline import SPECTRAIN_BACKWARDS
from interlace.pipeline.partition import pipeline_blocks
from interlace.runlog import new_run_dir
from interlace.train.checkpoint import latest_checkpoint, read_header
from interlace.train.config import DEFAULT_LR, OPTIMIZERS, PRECISIONS, TrainConfig
from interlace.train.job import train_rank
from interlace.train.kfac_options import add_kfac_arguments, check_kfac_options, kfac_options
from interlace.train.pipeline import check_pipeline_ranks
from interlace.train.pipeline_config import PARALLELISMS, PARTITION_BY, PIPELINE_SCHEDULES
from interlace.train.shared import run_label
from interlace.zoo import build_model, load_data
from interlace.zoo.text import DEFAULT_SEQ_LEN, TEXT_FILE, TEXT_NAMES


def add_arguments(
    parser: argparse.ArgumentParser, default_epochs: int = 15, default_nprocs: int = 1
) -> None:
    """Add the training job's flags to ``parser`` (``interlace train`` and ``interlace demo``).

    Args:
        parser: the subcommand's parser.
        default_epochs: ``--epochs`` when not given.
        default_nprocs: ``-n`` when not given.
    """
    defaults = TrainConfig()
    _add_model_and_data(parser, defaults)
    _add_averaging(parser, defaults)
    _add_ranks(parser, default_nprocs)
    _add_schedule(parser, defaults, default_epochs)
    _add_numerics(parser, defaults)
    _add_run_folder(parser, defaults)
    _add_checkpoints(parser)
    add_collective_timeout_argument(parser)
    _add_optimizer(parser, defaults)
    _add_pipeline(parser, defaults)
    kfac = parser.add_argument_group(
        "K-FAC (with --optimizer kfac and --parallel data): interlace.kfac.KFACPreconditioner's "
        "keywords (KFAC's own and kfac-pytorch's names), defaults theirs (kfac-pytorch's)"
    )
    add_kfac_arguments(kfac, TrainConfig)
    parser.set_defaults(default_epochs=default_epochs, default_nprocs=default_nprocs)


def _add_model_and_data(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """What trains on what: the model, the data set and its text options.

    Args:
        parser: the subcommand's parser.
        defaults: the flags' defaults.
    """
    parser.add_argument(
        "--model",
        default=defaults.model,
        help=f"zoo name or package.module:callable (default {defaults.model})",
    )
    parser.add_argument(
        "--data",
        default=defaults.data,
        help="digits, mnist1d, synthetic-cifar10, synthetic-imagenet, a CIFAR-10 python folder, "
        f"or text for --model gpt: {', '.join(TEXT_NAMES)} (packaged) or {TEXT_FILE} (your "
        f"--data-file) (default {defaults.data})",
    )
    parser.add_argument(
        "--data-file",
        metavar="PATH",
        help=f"the text file --data {TEXT_FILE} trains on (its bytes are the tokens; the last "
        "tenth is held out)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        help=f"tokens per sample of text data, at most the model's context "
        f"(default {DEFAULT_SEQ_LEN})",
    )


def _add_averaging(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """How gradients are averaged: the strategy, its buckets and channels.

    Args:
        parser: the subcommand's parser.
        defaults: the flags' defaults.
    """
    parser.add_argument(
        "--strategy",
        choices=RUNTIME_STRATEGIES,
        metavar="STRATEGY",
        default=defaults.strategy,
        help="how gradients are averaged: "
        + "; ".join(f"{name}: {STRATEGIES[name].description}" for name in RUNTIME_STRATEGIES)
        + f" (default {defaults.strategy})",
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=defaults.bucket_cap_mb,
        help="bucket cap of the ddp and fixed strategies, MB (default: 25, first bucket 1)",
    )
    add_channel_arguments(parser)


def _add_ranks(parser: argparse.ArgumentParser, default_nprocs: int) -> None:
    """How many ranks start, and the network they talk over.

    Args:
        parser: the subcommand's parser.
        default_nprocs: ``-n`` when not given.
    """
    parser.add_argument(
        "-n",
        "--nprocs",
        "--nproc-per-node",
        dest="nprocs",
        type=int,
        metavar="N",
        default=None,
        help=f"number of ranks to start (default {default_nprocs}, or the resumed run's); "
        "ignored under torchrun",
    )
    parser.add_argument(
        "--link",
        help="emulate a network of this rate per rank: 100mbit, 1gbit, 2.5gbit or 10gbit "
        "(needs root); default: plain loopback",
    )


def _add_schedule(
    parser: argparse.ArgumentParser, defaults: TrainConfig, default_epochs: int
) -> None:
    """How long and how fast: epochs, batch, learning rate and its schedule.

    Args:
        parser: the subcommand's parser.
        defaults: the flags' defaults.
        default_epochs: ``--epochs`` when not given.
    """
    parser.add_argument(
        "--epochs",
        type=int,
        default=default_epochs,
        help=f"epochs to train (default {default_epochs})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=defaults.batch_size,
        help=f"per-rank batch size (default {defaults.batch_size})",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default "
        + ", ".join(f"{rate:g} for {name}" for name, rate in DEFAULT_LR.items())
        + ")",
    )
    parser.add_argument(
        "--momentum",
        type=float,
        default=defaults.momentum,
        help=f"SGD momentum (default {defaults.momentum})",
    )
    parser.add_argument(
        "--weight-decay",
        type=float,
        default=defaults.weight_decay,
        help="weight decay: SGD's L2 term, AdamW's decoupled decay, on every parameter "
        f"(default {defaults.weight_decay})",
    )
    parser.add_argument(
        "--warmup-epochs",
        type=float,
        default=defaults.warmup_epochs,
        help="epochs of linear learning-rate warm-up before the cosine decay "
        f"(default {defaults.warmup_epochs:g})",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        help="optimizer steps of linear warm-up instead of --warmup-epochs (the cosine decay "
        "then runs over the remaining steps)",
    )


def _add_numerics(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """The update's numbers: clipping, precision, seed and determinism.

    Args:
        parser: the subcommand's parser.
        defaults: the flags' defaults.
    """
    parser.add_argument(
        "--clip-grad-norm",
        type=float,
        metavar="MAX",
        help="clip the averaged gradients' global norm to MAX before each update "
        "(torch.nn.utils.clip_grad_norm_; after K-FAC's preconditioning; with --strategy "
        "overlap it waits for every average first); default: no clipping",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=defaults.precision,
        help="fp32, or bf16: forward and loss under bfloat16 autocast (CPU and CUDA), weights, "
        f"gradients and the update in float32 (default {defaults.precision})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help=f"seeds the model, the shuffle and synthetic data (default {defaults.seed})",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="fix DataParallel's buckets before training (DDP-style caps, or the wfbp and "
        "single layouts) instead of planning them from measured times: the same --seed then "
        "gives the same numbers at any -n",
    )


def _add_run_folder(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """The data's shape and length, and where and how the run reports.

    Args:
        parser: the subcommand's parser.
        defaults: the flags' defaults.
    """
    add_model_shape_arguments(parser, defaults_from="the --data set's")
    parser.add_argument(
        "--synthetic-size",
        type=int,
        help="training samples of a generated data set (synthetic-* or mnist1d)",
    )
    parser.add_argument(
        "--max-steps-per-epoch", type=int, help="cut every epoch short (throughput runs)"
    )
    parser.add_argument(
        "--runs-dir", default=defaults.runs_dir, help="where run folders are made (default runs)"
    )
    parser.add_argument("--out", help="exact run folder to write (default: a new one in runs/)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--timeout", type=float, help="stop the whole job after this many seconds")


def _add_optimizer(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """The optimizer.

    Args:
        parser: the subcommand's parser.
        defaults: the flags' defaults.
    """
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=defaults.optimizer,
        help="sgd (SGD with momentum), kfac (K-FAC preconditioning in front of that same SGD, "
        "schedule and all) or adamw (torch's AdamW, default betas); each with the warm-up + "
        f"cosine schedule (default {defaults.optimizer})",
    )


def _add_checkpoints(parser: argparse.ArgumentParser) -> None:
    """Checkpoints: saving, resuming and replanning.

    Args:
        parser: the subcommand's parser.
    """
    checkpoints = parser.add_argument_group("checkpoints")
    checkpoints.add_argument(
        "--save-every",
        metavar="N|Nep",
        help="save a checkpoint in the run folder every N optimizer steps (e.g. 500) or every "
        "N epochs (e.g. 2ep), and at the end; the two latest are kept (default: none)",
    )
    checkpoints.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its latest checkpoint, with its own settings: "
        "the losses are those of the run never stopped",
    )
    checkpoints.add_argument(
        "--replan",
        action="store_true",
        help="with --resume: drop the checkpoint's DataParallel plan and profile, plan and try "
        "plans again (a run moved to another machine or network); default: keep the plan",
    )


def _add_pipeline(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """Pipeline parallelism: the schedule, stages, micro-batches and partition.

    Args:
        parser: the subcommand's parser.
        defaults: the flags' defaults.
    """
    pipeline = parser.add_argument_group(
        "pipeline parallelism (with --parallel pipeline: one stage per rank, -n stages, or "
        "-n / --stages replicas of --stages stages)"
    )
    pipeline.add_argument(
        "--parallel",
        choices=PARALLELISMS,
        default=defaults.parallel,
        help="data: replicate the model (--strategy); pipeline: cut it into -n stages, "
        "--batch-size then being the mini-batch through the pipeline (default data)",
    )
    pipeline.add_argument(
        "--schedule",
        choices=PIPELINE_SCHEDULES,
        default=defaults.schedule,
        help="gpipe or 1f1b (synchronous, micro-batches, one update per mini-batch); "
        "spectrain, pipedream or naive (asynchronous 1F1B, an update per mini-batch, "
        f"with predicted, stashed or latest weights); default {defaults.schedule}",
    )
    pipeline.add_argument(
        "--stages",
        type=int,
        default=defaults.stages,
        help="stages per pipeline: the -n ranks run -n / --stages replicas of it, each stage's "
        "gradients averaged over its replicas (--strategy's buckets, --channels, --compression) "
        "while its backward runs, and applied where the schedule updates; --batch-size stays "
        "the global mini-batch, split over the replicas (default: -n stages, one replica)",
    )
    pipeline.add_argument(
        "--microbatches",
        type=int,
        default=defaults.microbatches,
        help=f"micro-batches per mini-batch of gpipe and 1f1b (default {defaults.microbatches})",
    )
    pipeline.add_argument(
        "--chunks",
        type=int,
        default=defaults.chunks,
        help="pieces each mini-batch travels in through spectrain, pipedream or naive, all with "
        "the mini-batch's weights and one update: a stage starts on the first while the rest "
        "are in transit (faster on slow links; BatchNorm then normalises per piece); "
        f"default {defaults.chunks}",
    )
    pipeline.add_argument(
        "--spectrain-backward",
        choices=SPECTRAIN_BACKWARDS,
        default=defaults.spectrain_backward,
        help="spectrain's backward: recompute the stage with weights predicted at backward "
        "time (the paper's rule) or reuse the forward's prediction and graph (no second "
        f"forward); default {defaults.spectrain_backward}",
    )
    pipeline.add_argument(
        "--partition-by",
        choices=PARTITION_BY,
        default=defaults.partition_by,
        help="balance stages by measured forward+backward time, by parameter count, or by "
        "time plus each stage's all-reduce over its replicas (time+allreduce); auto: time with "
        f"one replica, time+allreduce with --stages below -n (default {defaults.partition_by})",
    )


def run(args: argparse.Namespace) -> int:
    """Run the training job the parsed flags describe: as this rank, or by launching ``-n``.

    Args:
        args: :func:`add_arguments`'s flags, parsed, and ``command`` (``train`` or ``demo``).

    Returns:
        The job's exit status.

    Raises:
        UsageError: for an impossible setting, a model or data that does not load, or a
            ``--link`` the launcher cannot emulate.
    """
    config = _config_of(args)
    if args.replan and args.resume is None:
        raise UsageError("--replan applies with --resume (a new run plans anyway)")
    config.validate()
    if args.resume is None and config.optimizer != "kfac":
        _refuse_kfac_flags(config)
    nprocs: int = args.default_nprocs if args.nprocs is None else args.nprocs
    run_dir: str | None = args.out
    if args.resume is not None:
        defaults = replace(TrainConfig(), epochs=args.default_epochs)
        config, world_size = resumed_config(args.resume, config, defaults)
        if args.nprocs is not None and args.nprocs != world_size:
            raise UsageError(
                f"-n {args.nprocs}: {args.resume} was trained by {world_size} rank(s); resume "
                f"it with as many (drop -n)"
            )
        if args.out is not None and Path(args.out).resolve() != Path(args.resume).resolve():
            raise UsageError("--resume continues RUN_DIR in place; drop --out")
        nprocs, run_dir = world_size, args.resume

    set_collective_timeout(args.collective_timeout)
    if in_launched_job():
        # Started by torchrun or `interlace launch`: this process is one rank already.
        train_rank(config, run_dir, args.resume is not None)
        return 0

    _check_before_launch(config, nprocs, args.link)
    run_dir = run_dir or str(
        new_run_dir(
            config.runs_dir, f"{run_label(config.model)}-{run_label(config.data)}-n{nprocs}"
        )
    )
    result = launch.run(
        train_rank,
        nprocs,
        link=args.link,
        args=(config, run_dir, args.resume is not None),
        timeout=args.timeout,
        collective_timeout=collective_timeout_of(args.collective_timeout),
    )
    return report_failure(f"interlace {args.command}", result, args.timeout)


def _config_of(args: argparse.Namespace) -> TrainConfig:
    """The run's config as the flags give it (not yet validated).

    Args:
        args: :func:`add_arguments`'s flags, parsed.
    """
    return TrainConfig(
        model=args.model,
        data=args.data,
        data_file=args.data_file,
        seq_len=args.seq_len,
        strategy=args.strategy,
        bucket_cap_mb=args.bucket_cap_mb,
        channels=args.channels,
        compression=args.compression,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=DEFAULT_LR[args.optimizer] if args.lr is None else args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        warmup_epochs=args.warmup_epochs,
        warmup_steps=args.warmup_steps,
        clip_grad_norm=args.clip_grad_norm,
        precision=args.precision,
        seed=args.seed,
        input_shape=args.input_shape,
        num_classes=args.classes,
        synthetic_size=args.synthetic_size,
        max_steps_per_epoch=args.max_steps_per_epoch,
        runs_dir=args.runs_dir,
        progress=not args.no_progress,
        optimizer=args.optimizer,
        **{option.field: getattr(args, option.field) for option in kfac_options(TrainConfig)},
        parallel=args.parallel,
        schedule=args.schedule,
        microbatches=args.microbatches,
        partition_by=args.partition_by,
        spectrain_backward=args.spectrain_backward,
        chunks=args.chunks,
        stages=args.stages,
        save_every=args.save_every,
        deterministic=args.deterministic,
        replan=args.replan,
    )


def _check_before_launch(config: TrainConfig, nprocs: int, link: str | None) -> None:
    """Check the settings that need the job's size, the link, the model and the data, here,
    once, so a typo is one line rather than N tracebacks.

    Args:
        config: the run's config (validated).
        nprocs: the ranks to start.
        link: ``--link``, or None.

    Raises:
        UsageError: naming the setting that does not fit.
    """
    if nprocs < 1:
        raise UsageError(f"-n must be >= 1, got {nprocs}")
    if link is not None:
        parse_link(link)
    if config.optimizer == "kfac":
        check_kfac_options(config, nprocs)
    if config.parallel == "pipeline":
        check_pipeline_ranks(config, nprocs)
    bundle = load_data(
        config.data,
        synthetic_size=config.synthetic_size,
        seed=config.seed,
        seq_len=config.seq_len,
        data_file=config.data_file,
    )
    model = build_model(
        config.model,
        config.input_shape or bundle.input_shape,
        config.num_classes or bundle.num_classes,
    )
    if config.parallel == "pipeline":
        check_stage_count(model, config.stages or nprocs)


def check_stage_count(model: nn.Module, stages: int) -> None:
    """Refuse more pipeline stages than the model has blocks, in one line.

    Args:
        model: the built model.
        stages: stages per pipeline.
    """
    blocks = len(pipeline_blocks(model))
    if stages > blocks:
        raise UsageError(
            f"{stages} pipeline stages but the model has {blocks} blocks; use --stages (or -n) "
            f"of at most {blocks}"
        )


def _refuse_kfac_flags(config: TrainConfig) -> None:
    """Refuse K-FAC flags given without ``--optimizer kfac``: they would change nothing."""
    for option in kfac_options(TrainConfig):
        if getattr(config, option.field) != option.default:
            raise UsageError(
                f"{option.flag} applies to --optimizer kfac; add --optimizer kfac or drop it"
            )


#: Settings a resumed run may change: they do not change what it computes.
_FREE_ON_RESUME = ("progress", "runs_dir", "save_every", "replan", "extra")
#: Flags whose name is not the field's.
_FLAGS = {"num_classes": "--classes", "input_shape": "--input-shape"}


def resumed_config(
    run_dir: str, asked: TrainConfig, defaults: TrainConfig
) -> tuple[TrainConfig, int]:
    """The config saved in ``run_dir``'s latest checkpoint, and the job size that saved it.

    Flags given with ``--resume`` that differ from their default and from the saved value are
    refused: a resumed run keeps its settings, or it would not continue the same run. Only
    :data:`_FREE_ON_RESUME` (progress bar, ``--save-every``, ``--replan``) may change.

    Args:
        run_dir: the run folder to resume.
        asked: the config the command line describes.
        defaults: the config of no flags at all.

    Raises:
        UsageError: when there is no readable checkpoint, the run is finished, or a flag
            contradicts the saved config.
    """
    path = latest_checkpoint(run_dir)
    if path is None:
        raise UsageError(
            f"--resume: {run_dir} holds no checkpoint (runs save them with --save-every)"
        )
    header = read_header(path)
    saved = TrainConfig(**header["config"])
    saved.validate()
    defaults.validate()
    for item in fields(TrainConfig):
        name = item.name
        mine, default, theirs = (getattr(c, name) for c in (asked, defaults, saved))
        if name in _FREE_ON_RESUME or mine in (default, theirs):
            continue
        flag = _FLAGS.get(name, "--" + name.replace("_", "-"))
        raise UsageError(
            f"{flag} {mine} differs from the resumed run's {theirs}: a resumed run keeps its "
            "settings (start a new run to change them)"
        )
    saved.progress = asked.progress
    saved.replan = asked.replan
    if asked.save_every is not None:
        saved.save_every = asked.save_every
    saved.validate()
    epoch = int(header["position"]["epoch"])
    if epoch > saved.epochs:
        raise UsageError(f"--resume: {run_dir} finished all its {saved.epochs} epochs already")
    return saved, int(header["world_size"])
