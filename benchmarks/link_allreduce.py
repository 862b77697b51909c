"""How faithful is the emulated network? A gloo all-reduce timed against the ring model.

``interlace launch -n 4 --link 1gbit -- python benchmarks/link_allreduce.py --mb 16``; rank 0
prints the median time beside ``2(N-1)/N * M / rate`` for the link in ``INTERLACE_LINK``. With
``--split`` it also times the same bytes as a reduce-scatter followed by an all-gather (DeAR's
and FSDP's decomposition of an all-reduce); ``--dtype bfloat16`` sends the bytes as bfloat16
(what bf16 compression sends: gloo then sums bfloat16 on the CPU).
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


def measure(
    nbytes: int, warmup: int, iters: int, dtype: torch.dtype = torch.float32
) -> list[float]:
    """Seconds per all-reduce of ``nbytes`` of ``dtype``, one entry per timed round (every
    rank)."""
    tensor = torch.ones(nbytes // dtype.itemsize, dtype=dtype)
    for _ in range(warmup):
        dist.all_reduce(tensor)
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    return times


def measure_split(nbytes: int, warmup: int, iters: int) -> list[float]:
    """Seconds per reduce-scatter + all-gather of ``nbytes`` of float32 (every rank)."""
    world = dist.get_world_size()
    numel = nbytes // 4 // world * world
    tensor = torch.ones(numel, dtype=torch.float32)
    shard = torch.empty(numel // world, dtype=torch.float32)

    def once() -> None:
        dist.reduce_scatter_tensor(shard, tensor)
        dist.all_gather_into_tensor(tensor, shard)

    for _ in range(warmup):
        once()
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return times


def _slowest_median(times: list[float]) -> float:
    # A round lasts until the slowest rank is done, so take each round's maximum over ranks.
    values = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return float(statistics.median(values.tolist()))


def main() -> None:
    """Parse the flags, time every size, and print the table on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, nargs="+", default=[16.0], help="sizes in MB (1e6 B)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds per size")
    parser.add_argument("--iters", type=int, default=10, help="timed rounds per size")
    parser.add_argument(
        "--split", action="store_true", help="also time reduce-scatter + all-gather"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the all-reduced elements' type (default float32)",
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    link = os.environ.get("INTERLACE_LINK")
    rate = parse_link(link) if link else None

    rows = []
    for mb in args.mb:
        nbytes = int(mb * 1e6) // 4 * 4
        median = _slowest_median(
            measure(nbytes, args.warmup, args.iters, getattr(torch, args.dtype))
        )
        split = (
            _slowest_median(measure_split(nbytes, args.warmup, args.iters)) if args.split else None
        )
        model = ring_allreduce_time(nbytes, world, rate) if rate else None
        rows.append((mb, median, model, split))
    dist.destroy_process_group()

    if rank == 0:
        print(
            f"{args.dtype}:\n"
            "| size (MB) | ranks | link | measured median (s) | ring model (s) | measured/model "
            "| reduce-scatter + all-gather (s) | split/all-reduce |"
        )
        print("|---:|---:|---|---:|---:|---:|---:|---:|")
        for mb, median, model, split in rows:
            model_s = f"{model:.4f}" if model is not None else "n/a"
            ratio = f"{median / model:.2f}" if model else "n/a"
            split_s = "-" if split is None else f"{split:.4f}"
            versus = "-" if split is None else f"{split / median:.2f}"
            print(
                f"| {mb:g} | {world} | {link or 'loopback'} | {median:.4f} | {model_s} | {ratio} "
                f"| {split_s} | {versus} |"
            )


if __name__ == "__main__":
    main()
