"""K-FAC against kfac-pytorch on one GPU: the transformer's factors layer by layer, whole steps.

``python benchmarks/gpu_kfac_h2h.py --json h2h.json --profile prof.txt`` (needs CUDA, or
``--device cpu``, and kfac-pytorch installed) prints two markdown tables: each
library's own factor helpers on the zoo transformer's captured layer inputs (CUDA events), with
interlace's biased ``A`` also built the other device's way (``input_moment``), and median
whole-step times of both preconditioners at their defaults on one NCCL rank.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from gpu_kfac_costs import device_s
from gpu_paths import median_step_s, sync, train_step
from interlace import KFAC, DataParallel
from interlace.kfac.module_helpers import LinearHelper, input_moment
from interlace.testing import run_ranks
from interlace.zoo import build_model

SHAPE = (3, 32, 32)
CLASSES = 10


def _captured_linears(batch: int, device: torch.device) -> list[tuple[nn.Module, Any, Any]]:
    """Every Linear layer of the zoo transformer with its input and output gradient."""
    torch.manual_seed(0)
    model = build_model("transformer", SHAPE, CLASSES).to(device)
    captured: dict[nn.Module, list[torch.Tensor]] = {}
    handles = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            captured[module] = []
            handles.append(
                module.register_forward_hook(
                    lambda mod, args, _out: captured[mod].append(args[0].detach())
                )
            )
            handles.append(
                module.register_full_backward_hook(
                    lambda mod, _gin, gout: captured[mod].append(cast(Any, gout)[0].detach())
                )
            )
    inputs = torch.randn(batch, *SHAPE, device=device)
    targets = torch.randint(0, CLASSES, (batch,), device=device)
    functional.cross_entropy(model(inputs), targets).backward()
    for handle in handles:
        handle.remove()
    return [(module, tensors[0], tensors[1]) for module, tensors in captured.items()]


def _host_ms(work: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median host milliseconds to queue ``work`` (no synchronisation inside)."""
    for _ in range(3):
        work()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        work()
        times.append((time.perf_counter() - start) * 1e3)
    sync(device)
    return statistics.median(times)


def factor_rows(batches: list[int], repeats: int, device: torch.device) -> list[dict[str, Any]]:
    """Both libraries' ``A`` and ``G`` of all 18 transformer Linear layers, per batch."""
    from kfac.layers.modules import LinearModuleHelper  # type: ignore[import-not-found]  # noqa: PLC0415

    rows = []
    for batch in batches:
        layers = _captured_linears(batch, device)
        ours = [(LinearHelper(m), x, g) for m, x, g in layers]
        theirs = [(LinearModuleHelper(m), x, g) for m, x, g in layers]

        def interlace_all(helpers: list[tuple[Any, Any, Any]] = ours) -> None:
            for helper, x, g in helpers:
                helper.a_factor(x)
                helper.g_factor(g)

        def peer_all(helpers: list[tuple[Any, Any, Any]] = theirs) -> None:
            for helper, x, g in helpers:
                # kfac-pytorch's save_layer_input clones the input first.
                helper.get_a_factor(x.clone())
                helper.get_g_factor(g)

        def other_way_all(helpers: list[tuple[Any, Any, Any]] = ours) -> None:
            # interlace with the other device's way of building a biased A.
            for helper, x, g in helpers:
                rows = x.reshape(-1, x.shape[-1])
                input_moment(rows, helper.bias is not None, by_padding=device.type == "cpu")
                helper.g_factor(g)

        row: dict[str, Any] = {"batch": batch, "layers": len(layers)}
        contenders = (
            ("interlace", interlace_all),
            ("kfac-pytorch", peer_all),
            ("other_way", other_way_all),
        )
        for name, work in contenders:
            row[f"{name}_device_ms"] = device_s(work, repeats, device) * 1e3
            row[f"{name}_host_ms"] = _host_ms(work, repeats, device)
        # Each library's factors agree (float32, same rows).
        worst = 0.0
        for (ours_h, x, g), (theirs_h, _, _) in zip(ours, theirs, strict=True):
            for mine, peer in (
                (ours_h.a_factor(x), theirs_h.get_a_factor(x.clone())),
                (ours_h.g_factor(g), theirs_h.get_g_factor(g)),
            ):
                worst = max(worst, float((mine - peer).norm() / peer.norm()))
        row["max_relative_difference"] = worst
        rows.append(row)
    return rows


CONTENDERS = ("sgd-ddp", "interlace", "kfac-pytorch")


def _build(contender: str, model_name: str, inv: int, device: torch.device) -> Any:
    """``(model, optimizer, preconditioner or None)`` of one contender."""
    torch.manual_seed(0)
    model = build_model(model_name, SHAPE, CLASSES).to(device)
    precond: Any = None
    if contender == "interlace":
        wrapped: nn.Module = DataParallel(model)
        precond = KFAC(wrapped, lr=0.01, factor_update_steps=1, inv_update_steps=inv)
    else:
        ids = [device.index] if device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=ids)
        if contender == "kfac-pytorch":
            from kfac.preconditioner import (  # type: ignore[import-not-found]  # noqa: PLC0415
                KFACPreconditioner,
            )

            precond = KFACPreconditioner(
                wrapped, factor_update_steps=1, inv_update_steps=inv, lr=0.01
            )
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9)
    return wrapped, optimizer, precond


def _step_medians(
    model_name: str, batch: int, inv: int, steps: int, rounds: int, warmup: int, on_cuda: bool
) -> dict[str, float]:
    """On one rank: each contender's median milliseconds per whole step."""
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    torch.backends.cudnn.benchmark = True
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(batch, *SHAPE, generator=generator).to(device)
    targets = torch.randint(0, CLASSES, (batch,), generator=generator).to(device)
    runners = {name: _build(name, model_name, inv, device) for name in CONTENDERS}

    def step(name: str) -> None:
        train_step(runners[name], inputs, targets)

    seconds = median_step_s(step, CONTENDERS, device, warmup=warmup, steps=steps, rounds=rounds)
    return {name: value * 1e3 for name, value in seconds.items()}


def _profile(model_name: str, batch: int, inv: int, out: str) -> None:
    """torch.profiler's op tables of 10 steps of each K-FAC contender, written to ``out``."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    device = torch.device("cuda", torch.cuda.current_device())
    inputs = torch.randn(batch, *SHAPE, device=device)
    targets = torch.randint(0, CLASSES, (batch,), device=device)
    text = []
    for name in ("interlace", "kfac-pytorch"):
        step = partial(train_step, _build(name, model_name, inv, device), inputs, targets)
        for _ in range(30):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        averages = prof.key_averages()
        for key in ("self_cuda_time_total", "self_cpu_time_total"):
            text.append(f"## {name}, {model_name} batch {batch}, inv {inv}, 10 steps, by {key}\n")
            text.append(averages.table(sort_by=key, row_limit=25))
    Path(out).write_text("\n".join(text))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factor-batches", default="8,32,128", help="per-rank batches")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per factor row")
    parser.add_argument("--models", default="resnet20,resnet32,transformer")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--inv", default="1,10", help="decomposition intervals")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--json", type=Path, help="write both tables' rows here")
    parser.add_argument("--profile", help="write op tables of 10 steps here (CUDA only)")
    parser.add_argument("--profile-model", default="transformer", help="the model profiled")
    parser.add_argument(
        "--profile-inv", type=int, default=10, help="its decomposition interval (10 steps)"
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: the same tables on the host (gloo, host clock)",
    )
    args = parser.parse_args()
    on_cuda = args.device == "cuda"
    if on_cuda and not torch.cuda.is_available():
        print(
            "benchmarks/gpu_kfac_h2h.py: no CUDA GPU is visible here; pass --device cpu for the "
            "host's tables.",
            file=sys.stderr,
        )
        return 2
    backend = "nccl" if on_cuda else "gloo"
    name = torch.cuda.get_device_name() if on_cuda else "cpu"
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    device = torch.device(args.device)
    factors = factor_rows([int(b) for b in args.factor_batches.split(",")], args.repeats, device)
    print(
        "\nThe zoo transformer's 18 Linear layers, A and G of each, ms per step\n\n"
        "| batch | interlace device | kfac-pytorch device | other-way A device | interlace host "
        "| kfac-pytorch host | other-way A host | max rel. diff |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for row in factors:
        print(
            f"| {row['batch']} | {row['interlace_device_ms']:.3f} | "
            f"{row['kfac-pytorch_device_ms']:.3f} | {row['other_way_device_ms']:.3f} | "
            f"{row['interlace_host_ms']:.3f} | {row['kfac-pytorch_host_ms']:.3f} | "
            f"{row['other_way_host_ms']:.3f} | {row['max_relative_difference']:.1e} |",
            flush=True,
        )
    steps = []
    for model_name in args.models.split(","):
        for inv in (int(k) for k in args.inv.split(",")):
            medians = run_ranks(
                _step_medians,
                1,
                model_name,
                args.batch_size,
                inv,
                args.steps,
                args.rounds,
                args.warmup,
                on_cuda,
                backend=backend,
                timeout=600,
            )[0]
            steps.append({"model": model_name, "inv": inv, "batch": args.batch_size, **medians})
            print(f"  {model_name} inv {inv}: {medians}", flush=True)
    print(
        f"\nms per whole step, one rank over {backend}, batch {args.batch_size}, "
        "factors every step\n"
        "\n| model | decompositions every | SGD (DDP) | interlace K-FAC | kfac-pytorch "
        "| interlace vs kfac-pytorch |\n|---|---:|---:|---:|---:|---:|"
    )
    for row in steps:
        print(
            f"| {row['model']} | {row['inv']} | {row['sgd-ddp']:.2f} | {row['interlace']:.2f} | "
            f"{row['kfac-pytorch']:.2f} | {row['kfac-pytorch'] / row['interlace']:.2f}x |"
        )
    if args.profile and on_cuda:
        run_ranks(
            _profile,
            1,
            args.profile_model,
            args.batch_size,
            args.profile_inv,
            args.profile,
            backend="nccl",
            timeout=600,
        )
    if args.json:
        meta = {"device": name, "torch": torch.__version__, "batch": args.batch_size}
        args.json.write_text(json.dumps({**meta, "factors": factors, "steps": steps}, indent=2))
    return 0


if __name__ == "__main__":
    # The rank unpickles its function by module name, which "__main__" is not for it: run
    # main() from the module imported under its own name (this directory is on its path).
    import gpu_kfac_h2h

    raise SystemExit(gpu_kfac_h2h.main())
