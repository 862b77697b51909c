"""``interlace bench kfac``: where a distributed K-FAC iteration spends its time, per model.

For each model one launch on the emulated cluster trains it with :class:`interlace.DataParallel`
(MG-WFBP buckets) and :class:`interlace.KFAC` on SGD with momentum, synthetic batches generated
once per rank. After warm-up (the data-parallel plan is final, the first decompositions are
made) it times iterations and splits each into the phases SPD-KFAC's breakdown uses:

* forward + backward: the plain module's, timed in the same rounds with no hooks and no
  communication (the compute every strategy must do);
* gradient comm: what data parallelism adds to that compute, from a second copy of the model
  under DataParallel alone (no K-FAC), timed in the same rounds: the exposed part of the
  gradient all-reduces;
* factor compute, factor comm, decomposition, decomposition comm, preconditioning and
  preconditioning comm: :attr:`interlace.KFAC.last_phase_s`;
* optimizer step.

Every sample is the maximum over ranks (a phase ends when its slowest rank is done) and a cell
is the median over iterations, so the phases need not add up to the iteration exactly. With
``--png`` the last iteration of the first model is drawn as a timeline, one process per rank.

``--ablation`` is SPD-KFAC's ablation instead: per model, one launch trains four copies of the
model (identical initial weights, the same batches), each under its own DataParallel and its own
:class:`interlace.KFAC` in one of the :data:`ABLATION_MODES` (``dkfac``: bulk factor all-reduce
and greedy placement; ``pipelined``: factors all-reduced from the hooks in merged buckets;
``lbp``: SPD-KFAC's load-balancing placement; ``spd``: both). The modes' iterations alternate
round-robin (the first mode rotating every round), so the machine's drift slows every mode
alike. Each mode gets the same phase breakdown (forward + backward and gradient comm are shared,
measured once per round), its K-FAC model's own forward + backward (hooks, overlapped factor
all-reduces and all), and its speed-up over ``dkfac`` in the same launch. ``--png`` then draws
grouped bars, one panel per model, one bar per mode stacked by phase.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from interlace.bench.dp import (
    DEFAULT_BATCH,
    DEFAULT_INPUT_SHAPE,
    FALLBACK_BATCH,
    NUM_CLASSES,
    LaunchFailedError,
    launch_on_ranks,
    parse_names,
    parse_shape,
)
from interlace.errors import UsageError

PROG = "interlace bench kfac"
#: The mlp is left out by default: on 3x32x32 inputs its first layer's A factor is 3073 x 3073,
#: whose eigendecomposition alone takes seconds on a CPU (ask for it with --models mlp).
DEFAULT_MODELS: tuple[str, ...] = ("resnet20", "resnet32", "transformer")
DEFAULT_LINK = "1gbit"
DEFAULT_NPROCS = 4
DEFAULT_ITERS = 10
DEFAULT_WARMUP = 3
DEFAULT_TIMEOUT_S = 900.0
#: Upper bound on warm-up steps spent waiting for the data-parallel plan (a bug otherwise).
_MAX_WARMUP_STEPS = 300
_BATCHES = 4

#: SPD-KFAC's ablation (``--ablation``): each mode's ``(factor_comm, fusion, placement)``, all
#: from the one :class:`interlace.KFAC`. ``dkfac`` is the baseline every speed-up is against.
ABLATION_MODES: dict[str, tuple[str, str, str]] = {
    "dkfac": ("bulk", "none", "greedy"),
    "pipelined": ("pipelined", "merged", "greedy"),
    "lbp": ("bulk", "none", "lbp"),
    "spd": ("pipelined", "merged", "lbp"),
}
BASELINE_MODE = "dkfac"
#: ``--compare kfac-pytorch`` adds this contender: kfac-pytorch's ``KFACPreconditioner`` with its
#: defaults (COMM-OPT, factors all-reduced from its hooks) and the run's update intervals.
KFAC_PYTORCH_MODE = "kfac-pytorch"
COMPARE_CHOICES = (KFAC_PYTORCH_MODE,)
#: How to get kfac-pytorch, which is not on PyPI.
KFAC_PYTORCH_INSTALL = "pip install git+https://github.com/gpauloski/kfac-pytorch"


def mode_settings(mode: str) -> tuple[str, str, str]:
    """``(factor_comm, fusion, placement)`` of an ablation mode or of the compared peer."""
    if mode == KFAC_PYTORCH_MODE:
        return ("kfac-pytorch", "kfac-pytorch", "kaisa")
    return ABLATION_MODES[mode]


DEFAULT_ABLATION_MODELS: tuple[str, ...] = ("resnet20", "resnet56", "vgg11", "transformer")
#: The ablation's extra column: the K-FAC model's own forward + backward (DataParallel's gradient
#: all-reduces, the factor hooks and, when pipelined, the factor all-reduces they launch).
KFAC_PASSES = ("kfac_passes", "fwd+bwd+hooks")

#: Columns of the table, in order: (key, heading).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("forward_backward", "fwd+bwd"),
    ("gradient_comm", "grad comm"),
    ("factor_compute", "factor compute"),
    ("factor_comm", "factor comm"),
    ("decomposition", "decomposition"),
    ("decomposition_comm", "decomp comm"),
    ("precondition", "precondition"),
    ("precondition_comm", "precond comm"),
    ("optimizer", "step"),
)


@dataclass(frozen=True)
class KfacJob:
    """What every rank of one launch measures."""

    model: str
    batch: int
    input_shape: tuple[int, ...]
    seed: int
    iters: int
    warmup: int
    compute_method: str
    grad_worker_fraction: float
    inv_update_steps: int
    timeline: bool
    placement: str = "greedy"
    factor_update_steps: int = 1


@dataclass
class KfacRow:
    """One model's measured breakdown (milliseconds, medians of maxima over ranks)."""

    model: str
    ranks: int
    link: str
    batch: int
    compute_method: str
    grad_worker_fraction: float
    inv_update_steps: int
    placement: str
    layers: int
    iteration_ms: float
    phases_ms: dict[str, float] = field(default_factory=dict)
    factor_update_steps: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class AblationJob:
    """What every rank of one ``--ablation`` launch measures: ``modes`` side by side."""

    model: str
    batch: int
    input_shape: tuple[int, ...]
    seed: int
    iters: int
    warmup: int
    compute_method: str
    factor_update_steps: int
    inv_update_steps: int
    modes: tuple[str, ...] = tuple(ABLATION_MODES)


@dataclass
class AblationRow:
    """One (model, mode) of the ablation (seconds, medians of maxima over ranks).

    ``phases_s`` holds the :data:`COLUMNS` phases and :data:`KFAC_PASSES`; ``factor_buckets`` is
    the number of pipelined factor all-reduces per factor step (None for bulk), and
    ``local_factors`` how many factors LBP decomposes on every rank (None for greedy).
    """

    model: str
    mode: str
    factor_comm: str
    fusion: str
    placement: str
    ranks: int
    link: str
    batch: int
    factor_update_steps: int
    inv_update_steps: int
    layers: int
    iters: int
    iteration_s: float
    speedup_vs_dkfac: float | None
    phases_s: dict[str, float] = field(default_factory=dict)
    factor_buckets: int | None = None
    local_factors: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _max_over_ranks(values: Sequence[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    result: list[float] = tensor.tolist()
    return result


def measure_rank(job: KfacJob) -> dict[str, Any]:
    """One rank of a launch: warm up, time ``job.iters`` iterations, return the medians."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn import functional

    from interlace.dp import DataParallel
    from interlace.kfac import KFAC, PHASES
    from interlace.zoo import build_model

    rank = dist.get_rank()
    torch.manual_seed(job.seed)
    plain = build_model(job.model, job.input_shape, NUM_CLASSES)
    model = copy.deepcopy(plain)
    wrapped = DataParallel(model)
    data_parallel_only = DataParallel(copy.deepcopy(plain))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    precond = KFAC(
        wrapped,
        lr=0.01,
        compute_method=job.compute_method,
        grad_worker_fraction=job.grad_worker_fraction,
        factor_update_steps=job.factor_update_steps,
        inv_update_steps=job.inv_update_steps,
        placement=job.placement,
    )
    generator = torch.Generator().manual_seed(job.seed * 1000 + rank)
    batches = [
        (
            torch.randn(job.batch, *job.input_shape, generator=generator),
            torch.randint(0, NUM_CLASSES, (job.batch,), generator=generator),
        )
        for _ in range(_BATCHES)
    ]

    def kfac_iteration(step: int) -> dict[str, float]:
        inputs, targets = batches[step % _BATCHES]
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = functional.cross_entropy(wrapped(inputs), targets)
        loss.backward()
        backward_end = time.perf_counter()
        precond.step()
        precond_end = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        sample = dict(precond.last_phase_s)
        sample["passes"] = backward_end - start
        sample["optimizer"] = end - precond_end
        sample["iteration"] = end - start
        return sample

    def passes(module: Any, step: int) -> float:
        inputs, targets = batches[step % _BATCHES]
        dist.barrier()
        start = time.perf_counter()
        module.zero_grad()
        functional.cross_entropy(module(inputs), targets).backward()
        return time.perf_counter() - start

    step = 0
    while step < job.warmup or not (wrapped.planning_done and data_parallel_only.planning_done):
        kfac_iteration(step)
        passes(data_parallel_only, step)
        step += 1
        if step > _MAX_WARMUP_STEPS:
            raise RuntimeError(f"{job.model}: DataParallel did not finish planning in warm-up")
    precond.take_events()

    keys = [*PHASES, "passes", "optimizer", "iteration", "plain", "data_parallel"]
    samples: dict[str, list[float]] = {key: [] for key in keys}
    events: list[dict[str, Any]] = []
    for index in range(job.iters):
        last = index == job.iters - 1
        if last and job.timeline:
            wrapped.record_timeline(True)
            precond.take_events()
        sample = kfac_iteration(step + index)
        if last and job.timeline:
            events = _iteration_events(wrapped, precond, rank, sample)
        sample["plain"] = passes(plain, step + index)
        sample["data_parallel"] = passes(data_parallel_only, step + index)
        for key in keys:
            samples[key].append(sample[key])
    maxima = {key: _max_over_ranks(values) for key, values in samples.items()}
    medians = {key: statistics.median(values) for key, values in maxima.items()}
    # Data parallelism's share of forward + backward: the wrapped passes beyond the plain ones.
    exposed = [
        max(0.0, wrapped_s - plain_s)
        for wrapped_s, plain_s in zip(maxima["data_parallel"], maxima["plain"], strict=True)
    ]
    medians["gradient_comm"] = statistics.median(exposed)
    medians["forward_backward"] = medians["plain"]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, events)
    return {
        "medians": medians,
        "layers": len(precond.layers),
        "events": [event for rank_events in gathered for event in rank_events],
    }


@dataclass
class _Contender:
    """One ablation mode on one rank: its own copy of the model, wrapper, optimizer and K-FAC."""

    mode: str
    wrapped: Any
    optimizer: Any
    precond: Any

    def settled(self) -> bool:
        """Whether every plan is final: DataParallel's buckets, and for pipelined factors the
        merged buckets (one bulk factor step, then ``profile_steps`` profiled ones)."""
        if not self.wrapped.planning_done:
            return False
        precond = self.precond
        if precond.factor_comm != "pipelined":
            return True
        return bool(precond.steps > precond.profile_steps * precond.factor_update_steps)


class _KfacPytorch:
    """kfac-pytorch's ``KFACPreconditioner`` (its defaults) seen through what a contender needs.

    It keeps no phase timings, so :attr:`last_phase_s` stays zero and the row shows only the
    iteration; its factors go out from its own hooks (``update_factors_in_hook=True``).
    """

    factor_comm = "kfac-pytorch"
    placement = "kaisa"
    factor_plan = None

    def __init__(self, model: Any, job: AblationJob) -> None:
        self.factor_owners: dict[str, Any] = {}
        # An optional peer, not a dependency: checked by check_kfac_pytorch before launching.
        from kfac.preconditioner import KFACPreconditioner  # type: ignore[import-not-found]

        self.inner = KFACPreconditioner(
            model,
            factor_update_steps=job.factor_update_steps,
            inv_update_steps=job.inv_update_steps,
            lr=0.01,
            compute_method=job.compute_method,
        )
        from interlace.kfac import PHASES

        self.last_phase_s = dict.fromkeys(PHASES, 0.0)
        layers = getattr(self.inner, "_layers", None)
        self.layers = list(layers) if layers is not None else []

    def step(self) -> None:
        self.inner.step()


def measure_ablation_rank(job: AblationJob) -> dict[str, Any]:
    """One rank of an ablation launch: every mode on its own copy of the model, interleaved.

    Every round runs one iteration of each mode (the first mode rotating from round to round),
    then the plain module's passes and DataParallel's alone, each behind a barrier.
    """
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn import functional

    from interlace.dp import DataParallel
    from interlace.kfac import KFAC, PHASES
    from interlace.zoo import build_model

    rank = dist.get_rank()
    torch.manual_seed(job.seed)
    plain = build_model(job.model, job.input_shape, NUM_CLASSES)
    data_parallel_only = DataParallel(copy.deepcopy(plain))
    contenders: list[_Contender] = []
    lbp_costs: dict[str, Any] = {}
    # The same order on every rank: KFAC creates process groups and measures LBP's costs with
    # collectives. The LBP modes share one measurement, so they share one placement.
    for mode in job.modes:
        model = copy.deepcopy(plain)
        wrapped = DataParallel(model)
        if mode == KFAC_PYTORCH_MODE:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            contenders.append(_Contender(mode, wrapped, optimizer, _KfacPytorch(wrapped, job)))
            continue
        factor_comm, fusion, placement = ABLATION_MODES[mode]
        precond = KFAC(
            wrapped,
            lr=0.01,
            compute_method=job.compute_method,
            grad_worker_fraction=1.0,
            factor_update_steps=job.factor_update_steps,
            inv_update_steps=job.inv_update_steps,
            placement=placement,
            factor_comm=factor_comm,
            fusion=fusion,
            **(lbp_costs if placement == "lbp" else {}),
        )
        if placement == "lbp" and not lbp_costs:
            lbp_costs = {
                "decomposition_cost": precond.decomposition_cost,
                "broadcast_cost": precond.broadcast_cost,
            }
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        contenders.append(_Contender(mode, wrapped, optimizer, precond))
    generator = torch.Generator().manual_seed(job.seed * 1000 + rank)
    batches = [
        (
            torch.randn(job.batch, *job.input_shape, generator=generator),
            torch.randint(0, NUM_CLASSES, (job.batch,), generator=generator),
        )
        for _ in range(_BATCHES)
    ]

    def kfac_iteration(contender: _Contender, step: int) -> dict[str, float]:
        inputs, targets = batches[step % _BATCHES]
        dist.barrier()
        start = time.perf_counter()
        contender.optimizer.zero_grad()
        loss = functional.cross_entropy(contender.wrapped(inputs), targets)
        loss.backward()
        backward_end = time.perf_counter()
        contender.precond.step()
        precond_end = time.perf_counter()
        contender.optimizer.step()
        end = time.perf_counter()
        sample = dict(contender.precond.last_phase_s)
        sample[KFAC_PASSES[0]] = backward_end - start
        sample["optimizer"] = end - precond_end
        sample["iteration"] = end - start
        return sample

    def passes(module: Any, step: int) -> float:
        inputs, targets = batches[step % _BATCHES]
        dist.barrier()
        start = time.perf_counter()
        module.zero_grad()
        functional.cross_entropy(module(inputs), targets).backward()
        return time.perf_counter() - start

    def one_round(step: int) -> tuple[dict[str, dict[str, float]], float, float]:
        first = step % len(contenders)
        samples = {
            contender.mode: kfac_iteration(contender, step)
            for contender in contenders[first:] + contenders[:first]
        }
        return samples, passes(plain, step), passes(data_parallel_only, step)

    # Warm up until every plan is final, then one more round on the final plans.
    step = 0
    settled_at: int | None = None
    while step < job.warmup or settled_at is None or step <= settled_at:
        one_round(step)
        step += 1
        if (
            settled_at is None
            and data_parallel_only.planning_done
            and all(contender.settled() for contender in contenders)
        ):
            settled_at = step
        if step > _MAX_WARMUP_STEPS:
            raise RuntimeError(f"{job.model}: the plans were not final after the warm-up")

    keys = [*PHASES, KFAC_PASSES[0], "optimizer", "iteration"]
    samples: dict[str, dict[str, list[float]]] = {
        mode: {key: [] for key in keys} for mode in job.modes
    }
    plain_s: list[float] = []
    data_parallel_s: list[float] = []
    for index in range(job.iters):
        round_samples, plain_sample, data_parallel_sample = one_round(step + index)
        for mode, sample in round_samples.items():
            for key in keys:
                samples[mode][key].append(sample[key])
        plain_s.append(plain_sample)
        data_parallel_s.append(data_parallel_sample)
    # One collective for every series: the maximum over ranks of each sample.
    series = [samples[mode][key] for mode in job.modes for key in keys]
    series += [plain_s, data_parallel_s]
    flat = _max_over_ranks([value for values in series for value in values])
    maxima = [flat[i * job.iters : (i + 1) * job.iters] for i in range(len(series))]
    plain_max, data_parallel_max = maxima[-2], maxima[-1]
    forward_backward = statistics.median(plain_max)
    # Data parallelism's share of forward + backward: the wrapped passes beyond the plain ones.
    gradient_comm = statistics.median(
        max(0.0, wrapped_s - plain_s)
        for wrapped_s, plain_s in zip(data_parallel_max, plain_max, strict=True)
    )
    medians: dict[str, dict[str, float]] = {}
    for m, mode in enumerate(job.modes):
        medians[mode] = {
            key: statistics.median(maxima[m * len(keys) + k]) for k, key in enumerate(keys)
        }
        medians[mode]["forward_backward"] = forward_backward
        medians[mode]["gradient_comm"] = gradient_comm
    return {
        "medians": medians,
        "layers": len(contenders[0].precond.layers),
        "factor_buckets": {
            c.mode: len(c.precond.factor_plan) if c.precond.factor_plan is not None else None
            for c in contenders
        },
        "local_factors": {
            c.mode: sum(
                owner is None for pair in c.precond.factor_owners.values() for owner in pair
            )
            if c.precond.placement == "lbp"
            else None
            for c in contenders
        },
    }


def _iteration_events(
    wrapped: Any, precond: Any, rank: int, sample: dict[str, float]
) -> list[dict[str, Any]]:
    """The last iteration as plain dicts (picklable): the data-parallel timeline of forward,
    backward and gradient all-reduces, then K-FAC's spans, on one time origin."""
    process = f"rank {rank}"
    origin = wrapped.last_forward_start
    events: list[dict[str, Any]] = []
    timeline = wrapped.last_timeline
    if timeline is not None:
        for event in timeline.events:
            events.append(
                {
                    "name": event.name,
                    "category": event.category,
                    "start_s": event.start_s,
                    "end_s": event.end_s,
                    "lane": event.lane,
                    "process": process,
                }
            )
    for event in precond.take_events(process=process, origin_s=origin):
        events.append(
            {
                "name": event.name,
                "category": event.category,
                "start_s": event.start_s,
                "end_s": event.end_s,
                "lane": "kfac comm" if event.category == "comm" else "kfac",
                "process": process,
            }
        )
    end = sample["iteration"]
    events.append(
        {
            "name": "SGD step",
            "category": "optimizer",
            "start_s": end - sample["optimizer"],
            "end_s": end,
            "lane": "kfac",
            "process": process,
        }
    )
    return events


# ============================================================================ command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        help="comma-separated zoo names or package.module:callable "
        f"(default {','.join(DEFAULT_MODELS)}; with --ablation "
        f"{','.join(DEFAULT_ABLATION_MODELS)})",
    )
    parser.add_argument("--model", help="one model (zoo name or package.module:callable)")
    parser.add_argument("-n", "--nprocs", type=int, default=DEFAULT_NPROCS)
    parser.add_argument(
        "--link", default=DEFAULT_LINK, help=f"emulated link per rank (default {DEFAULT_LINK})"
    )
    parser.add_argument(
        "--no-netem", action="store_true", help="plain loopback instead of the emulated cluster"
    )
    parser.add_argument("--batch", type=int, help="per-rank batch (default: per model)")
    parser.add_argument("--input-shape", type=parse_shape, default=DEFAULT_INPUT_SHAPE)
    parser.add_argument("--iters", type=int, default=DEFAULT_ITERS, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP)
    parser.add_argument("--compute-method", choices=("eigen", "inverse"), default="eigen")
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
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument(
        "--png",
        metavar="PATH",
        help="timeline of the first model's last iteration (PNG); with --ablation, bars of "
        "every mode's iteration time stacked by phase",
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)


def format_table(rows: Sequence[KfacRow]) -> str:
    head = ["model", "ranks", "link", "iteration ms", *(title + " ms" for _, title in COLUMNS)]
    lines = [
        "| " + " | ".join(head) + " |",
        "|---|---:|---|" + "---:|" * (len(head) - 3),
    ]
    for row in rows:
        cells = [row.model, str(row.ranks), row.link, f"{row.iteration_ms:.1f}"]
        cells += [f"{row.phases_ms.get(key, 0.0):.1f}" for key, _ in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def ablation_rows(
    model: str,
    value: dict[str, Any],
    *,
    ranks: int,
    link: str,
    batch: int,
    factor_update_steps: int,
    inv_update_steps: int,
    iters: int,
) -> list[AblationRow]:
    """One row per mode from an ablation launch's value (:func:`measure_ablation_rank`'s),
    each with its speed-up over :data:`BASELINE_MODE` (None when that mode was not run)."""
    medians: dict[str, dict[str, float]] = value["medians"]
    baseline = medians.get(BASELINE_MODE, {}).get("iteration")
    rows: list[AblationRow] = []
    for mode, phases in medians.items():
        factor_comm, fusion, placement = mode_settings(mode)
        iteration = phases["iteration"]
        measured_phases = mode != KFAC_PYTORCH_MODE
        rows.append(
            AblationRow(
                model=model,
                mode=mode,
                factor_comm=factor_comm,
                fusion=fusion,
                placement=placement,
                ranks=ranks,
                link=link,
                batch=batch,
                factor_update_steps=factor_update_steps,
                inv_update_steps=inv_update_steps,
                layers=value["layers"],
                iters=iters,
                iteration_s=iteration,
                speedup_vs_dkfac=baseline / iteration if baseline and iteration > 0 else None,
                # kfac-pytorch does not time its phases: only its iteration is known (and the
                # passes every mode shares).
                phases_s={
                    key: phases[key]
                    for key, _ in (*COLUMNS, KFAC_PASSES)
                    if measured_phases or key in ("forward_backward", "gradient_comm")
                },
                factor_buckets=value.get("factor_buckets", {}).get(mode),
                local_factors=value.get("local_factors", {}).get(mode),
            )
        )
    return rows


def format_ablation_table(rows: Sequence[AblationRow]) -> str:
    """One line per (model, mode): iteration, speed-up over dkfac, the phases (ms)."""
    head = [
        "model",
        "mode",
        "iteration ms",
        "vs dkfac",
        *(title + " ms" for _, title in (*COLUMNS, KFAC_PASSES)),
    ]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for row in rows:
        speedup = "-" if row.speedup_vs_dkfac is None else f"{row.speedup_vs_dkfac:.2f}x"
        cells = [row.model, row.mode, _ms(row.iteration_s), speedup]
        cells += [
            _ms(row.phases_s[key]) if key in row.phases_s else "-"
            for key, _ in (*COLUMNS, KFAC_PASSES)
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def factor_comm_share(rows: Sequence[AblationRow]) -> dict[str, float]:
    """Per model, the fraction of dkfac's iteration spent in factor communication."""
    return {
        row.model: row.phases_s.get("factor_comm", 0.0) / row.iteration_s
        for row in rows
        if row.mode == BASELINE_MODE and row.iteration_s > 0
    }


def format_ablation_header(
    rows: Sequence[AblationRow], *, ranks: int, link: str, compute_method: str, iters: int
) -> str:
    """The regime in a few lines: ranks, link, batches, update intervals, and how much of
    dkfac's iteration factor communication takes (the part the pipelined modes can hide)."""
    first = rows[0] if rows else None
    factor_steps = first.factor_update_steps if first else 1
    inv_steps = first.inv_update_steps if first else 1
    batches = ", ".join(
        dict.fromkeys(f"{row.model} {row.batch}" for row in rows)  # first-seen order
    )
    modes = "; ".join(
        f"{mode} = {comm} factor all-reduce"
        + (f" ({fusion} buckets)" if comm == "pipelined" else "")
        + f", {placement} placement"
        for mode, (comm, fusion, placement) in ABLATION_MODES.items()
    )
    lines = [
        f"SPD-KFAC ablation: {ranks} ranks on {link}, per-rank batch ({batches or 'none'}); "
        f"factors all-reduced every {factor_steps} step(s), decomposed ({compute_method}, "
        f"COMM-OPT) every {inv_steps} step(s); medians over {iters} iterations of the maximum "
        "over ranks, the modes interleaved round-robin in one launch per model.",
        f"Modes: {modes}.",
    ]
    by_model = {row.model: row for row in rows if row.mode == BASELINE_MODE}
    shares = factor_comm_share(rows)
    if shares:
        lines.append(
            "Factor comm share of dkfac's iteration: "
            + ", ".join(
                f"{model} {share:.0%} ({_ms(by_model[model].phases_s.get('factor_comm', 0.0))} "
                f"of {_ms(by_model[model].iteration_s)} ms)"
                for model, share in shares.items()
            )
            + "."
        )
    return "\n".join(lines)


def plot_ablation(rows: Sequence[AblationRow], path: str | Path, title: str = "") -> None:
    """Grouped bars: a panel per model, a bar per mode stacked by phase (the medians; what the
    phases leave of the measured iteration is drawn as "other"), the measured iteration as a
    black tick and the speed-up over dkfac above each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(row.model for row in rows))
    if not models:
        raise ValueError("no rows to plot")
    modes = list(dict.fromkeys(row.mode for row in rows))
    figure, axes = plt.subplots(
        1, len(models), figsize=(max(6.4, 2.6 * len(models) + 1.6), 4.6), squeeze=False
    )
    colours = plt.get_cmap("tab10")
    stack = [*COLUMNS, ("other", "other (overlap, hooks, noise)")]
    for panel, model in zip(axes[0], models, strict=True):
        highest = 0.0
        for position, mode in enumerate(modes):
            row = next((r for r in rows if r.model == model and r.mode == mode), None)
            if row is None:
                continue
            bottom = 0.0
            for index, (key, label) in enumerate(stack):
                if key == "other":
                    height = max(0.0, row.iteration_s - bottom / 1e3) * 1e3
                    colour: Any = "lightgrey"
                else:
                    height = row.phases_s.get(key, 0.0) * 1e3
                    colour = colours(index % 10)
                panel.bar(
                    position,
                    height,
                    bottom=bottom,
                    width=0.7,
                    color=colour,
                    label=label if position == 0 and model == models[0] else None,
                )
                bottom += height
            top = row.iteration_s * 1e3
            highest = max(highest, top, bottom)
            panel.hlines(top, position - 0.38, position + 0.38, color="black", linewidth=1.5)
            if row.speedup_vs_dkfac is not None:
                panel.annotate(
                    f"{row.speedup_vs_dkfac:.2f}x",
                    (position, max(top, bottom)),
                    textcoords="offset points",
                    xytext=(0, 3),
                    ha="center",
                    fontsize=7,
                )
        panel.set_xticks(range(len(modes)))
        panel.set_xticklabels(modes, fontsize=8)
        panel.set_title(model)
        panel.grid(axis="y", alpha=0.3)
        # Room above the tallest bar for its speed-up label.
        panel.set_ylim(0.0, max(highest, 1e-3) * 1.12)
    axes[0][0].set_ylabel("iteration ms (median of max over ranks)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=5, fontsize=7, frameon=False)
    figure.suptitle(
        (title or "SPD-KFAC ablation: iteration time by phase")
        + "\n(black tick: measured iteration; label: speed-up vs dkfac)",
        fontsize=10,
    )
    figure.tight_layout(rect=(0.0, 0.1, 1.0, 1.0))
    figure.savefig(path, dpi=120)
    plt.close(figure)


def models_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """``--model``, else ``--models``, else the defaults (the ablation's with ``--ablation``)."""
    if args.model:
        return (args.model,)
    if args.models:
        return parse_names(args.models, None, "models", "model")
    return DEFAULT_ABLATION_MODELS if args.ablation else DEFAULT_MODELS


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; the exit status."""
    from interlace.comm.links import parse_link
    from interlace.kfac.placement import worker_count
    from interlace.launch import netem

    models = models_from_args(args)
    if args.nprocs < 1:
        raise UsageError(f"-n must be >= 1, got {args.nprocs}")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be >= 1 and --warmup >= 0")
    if args.ablation:
        if args.placement is not None:
            raise UsageError("--placement is set by each --ablation mode; leave it out")
        if args.grad_worker_fraction != 1:
            raise UsageError("--ablation runs COMM-OPT (lbp needs it): --grad-worker-fraction 1")
        if args.nprocs < 2:
            raise UsageError(f"--ablation needs -n >= 2 (nothing is sent on {args.nprocs})")
    if args.compare is not None:
        if not args.ablation:
            raise UsageError("--compare runs beside the modes of --ablation; add --ablation")
        check_kfac_pytorch()
    if args.placement == "lbp" and args.grad_worker_fraction < 1:
        raise UsageError("--placement lbp needs --grad-worker-fraction 1 (COMM-OPT)")
    if args.inv_update_steps < 1:
        raise UsageError(f"--inv-update-steps must be >= 1, got {args.inv_update_steps}")
    if args.factor_update_steps < 1:
        raise UsageError(f"--factor-update-steps must be >= 1, got {args.factor_update_steps}")
    try:
        worker_count(args.grad_worker_fraction, args.nprocs)
    except ValueError as exc:
        raise UsageError(f"--grad-worker-fraction: {exc}") from None
    link: str | None = None
    if not args.no_netem:
        parse_link(args.link)
        try:
            netem.check_available()
        except netem.NetemUnavailableError as exc:
            raise UsageError(
                f"{exc}; run as root, or pass --no-netem to measure on loopback"
            ) from exc
        link = args.link
    if args.ablation:
        return _run_ablation(args, models, link)
    return _run_breakdown(args, models, link)


def check_kfac_pytorch() -> None:
    """Raise :class:`UsageError`, saying how to install it, unless kfac-pytorch is importable."""
    import importlib.util

    try:
        found = importlib.util.find_spec("kfac.preconditioner") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise UsageError(
            "--compare kfac-pytorch needs kfac-pytorch, which is not installed (it is not on "
            f"PyPI): {KFAC_PYTORCH_INSTALL}, then run again"
        )


def _launch(
    fn: Any, job: Any, args: argparse.Namespace, link: str | None, note: Callable[[str], None]
) -> Any:
    """Rank 0's value of ``fn(job)`` on the ranks, or the failure as a string (the shared
    launcher's retry rule: :func:`interlace.bench.dp.launch_on_ranks`)."""
    try:
        return launch_on_ranks(
            fn,
            job,
            nprocs=args.nprocs,
            link=link,
            timeout_s=args.timeout,
            note=note,
            prog=PROG,
        )
    except LaunchFailedError as exc:
        return str(exc)


def _run_ablation(args: argparse.Namespace, models: Sequence[str], link: str | None) -> int:
    from tqdm import tqdm

    rows: list[AblationRow] = []
    failures: list[str] = []
    link_text = link or "loopback"
    with tqdm(total=len(models), unit="model", desc=PROG, dynamic_ncols=True) as bar:
        for model in models:
            bar.set_postfix_str(model)
            job = AblationJob(
                model=model,
                batch=args.batch or DEFAULT_BATCH.get(model, FALLBACK_BATCH),
                input_shape=tuple(args.input_shape),
                seed=args.seed,
                iters=args.iters,
                warmup=args.warmup,
                compute_method=args.compute_method,
                factor_update_steps=args.factor_update_steps,
                inv_update_steps=args.inv_update_steps,
                modes=tuple(ABLATION_MODES) + ((args.compare,) if args.compare else ()),
            )
            value = _launch(measure_ablation_rank, job, args, link, bar.write)
            bar.update(1)
            if isinstance(value, str):
                failures.append(f"{model}: {value}")
                bar.write(failures[-1])
                continue
            new_rows = ablation_rows(
                model,
                value,
                ranks=args.nprocs,
                link=link_text,
                batch=job.batch,
                factor_update_steps=job.factor_update_steps,
                inv_update_steps=job.inv_update_steps,
                iters=job.iters,
            )
            rows += new_rows
            for line in format_ablation_table(new_rows).splitlines()[2:]:
                bar.write(line)
    header = format_ablation_header(
        rows,
        ranks=args.nprocs,
        link=link_text,
        compute_method=args.compute_method,
        iters=args.iters,
    )
    print(f"\n{header}\n")
    print(format_ablation_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([row.to_dict() for row in rows], indent=1) + "\n")
        print(f"\nrows written to {args.json}")
    if args.png and rows:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        plot_ablation(
            rows,
            args.png,
            title=f"SPD-KFAC ablation: iteration time by phase, {args.nprocs} ranks on {link_text}",
        )
        print(f"chart written to {args.png}")
    for failure in failures:
        print(f"{PROG}: {failure}")
    return 1 if failures else 0


def _run_breakdown(args: argparse.Namespace, models: Sequence[str], link: str | None) -> int:
    from tqdm import tqdm

    placement = args.placement or "greedy"
    rows: list[KfacRow] = []
    failures: list[str] = []
    events: list[dict[str, Any]] = []
    with tqdm(total=len(models), unit="model", desc=PROG, dynamic_ncols=True) as bar:
        for index, model in enumerate(models):
            bar.set_postfix_str(model)
            job = KfacJob(
                model=model,
                batch=args.batch or DEFAULT_BATCH.get(model, FALLBACK_BATCH),
                input_shape=tuple(args.input_shape),
                seed=args.seed,
                iters=args.iters,
                warmup=args.warmup,
                compute_method=args.compute_method,
                grad_worker_fraction=args.grad_worker_fraction,
                inv_update_steps=args.inv_update_steps,
                timeline=bool(args.png) and index == 0,
                placement=placement,
                factor_update_steps=args.factor_update_steps,
            )
            value = _launch(measure_rank, job, args, link, bar.write)
            bar.update(1)
            if isinstance(value, str):
                failures.append(f"{model}: {value}")
                bar.write(failures[-1])
                continue
            medians = value["medians"]
            rows.append(
                KfacRow(
                    model=model,
                    ranks=args.nprocs,
                    link=link or "loopback",
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
            if job.timeline:
                events = value["events"]
            bar.write(format_table(rows[-1:]).splitlines()[-1])
    print(
        f"\nK-FAC phase breakdown ({args.compute_method}, grad_worker_fraction "
        f"{args.grad_worker_fraction:g}, {placement} placement, "
        + (
            f"factors every {args.factor_update_steps} steps, "
            if args.factor_update_steps != 1
            else ""
        )
        + f"decompositions every {args.inv_update_steps} step(s)), "
        f"{args.nprocs} ranks on {link or 'loopback'}; per-rank batch per model "
        f"({', '.join(f'{r.model} {r.batch}' for r in rows)}); medians over {args.iters} "
        "iterations of the maximum over ranks:\n"
    )
    print(format_table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([row.to_dict() for row in rows], indent=1) + "\n")
        print(f"\nrows written to {args.json}")
    if args.png and events:
        from interlace.timeline import Event, Timeline

        timeline = Timeline(
            [Event(**event) for event in events],
            title=f"{rows[0].model}: DataParallel + K-FAC, one iteration, "
            f"{args.nprocs} ranks on {link or 'loopback'}",
        )
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        timeline.to_png(args.png)
        chrome_trace = Path(args.png).with_suffix(".json")
        timeline.to_chrome_trace(chrome_trace)
        print(f"timeline written to {args.png} (Chrome trace: {chrome_trace})")
    for failure in failures:
        print(f"{PROG}: {failure}")
    return 1 if failures else 0
