"""K-FAC's device costs on one GPU: decompositions, factor products, preconditioning, launches.

``python benchmarks/gpu_kfac_costs.py --json costs.json`` (needs CUDA) times each with CUDA
events and prints a markdown table; the emulated K-FAC prices its device time with these.
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


def _device_s(work: Callable[[], object], repeats: int) -> float:
    """Median device seconds of ``work`` over ``repeats`` runs, after two warm-ups."""
    for _ in range(2):
        work()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _spd(n: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, n, generator=generator, dtype=torch.float64)
    return (x @ x.T / n + 0.01 * torch.eye(n, dtype=torch.float64)).to("cuda", torch.float32)


def _inverse(spd: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
    """The damped inverse through Cholesky, as K-FAC's inverse method computes it."""
    return torch.cholesky_inverse(torch.linalg.cholesky(spd + eye))


def _precondition(q: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Eigen preconditioning's products: into both eigenbases and back (four n x n products)."""
    return q.T @ (q.T @ grad @ q) @ q


def _factor(x: torch.Tensor) -> torch.Tensor:
    """One factor from ``x``'s rows: ``x^T x / rows``."""
    return x.T @ (x / x.shape[0])


def measure(dims: list[int], rows: list[int], repeats: int) -> dict[str, Any]:
    """Every cost, by size.

    Args:
        dims: Factor dimensions n.
        rows: Rows of the activations a factor is computed from (batch x positions).
        repeats: Timed runs per size.
    """
    generator = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tf32": torch.backends.cuda.matmul.allow_tf32,
        "eigh_s": [],
        "inverse_s": [],
        "factor_s": [],
        "precondition_s": [],
    }
    for n in dims:
        spd = _spd(n, generator)
        eye = torch.eye(n, device="cuda")
        grad = torch.randn(n, n, device="cuda")
        result["eigh_s"].append((n, _device_s(partial(torch.linalg.eigh, spd), repeats)))
        result["inverse_s"].append((n, _device_s(partial(_inverse, spd, eye), repeats)))
        result["precondition_s"].append((n, _device_s(partial(_precondition, spd, grad), repeats)))
        for count in rows:
            x = torch.randn(count, n, device="cuda")
            result["factor_s"].append((count, n, _device_s(partial(_factor, x), repeats)))
    tiny = torch.zeros(1, device="cuda")
    launches = 200
    per_launch = _device_s(lambda: [tiny.add_(1.0) for _ in range(launches)], repeats) / launches
    result["kernel_s"] = per_launch
    return result


def table(result: dict[str, Any]) -> str:
    """The markdown tables of :func:`measure`'s result."""
    lines = [
        f"{result['device']}, torch {result['torch']}, float32 (TF32 matmul "
        f"{'on' if result['tf32'] else 'off'}); device ms, median",
        "",
        "| n | eigh | Cholesky inverse | preconditioning (4 products n x n) | TFLOP/s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for (n, eigh), (_, inverse), (_, pre) in zip(
        result["eigh_s"], result["inverse_s"], result["precondition_s"], strict=True
    ):
        lines.append(
            f"| {n} | {eigh * 1e3:.3f} | {inverse * 1e3:.3f} | {pre * 1e3:.3f} | "
            f"{4 * 2 * n**3 / pre / 1e12:.1f} |"
        )
    lines += ["", "| rows x n | factor x^T x ms | TFLOP/s |", "|---|---:|---:|"]
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
