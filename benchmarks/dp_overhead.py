"""Host work per step of DataParallel (default and ``overlap="forward"``) against torch DDP on a
latency-bound model (48 blocks of Linear(32, 32) + ReLU, AdamW, gloo), in interleaved rounds.

``python benchmarks/dp_overhead.py --ranks 1,2`` prints, per rank count, each contender's median
milliseconds per step in wall and CPU time, the p25-p75 spread, the ratio to DDP (slowest rank
per step, after planning and a warm-up) and the buckets each all-reduces per step (the plan the
trials kept; DDP's own, from its reducer); ``--json PATH`` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from interlace.dp import DataParallel
from interlace.testing import run_ranks

#: Contenders, in the order they are built; each round runs them in a rotated order.
CONTENDERS = ("ddp", "default", "overlap")
BLOCKS = 48
WIDTH = 32
BATCH = 32
#: Wall time, and the process's CPU time (host work, which others' load on a shared machine
#: does not inflate as much).
CLOCKS = ("wall", "cpu")
#: Planning gives up after this many steps (a bound, not a target: planning takes far fewer).
PLANNING_LIMIT = 2000


def build_model(seed: int = 0) -> nn.Sequential:
    """The latency-bound model: ``BLOCKS`` blocks of Linear(WIDTH, WIDTH) + ReLU.

    Args:
        seed: Seeds the weights, the same on every rank.
    """
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def _stepper(
    kind: str, plan: dict[str, Any] | None = None
) -> tuple[nn.Module, Callable[[torch.Tensor], None]]:
    """One contender's wrapped model and its training step; ``plan``: DataParallel's
    ``bucketing`` and ``tune_steps`` (default: its own defaults)."""
    model = build_model()
    wrapped: nn.Module
    if kind == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        overlap = "forward" if kind == "overlap" else "backward"
        wrapped = DataParallel(model, overlap=overlap, **(plan or {}))
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)

    def step(inputs: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        wrapped(inputs).square().mean().backward()
        optimizer.step()

    return wrapped, step


def _all_planned(wrappers: list[nn.Module]) -> bool:
    """Whether every DataParallel has planned, on every rank (the ranks must step alike)."""
    done = all(getattr(w, "planning_done", True) for w in wrappers)
    flag = torch.tensor([1.0 if done else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _bucket_count(wrapped: nn.Module) -> int:
    """How many buckets ``wrapped`` all-reduces per step (0: none, on one rank)."""
    if isinstance(wrapped, DistributedDataParallel):
        sizes = str(wrapped._get_ddp_logging_data().get("bucket_sizes", ""))
        return len(sizes.split(",")) if sizes else 0
    assert isinstance(wrapped, DataParallel)
    return len(wrapped.buckets)


def measure(
    rounds: int, steps: int, warmup: int, plan: dict[str, Any] | None = None
) -> dict[str, dict[str, list[float]]]:
    """On one rank: every contender's seconds per step, ``rounds`` rounds of ``steps`` each.

    Args:
        rounds: Interleaved rounds; round ``r`` starts with contender ``r mod 3``.
        steps: Timed steps per contender and round.
        warmup: Untimed steps per contender after planning.
        plan: DataParallel's ``bucketing`` and ``tune_steps``, if not its defaults.

    Returns:
        Per contender and clock (wall, and the process's CPU time, all its threads), its step
        times in seconds, in the order they ran; under ``"buckets"``, its bucket count.
    """
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    inputs = torch.randn(BATCH, WIDTH, generator=generator)
    built = {kind: _stepper(kind, plan) for kind in CONTENDERS}
    # Each wrapper plans alone, as in a user's loop: its trials time whole iterations, which
    # must not include the other contenders' steps.
    for wrapped, step in built.values():
        for _ in range(PLANNING_LIMIT):
            if _all_planned([wrapped]):
                break
            step(inputs)
        else:
            raise RuntimeError(f"planning did not finish in {PLANNING_LIMIT} steps")
    for _, step in built.values():
        for _ in range(warmup):
            step(inputs)
    times: dict[str, dict[str, list[float]]] = {
        k: {"buckets": [float(_bucket_count(built[k][0]))], **{c: [] for c in CLOCKS}}
        for k in CONTENDERS
    }
    for index in range(rounds):
        shift = index % len(CONTENDERS)
        for kind in CONTENDERS[shift:] + CONTENDERS[:shift]:
            step = built[kind][1]
            for _ in range(steps):
                wall, cpu = time.perf_counter(), time.process_time()
                step(inputs)
                times[kind]["cpu"].append(time.process_time() - cpu)
                times[kind]["wall"].append(time.perf_counter() - wall)
    return times


def summarise(
    per_rank: list[dict[str, dict[str, list[float]]]], ranks: int
) -> list[dict[str, Any]]:
    """Rows of one rank count: per clock, median and p25/p75 of the slowest rank at each step.

    Args:
        per_rank: Each rank's step times, as :func:`measure` returns them.
        ranks: The rank count, copied into the rows.
    """
    rows: list[dict[str, Any]] = []
    for kind in CONTENDERS:
        buckets = {int(r[kind]["buckets"][0]) for r in per_rank}
        row: dict[str, Any] = {"ranks": ranks, "contender": kind, "buckets": max(buckets)}
        for clock in CLOCKS:
            by_step = zip(*(r[kind][clock] for r in per_rank), strict=True)
            slowest = [max(times) * 1e3 for times in by_step]
            q = statistics.quantiles(slowest, n=4) if len(slowest) > 1 else slowest * 3
            row["steps"] = len(slowest)
            row[f"{clock}_median_ms"] = statistics.median(slowest)
            row[f"{clock}_p25_ms"], row[f"{clock}_p75_ms"] = q[0], q[2]
        rows.append(row)
    for row in rows:
        for clock in CLOCKS:
            ddp = rows[0][f"{clock}_median_ms"]
            row[f"{clock}_ratio_to_ddp"] = row[f"{clock}_median_ms"] / ddp
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table.

    Args:
        rows: As :func:`summarise` returns them, any rank counts.
    """
    lines = [
        "| ranks | contender | buckets | wall ms/step | wall p25-p75 | wall vs DDP "
        "| CPU ms/step | CPU p25-p75 | CPU vs DDP |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = [str(row["ranks"]), row["contender"], str(row["buckets"])]
        for clock in CLOCKS:
            cells += [
                f"{row[f'{clock}_median_ms']:.2f}",
                f"{row[f'{clock}_p25_ms']:.2f}-{row[f'{clock}_p75_ms']:.2f}",
                f"{row[f'{clock}_ratio_to_ddp']:.2f}x",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ranks(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks wants counts like 1,2, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--ranks wants counts >= 1, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    """Measure each rank count, print the table, optionally write the rows as JSON.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ranks", type=_ranks, default=[1, 2], help="rank counts, e.g. 1,2")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps after planning")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per rank count")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--bucketing",
        default=None,
        help="DataParallel's bucketing (default: its own); 'fixed' with --tune-steps 0 pins "
        "DDP's buckets, so that both send the same all-reduces",
    )
    parser.add_argument("--tune-steps", type=int, default=None, help="DataParallel's tune_steps")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--rounds and --steps must be >= 1, --warmup >= 0")
    plan: dict[str, Any] = {}
    if args.bucketing is not None:
        plan["bucketing"] = args.bucketing
    if args.tune_steps is not None:
        plan["tune_steps"] = args.tune_steps
    rows: list[dict[str, Any]] = []
    for ranks in args.ranks:
        per_rank = run_ranks(
            measure, ranks, args.rounds, args.steps, args.warmup, plan, timeout=args.timeout
        )
        rows += summarise(per_rank, ranks)
    print(table(rows))
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"rows": rows, "loadavg": list(load), "argv": sys.argv[1:]}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
