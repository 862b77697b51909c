"""How much can the choice of buckets alone buy over DDP on this cluster?

``python benchmarks/dp_bucket_sweep.py --model resnet20 --link 188mbit [--caps 0.25,0.5,1]``;
each row: a contender (DDP or DataParallel at a bucket cap, MG-WFBP with and without trials),
its bucket count, the median iteration (slowest rank) and its speed relative to DDP's defaults.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from interlace import DataParallel
from interlace.bench.harness import (
    NUM_CLASSES,
    default_batch,
    launch_on_ranks,
    max_over_ranks,
    split_blocks,
    synthetic_batches,
)
from interlace.zoo import build_model

#: Untimed iterations per contender once its buckets are final (DDP rebuilds its buckets at its
#: second iteration; interlace's are final when it has planned and run its trials).
WARMUP_STEPS = 5
#: A wrapper with no final plan after this many iterations is a bug, reported, not waited on.
MAX_PLAN_STEPS = 300


@dataclass(frozen=True)
class SweepJob:
    model: str
    batch: int
    caps_mb: tuple[float, ...]
    iters: int
    rounds: int
    seed: int = 0


def _contenders(caps_mb: tuple[float, ...]) -> list[tuple[str, dict[str, Any]]]:
    contenders: list[tuple[str, dict[str, Any]]] = [("ddp (defaults)", {"kind": "ddp"})]
    contenders += [(f"ddp cap {cap:g} MB", {"kind": "ddp", "cap": cap}) for cap in caps_mb]
    contenders += [
        (f"interlace fixed {cap:g} MB", {"kind": "fixed", "cap": cap}) for cap in caps_mb
    ]
    contenders += [
        ("interlace mgwfbp, model's plan", {"kind": "mgwfbp", "tune_steps": 0}),
        ("interlace mgwfbp, tuned", {"kind": "mgwfbp"}),
    ]
    return contenders


def _wrap(model: Any, spec: dict[str, Any]) -> Any:
    if spec["kind"] == "ddp":
        if "cap" in spec:
            return DistributedDataParallel(model, bucket_cap_mb=spec["cap"])
        return DistributedDataParallel(model)
    if spec["kind"] == "fixed":
        cap = spec["cap"]
        return DataParallel(model, bucketing="fixed", bucket_cap_mb=cap, first_bucket_cap_mb=cap)
    return DataParallel(model, bucketing="merged", tune_steps=spec.get("tune_steps", 3))


def sweep_rank(job: SweepJob) -> list[dict[str, Any]]:
    """Every contender warmed up, then timed in rotating round-robin blocks."""
    batches = synthetic_batches(job.batch, (3, 32, 32), job.seed, dist.get_rank())
    runs: list[tuple[str, Any, Any, list[float]]] = []
    for label, spec in _contenders(job.caps_mb):
        torch.manual_seed(job.seed)
        wrapper = _wrap(build_model(job.model, (3, 32, 32), NUM_CLASSES), spec)
        optimizer = torch.optim.SGD(wrapper.parameters(), lr=0.01, momentum=0.9)
        runs.append((label, wrapper, optimizer, []))
    counter = 0

    def step(wrapper: Any, optimizer: Any) -> None:
        nonlocal counter
        counter += 1
        inputs, targets = batches[counter % len(batches)]
        optimizer.zero_grad()
        functional.cross_entropy(wrapper(inputs), targets).backward()
        optimizer.step()

    for label, wrapper, optimizer, _ in runs:
        steps = 0
        while not getattr(wrapper, "planning_done", True):
            if steps >= MAX_PLAN_STEPS:
                raise RuntimeError(f"{label}: no final plan after {steps} steps")
            step(wrapper, optimizer)
            steps += 1
        for _ in range(WARMUP_STEPS):
            step(wrapper, optimizer)
    for round_index, block in enumerate(split_blocks(job.iters, job.rounds)):
        shift = round_index % len(runs)
        for _, wrapper, optimizer, times in runs[shift:] + runs[:shift]:
            dist.barrier()
            for _ in range(block):
                start = time.perf_counter()
                step(wrapper, optimizer)
                times.append(time.perf_counter() - start)
    results = []
    for label, wrapper, _, times in runs:
        plan = getattr(wrapper, "plan", None)
        results.append(
            {
                "contender": label,
                "buckets": None if plan is None else len(plan.buckets),
                "median_s": statistics.median(max_over_ranks(times)),
                "tuning": getattr(wrapper, "tuning_summary", "") or None,
            }
        )
    return results


def format_table(results: list[dict[str, Any]]) -> str:
    reference = results[0]["median_s"]
    lines = ["| contender | buckets | median ms | vs DDP defaults |", "|---|---:|---:|---:|"]
    for row in results:
        buckets = "-" if row["buckets"] is None else str(row["buckets"])
        lines.append(
            f"| {row['contender']} | {buckets} | {row['median_s'] * 1e3:.1f} | "
            f"{reference / row['median_s']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet20", help="zoo model (default resnet20)")
    parser.add_argument("--link", default="188mbit", help="emulated link (default 188mbit)")
    parser.add_argument("-n", "--nprocs", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--batch-size", type=int, default=None, help="per-rank batch")
    parser.add_argument(
        "--caps", default="0.25,0.5,1", help="bucket caps in MB to sweep (default 0.25,0.5,1)"
    )
    parser.add_argument("--iters", type=int, default=24, help="timed iterations (default 24)")
    parser.add_argument("--rounds", type=int, default=4, help="round-robin blocks (default 4)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args()
    caps = tuple(float(text) for text in args.caps.split(","))
    if any(cap <= 0 for cap in caps):
        parser.error(f"--caps must be positive MB, got {args.caps}")
    batch = args.batch_size or default_batch(args.model)
    print(
        f"{args.model}, batch {batch} per rank, {args.nprocs} ranks on {args.link}; "
        f"{args.iters} timed iterations per contender in {args.rounds} rounds"
    )
    results = launch_on_ranks(
        sweep_rank,
        SweepJob(args.model, batch, caps, args.iters, args.rounds),
        nprocs=args.nprocs,
        link=args.link,
        timeout_s=1800,
        prog="dp_bucket_sweep",
    )
    print(format_table(results))
    for row in results:
        if row["tuning"]:
            print(f"{row['contender']}: {row['tuning']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    # The ranks unpickle the job and the rank function by module name, which "__main__" is not
    # for them: run main() from the module imported under its own name (this directory is on
    # the path the launcher hands the ranks).
    import dp_bucket_sweep

    raise SystemExit(dp_bucket_sweep.main())
