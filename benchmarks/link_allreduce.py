"""How faithful is the emulated network? A gloo all-reduce timed against the ring model.

Run it on the emulated cluster, e.g.::

    interlace launch -n 4 --link 1gbit -- python benchmarks/link_allreduce.py --mb 16

Every rank all-reduces a float32 tensor of ``--mb`` megabytes: a few warm-up rounds (connection
set-up, first-touch allocation), then ``--iters`` timed rounds, each started after a barrier so the
ranks start together. Rank 0 prints a markdown table comparing the median time with the ring
all-reduce model ``2(N-1)/N * M / rate`` (:func:`interlace.comm.cost.ring_allreduce_time`) for
the link named by ``INTERLACE_LINK``, which the launcher sets with ``--link``. A ratio near 1
means that times measured on this machine stand for what a cluster of that link would see.
Without ``--link`` the ranks talk over loopback and the model columns read ``n/a``.
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
