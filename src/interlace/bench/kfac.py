"""``interlace bench kfac``: where a distributed K-FAC iteration spends its time, per model.

The breakdown times one configuration phase by phase; ``--ablation`` times SPD-KFAC's modes
side by side (:mod:`interlace.bench.kfac_rank`) and prints their rows
(:mod:`interlace.bench.kfac_report`).
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from interlace.bench.harness import undilated
from interlace.bench.kfac_rank import (
    ABLATION_MODES,
    KFAC_PYTORCH_MODE,
    MEMORY_STEPS,
    AblationJob,
    BreakdownJob,
    KfacJob,
    measure_ablation_rank,
    measure_memory_rank,
    measure_rank,
)
from interlace.bench.kfac_report import (
    COLUMNS,
    AblationRow,
    KfacRow,
    ablation_rows,
    format_ablation_header,
    format_ablation_table,
    format_h2h_table,
    format_table,
    plot_ablation,
)
from interlace.bench.session import Session
from interlace.bench.skeleton import BenchConfig, Benchmark, Flags, parse_names
from interlace.bench.tables import Row, write_timeline
from interlace.errors import OptionError, UsageError
from interlace.kfac.enums import FactorSync
from interlace.kfac.options import check_placement
from interlace.kfac.placements import placement_from
from interlace.kfac.worker_groups import worker_count
from interlace.timeline import Event, Timeline

PROG = "interlace bench kfac"
#: The mlp is left out by default: on 3x32x32 inputs its first layer's A factor is 3073 x 3073,
#: whose eigendecomposition alone takes seconds on a CPU (ask for it with --models mlp).
DEFAULT_MODELS: tuple[str, ...] = ("resnet20", "resnet32", "transformer")
DEFAULT_LINK = "1gbit"
DEFAULT_NPROCS = 4
DEFAULT_ITERS = 10
DEFAULT_WARMUP = 3
DEFAULT_TIMEOUT_S = 900.0
COMPARE_CHOICES = (KFAC_PYTORCH_MODE,)
#: How to get kfac-pytorch, which is not on PyPI.
KFAC_PYTORCH_INSTALL = "pip install git+https://github.com/gpauloski/kfac-pytorch"
DEFAULT_ABLATION_MODELS: tuple[str, ...] = ("resnet20", "resnet56", "vgg11", "transformer")

FLAGS = Flags(
    models=DEFAULT_MODELS,
    models_help="comma-separated zoo names or package.module:callable "
    f"(default {','.join(DEFAULT_MODELS)}; with --ablation {','.join(DEFAULT_ABLATION_MODELS)})",
    nprocs=DEFAULT_NPROCS,
    nprocs_help="ranks",
    link=DEFAULT_LINK,
    link_help=f"emulated link per rank (default {DEFAULT_LINK})",
    batch=None,
    batch_help="per-rank batch (default: per model, as bench dp)",
    iters=DEFAULT_ITERS,
    iters_help="timed iterations",
    warmup=DEFAULT_WARMUP,
    warmup_help="untimed iterations before timing",
    timeout_s=DEFAULT_TIMEOUT_S,
    png_help="timeline of the first model's last iteration (PNG); with --ablation, bars of "
    "every mode's iteration time stacked by phase",
)

_KfacRow = TypeVar("_KfacRow", bound=Row)
_KfacJob = TypeVar("_KfacJob", bound=KfacJob)


def _flag(option: str) -> str:
    """A K-FAC keyword as this command's flag: ``grad_worker_fraction``, ``--grad-worker-fraction``.

    Args:
        option: The keyword.
    """
    return "--" + option.replace("_", "-")


@dataclass(frozen=True, kw_only=True)
class KfacConfig(BenchConfig):
    """A validated ``interlace bench kfac`` run: the shared settings and K-FAC's.

    Args:
        compute_method: How each factor is decomposed (``eigen`` or ``inverse``).
        grad_worker_fraction: 1 = COMM-OPT, 1/N = MEM-OPT, between = HYBRID.
        factor_update_steps: Steps between factor updates.
        inv_update_steps: Steps between decompositions.
        placement: Where the breakdown's decompositions are computed.
        factor_sync: When interlace's K-FAC averages factors (``KFAC(factor_sync=)``).
        compare: The peer run beside the ablation's modes (None: none).
        memory: The modes whose peak RSS is measured (``--memory``; empty: none).
    """

    compute_method: str
    grad_worker_fraction: float
    factor_update_steps: int
    inv_update_steps: int
    placement: str = "greedy"
    factor_sync: str = FactorSync.AT_DECOMPOSITION.value
    compare: str | None = None
    memory: tuple[str, ...] = ()

    @property
    def modes(self) -> tuple[str, ...]:
        """The ablation's contenders: SPD-KFAC's modes, then the compared peer."""
        return tuple(ABLATION_MODES) + ((self.compare,) if self.compare else ())

    @property
    def memory_modes(self) -> tuple[str, ...]:
        """The contenders measured alone for their memory, in :attr:`modes` order."""
        return tuple(mode for mode in self.modes if mode in self.memory)

    def kfac_job(self, kind: type[_KfacJob], model: str, **own: Any) -> _KfacJob:
        """The job of ``model``'s launch, with the run's K-FAC settings.

        Args:
            kind: The breakdown's or the ablation's job class.
            model: The model of the launch.
            **own: The fields that job adds.
        """
        return self.job(
            kind,
            model,
            compute_method=self.compute_method,
            factor_update_steps=self.factor_update_steps,
            inv_update_steps=self.inv_update_steps,
            factor_sync=self.factor_sync,
            **own,
        )


def check_kfac_pytorch() -> None:
    """Raise :class:`UsageError`, saying how to install it, unless kfac-pytorch is importable."""
    try:
        found = importlib.util.find_spec("kfac.preconditioner") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise UsageError(
            "--compare kfac-pytorch needs kfac-pytorch, which is not installed (it is not on "
            f"PyPI): {KFAC_PYTORCH_INSTALL}, then run again"
        )


class KfacBenchmark(Benchmark[KfacConfig, _KfacRow]):
    """``interlace bench kfac``'s flags and config, shared by the breakdown and the ablation."""

    prog = PROG
    description = "Where a distributed K-FAC iteration spends its time, per model."
    flags = FLAGS

    def add_own_arguments(self, parser: argparse.ArgumentParser) -> None:
        """K-FAC's settings, ``--ablation`` and what it adds.

        Args:
            parser: The parser.
        """
        parser.add_argument(
            "--compute-method",
            choices=("eigen", "inverse"),
            default="eigen",
            help="how each factor is decomposed for preconditioning: eigendecomposition or inverse",
        )
        parser.add_argument(
            "--grad-worker-fraction",
            type=float,
            default=1.0,
            help="1 = COMM-OPT (default), 1/N = MEM-OPT, between = HYBRID",
        )
        parser.add_argument(
            "--factor-update-steps",
            type=int,
            default=1,
            help="all-reduce and fold the factors every K steps (default 1, so factor "
            "communication is in every iteration)",
        )
        parser.add_argument(
            "--inv-update-steps",
            type=int,
            default=1,
            help="decompose every K steps (default 1, so every phase shows in every iteration)",
        )
        parser.add_argument(
            "--factor-sync",
            choices=tuple(choice.value for choice in FactorSync),
            default=FactorSync.AT_DECOMPOSITION.value,
            help="when interlace's K-FAC averages factors across ranks: at-decomposition "
            "(default: each rank folds its own between decompositions) or every-update "
            "(kfac-pytorch's)",
        )
        parser.add_argument(
            "--placement",
            choices=("greedy", "round-robin", "lbp"),
            help="where decompositions are computed (default greedy, SC20/KAISA; not with "
            "--ablation, whose modes set it)",
        )
        parser.add_argument(
            "--ablation",
            action="store_true",
            help="SPD-KFAC's ablation: the modes "
            + ", ".join(
                f"{mode} ({comm}, {fusion} fusion, {placement})"
                for mode, (comm, fusion, placement) in ABLATION_MODES.items()
            )
            + " side by side in one launch per model, with their speed-ups over dkfac",
        )
        parser.add_argument(
            "--compare",
            choices=COMPARE_CHOICES,
            help="with --ablation, also run kfac-pytorch's KFACPreconditioner (its defaults, the "
            f"same update intervals) side by side; needs it installed: {KFAC_PYTORCH_INSTALL}",
        )
        parser.add_argument(
            "--memory",
            nargs="?",
            const="all",
            metavar="MODES",
            help="with --ablation, also measure peak RSS per rank of every mode (or of the "
            "comma-separated MODES): one more launch per mode, the mode alone in fresh processes",
        )

    def config_from_args(self, args: argparse.Namespace) -> KfacConfig:
        """Resolve the defaults (the ablation's with ``--ablation``) and check every value;
        raises UsageError.

        Args:
            args: The parsed flags (see :meth:`add_arguments`).
        """
        if args.ablation:
            if args.placement is not None:
                raise UsageError("--placement is set by each --ablation mode; leave it out")
            if args.grad_worker_fraction != 1:
                raise UsageError(
                    "--ablation runs COMM-OPT (lbp needs it): --grad-worker-fraction 1"
                )
            if args.nprocs < 2:
                raise UsageError(f"--ablation needs -n >= 2 (nothing is sent on {args.nprocs})")
        memory: tuple[str, ...] = ()
        if args.memory and not args.ablation:
            raise UsageError("--memory measures the modes of --ablation; add --ablation")
        if args.memory:
            memory = (
                (*ABLATION_MODES, *COMPARE_CHOICES)
                if args.memory == "all"
                else parse_names(args.memory, (*ABLATION_MODES, *COMPARE_CHOICES), "memory", "mode")
            )
        if args.compare is not None:
            if not args.ablation:
                raise UsageError("--compare runs beside the modes of --ablation; add --ablation")
            check_kfac_pytorch()
        try:
            check_placement(placement_from(args.placement or "greedy"), args.grad_worker_fraction)
        except OptionError as error:
            raise UsageError(
                error.spelt(_flag, lambda name, value: f"{_flag(name)} {value}")
            ) from None
        if args.inv_update_steps < 1:
            raise UsageError(f"--inv-update-steps must be >= 1, got {args.inv_update_steps}")
        if args.factor_update_steps < 1:
            raise UsageError(f"--factor-update-steps must be >= 1, got {args.factor_update_steps}")
        try:
            worker_count(args.grad_worker_fraction, args.nprocs)
        except ValueError as exc:
            raise UsageError(f"--grad-worker-fraction: {exc}") from None
        return KfacConfig.from_args(
            args,
            replace(FLAGS, models=DEFAULT_ABLATION_MODELS) if args.ablation else FLAGS,
            min_ranks=1,
            compute_method=args.compute_method,
            grad_worker_fraction=args.grad_worker_fraction,
            factor_update_steps=args.factor_update_steps,
            inv_update_steps=args.inv_update_steps,
            placement=args.placement or "greedy",
            factor_sync=args.factor_sync,
            compare=args.compare,
            memory=memory,
        )


class Breakdown(KfacBenchmark[KfacRow]):
    """The phase breakdown: per model, one launch times DataParallel + K-FAC phase by phase."""

    def measure(self, config: KfacConfig, session: Session) -> list[KfacRow]:
        """One launch per model; with ``--png`` the first model's last iteration as a timeline.

        Args:
            config: The run.
            session: Where the launches go.
        """
        rows: list[KfacRow] = []
        for index, model in enumerate(config.models):
            job = config.kfac_job(
                BreakdownJob,
                model,
                grad_worker_fraction=config.grad_worker_fraction,
                placement=config.placement,
                timeline=bool(config.png_path) and index == 0,
            )
            value = session.launch(measure_rank, job, what=model, link=config.link)
            if value is None:
                continue
            medians = undilated(value["medians"], config.compute.dilation)
            rows.append(
                KfacRow(
                    model=model,
                    ranks=config.nprocs,
                    link=config.link_text,
                    compute=config.compute.label(),
                    batch=job.batch,
                    compute_method=job.compute_method,
                    grad_worker_fraction=job.grad_worker_fraction,
                    inv_update_steps=job.inv_update_steps,
                    placement=job.placement,
                    layers=value["layers"],
                    iteration_ms=medians["iteration"] * 1e3,
                    phases_ms={key: medians[key] * 1e3 for key, _ in COLUMNS},
                    factor_update_steps=job.factor_update_steps,
                )
            )
            if job.timeline and value["events"] and config.png_path:
                timeline = Timeline(
                    [Event(**event) for event in value["events"]],
                    title=f"{model}: DataParallel + K-FAC, one iteration, "
                    f"{config.nprocs} ranks on {config.launch_link or 'loopback'}",
                )
                session.wrote(write_timeline(timeline, config.png_path))
            session.note(format_table(rows[-1:]).splitlines()[-1])
        return rows

    def report(self, config: KfacConfig, rows: list[KfacRow]) -> None:
        """The settings, then the breakdown's table.

        Args:
            config: The run.
            rows: Its rows.
        """
        link = config.launch_link
        print(
            f"\nK-FAC phase breakdown ({config.compute_method}, grad_worker_fraction "
            f"{config.grad_worker_fraction:g}, {config.placement} placement, "
            + (
                f"factors every {config.factor_update_steps} steps, "
                if config.factor_update_steps != 1
                else ""
            )
            + f"decompositions every {config.inv_update_steps} step(s)), "
            f"{config.nprocs} ranks on {config.link_text}, compute {config.compute.label()}"
            + (f" (links at {link}, times undilated)" if config.compute.emulated and link else "")
            + "; per-rank batch per model "
            f"({', '.join(f'{r.model} {r.batch}' for r in rows)}); medians over {config.iters} "
            "iterations of the maximum over ranks:\n"
        )
        print(format_table(rows))


class Ablation(KfacBenchmark[AblationRow]):
    """SPD-KFAC's ablation: per model, one launch times every mode side by side, and with
    ``--memory`` one more launch per mode measures its memory alone."""

    def launches(self, config: KfacConfig) -> int:
        """Per model, the ablation's launch and a memory launch per mode asked for.

        Args:
            config: The run.
        """
        return len(config.models) * (1 + len(config.memory_modes))

    def measure(self, config: KfacConfig, session: Session) -> list[AblationRow]:
        """The modes side by side per model, then their memory.

        Args:
            config: The run.
            session: Where the launches go.
        """
        rows: list[AblationRow] = []
        for model in config.models:
            job = config.kfac_job(AblationJob, model, modes=config.modes)
            value = session.launch(measure_ablation_rank, job, what=model, link=config.link)
            if value is None:
                continue
            value["medians"] = undilated(value["medians"], config.compute.dilation)
            if config.memory_modes:
                value["memory"] = _measure_memory(job, config, session)
            new_rows = ablation_rows(
                model,
                value,
                compute=config.compute.label(),
                ranks=config.nprocs,
                link=config.link_text,
                batch=job.batch,
                factor_update_steps=job.factor_update_steps,
                inv_update_steps=job.inv_update_steps,
                iters=job.iters,
            )
            rows += new_rows
            for line in format_ablation_table(new_rows).splitlines()[2:]:
                session.note(line)
        return rows

    def report(self, config: KfacConfig, rows: list[AblationRow]) -> None:
        """The regime, the modes' table, and against kfac-pytorch the head-to-head table.

        Args:
            config: The run.
            rows: Its rows.
        """
        header = format_ablation_header(
            rows,
            ranks=config.nprocs,
            link=config.link_text,
            compute_method=config.compute_method,
            iters=config.iters,
            compute=config.compute.label(),
        )
        print(f"\n{header}\n")
        print(format_ablation_table(rows))
        if config.compare is None:
            return
        print(
            f"\nAgainst {config.compare}: whole cycles of {config.inv_update_steps} iteration(s) "
            "(mean of each iteration's slowest rank; phases likewise) beside the per-step median"
            + (
                "; peak RSS of each mode alone in fresh processes, after its plans are final "
                f"and at least {MEMORY_STEPS} steps, and as many as any mode measured before it"
                if config.memory
                else ""
            )
            + ":\n"
        )
        print(format_h2h_table(rows))

    def plot(self, config: KfacConfig, rows: list[AblationRow]) -> str | None:
        """Grouped bars, a panel per model, a bar per mode stacked by phase.

        Args:
            config: The run.
            rows: Its rows.
        """
        assert config.png_path is not None
        plot_ablation(
            rows,
            config.png_path,
            title=f"SPD-KFAC ablation: iteration time by phase, {config.nprocs} ranks on "
            f"{config.link_text}",
        )
        return f"chart written to {config.png_path}"


def _measure_memory(
    job: AblationJob, config: KfacConfig, session: Session
) -> dict[str, dict[str, Any]]:
    """Each mode's peak RSS, one launch per mode (:func:`measure_memory_rank`); a failed
    launch leaves its mode out.

    Peak RSS climbs with the steps taken, so each launch takes at least as many steps as any
    launch before it; the modes run in ``job.modes`` order, the compared peer last."""
    memory: dict[str, dict[str, Any]] = {}
    steps = MEMORY_STEPS
    for mode in config.memory_modes:
        launch = replace(job, modes=(mode,), memory_steps=steps)
        value = session.launch(
            measure_memory_rank, launch, what=f"{job.model} {mode} memory", link=config.link
        )
        if value is None:
            continue
        memory[mode] = value
        steps = max(steps, int(value["steps"]))
    return memory


BREAKDOWN = Breakdown()
ABLATION = Ablation()
#: The breakdown and the ablation take the same flags and make the same config.
add_arguments = BREAKDOWN.add_arguments
config_from_args = BREAKDOWN.config_from_args


def run(args: argparse.Namespace) -> int:
    """Run the breakdown, or with ``--ablation`` the ablation; the exit status.

    Args:
        args: The parsed flags (see :func:`add_arguments`).
    """
    return (ABLATION if args.ablation else BREAKDOWN).run(args)
