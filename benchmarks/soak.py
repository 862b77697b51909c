"""Does a long run leak memory? Resident memory per rank over many DataParallel (+ K-FAC) steps.

``python benchmarks/soak.py --steps 3000`` trains a small MLP on 2 ranks and prints each rank's
resident-memory slope (least squares over the samples after the warm-up), in KiB per 1,000
steps, for plain DataParallel and for DataParallel with K-FAC.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from torch import nn

from interlace import launch


def _rss_kib() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1024


def soak_rank(steps: int, every: int, kfac: bool) -> list[tuple[int, float]]:
    """Train on this rank and sample its resident memory every ``every`` steps.

    Args:
        steps: Optimizer steps.
        every: Steps between samples.
        kfac: Precondition with ``interlace.KFAC``.
    """
    import torch.distributed as dist  # noqa: PLC0415 - a spawned rank's entry point

    import interlace  # noqa: PLC0415 - a spawned rank's entry point

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    )
    wrapped = interlace.DataParallel(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9)
    precond = interlace.KFAC(wrapped, inv_update_steps=10) if kfac else None
    generator = torch.Generator().manual_seed(dist.get_rank())
    samples = []
    for step in range(1, steps + 1):
        x = torch.randn(16, 32, generator=generator)
        y = torch.randint(0, 10, (16,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(wrapped(x), y).backward()
        if precond is not None:
            precond.step()
        optimizer.step()
        if step % every == 0:
            samples.append((step, _rss_kib()))
    dist.destroy_process_group()
    return samples


def slope_per_1000(samples: list[tuple[int, float]]) -> float:
    """Least-squares slope of resident KiB against steps, per 1,000 steps.

    Args:
        samples: ``(step, KiB)`` pairs.
    """
    steps = [float(s) for s, _ in samples]
    kib = [k for _, k in samples]
    slope, _ = statistics.linear_regression(steps, kib)
    return 1000 * slope


def main() -> int:
    """Run both soaks and print each rank's memory slope."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000, help="steps per soak (default 3000)")
    parser.add_argument("--every", type=int, default=100, help="steps between samples (100)")
    parser.add_argument(
        "--warmup", type=int, default=500, help="steps left out of the fit (default 500)"
    )
    args = parser.parse_args()
    print("| run | rank | RSS at warm-up end (MiB) | RSS at end (MiB) | slope (KiB / 1000 steps) |")
    print("|---|---:|---:|---:|---:|")
    for label, kfac in (("DataParallel", False), ("DataParallel + K-FAC", True)):
        result = launch.run(soak_rank, 2, args=(args.steps, args.every, kfac)).check()
        for rank, samples in enumerate(result.values):
            kept = [(s, k) for s, k in samples if s > args.warmup]
            print(
                f"| {label} | {rank} | {kept[0][1] / 1024:.1f} | {kept[-1][1] / 1024:.1f} | "
                f"{slope_per_1000(kept):+.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
