"""``interlace bench dp``: every data-parallel strategy against PyTorch DDP, at chosen regimes.

Per model, a calibration launch picks the link rates that give target communication/compute
ratios; one launch per (model, ratio) then times every strategy side by side
(:mod:`interlace.bench.dp_rank`) and prints rows against DDP (:mod:`interlace.bench.dp_report`).
"""

from __future__ import annotations

import argparse
import datetime
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from interlace.bench.dp_rank import (
    Calibration,
    CalibrationJob,
    MeasureJob,
    calibrate_rank,
    measure_rank,
    parse_variant,
    variant_label,
)
from interlace.bench.dp_report import (
    LaunchContext,
    Row,
    format_cluster,
    format_summary,
    format_table,
    one_line,
    plot_speedups,
    rate_for_ratio,
    rows_from_measurement,
)
from interlace.bench.harness import DEFAULT_BATCH, split_blocks
from interlace.bench.session import Session, format_rate
from interlace.bench.skeleton import BenchConfig, Benchmark, Flags, parse_names, parse_ratios
from interlace.bench.tables import machine
from interlace.comm.cost import CostModel
from interlace.comm.links import parse_link
from interlace.comm.strategies import BENCH_STRATEGIES, STRATEGIES
from interlace.emulate import dilate_rate
from interlace.errors import UsageError
from interlace.sim.network import NETWORK_HELP, parse_network
from interlace.wrapping import parse_channels

PROG = "interlace bench dp"

DEFAULT_MODELS: tuple[str, ...] = ("mlp", "resnet20", "resnet56", "vgg11", "transformer")
DEFAULT_STRATEGIES: tuple[str, ...] = ("ddp", "wfbp", "fixed", "single", "mgwfbp")
DEFAULT_RATIOS: tuple[float, ...] = (0.5, 1.0, 2.0)

#: The link the calibration runs at: fast enough to be quick, slow enough to be faithful.
REF_LINK = "1gbit"
#: Slowest link chosen: below it, tbf's 96 KiB bucket is a visible share of a transfer.
MIN_LINK = "20mbit"
#: Fastest link chosen: on a 2-core machine faster shaping is not reproduced faithfully.
MAX_LINK = "2.5gbit"

#: Per-rank batch on emulated compute: the batch only feeds the gradients' arithmetic.
EMULATED_BATCH = 8

DEFAULT_ITERS = 12
DEFAULT_WARMUP = 2
DEFAULT_ROUNDS = 3
DEFAULT_NPROCS = 4
DEFAULT_TIMEOUT_S = 900.0

#: ``--quick``: two models at one ratio and fewer iterations, about two minutes.
QUICK_MODELS: tuple[str, ...] = ("mlp", "resnet20")
QUICK_RATIOS: tuple[float, ...] = (1.0,)
QUICK_ITERS = 8
QUICK_WARMUP = 1
QUICK_ROUNDS = 2

FLAGS = Flags(
    models=DEFAULT_MODELS,
    models_help=f"comma-separated zoo models or package.module:callable "
    f"(default {','.join(DEFAULT_MODELS)}; --quick: {','.join(QUICK_MODELS)})",
    nprocs=DEFAULT_NPROCS,
    nprocs_help="ranks",
    link=None,
    link_help="use this link for every row instead of calibrating one per ratio "
    "(e.g. 100mbit, 1gbit, 300mbit)",
    batch=None,
    batch_help="per-rank batch for every model (default: per model, "
    + ", ".join(f"{k} {v}" for k, v in DEFAULT_BATCH.items())
    + ")",
    iters=DEFAULT_ITERS,
    iters_help=f"timed iterations per strategy and launch (default {DEFAULT_ITERS}; "
    f"--quick: {QUICK_ITERS})",
    warmup=DEFAULT_WARMUP,
    warmup_help="untimed iterations per strategy after its buckets are final "
    f"(default {DEFAULT_WARMUP}; --quick: {QUICK_WARMUP})",
    timeout_s=DEFAULT_TIMEOUT_S,
    png_help="plot speed-ups vs DDP",
)
QUICK_FLAGS = replace(FLAGS, models=QUICK_MODELS, iters=QUICK_ITERS, warmup=QUICK_WARMUP)


@dataclass(frozen=True, kw_only=True)
class DpConfig(BenchConfig):
    """A validated ``interlace bench dp`` run: the shared settings and its own.

    Args:
        strategies: Every strategy variant (:func:`expand_variants`).
        ratios: Target communication/compute ratios (when links are calibrated).
        rounds: Round-robin blocks per launch.
        ref_link: The calibration's link.
        min_link: The slowest link a ratio may pick.
        max_link: The fastest link a ratio may pick.
        network: The target cluster (``--network``) whose all-reduce ``a`` and ``b`` the rows
            show.
        clip_grad_norm: Every strategy clips its gradients to this total norm before its step
            (``--clip-grad-norm``; None: no clipping).
        unused_layer: Give the model a layer its forward never calls (``--unused-layer``).
    """

    strategies: tuple[str, ...]
    ratios: tuple[float, ...]
    rounds: int
    ref_link: str = REF_LINK
    min_link: str = MIN_LINK
    max_link: str = MAX_LINK
    network: str | None = None
    clip_grad_norm: float | None = None
    unused_layer: bool = False

    def batch_for(self, model: str) -> int:
        """The per-rank batch of ``model``: ``--batch-size``, else :data:`EMULATED_BATCH` on
        emulated compute, else the model's default.

        Args:
            model: A zoo name or ``package.module:callable``.
        """
        if self.batch_size is None and self.compute.emulated:
            return EMULATED_BATCH
        return super().batch_for(model)

    @property
    def calibrates(self) -> bool:
        """Whether a calibration launch picks a link per model and ratio."""
        return self.netem and self.link is None


def expand_variants(
    strategies: Sequence[str], channels_text: str, compression_text: str
) -> tuple[str, ...]:
    """Every strategy with every channel setting and compression (torch's wrappers: one channel
    only; FSDP2 uncompressed). A strategy given as a variant label (``ddp/bf16``,
    ``overlap/k=auto/bf16``) is run as it says, not expanded.

    Args:
        strategies: Strategy names or variant labels.
        channels_text: The ``--channels`` value (comma-separated).
        compression_text: The ``--compression`` value (comma-separated).

    Raises:
        UsageError: For an unknown channel setting or compression, or a variant a strategy
            cannot take.
    """

    channel_settings = [parse_channels(part.strip()) for part in channels_text.split(",")]
    compressions = [_compression(part.strip()) for part in compression_text.split(",")]
    labels: list[str] = []
    for strategy in strategies:
        if "/" in strategy:
            labels.append(_checked_variant(strategy))
            continue
        torch_wrapper = STRATEGIES[strategy].torch_wrapper
        for compression in compressions if torch_wrapper != "fsdp2" else [None]:
            for channels in channel_settings if torch_wrapper is None else [1]:
                labels.append(variant_label(strategy, channels, compression))
    return tuple(dict.fromkeys(labels))


def _compression(text: str) -> str | None:
    if text not in ("none", "fp16", "bf16"):
        raise UsageError(f"--compression: unknown {text!r}; choose none, fp16 or bf16")
    return None if text == "none" else text


def _checked_variant(label: str) -> str:
    """``label`` as :func:`variant_label` writes it, once its parts are known to go together."""
    try:
        strategy, channels, compression = parse_variant(label)
    except ValueError:
        raise UsageError(
            f"--strategies: cannot read {label!r}; write STRATEGY[/k=K][/fp16|/bf16], "
            "e.g. ddp/bf16 or overlap/k=auto/bf16"
        ) from None
    if strategy not in BENCH_STRATEGIES:
        raise UsageError(
            f"--strategies: unknown strategy {strategy!r} in {label!r}; choose from "
            f"{', '.join(BENCH_STRATEGIES)}"
        )
    torch_wrapper = STRATEGIES[strategy].torch_wrapper
    if channels != 1 and torch_wrapper is not None:
        raise UsageError(f"--strategies: {strategy} sends on one channel; drop /k= from {label!r}")
    if compression is not None:
        _compression(compression)
        if torch_wrapper == "fsdp2":
            raise UsageError(f"--strategies: fsdp2 runs uncompressed; drop /{compression}")
    return variant_label(strategy, parse_channels(channels), compression)


def launch_context(config: DpConfig) -> LaunchContext:
    """The context of a launch at ``--link``: on emulated compute the ranks run at the link's
    rate / dilation, and ``--network`` gives the target's all-reduce cost.

    Args:
        config: A run with a fixed ``--link``.
    """
    assert config.link is not None
    target: CostModel | None = None
    if config.network is not None:
        target = parse_network(config.network).cost(config.nprocs)
    emulated = (
        format_rate(dilate_rate(config.link, config.compute.dilation))
        if config.compute.emulated
        else None
    )
    return LaunchContext(
        None, config.link, emulated_link=emulated, target=target, target_name=config.network
    )


def describe_conditions(config: DpConfig) -> str:
    """One paragraph saying when, where and how the rows were measured.

    Args:
        config: The run.
    """
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    network = (
        "loopback (no emulated network)"
        if not config.netem
        else f"emulated cluster, fixed link {config.link}"
        if config.link is not None
        else f"emulated cluster, links chosen per model from a calibration at {config.ref_link} "
        f"(clamped to {config.min_link}..{config.max_link})"
    )
    return (
        f"{now}; {machine()}; {config.nprocs} ranks on {network}; "
        + (
            f"compute {config.compute.label()}, every time undilated (measured / "
            f"{config.compute.dilation:g}), links at the given rate / "
            f"{config.compute.dilation:g}"
            if config.compute.emulated
            else f"input {'x'.join(map(str, config.input_shape))}"
        )
        + f"; per strategy {config.warmup} warm-up "
        f"iterations after its buckets are final, then {config.iters} timed in "
        f"{len(split_blocks(config.iters, config.rounds))} round-robin rounds; iteration = "
        "forward + backward + "
        + (
            ""
            if config.clip_grad_norm is None
            else f"clip_grad_norm_ to {config.clip_grad_norm:g} + "
        )
        + "SGD step, wall clock, maximum over ranks per iteration, median over iterations; "
        + (
            "bound = the trace's forward + max(its backward, one all-reduce of all gradients) + "
            "the measured step (the ideal-bound row)."
            if config.compute.emulated
            else "bound = forward + max(backward, one all-reduce of all gradients) + step of "
            "the plain module, measured in the same rounds; contended bound = the same iteration "
            "run with that all-reduce launched as backward starts (what perfect overlap costs on "
            "these cores)."
        )
    )


class DpBenchmark(Benchmark[DpConfig, Row]):
    """``interlace bench dp``: per model, a calibration launch picks the link of each target
    ratio, then one launch per (model, ratio) times every strategy side by side."""

    prog = PROG
    description = (
        "Compare data-parallel strategies with PyTorch DDP on the emulated cluster, "
        "at link rates chosen for target communication/compute ratios."
    )
    flags = FLAGS

    def add_own_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The strategies and their variants, the ratios and the links they may pick.

        Args:
            parser: The parser.
        """
        parser.add_argument(
            "--strategies",
            "--strategy",
            dest="strategies",
            help="comma-separated strategies, each run with every --channels and --compression, "
            "or variants run as named: STRATEGY[/k=K][/fp16|/bf16], e.g. ddp/bf16 "
            f"(default {','.join(DEFAULT_STRATEGIES)})",
        )
        parser.add_argument(
            "--channels",
            default="1",
            help="comma-separated channel settings each interlace strategy runs with, e.g. "
            "1,auto or 1,2,4 (default 1); the table gains the channels asked for and used",
        )
        parser.add_argument(
            "--compression",
            default="none",
            help="comma-separated compressions each strategy runs with: none, fp16, bf16 "
            "(default none)",
        )
        parser.add_argument(
            "--ratios",
            help="target communication/compute ratios; each picks a link rate per model "
            f"(default {','.join(f'{r:g}' for r in DEFAULT_RATIOS)}; --quick: "
            f"{','.join(f'{r:g}' for r in QUICK_RATIOS)})",
        )
        parser.add_argument(
            "--rounds",
            type=int,
            help="round-robin blocks the timed iterations are split into "
            f"(default {DEFAULT_ROUNDS}; --quick: {QUICK_ROUNDS})",
        )
        parser.add_argument(
            "--quick",
            action="store_true",
            help="a ~2-minute run: fewer models, one ratio, fewer iterations",
        )
        for flag, default, what in (
            ("--ref-link", REF_LINK, "link of the calibration launch"),
            ("--min-link", MIN_LINK, "slowest link a ratio may pick"),
            ("--max-link", MAX_LINK, "fastest link a ratio may pick"),
        ):
            parser.add_argument(flag, default=default, help=f"{what} (default {default})")
        parser.add_argument(
            "--clip-grad-norm",
            type=float,
            metavar="MAX",
            help="every strategy clips its gradients to this total norm between backward and "
            "the step (torch.nn.utils.clip_grad_norm_; default: no clipping)",
        )
        parser.add_argument(
            "--unused-layer",
            action="store_true",
            help="add a layer the forward never calls (about 1 MB of gradients) to every "
            "model; DDP then runs with find_unused_parameters=True",
        )
        parser.add_argument(
            "--network",
            metavar="SPEC",
            help="the target cluster whose all-reduce start-up a and per-byte b the rows show "
            f"beside the measured ones, e.g. osu:10gbe ({NETWORK_HELP})",
        )

    def config_from_args(self, args: argparse.Namespace) -> DpConfig:
        """Resolve ``--quick`` and defaults and check every value; raises UsageError.

        Args:
            args: The parsed flags (see :meth:`add_arguments`).
        """
        quick = bool(args.quick)
        if args.network is not None:
            parse_network(args.network)
        strategies = (
            parse_names(args.strategies, None, "strategies", "strategy")
            if args.strategies
            else DEFAULT_STRATEGIES
        )
        for name in strategies:
            if "/" not in name and name not in BENCH_STRATEGIES:
                raise UsageError(
                    f"--strategies: unknown strategy {name!r}; choose from "
                    f"{', '.join(BENCH_STRATEGIES)}, each optionally as a variant "
                    "(STRATEGY[/k=K][/fp16|/bf16], e.g. ddp/bf16)"
                )
        ratios = (
            parse_ratios(args.ratios)
            if args.ratios
            else (QUICK_RATIOS if quick else DEFAULT_RATIOS)
        )
        rounds = (
            args.rounds if args.rounds is not None else (QUICK_ROUNDS if quick else DEFAULT_ROUNDS)
        )
        if rounds < 1:
            raise UsageError(f"--rounds must be >= 1, got {rounds}")
        clip = args.clip_grad_norm
        if clip is not None and not (math.isfinite(clip) and clip > 0):
            raise UsageError(f"--clip-grad-norm must be a finite number > 0, got {clip}")
        for value in (args.ref_link, args.min_link, args.max_link):
            parse_link(value)
        if parse_link(args.min_link) > parse_link(args.max_link):
            raise UsageError(
                f"--min-link {args.min_link} is faster than --max-link {args.max_link}"
            )
        config = DpConfig.from_args(
            args,
            QUICK_FLAGS if quick else FLAGS,
            ranks_reason="data parallelism needs ranks to average",
            strategies=expand_variants(strategies, args.channels, args.compression),
            ratios=ratios,
            rounds=rounds,
            ref_link=args.ref_link,
            min_link=args.min_link,
            max_link=args.max_link,
            network=args.network,
            clip_grad_norm=clip,
            unused_layer=bool(args.unused_layer),
        )
        if config.compute.emulated and config.link is None and config.netem:
            raise UsageError(
                "--compute emulated:TRACE needs --link RATE (the target cluster's link; the "
                "ranks run at RATE / dilation) or --no-netem"
            )
        return config

    def launches(self, config: DpConfig) -> int:
        """The calibration, if any, and a launch per model (and ratio, when calibrated).

        Args:
            config: The run.
        """
        if config.calibrates:
            return 1 + len(config.models) * len(config.ratios)
        return len(config.models)

    def measure(self, config: DpConfig, session: Session) -> list[Row]:
        """Calibrate the links (unless fixed), then time every strategy per (model, ratio).

        Args:
            config: The run.
            session: Where the launches go.
        """
        calibrations = None
        if config.calibrates:
            calibration = CalibrationJob(
                config.models,
                tuple(config.batch_for(m) for m in config.models),
                config.input_shape,
                config.seed,
                num_classes=config.num_classes,
            )
            found = session.launch(
                calibrate_rank,
                calibration,
                what=f"calibration at {config.ref_link}",
                link=config.ref_link,
            )
            if found is None:
                return []
            calibrations = {c.model: c for c in found}
            for c in found:
                session.note(
                    f"calibration {c.model}: compute {c.compute_s * 1e3:.1f} ms, all-reduce of "
                    f"all gradients {c.allreduce_s * 1e3:.1f} ms at {config.ref_link} (tiny "
                    f"all-reduce {c.latency_s * 1e3:.2f} ms)"
                )
        rows: list[Row] = []
        for model, context in _launch_plan(config, calibrations):
            ratio = "-" if context.ratio is None else f"{context.ratio:g}"
            job = config.job(
                MeasureJob,
                model,
                strategies=config.strategies,
                rounds=config.rounds,
                clip_grad_norm=config.clip_grad_norm,
                unused_layer=config.unused_layer,
            )
            measurement = session.launch(
                measure_rank,
                job,
                what=f"{model} ratio {ratio} at {context.link}",
                link=context.link if config.netem else None,
            )
            if measurement is None:
                continue
            new_rows = [
                replace(row, clip_grad_norm=config.clip_grad_norm)
                for row in rows_from_measurement(measurement, context)
            ]
            rows.extend(new_rows)
            session.note(one_line(new_rows))
            for row in new_rows:
                if row.tuning:
                    session.note(f"  {row.strategy} {row.tuning}")
        return rows

    def report(self, config: DpConfig, rows: list[Row]) -> None:
        """How the rows were measured, the summary, the table, the measured clusters.

        Args:
            config: The run.
            rows: Its rows.
        """
        print(f"\n{PROG}: {describe_conditions(config)}\n")
        if not rows:
            return
        print(format_summary(rows))
        print()
        print(format_table(rows))
        cluster = format_cluster(rows)
        if cluster:
            print(f"\nall-reduce a + b*M{' (undilated)' if config.compute.emulated else ''}:")
            print(cluster)

    def plot(self, config: DpConfig, rows: list[Row]) -> str | None:
        """Speed-ups vs DDP, a panel per model.

        Args:
            config: The run.
            rows: Its rows.
        """
        assert config.png_path is not None
        plot_speedups(rows, config.png_path)
        return f"chart written to {config.png_path}"


def _launch_plan(
    config: DpConfig, calibrations: dict[str, Calibration] | None
) -> list[tuple[str, LaunchContext]]:
    """Every measuring launch: its model and context (the ratio and the link it runs at)."""
    plans = []
    for model in config.models:
        if not config.netem:
            plans.append((model, LaunchContext(None, "loopback")))
            continue
        if config.link is not None:
            plans.append((model, launch_context(config)))
            continue
        assert calibrations is not None
        calibration = calibrations[model]
        for ratio in config.ratios:
            choice = rate_for_ratio(
                ratio,
                calibration.compute_s,
                parse_link(config.ref_link),
                calibration.allreduce_s,
                latency_s=calibration.latency_s,
                min_bps=parse_link(config.min_link),
                max_bps=parse_link(config.max_link),
            )
            wanted = (
                "inf" if not math.isfinite(choice.wanted_bps) else format_rate(choice.wanted_bps)
            )
            context = LaunchContext(
                ratio, choice.link, choice.clamped, wanted if choice.clamped else None
            )
            plans.append((model, context))
    return plans


BENCHMARK = DpBenchmark()
add_arguments = BENCHMARK.add_arguments
config_from_args = BENCHMARK.config_from_args
run = BENCHMARK.run
main = BENCHMARK.main
