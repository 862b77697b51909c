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
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from interlace.bench.dp import (
    DEFAULT_BATCH,
    DEFAULT_INPUT_SHAPE,
    FALLBACK_BATCH,
    NUM_CLASSES,
    parse_names,
    parse_shape,
    rank_entry,
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
_MAX_WARMUP_STEPS = 50
_BATCHES = 4

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
        default=",".join(DEFAULT_MODELS),
        help="comma-separated zoo names or package.module:callable "
        f"(default {','.join(DEFAULT_MODELS)})",
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
        "--inv-update-steps",
        type=int,
        default=1,
        help="decompose every K steps (default 1, so every phase shows in every iteration)",
    )
    parser.add_argument(
        "--placement",
        choices=("greedy", "round-robin", "lbp"),
        default="greedy",
        help="where decompositions are computed (default greedy, SC20/KAISA)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument(
        "--png", metavar="PATH", help="timeline of the first model's last iteration (PNG)"
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


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; the exit status."""
    from tqdm import tqdm

    from interlace import launch, netem
    from interlace.kfac.placement import worker_count
    from interlace.netem import parse_link

    models = (args.model,) if args.model else parse_names(args.models, None, "models", "model")
    if args.nprocs < 1:
        raise UsageError(f"-n must be >= 1, got {args.nprocs}")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be >= 1 and --warmup >= 0")
    if args.placement == "lbp" and args.grad_worker_fraction < 1:
        raise UsageError("--placement lbp needs --grad-worker-fraction 1 (COMM-OPT)")
    if args.inv_update_steps < 1:
        raise UsageError(f"--inv-update-steps must be >= 1, got {args.inv_update_steps}")
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
                placement=args.placement,
            )
            sink = io.StringIO()
            result = launch.run(
                rank_entry,
                args.nprocs,
                link,
                args=(measure_rank, job, args.timeout),
                timeout=args.timeout,
                output=sink,
            )
            bar.update(1)
            if not result.ok:
                rank = result.failed_rank
                trace = result.tracebacks.get(rank, "") if rank is not None else ""
                failures.append(f"{model}: rank {rank} failed\n{trace.strip()}")
                bar.write(failures[-1])
                continue
            value = result.values[0]
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
                )
            )
            if job.timeline:
                events = value["events"]
            bar.write(format_table(rows[-1:]).splitlines()[-1])
    print(
        f"\nK-FAC phase breakdown ({args.compute_method}, grad_worker_fraction "
        f"{args.grad_worker_fraction:g}, {args.placement} placement, decompositions every "
        f"{args.inv_update_steps} step(s)), "
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
