"""How faithful is the emulated network? A gloo all-reduce timed against the ring model.

``interlace launch -n 4 --link 1gbit -- python benchmarks/link_allreduce.py --mb 16``; rank 0
prints the median time beside ``2(N-1)/N * M / rate`` for the link in ``INTERLACE_LINK``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from interlace.comm.cost import ring_allreduce_time
from interlace.comm.links import parse_link


def measure(nbytes: int, warmup: int, iters: int) -> list[float]:
    """Seconds per all-reduce of ``nbytes`` of float32, one entry per timed round (every rank)."""
    tensor = torch.ones(nbytes // 4, dtype=torch.float32)
    for _ in range(warmup):
        dist.all_reduce(tensor)
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    """Parse the flags, time every size, and print the table on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[16.0], help="sizes in MB (1e6 B)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds per size")
    parser.add_argument("--iters", type=int, default=10, help="timed rounds per size")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    link = os.environ.get("INTERLACE_LINK")
    rate = parse_link(link) if link else None

    rows = []
    for mb in args.mb:
        nbytes = int(mb * 1e6) // 4 * 4
        times = torch.tensor(measure(nbytes, args.warmup, args.iters), dtype=torch.float64)
        # A round lasts until the slowest rank is done, so take each round's maximum over ranks.
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        median = statistics.median(times.tolist())
        model = ring_allreduce_time(nbytes, world, rate) if rate else None
        rows.append((mb, median, model))
    dist.destroy_process_group()

    if rank == 0:
        print(
            "| size (MB) | ranks | link | measured median (s) | ring model (s) | measured/model |"
        )
        print("|---:|---:|---|---:|---:|---:|")
        for mb, median, model in rows:
            model_s = f"{model:.4f}" if model is not None else "n/a"
            ratio = f"{median / model:.2f}" if model else "n/a"
            print(
                f"| {mb:g} | {world} | {link or 'loopback'} | {median:.4f} | {model_s} | {ratio} |"
            )


if __name__ == "__main__":
    main()
