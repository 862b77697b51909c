"""K-FAC's device costs on one GPU: decompositions, factor products, preconditioning, launches.

``python benchmarks/gpu_kfac_costs.py --json costs.json`` (needs CUDA) times the library's own
functions (``decompose``, ``precondition``, ``second_moment``) with CUDA events and prints a
markdown table; the emulated K-FAC prices its device time with these.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from interlace.clock import StreamClock
from interlace.kfac.costs import random_spd
from interlace.kfac.decomp import decompose, precondition
from interlace.kfac.module_helpers import second_moment


def device_s(
    work: Callable[[], object], repeats: int, device: torch.device | str = "cuda"
) -> float:
    """Median device seconds of ``work`` over ``repeats`` runs, after two warm-ups (CUDA
    events on a GPU, the host clock elsewhere).

    Args:
        work: What is timed.
        repeats: Timed runs.
        device: Where ``work`` runs.
    """
    clock = StreamClock(device)
    for _ in range(2):
        work()
    times = []
    for _ in range(repeats):
        start = clock.mark()
        work()
        times.append(clock.seconds(start, clock.mark()))
    return statistics.median(times)


def measure(dims: list[int], rows: list[int], repeats: int) -> dict[str, Any]:
    """Every cost, by size, of the library's own K-FAC functions.

    Args:
        dims: Factor dimensions n.
        rows: Rows of the activations a factor is computed from (batch x positions).
        repeats: Timed runs per size.
    """
    generator = torch.Generator().manual_seed(0)
    device = torch.device("cuda")
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tf32": torch.backends.cuda.matmul.allow_tf32,
        "eigh_s": [],
        "inverse_s": [],
        "factor_s": [],
        "precondition_s": [],
    }
    damping = 1e-3
    for n in dims:
        factor = random_spd(n, torch.float32, device, generator)
        for method, key in (("eigen", "eigh_s"), ("inverse", "inverse_s")):
            work = partial(decompose, factor, method, damping, torch.float32)
            result[key].append((n, device_s(work, repeats)))
        # Eigen preconditioning of an n x n gradient with both factors' decompositions.
        eigen = decompose(factor, "eigen", damping, torch.float32)
        grad = torch.randn(n, n, device=device)
        preconditioning = partial(precondition, grad, eigen, eigen, damping)
        result["precondition_s"].append((n, device_s(preconditioning, repeats)))
        for count in rows:
            x = torch.randn(count, n, device=device)
            result["factor_s"].append((count, n, device_s(partial(second_moment, x), repeats)))
    tiny = torch.zeros(1, device=device)
    launches = 200
    per_launch = device_s(lambda: [tiny.add_(1.0) for _ in range(launches)], repeats) / launches
    result["kernel_s"] = per_launch
    return result


def table(result: dict[str, Any]) -> str:
    """The markdown tables of :func:`measure`'s result."""
    lines = [
        f"{result['device']}, torch {result['torch']}, float32 (TF32 matmul "
        f"{'on' if result['tf32'] else 'off'}); device ms, median",
        "",
        "| n | eigen decompose | inverse decompose | eigen precondition (n x n) | TFLOP/s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for (n, eigh), (_, inverse), (_, pre) in zip(
        result["eigh_s"], result["inverse_s"], result["precondition_s"], strict=True
    ):
        lines.append(
            f"| {n} | {eigh * 1e3:.3f} | {inverse * 1e3:.3f} | {pre * 1e3:.3f} | "
            f"{4 * 2 * n**3 / pre / 1e12:.1f} |"
        )
    lines += ["", "| rows x n | factor (second_moment) ms | TFLOP/s |", "|---|---:|---:|"]
    for count, n, seconds in result["factor_s"]:
        lines.append(
            f"| {count} x {n} | {seconds * 1e3:.3f} | {2 * count * n * n / seconds / 1e12:.1f} |"
        )
    lines += ["", f"kernel launch (back to back): {result['kernel_s'] * 1e6:.1f} us"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure and print; ``--json`` also writes the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="64,256,1024,2048,4096", help="factor dimensions")
    parser.add_argument("--rows", default="4096,65536", help="rows a factor is computed from")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per size")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kfac_costs: needs a CUDA GPU", file=sys.stderr)
        return 2
    result = measure(
        [int(d) for d in args.dims.split(",")],
        [int(r) for r in args.rows.split(",")],
        args.repeats,
    )
    print(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
