"""The race, MLPerf style: epochs and wall-clock to a fixed accuracy, K-FAC against SGD, MNIST-1D.

Each optimiser gets the same number of configurations, picked by epochs to the target on the
first seed, then rerun on the other seeds; ``--large-batch`` races at a global batch of 1,024.
Resumable: finished runs in ``--out`` or ``--json`` are kept. See docs/kfac/race.md.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from interlace import launch
from interlace.bench.kfac_rank import DEFAULT_MODE
from interlace.distenv import finish_distributed, init_distributed
from interlace.runlog import read_metrics
from interlace.train import TrainConfig, train_data_parallel

#: The grids, most promising first so that ``--configs N`` keeps the likeliest winners. SGD:
#: learning rate x momentum; K-FAC: learning rate x damping x KL-clip (momentum 0.9).
SGD_LRS = (0.1, 0.2, 0.05, 0.4)
SGD_MOMENTA = (0.9, 0.8)
KFAC_LRS = (0.1, 0.03)
KFAC_DAMPINGS = (0.03, 0.01)
KFAC_KL_CLIPS = (0.001, 0.01)
#: Starting dampings under Levenberg-Marquardt adaptation (it moves them within x100 each way).
KFAC_LM_DAMPINGS = (0.01, 0.001)
#: K-FAC settings held fixed: factors every step, decompositions every 10 (4 per epoch here).
KFAC_INV_UPDATE_STEPS = 10
KFAC_FACTOR_UPDATE_STEPS = 1
KFAC_FACTOR_DECAY = 0.95
KFAC_FIXED = {
    "inv_update_steps": KFAC_INV_UPDATE_STEPS,
    "factor_update_steps": KFAC_FACTOR_UPDATE_STEPS,
    "factor_decay": KFAC_FACTOR_DECAY,
}
#: Epoch caps: the cosine schedule spans the cap, the same for both optimisers.
DEFAULT_EPOCHS = {"mlp1d": 30, "cnn1d": 25, "resnet1d": 15}
#: The target is 96% of SGD's best on the first seed's sweep (:func:`derived_target`); these
#: fixed ones (96% of single-process SGD at lr 0.1, momentum 0.9) are raced too.
DEFAULT_TARGETS = {"mlp1d": 0.60, "cnn1d": 0.90}
TARGET_SHARE = 0.96
NAMES = {"sgd": "SGD", "kfac": "K-FAC"}
#: Side-by-side timing runs: epochs each (the first left out), and their seeds' start.
TIMING_EPOCHS = 3
TIMING_SEED = 100
#: The marker file of a run whose launch failed; it is not tried again.
FAILED = "FAILED"

#: The large-batch race (``--large-batch``): 4 ranks x 256 (a global batch of 1,024) on 20,000
#: MNIST-1D training sequences, 19 steps an epoch. Both sides scale the batch-100 race's picks
#: (SGD 0.2-0.4, K-FAC 0.03-0.1) by x3.2 (square root) to x10.24 (linear) and warm up.
LARGE_BATCH = 256
LARGE_TRAIN_SAMPLES = 20_000
#: SGD with momentum 0.9 (Goyal et al.'s recipe): peak learning rate x warm-up epochs. cnn1d
#: (no normalisation) collapses to chance at 0.5-4 with either warm-up, so its rates are lower.
LARGE_SGD_LRS = {"cnn1d": (0.25, 0.5, 0.125, 0.0625), "*": (1.0, 2.0, 0.5, 4.0)}
LARGE_WARMUPS = (3.0, 1.0)
#: K-FAC (momentum 0.9, damping 0.03, the batch-100 race's usual pick): learning rate x KL-clip
#: x warm-up epochs. While the clip binds it, not the learning rate, sizes the step.
LARGE_KFAC_LRS = (0.3, 1.0)
LARGE_KFAC_KL_CLIPS = (0.001, 0.01)
LARGE_KFAC_DAMPING = 0.03
#: Epoch caps (19 steps an epoch); resnet1d's short cap keeps the race near an hour on 2 cores.
LARGE_EPOCHS = {"mlp1d": 25, "cnn1d": 20, "resnet1d": 8}
PAPER_TRAIN_SAMPLES = 4000


@dataclass(frozen=True)
class RaceRun:
    """One training run of the race.

    Args:
        model: a 1-D zoo model (mlp1d, cnn1d, resnet1d).
        optimizer: ``"sgd"`` or ``"kfac"``.
        lr: peak learning rate.
        momentum: SGD momentum (K-FAC keeps 0.9).
        damping: K-FAC damping (None for SGD).
        kl_clip: K-FAC KL-clip (None for SGD).
        seed: seeds the model and the shuffle.
        epochs: the epoch cap, which the schedule spans.
        adaptation: K-FAC's damping adaptation, ``"fixed"`` or ``"levenberg-marquardt"``
            (then ``damping`` is where it starts).
        warmup: epochs of linear learning-rate warm-up (None: the job's default, 1, unnamed).
        train_samples: MNIST-1D training sequences (None: the paper's 4,000).
    """

    model: str
    optimizer: str
    lr: float
    momentum: float
    damping: float | None
    kl_clip: float | None
    seed: int
    epochs: int
    adaptation: str = "fixed"
    warmup: float | None = None
    train_samples: int | None = None

    @property
    def label(self) -> str:
        """The configuration in words, without the seed: ``lr 0.1, momentum 0.9``."""
        warmup = "" if self.warmup is None else f", warm-up {self.warmup:g} ep"
        if self.optimizer == "sgd":
            return f"lr {self.lr:g}, momentum {self.momentum:g}{warmup}"
        adaptive = "" if self.adaptation == "fixed" else " adaptive from"
        return (
            f"lr {self.lr:g}, damping{adaptive} {self.damping:g}, kl_clip {self.kl_clip:g}{warmup}"
        )

    @property
    def name(self) -> str:
        """The run's folder name, unique within a model: optimiser, configuration, seed."""
        # The batch-100 race's names carry neither suffix, so its folders stay valid.
        extra = "" if self.warmup is None else f"-w{self.warmup:g}"
        extra += "" if self.train_samples is None else f"-n{self.train_samples}"
        if self.optimizer == "sgd":
            return f"sgd-lr{self.lr:g}-m{self.momentum:g}{extra}-e{self.epochs}-seed{self.seed}"
        return (
            f"kfac-lr{self.lr:g}-d{self.damping:g}-kl{self.kl_clip:g}"
            f"{'' if self.adaptation == 'fixed' else '-lm'}{extra}-e{self.epochs}"
            f"-seed{self.seed}"
        )

    def config(self, batch_size: int) -> TrainConfig:
        """The training job's config of this run.

        Args:
            batch_size: the per-rank batch.
        """
        kfac = self.optimizer == "kfac"
        return TrainConfig(
            model=self.model,
            data="mnist1d",
            epochs=self.epochs,
            batch_size=batch_size,
            lr=self.lr,
            momentum=self.momentum,
            warmup_epochs=1.0 if self.warmup is None else self.warmup,
            synthetic_size=self.train_samples,
            seed=self.seed,
            optimizer=self.optimizer,
            deterministic=True,  # fixed buckets: a rerun of a seed gives the same curve
            progress=False,
            kfac_damping=self.damping if kfac and self.damping is not None else 0.001,
            kfac_kl_clip=self.kl_clip if kfac and self.kl_clip is not None else 0.001,
            kfac_inv_update_steps=KFAC_INV_UPDATE_STEPS,
            kfac_factor_update_steps=KFAC_FACTOR_UPDATE_STEPS,
            kfac_factor_decay=KFAC_FACTOR_DECAY,
            kfac_damping_adaptation=self.adaptation if kfac else "fixed",
        )


def grid(
    model: str,
    optimizer: str,
    epochs: int,
    configs: int,
    adaptation: str = "fixed",
    *,
    large: bool = False,
    train_samples: int | None = None,
) -> list[RaceRun]:
    """The first ``configs`` configurations of an optimiser's grid, on seed 0.

    Args:
        model: the model.
        optimizer: ``"sgd"`` or ``"kfac"``.
        epochs: the epoch cap.
        configs: how many configurations to keep (at most the grid's 8).
        adaptation: K-FAC's damping adaptation (its grid then starts from smaller dampings).
        large: the large-batch grids (scaled learning rates, longer warm-ups).
        train_samples: MNIST-1D training sequences (None: the paper's 4,000).
    """
    runs: list[RaceRun]
    if large and optimizer == "sgd":
        runs = [
            RaceRun(model, "sgd", lr, 0.9, None, None, 0, epochs, "fixed", warmup, train_samples)
            for warmup, lr in itertools.product(
                LARGE_WARMUPS, LARGE_SGD_LRS.get(model, LARGE_SGD_LRS["*"])
            )
        ]
    elif large:
        runs = [
            RaceRun(
                model,
                "kfac",
                lr,
                0.9,
                LARGE_KFAC_DAMPING if adaptation == "fixed" else KFAC_LM_DAMPINGS[0],
                clip,
                0,
                epochs,
                adaptation,
                warmup=warmup,
                train_samples=train_samples,
            )
            for warmup, clip, lr in itertools.product(
                LARGE_WARMUPS, LARGE_KFAC_KL_CLIPS, LARGE_KFAC_LRS
            )
        ]
    elif optimizer == "sgd":
        runs = [
            RaceRun(model, "sgd", lr, momentum, None, None, 0, epochs)
            for momentum, lr in itertools.product(SGD_MOMENTA, SGD_LRS)
        ]
    else:
        runs = [
            RaceRun(model, "kfac", lr, 0.9, damping, clip, 0, epochs, adaptation)
            for damping, clip, lr in itertools.product(
                KFAC_DAMPINGS if adaptation == "fixed" else KFAC_LM_DAMPINGS,
                KFAC_KL_CLIPS,
                KFAC_LRS,
            )
        ]
    return runs[:configs]


def epochs_to(accuracies: Sequence[float], target: float) -> int | None:
    """The first epoch (1-based) whose test accuracy is at least ``target``; None if none is.

    Args:
        accuracies: test accuracy after each epoch.
        target: the accuracy to reach.
    """
    return next((epoch for epoch, acc in enumerate(accuracies, 1) if acc >= target), None)


def derived_target(best: float, share: float = TARGET_SHARE) -> float:
    """``share`` of SGD's best accuracy, rounded down to a whole percent.

    Args:
        best: SGD's best test accuracy, as a fraction.
        share: the share of it to reach.
    """
    return math.floor(round(100 * share * best, 6)) / 100


def _best(rec: dict[str, Any]) -> float:
    """A run's best test accuracy; 0 for a run that failed before its first epoch."""
    return max(rec["test_accuracy"], default=0.0)


def pick(records: Sequence[dict[str, Any]], target: float) -> dict[str, Any]:
    """The configuration that reaches ``target`` in the fewest epochs.

    Ties go to the shorter wall-clock to the target, then to the higher best accuracy; when
    none reaches it, the highest best accuracy wins.

    Args:
        records: one optimiser's runs on the selection seed (see :func:`record`).
        target: the accuracy to reach.
    """

    def key(rec: dict[str, Any]) -> tuple[float, float, float]:
        reached = epochs_to(rec["test_accuracy"], target)
        if reached is None:
            return (math.inf, math.inf, -_best(rec))
        return (reached, sum(rec["epoch_s"][:reached]), -_best(rec))

    return min(records, key=key)


def steps_per_epoch(train_samples: int | None, nprocs: int, batch: int) -> int:
    """Optimizer steps an epoch: each rank's shard in whole batches (the job drops the rest).

    Args:
        train_samples: MNIST-1D training sequences (None: the paper's 4,000).
        nprocs: ranks.
        batch: per-rank batch.
    """
    return (train_samples or PAPER_TRAIN_SAMPLES) // nprocs // batch


def record(run: RaceRun, run_dir: Path, nprocs: int, batch: int) -> dict[str, Any]:
    """One run's entry of race.json: its settings and its per-epoch curve.

    Args:
        run: the run.
        run_dir: its folder (metrics.csv, and FAILED when it failed).
        nprocs: ranks.
        batch: per-rank batch.
    """
    path = run_dir / "metrics.csv"
    metrics = read_metrics(path) if path.exists() else []
    failed = run_dir / FAILED
    return {
        "failed": failed.read_text().strip() if failed.exists() else None,
        **asdict(run),
        "config": run.label,
        "nprocs": nprocs,
        "batch_size": batch,
        "global_batch": nprocs * batch,
        "steps_per_epoch": steps_per_epoch(run.train_samples, nprocs, batch),
        "test_accuracy": [row["test_accuracy"] for row in metrics],
        "train_loss": [row["train_loss"] for row in metrics],
        "epoch_s": [row["epoch_s"] for row in metrics],
    }


def summarise(finals: Sequence[dict[str, Any]], target: float) -> dict[str, Any]:
    """One optimiser's row of the table from its picked configuration's seeds.

    A seed that never reaches the target counts as infinitely many epochs (and seconds) in the
    median, so a median over a majority of such seeds is None ("not reached").

    Args:
        finals: the picked configuration's runs, one per seed.
        target: the accuracy to reach.
    """
    reached = [epochs_to(rec["test_accuracy"], target) for rec in finals]
    epochs = [math.inf if e is None else float(e) for e in reached]
    seconds = [
        math.inf if e is None else sum(rec["epoch_s"][:e])
        for rec, e in zip(finals, reached, strict=True)
    ]
    median_epochs = statistics.median(epochs)
    median_s = statistics.median(seconds)
    per_epoch = finals[0].get("steps_per_epoch")
    steps = [None if e is None or per_epoch is None else e * per_epoch for e in reached]
    return {
        "config": finals[0]["config"],
        "seeds": [rec["seed"] for rec in finals],
        "epochs_to_target": reached,
        "median_epochs": None if math.isinf(median_epochs) else median_epochs,
        # Steps, for wall-clock from per-step costs measured elsewhere (an epoch is evaluated
        # whole, so a run reaches the target at an epoch's last step).
        "steps_per_epoch": per_epoch,
        "steps_to_target": steps,
        "median_steps": (
            None if math.isinf(median_epochs) or per_epoch is None else median_epochs * per_epoch
        ),
        "seconds_to_target": [None if math.isinf(s) else s for s in seconds],
        "median_seconds": None if math.isinf(median_s) else median_s,
        "best_accuracy": [_best(rec) for rec in finals],
        # The first epoch also warms up (first calls, buffers): the median of the others.
        "epoch_s_median": statistics.median(
            [s for rec in finals for s in rec["epoch_s"][1:]] or [math.nan]
        ),
    }


def ratio(sgd: float | None, kfac: float | None) -> float | None:
    """SGD's epochs (or seconds) over K-FAC's (above 1: K-FAC is faster); None when either
    never reached the target.

    Args:
        sgd: SGD's median epochs (or seconds) to the target.
        kfac: K-FAC's median epochs (or seconds) to the target.
    """
    if sgd is None or kfac is None:
        return None
    return sgd / kfac


def _span(values: Sequence[float | int | None], fmt: str) -> str:
    """``median [min-max]`` of values, None meaning never (shown as a dash)."""
    known = [v for v in values if v is not None]
    finite = [math.inf if v is None else float(v) for v in values]
    median = statistics.median(finite)
    if not known:
        return "not reached"
    middle = "not reached" if math.isinf(median) else format(median, fmt)
    low = format(min(known), fmt)
    high = "never" if len(known) < len(values) else format(max(known), fmt)
    return f"{middle} [{low}-{high}]"


def table(models: Sequence[dict[str, Any]]) -> str:
    """The markdown table of the race, a row per model and optimiser.

    "s to target" sums the race runs' own epoch times (measured at different moments);
    "SGD/K-FAC time to target" is the epoch ratio divided by the side-by-side cost ratio.

    Args:
        models: per model: ``model``, ``target``, ``sgd`` and ``kfac`` summaries.
    """
    lines = [
        "| model | target | optimiser | picked config | epochs to target, median [min-max] "
        "| s to target, median [min-max] | best acc. % (median) | s per epoch, side by side "
        "| SGD/K-FAC epochs to target | SGD/K-FAC time to target |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in models:
        speedup = ratio(entry["sgd"]["median_epochs"], entry["kfac"]["median_epochs"])
        cost = entry.get("epoch_s_side_by_side", {})
        clock = None
        if speedup is not None and cost:
            clock = speedup / cost["kfac_over_sgd"]
        for optimizer in ("sgd", "kfac"):
            row = entry[optimizer]
            best = 100 * statistics.median(row["best_accuracy"])
            epochs = "" if optimizer == "sgd" else ("-" if speedup is None else f"{speedup:.2f}x")
            time_ratio = "" if optimizer == "sgd" else ("-" if clock is None else f"{clock:.2f}x")
            per_epoch = f"{cost[optimizer]:.2f}" if cost else "-"
            lines.append(
                f"| {entry['model']} | {100 * entry['target']:g}% | {NAMES[optimizer]} | "
                f"{row['config']} | {_span(row['epochs_to_target'], 'g')} | "
                f"{_span(row['seconds_to_target'], '.1f')} | {best:.1f} | {per_epoch} | "
                f"{epochs} | {time_ratio} |"
            )
    return "\n".join(lines)


#: The K-FAC mode that prices a race step, as ``interlace bench kfac --ablation`` names it: the
#: training job's default on the race's 4 ranks (pipelined factor all-reduces in merged
#: buckets, LBP placement). The runs themselves predate LBP as the default; placement moves
#: where a decomposition is made, not what it is, so their steps to the target stand.
RACE_KFAC_MODE = DEFAULT_MODE


@dataclass(frozen=True)
class StepCosts:
    """Seconds per optimizer step of each side, from one ``interlace bench kfac`` JSON.

    That bench times, in the same rounds, each K-FAC mode's whole iteration, the plain model's
    forward + backward and DataParallel's passes; both sides' costs come from those rounds.

    Args:
        source: the bench JSON they come from.
        compute: what the bench ran on (``emulated:resnet20-h200 D=16``; times undilated).
        mode: the K-FAC mode whose row gives K-FAC's step.
        ranks: the bench's ranks.
        link: its link.
        batch: its per-rank batch.
        sgd_s: an SGD step: median forward + backward, DataParallel's gradient communication
            beyond it, and the optimizer step.
        kfac_s: a K-FAC step: the mode's mean iteration over whole cycles of
            ``KFAC_INV_UPDATE_STEPS`` (one decomposition each), as the race's K-FAC runs.
    """

    source: str
    compute: str
    mode: str
    ranks: int
    link: str
    batch: int
    sgd_s: float
    kfac_s: float

    @property
    def kfac_over_sgd(self) -> float:
        """A K-FAC step's cost over an SGD step's."""
        return self.kfac_s / self.sgd_s

    def seconds(self, optimizer: str) -> float:
        """One step of ``optimizer`` (``"sgd"`` or ``"kfac"``), in seconds.

        Args:
            optimizer: ``"sgd"`` or ``"kfac"``.
        """
        return self.sgd_s if optimizer == "sgd" else self.kfac_s

    @property
    def label(self) -> str:
        """Where the costs come from, in one line."""
        return (
            f"{self.compute}, {self.ranks} ranks x batch {self.batch}, link {self.link}, "
            f"K-FAC mode {self.mode}, from {self.source}"
        )


def step_costs(
    rows: Sequence[dict[str, Any]], source: str, mode: str = RACE_KFAC_MODE
) -> StepCosts:
    """Both sides' per-step costs from a bench's rows (``interlace bench kfac --ablation``).

    Args:
        rows: the bench JSON's rows, one per K-FAC mode.
        source: where they were read from (for the label).
        mode: the K-FAC mode the race's runs used.

    Raises:
        ValueError: no row of ``mode``, no whole-cycle time, or update intervals other than the
            race's (factors every step, decompositions every ``KFAC_INV_UPDATE_STEPS``).
    """
    found = [row for row in rows if row.get("mode") == mode]
    if len(found) != 1:
        raise ValueError(f"{source}: expected one row of mode {mode!r}, found {len(found)}")
    row = found[0]
    intervals = (row["factor_update_steps"], row["inv_update_steps"])
    if intervals != (KFAC_FACTOR_UPDATE_STEPS, KFAC_INV_UPDATE_STEPS):
        raise ValueError(
            f"{source}: factors every {intervals[0]}, decompositions every {intervals[1]} "
            f"steps; the race's K-FAC uses {KFAC_FACTOR_UPDATE_STEPS} and "
            f"{KFAC_INV_UPDATE_STEPS}"
        )
    if row.get("cycle_iteration_s") is None:
        raise ValueError(f"{source}: mode {mode!r} has no whole-cycle iteration time")
    phases = row["phases_s"]
    return StepCosts(
        source=source,
        compute=row.get("compute", "real"),
        mode=mode,
        ranks=row["ranks"],
        link=row["link"],
        batch=row["batch"],
        sgd_s=phases["forward_backward"] + phases["gradient_comm"] + phases["optimizer"],
        kfac_s=row["cycle_iteration_s"],
    )


def load_step_costs(path: Path, mode: str = RACE_KFAC_MODE) -> StepCosts:
    """:func:`step_costs` of a bench JSON file (a list of rows).

    Args:
        path: the JSON, e.g. docs/kfac/h2h-resnet20-h200-10gbit-inv10.json.
        mode: the K-FAC mode the race's runs used.
    """
    return step_costs(json.loads(path.read_text()), str(path), mode)


def wall_clock(row: dict[str, Any], step_s: float) -> dict[str, Any]:
    """Wall-clock to the target of one side's seeds: its steps to the target x ``step_s``.

    A seed that never reached the target counts as never (None), as in :func:`summarise`.

    Args:
        row: the side's summary (:func:`summarise`), with ``steps_to_target``.
        step_s: seconds per step of that side.
    """
    seconds = [None if steps is None else steps * step_s for steps in row["steps_to_target"]]
    median = statistics.median([math.inf if s is None else s for s in seconds])
    return {"seconds": seconds, "median_s": None if math.isinf(median) else median}


def step_table(models: Sequence[dict[str, Any]], costs: StepCosts | None = None) -> str:
    """The large-batch race's table: epochs, steps and wall-clock to the target, per model.

    Wall-clock to the target is each seed's steps to it times its side's per-step cost from
    ``costs`` (medians over the seeds); without ``costs`` those columns are dashes.

    Args:
        models: per model: ``model``, ``target``, ``sgd`` and ``kfac`` summaries.
        costs: the per-step costs (:func:`load_step_costs`), or None.
    """
    lines = [
        "| model | target | optimiser | picked config | seeds reaching it "
        "| epochs to target, median [min-max] | steps to target, median [min-max] "
        "| best acc. % (median) | SGD/K-FAC epochs to target | ms per step "
        "| wall-clock to target, s, median [min-max] | SGD/K-FAC wall-clock to target |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in models:
        speedup = ratio(entry["sgd"]["median_epochs"], entry["kfac"]["median_epochs"])
        clocks = {
            o: wall_clock(entry[o], costs.seconds(o)) if costs else None for o in ("sgd", "kfac")
        }
        for optimizer in ("sgd", "kfac"):
            row = entry[optimizer]
            reached = sum(e is not None for e in row["epochs_to_target"])
            best = 100 * statistics.median(row["best_accuracy"])
            epochs = "" if optimizer == "sgd" else ("-" if speedup is None else f"{speedup:.2f}x")
            clock = clocks[optimizer]
            per_step = "-" if costs is None else f"{1e3 * costs.seconds(optimizer):.2f}"
            seconds = "-" if clock is None else _span(clock["seconds"], ".2f")
            faster = ""
            if optimizer == "kfac":
                sgd_clock, kfac_clock = clocks["sgd"], clocks["kfac"]
                both = None
                if sgd_clock is not None and kfac_clock is not None:
                    both = ratio(sgd_clock["median_s"], kfac_clock["median_s"])
                faster = "-" if both is None else f"{both:.2f}x"
            lines.append(
                f"| {entry['model']} | {100 * entry['target']:g}% | {NAMES[optimizer]} | "
                f"{row['config']} | {reached} of {len(row['epochs_to_target'])} | "
                f"{_span(row['epochs_to_target'], 'g')} | "
                f"{_span(row['steps_to_target'], 'g')} | {best:.1f} | {epochs} | {per_step} | "
                f"{seconds} | {faster} |"
            )
    return "\n".join(lines)


def timing_runs(bases: dict[str, RaceRun], rounds: int) -> list[RaceRun]:
    """Short runs of both picked configurations, alternated in one launch, to time an epoch.

    The race's own runs are timed at different moments, under whatever else the machine runs;
    alternating SGD and K-FAC epochs in one job gives a cost ratio measured side by side.

    Args:
        bases: the picked run of each optimiser.
        rounds: how many SGD-then-K-FAC pairs.
    """
    return [
        replace(bases[o], seed=TIMING_SEED + k, epochs=TIMING_EPOCHS)
        for k in range(rounds)
        for o in ("sgd", "kfac")
    ]


def epoch_cost(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Median seconds per epoch of each optimiser, the first epoch of a run (warm-up) left out.

    Args:
        records: the records of :func:`timing_runs`.
    """
    cost = {
        o: statistics.median(
            [s for rec in records if rec["optimizer"] == o for s in rec["epoch_s"][1:]]
            or [math.nan]
        )
        for o in ("sgd", "kfac")
    }
    return {**cost, "kfac_over_sgd": cost["kfac"] / cost["sgd"]}


class Results:
    """The race's JSON, rewritten (atomically) after every finished run.

    A rerun reads it back and does not train the runs it holds again, even when their folders
    in ``--out`` are gone.

    Args:
        path: the JSON file (None: keep nothing).
        header: the race's settings, written above the runs.
    """

    def __init__(self, path: Path | None, header: dict[str, Any]) -> None:
        self.path = path
        self.header = header
        self.summary: list[dict[str, Any]] = []
        self.runs: dict[str, dict[str, Any]] = {}
        if path is not None and path.is_file():
            for rec in json.loads(path.read_text()).get("runs", []):
                self.runs[self._key(rec)] = rec

    @staticmethod
    def _key(rec: dict[str, Any]) -> str:
        return f"{rec['model']}/{rec['nprocs']}x{rec['batch_size']}/{_name(rec)}"

    def get(self, run: RaceRun, nprocs: int, batch: int) -> dict[str, Any] | None:
        """The stored record of a finished run (all its epochs, or failed); None if none.

        Args:
            run: the run.
            nprocs: ranks.
            batch: per-rank batch.
        """
        rec = self.runs.get(f"{run.model}/{nprocs}x{batch}/{run.name}")
        if rec is None or not (rec["failed"] or len(rec["test_accuracy"]) >= run.epochs):
            return None
        return rec

    def add(self, rec: dict[str, Any]) -> None:
        """Keep a finished run's record and write the file.

        Args:
            rec: the run's record (see :func:`record`).
        """
        self.runs[self._key(rec)] = rec
        self.write()

    def write(self) -> None:
        """Write the header, the summary so far and every run."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        document = {**self.header, "summary": self.summary, "runs": list(self.runs.values())}
        handle, temporary = tempfile.mkstemp(dir=self.path.parent, suffix=".json.tmp")
        with os.fdopen(handle, "w") as out:
            out.write(json.dumps(document, indent=1) + "\n")
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would make the file private
        os.replace(temporary, self.path)


def _name(rec: dict[str, Any]) -> str:
    """The folder name of a stored record's run."""
    fields = {key: rec[key] for key in RaceRun.__dataclass_fields__ if key in rec}
    return RaceRun(**fields).name


def _rank_worker(jobs: list[tuple[TrainConfig, str]]) -> None:
    """Train ``jobs`` one after the other in one process group (one start-up for all)."""
    context = init_distributed()
    try:
        for config, run_dir in jobs:
            config.validate()
            train_data_parallel(config, context, run_dir)
    finally:
        finish_distributed()


def _done_epochs(run_dir: Path) -> int:
    path = run_dir / "metrics.csv"
    return len(read_metrics(path)) if path.exists() else 0


def _finished(run: RaceRun, run_dir: Path) -> bool:
    """All epochs recorded, or the run failed (FAILED holds why) and is not tried again."""
    return (run_dir / FAILED).exists() or _done_epochs(run_dir) >= run.epochs


def _launch(
    jobs: list[tuple[TrainConfig, str]],
    nprocs: int,
    link: str | None,
    bar: tqdm,
    counted: int,
    poll: Callable[[], None] = lambda: None,
) -> tuple[Any, int]:
    """One launch training ``jobs`` in turn; the bar follows their metrics.csv files.

    ``poll`` is called every 2 s while it runs (to store the runs that have finished).
    """
    outcome: list[Any] = []
    thread = threading.Thread(
        target=lambda: outcome.append(
            launch.run(_rank_worker, nprocs, link=link, args=(jobs,), output=io.StringIO())
        )
    )
    thread.start()
    while thread.is_alive():
        thread.join(2.0)
        done = sum(_done_epochs(Path(run_dir)) for _, run_dir in jobs)
        bar.update(max(0, done - counted))
        counted = max(counted, done)
        poll()
    return outcome[0], counted


def _failure(result: Any) -> str:
    """A failed launch in one line: its status and the last line of the failing traceback."""
    detail = result.tracebacks.get(result.failed_rank) or "\n".join(result.tracebacks.values())
    last = detail.strip().splitlines()[-1] if detail.strip() else result.reason or "no traceback"
    return f"rank {result.failed_rank} ended with status {result.returncode}: {last}"


def execute(
    runs: Sequence[RaceRun],
    out: Path,
    *,
    nprocs: int,
    batch: int,
    link: str | None,
    bar: tqdm,
    results: Results | None = None,
) -> list[dict[str, Any]]:
    """Train the runs not yet finished in ``out`` (one launch for all), return every record.

    A run counts as finished when its metrics.csv has all its epochs; a partial one is
    trained again from the start. A launch that fails marks the run it stopped in as failed
    (its partial curve is kept) and the rest go on in a new launch.

    Args:
        runs: the runs, all of one model.
        out: the output folder (runs go in ``out/<model>/<name>``).
        nprocs: ranks.
        batch: per-rank batch.
        link: the emulated link (None: plain loopback).
        bar: the progress bar, in epochs.
        results: the race's JSON: runs it holds are not trained again, finished ones go in it.
    """
    dirs = {run: out / run.model / run.name for run in runs}
    stored: dict[RaceRun, dict[str, Any]] = {}
    for run in runs:
        rec = results.get(run, nprocs, batch) if results is not None else None
        if rec is not None:
            stored[run] = rec

    def harvest() -> None:
        for run in runs:
            if run not in stored and _finished(run, dirs[run]):
                stored[run] = record(run, dirs[run], nprocs, batch)
                if results is not None:
                    results.add(stored[run])

    harvest()
    pending = [run for run in runs if run not in stored]
    bar.update(sum(run.epochs for run in runs if run not in pending))
    for run in pending:
        for stale in dirs[run].glob("*"):
            stale.unlink()
    while pending:
        jobs = [(run.config(batch), str(dirs[run])) for run in pending]
        result, _ = _launch(jobs, nprocs, link, bar, 0, harvest)
        harvest()
        if result.ok:
            break
        stopped = next((r for r in pending if not _finished(r, dirs[r])), None)
        if stopped is None:
            break
        dirs[stopped].mkdir(parents=True, exist_ok=True)
        (dirs[stopped] / FAILED).write_text(_failure(result) + "\n")
        harvest()
        pending = [r for r in pending if r not in stored]
        for run in pending:
            for stale in dirs[run].glob("*"):
                stale.unlink()
    return [stored.get(run) or record(run, dirs[run], nprocs, batch) for run in runs]


def _parse_map(text: str, kind: type, what: str) -> dict[str, Any]:
    """``mlp1d=30,cnn1d=25`` as a dict; a bare value applies to every model (key ``*``)."""
    result: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.rpartition("=")
        try:
            result[key or "*"] = kind(value)
        except ValueError:
            raise SystemExit(f"{what}: {value!r} is not a number; write e.g. mlp1d=30") from None
    return result


#: What ``--large-batch`` changes: a global batch of 1,024 on 20,000 sequences, no second fixed
#: target, no side-by-side timing (wall-clock comes from per-step costs measured elsewhere).
LARGE_DEFAULTS: dict[str, Any] = {
    "batch_size": LARGE_BATCH,
    "train_samples": LARGE_TRAIN_SAMPLES,
    "epochs": ",".join(f"{m}={e}" for m, e in LARGE_EPOCHS.items()),
    "targets": "",
    "timing_rounds": 0,
}
#: What ``--quick`` changes: a smoke test of a few minutes (one model, 2 configurations each,
#: 3 epochs, 2 seeds, no timing runs).
QUICK_DEFAULTS: dict[str, Any] = {
    "models": "mlp1d",
    "configs": 2,
    "epochs": "3",
    "seeds": "0,1",
    "timing_rounds": 0,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The race's flags; ``--large-batch`` and ``--quick`` change the defaults of others.

    Args:
        argv: the arguments (None: the command line's).
    """
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--large-batch",
        action="store_true",
        help=f"the large-batch race: {LARGE_DEFAULTS} unless given, scaled grids with warm-up",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"a smoke test of a few minutes: {QUICK_DEFAULTS}"
    )
    parser.add_argument("--models", default="mlp1d,cnn1d,resnet1d")
    parser.add_argument(
        "--epochs",
        default=",".join(f"{m}={e}" for m, e in DEFAULT_EPOCHS.items()),
        help="epoch cap per model, model=N,... or one N for all (default %(default)s)",
    )
    parser.add_argument(
        "--share",
        type=float,
        default=TARGET_SHARE,
        help="the target: this share of SGD's best accuracy over the first seed's sweep, "
        "rounded down to a whole percent (default %(default)s)",
    )
    parser.add_argument(
        "--targets",
        default=",".join(f"{m}={t:g}" for m, t in DEFAULT_TARGETS.items()),
        help="a second, fixed target per model, model=F,... (default %(default)s); '' for none",
    )
    parser.add_argument(
        "--configs", type=int, default=8, help="configurations per optimiser, 1-8 (default 8)"
    )
    parser.add_argument("--seeds", default="0,1,2", help="the first picks (default 0,1,2)")
    parser.add_argument(
        "--timing-rounds",
        type=int,
        default=3,
        help=f"SGD-then-K-FAC pairs of {TIMING_EPOCHS}-epoch runs timing an epoch side by side "
        "(default 3; 0 for none)",
    )
    parser.add_argument(
        "--kfac-damping-adaptation",
        choices=("fixed", "levenberg-marquardt"),
        default="fixed",
        help="K-FAC's damping: fixed, or adapted from a smaller start (default %(default)s)",
    )
    parser.add_argument("-n", "--nprocs", type=int, default=4, help="ranks (default 4)")
    parser.add_argument(
        "--batch-size", type=int, default=25, help="per-rank batch (default 25: 100 in all)"
    )
    parser.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="MNIST-1D training sequences, generated from the package's seed and cached "
        "(default: the paper's 4,000)",
    )
    parser.add_argument("--link", default=None, help="emulated link (default: plain loopback)")
    parser.add_argument("--out", default="runs/kfac-race", help="run folders (resumable)")
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="every run and the table as JSON, rewritten after each run; runs it holds are "
        "not trained again",
    )
    parser.add_argument("--png-dir", metavar="DIR", help="write race-<model>.png there")
    parser.add_argument(
        "--step-costs",
        metavar="PATH",
        help="an `interlace bench kfac --ablation` JSON (decompositions every "
        f"{KFAC_INV_UPDATE_STEPS} steps, e.g. docs/kfac/h2h-resnet20-h200-10gbit-inv10.json): "
        "fills the large-batch table's wall-clock to target from each side's per-step cost",
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="train nothing: print the table of the race in --json (with --step-costs, its "
        "wall-clock to target); the JSON is not rewritten",
    )
    presets, _ = parser.parse_known_args(argv)
    if presets.large_batch:
        parser.set_defaults(**LARGE_DEFAULTS)
    if presets.quick:
        parser.set_defaults(**QUICK_DEFAULTS)
    args = parser.parse_args(argv)
    if not 1 <= args.configs <= 8:
        parser.error(f"--configs must be 1-8, got {args.configs}")
    if args.report and not args.json:
        parser.error("--report reads the race from --json PATH")
    return args


def report(path: Path, costs: StepCosts | None) -> str:
    """The table of a finished race, from its JSON alone (nothing is trained or rewritten).

    Args:
        path: the race's JSON (``--json``).
        costs: per-step costs for the large-batch table's wall-clock columns, or None.

    Raises:
        SystemExit: no such file, or step costs for the batch-100 race (whose table compares
            side-by-side CPU epoch times instead).
    """
    if not path.is_file():
        raise SystemExit(f"--report: no race JSON at {path}")
    document = json.loads(path.read_text())
    large = document.get("grid") == "large-batch"
    if costs is not None and not large:
        raise SystemExit(f"--step-costs applies to the large-batch race; {path} is batch-100")
    lines = [
        f"MNIST-1D ({document['train_samples']} training sequences), {document['nprocs']} ranks "
        f"x batch {document['batch_size']} (global {document['global_batch']}), "
        f"link {document['link']}, seeds {','.join(map(str, document['seeds']))}; "
        f"{len(document['runs'])} runs in {path}",
    ]
    if costs is not None:
        lines.append(
            f"Per-step costs: SGD {1e3 * costs.sgd_s:.2f} ms, K-FAC {1e3 * costs.kfac_s:.2f} ms "
            f"({costs.kfac_over_sgd:.2f}x), {costs.label}"
        )
    summaries = document["summary"]
    lines += ["", step_table(summaries, costs) if large else table(summaries)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, run the race model by model, print the table, write the files.

    Args:
        argv: the arguments (None: the command line's).
    """
    args = parse_args(argv)
    costs = load_step_costs(Path(args.step_costs)) if args.step_costs else None
    if args.report:
        print(report(Path(args.json), costs))
        return 0
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    caps = _parse_map(args.epochs, int, "--epochs")
    fixed = {m: [t] for m, t in _parse_map(args.targets, float, "--targets").items()}
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    started = time.perf_counter()
    large = args.large_batch

    def cap(model: str) -> int:
        defaults = LARGE_EPOCHS if large else DEFAULT_EPOCHS
        return int(caps.get(model, caps.get("*", defaults.get(model, 15))))

    adaptation = args.kfac_damping_adaptation
    if args.train_samples is not None:
        # Generate (or find) the data once here, not in every rank at once.
        from interlace.zoo.mnist1d import mnist1d_arrays  # noqa: PLC0415 - needs mnist1d

        mnist1d_arrays(train_samples=args.train_samples)
    sweeps = {
        m: {
            o: grid(
                m,
                o,
                cap(m),
                args.configs,
                adaptation,
                large=large,
                train_samples=args.train_samples,
            )
            for o in ("sgd", "kfac")
        }
        for m in models
    }
    results = Results(
        Path(args.json) if args.json else None,
        {
            "data": "mnist1d",
            "train_samples": args.train_samples or PAPER_TRAIN_SAMPLES,
            "nprocs": args.nprocs,
            "batch_size": args.batch_size,
            "global_batch": args.nprocs * args.batch_size,
            "steps_per_epoch": steps_per_epoch(args.train_samples, args.nprocs, args.batch_size),
            "link": args.link or "loopback",
            "grid": "large-batch" if large else "batch-100",
            "kfac_fixed": KFAC_FIXED,
            "kfac_damping_adaptation": adaptation,
            "seeds": seeds,
            "configs_per_optimizer": args.configs,
            "epoch_caps": {m: cap(m) for m in models},
            "command": " ".join(["python", "benchmarks/kfac_race.py", *(sys.argv[1:])]),
        },
    )
    total = sum(
        r.epochs * (1 + (len(seeds) - 1) / len(rs))
        for per in sweeps.values()
        for rs in per.values()
        for r in rs
    )
    everything: list[dict[str, Any]] = []
    summaries = results.summary
    with tqdm(total=round(total), unit="epoch", desc="kfac race") as bar:
        launching: dict[str, Any] = {
            "nprocs": args.nprocs,
            "batch": args.batch_size,
            "link": args.link,
            "bar": bar,
            "results": results,
        }
        for model in models:
            bar.set_postfix(model=model, phase="sweep")
            first = [replace(r, seed=seeds[0]) for o in ("sgd", "kfac") for r in sweeps[model][o]]
            records = execute(first, out, **launching)
            sweep = {o: [rec for rec in records if rec["optimizer"] == o] for o in ("sgd", "kfac")}
            sgd_best = max(_best(rec) for rec in sweep["sgd"])
            rule = derived_target(sgd_best, args.share)
            extra = [t for t in fixed.get(model, [])[:1] if t != rule]
            for number, target in enumerate([rule, *extra]):
                picked = {o: pick(sweep[o], target) for o in ("sgd", "kfac")}
                bar.set_postfix(model=model, phase=f"seeds, target {100 * target:g}%")
                bases = {
                    o: next(r for r in sweeps[model][o] if r.label == picked[o]["config"])
                    for o in ("sgd", "kfac")
                }
                again = [replace(bases[o], seed=s) for o in ("sgd", "kfac") for s in seeds[1:]]
                if number:  # the first target's seeds are in the bar's total already
                    bar.total += sum(r.epochs for r in again)
                    bar.refresh()
                others = execute(again, out, **launching)
                finals = {
                    o: [picked[o], *(rec for rec in others if rec["optimizer"] == o)]
                    for o in ("sgd", "kfac")
                }
                timed: list[dict[str, Any]] = []
                if args.timing_rounds > 0:
                    bar.set_postfix(model=model, phase="side-by-side timing")
                    clocked = timing_runs(bases, args.timing_rounds)
                    bar.total += sum(r.epochs for r in clocked)
                    bar.refresh()
                    timed = execute(clocked, out, **launching)
                everything += [rec for rec in [*records, *others, *timed] if rec not in everything]
                summaries.append(
                    {
                        "model": model,
                        "target": target,
                        "target_rule": f"{args.share:g} x SGD's best" if number == 0 else "fixed",
                        "sgd_best_first_seed": sgd_best,
                        "epochs": cap(model),
                        **{o: summarise(finals[o], target) for o in ("sgd", "kfac")},
                        "epoch_s_side_by_side": epoch_cost(timed) if timed else {},
                    }
                )
                results.write()
    print(
        f"\nMNIST-1D ({args.train_samples or PAPER_TRAIN_SAMPLES} training sequences), "
        f"{args.nprocs} ranks x batch {args.batch_size} (global {args.nprocs * args.batch_size}), "
        f"link {args.link or 'loopback'}, {args.configs} configs per optimiser on seed "
        f"{seeds[0]}, seeds {args.seeds}\n"
    )
    if costs is not None:
        print(f"Per-step costs: {costs.label}\n")
    print(step_table(summaries, costs) if large else table(summaries))
    print(f"\n{len(everything)} runs, {time.perf_counter() - started:.0f} s this time")
    if args.json and not large:
        # The batch-100 race's files keep only this invocation's runs, as they always have.
        results.runs = {Results._key(rec): rec for rec in everything}
    results.write()
    if args.png_dir:
        from kfac_race_plot import plot_race  # noqa: PLC0415 - matplotlib only when asked

        for entry in summaries:
            suffix = "" if entry["target_rule"] != "fixed" else f"-{100 * entry['target']:g}"
            suffix += "" if adaptation == "fixed" else "-lm"
            suffix += "-large-batch" if large else ""
            plot_race(entry, everything, Path(args.png_dir) / f"race-{entry['model']}{suffix}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
