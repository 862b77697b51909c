"""The GPU path: decompositions on GPU vs CPU, and training steps on one GPU over NCCL.

``python benchmarks/gpu_paths.py --json gpu.json`` (needs CUDA); prints two markdown tables
(see docs/notes/bench.md for what each column is).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from interlace import KFAC, DataParallel
from interlace.kfac.costs import random_spd
from interlace.kfac.decomp import COMPUTE_METHODS, decompose
from interlace.kfac.factor_modes import Pipelined
from interlace.testing import run_ranks
from interlace.zoo import build_model


def time_decomposition(method: str, n: int, device: torch.device, repeats: int) -> float:
    """Median seconds of the library's decomposition of a damped ``n x n`` SPD matrix."""
    generator = torch.Generator().manual_seed(n)
    matrices = [random_spd(n, torch.float32, device, generator) for _ in range(repeats + 1)]
    times = []
    for matrix in matrices:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        decompose(matrix, method, 1e-3, torch.float32)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first call loads the solver


def decomposition_rows(dims: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for method in COMPUTE_METHODS:
        for n in dims:
            gpu = time_decomposition(method, n, torch.device("cuda"), repeats)
            cpu = time_decomposition(method, n, torch.device("cpu"), max(1, repeats // 2))
            rows.append({"method": method, "n": n, "gpu_s": gpu, "cpu_s": cpu})
    return rows


_CONFIGS = ("ddp", "dataparallel", "kfac-dkfac", "kfac-spd")


def _train_steps(model_name: str, batch_size: int, steps: int, rounds: int) -> dict[str, Any]:
    """On one NCCL rank: median seconds per training step of every configuration."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cudnn.benchmark = True
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(batch_size, 3, 32, 32, generator=generator).to(device)
    targets = torch.randint(0, 10, (batch_size,), generator=generator).to(device)
    runners: dict[str, tuple[nn.Module, torch.optim.Optimizer, KFAC | None]] = {}
    for config in _CONFIGS:
        torch.manual_seed(0)
        model = build_model(model_name, (3, 32, 32), 10).to(device)
        precond = None
        if config == "ddp":
            wrapped: nn.Module = DistributedDataParallel(model, device_ids=[device.index])
        else:
            wrapped = DataParallel(model)
        if config.startswith("kfac"):
            spd = config == "kfac-spd"
            precond = KFAC(
                wrapped,
                inv_update_steps=10,
                factor_comm=Pipelined(fusion="merged") if spd else "bulk",
                placement="lbp" if spd else "greedy",
            )
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9)
        runners[config] = (wrapped, optimizer, precond)

    def step(config: str) -> None:
        train_step(runners[config], inputs, targets)

    # Warm up each (cuDNN autotuning, DataParallel's profiling, planning and plan trials).
    return median_step_s(step, _CONFIGS, device, warmup=60, steps=steps, rounds=rounds)


def train_step(runner: tuple[Any, Any, Any], inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """One step of a ``(model, optimizer, preconditioner or None)`` on one batch.

    Args:
        runner: The contender.
        inputs: The batch.
        targets: Its classes.
    """
    model, optimizer, precond = runner
    optimizer.zero_grad(set_to_none=True)
    functional.cross_entropy(model(inputs), targets).backward()
    if precond is not None:
        precond.step()
    optimizer.step()


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA).

    Args:
        device: The device.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_step_s(
    step: Callable[[str], None],
    names: Sequence[str],
    device: torch.device,
    *,
    warmup: int,
    steps: int,
    rounds: int,
) -> dict[str, float]:
    """Each contender's median seconds per ``step(name)``, the device synchronised around each.

    Rounds alternate the contenders' order, so none always runs after the same one.

    Args:
        step: One training step of the named contender.
        names: The contenders.
        device: Where they run (CUDA is synchronised; the host clock times any other).
        warmup: Untimed steps of each first.
        steps: Timed steps per contender per round.
        rounds: Rounds.
    """

    for name in names:
        for _ in range(warmup):
            step(name)
    sync(device)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else tuple(reversed(names))
        for name in order:
            for _ in range(steps):
                sync(device)
                start = time.perf_counter()
                step(name)
                sync(device)
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="64,256,1024,2048,4096", help="factor dimensions")
    parser.add_argument("--repeats", type=int, default=5, help="timed decompositions per size")
    parser.add_argument("--models", default="resnet20,resnet56")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gpu_paths.py needs a CUDA GPU; none is visible here.", file=sys.stderr)
        return 2

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    decompositions = decomposition_rows([int(d) for d in args.dims.split(",")], args.repeats)
    print("\n| method | n | GPU ms | CPU ms | GPU speed-up |\n|---|---:|---:|---:|---:|")
    for row in decompositions:
        print(
            f"| {row['method']} | {row['n']} | {row['gpu_s'] * 1e3:.2f} | "
            f"{row['cpu_s'] * 1e3:.2f} | {row['cpu_s'] / row['gpu_s']:.1f}x |"
        )

    training = []
    for model_name in args.models.split(","):
        medians = run_ranks(
            _train_steps,
            1,
            model_name,
            args.batch_size,
            args.steps,
            args.rounds,
            backend="nccl",
            timeout=600,
        )[0]
        training.append({"model": model_name, "batch_size": args.batch_size, **medians})
    print(
        f"\nms per training step, one rank over NCCL, batch {args.batch_size} of 3x32x32\n"
        "\n| model | torch DDP | DataParallel | vs DDP | K-FAC (D-KFAC) | K-FAC (SPD) "
        "| SPD vs D-KFAC |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for row in training:
        print(
            f"| {row['model']} | {row['ddp'] * 1e3:.2f} | {row['dataparallel'] * 1e3:.2f} | "
            f"{row['ddp'] / row['dataparallel']:.2f}x | {row['kfac-dkfac'] * 1e3:.2f} | "
            f"{row['kfac-spd'] * 1e3:.2f} | {row['kfac-dkfac'] / row['kfac-spd']:.2f}x |"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"decompositions": decompositions, "training": training}, indent=2)
        )
    return 0


if __name__ == "__main__":
    # The rank unpickles its function by module name, which "__main__" is not for it: run
    # main() from the module imported under its own name (this directory is on its path).
    import gpu_paths

    raise SystemExit(gpu_paths.main())
