"""Does adaptive damping stop K-FAC's collapse at kfac-pytorch's defaults? MNIST-1D, mlp1d.

``python benchmarks/kfac_damping.py --json docs/kfac/damping.json --png docs/kfac/damping.png``
trains the MNIST-1D MLP in one process (100 per batch, SGD with momentum 0.9, weight decay 5e-4,
one warm-up epoch then cosine, as ``interlace train`` does) with K-FAC at fixed damping 0.001,
at Levenberg-Marquardt damping starting from 0.001 (default bounds 1e-5 to 0.1, and up to 1),
and at fixed 0.03; prints the table of
docs/kfac/damping.md (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from interlace.kfac import KFAC, LevenbergMarquardt
from interlace.train.config import WarmupCosine
from interlace.zoo.mnist1d import mnist1d_arrays
from interlace.zoo.models1d import MLP1d

#: mode -> (starting damping, damping_adaptation)
MODES: dict[str, tuple[float, Any]] = {
    "fixed 0.001": (0.001, "fixed"),
    "LM from 0.001": (0.001, LevenbergMarquardt()),
    "LM from 0.001 (max 1)": (0.001, LevenbergMarquardt(max_damping=1.0)),
    "fixed 0.03": (0.03, "fixed"),
}


def run(
    mode: str, lr: float, seed: int, *, epochs: int, batch: int, kl_clip: float
) -> dict[str, Any]:
    """Train one configuration; test accuracy, mean training loss and damping per epoch.

    Args:
        mode: A key of :data:`MODES`.
        lr: Peak learning rate.
        seed: Seeds the model and the batch order.
        epochs: Epochs to train.
        batch: Samples per batch.
        kl_clip: K-FAC's KL-clip.
    """
    arrays, _ = mnist1d_arrays()
    x, y, x_test, y_test = arrays["x"], arrays["y"], arrays["x_test"], arrays["y_test"]
    torch.manual_seed(seed)
    model = MLP1d((1, x.shape[1]), 10)
    steps = x.shape[0] // batch
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(epochs * steps, steps))
    damping, adaptation = MODES[mode]
    precond = KFAC(
        model,
        damping=damping,
        kl_clip=kl_clip,
        lr=lambda _: optimizer.param_groups[0]["lr"],
        damping_adaptation=adaptation,
    )
    loss_fn = nn.CrossEntropyLoss()
    order = torch.Generator().manual_seed(seed)
    history: dict[str, list[float]] = {"accuracy": [], "loss": [], "damping": []}
    started = time.perf_counter()
    for _ in range(epochs):
        model.train()
        permutation = torch.randperm(x.shape[0], generator=order)
        losses = []
        for index in range(steps):
            rows = permutation[index * batch : (index + 1) * batch]
            optimizer.zero_grad()
            loss = loss_fn(model(x[rows].unsqueeze(1)), y[rows])
            loss.backward()
            precond.step(loss=loss)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
        model.eval()
        with torch.no_grad():
            correct = (model(x_test.unsqueeze(1)).argmax(dim=1) == y_test).float().mean()
        history["accuracy"].append(float(correct))
        history["loss"].append(statistics.fmean(losses))
        history["damping"].append(precond.damping)
    return {
        "mode": mode,
        "lr": lr,
        "seed": seed,
        "seconds": time.perf_counter() - started,
        **history,
    }


def _epochs_to(accuracy: list[float], target: float) -> int | None:
    return next((epoch + 1 for epoch, value in enumerate(accuracy) if value >= target), None)


def table(runs: list[dict[str, Any]], target: float) -> str:
    """The markdown table of docs/kfac/damping.md: one row per run.

    Args:
        runs: What :func:`run` returned.
        target: The accuracy whose epoch is reported.
    """
    lines = [
        f"| lr | K-FAC damping | seed | best | final | epoch to {target:.0%} | final damping |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in runs:
        reached = _epochs_to(result["accuracy"], target)
        lines.append(
            f"| {result['lr']:g} | {result['mode']} | {result['seed']} "
            f"| {max(result['accuracy']):.1%} | {result['accuracy'][-1]:.1%} "
            f"| {reached if reached is not None else 'never'} | {result['damping'][-1]:.3g} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Test accuracy against epoch, a panel per learning rate, seeds' range shaded.

    Args:
        runs: What :func:`run` returned.
        path: The PNG to write.
    """
    import matplotlib  # noqa: PLC0415 - heavy import, only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after choosing the Agg backend

    rates = sorted({result["lr"] for result in runs})
    figure, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 3.6), squeeze=False)
    for axis, lr in zip(axes[0], rates, strict=True):
        for mode in MODES:
            curves = [r["accuracy"] for r in runs if r["lr"] == lr and r["mode"] == mode]
            if not curves:
                continue
            epochs = range(1, len(curves[0]) + 1)
            columns = list(zip(*curves, strict=True))
            axis.plot(epochs, [statistics.fmean(c) for c in columns], label=mode)
            axis.fill_between(
                epochs, [min(c) for c in columns], [max(c) for c in columns], alpha=0.2
            )
        axis.set_title(f"MNIST-1D mlp1d, K-FAC, lr {lr:g}, kl_clip 0.001")
        axis.set_xlabel("epoch")
        axis.set_ylabel("test accuracy")
        axis.set_ylim(0, 0.8)
        axis.grid(alpha=0.3)
        axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    """Parse the flags, run every (lr, mode, seed), print the table, write the files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", default="0.03,0.1", help="comma-separated peak rates")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--kl-clip", type=float, default=0.001)
    parser.add_argument("--target", type=float, default=0.6)
    parser.add_argument("--json", type=Path, help="write every run's history here")
    parser.add_argument("--png", type=Path, help="write the accuracy plot here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = []
    for lr in (float(value) for value in args.lrs.split(",")):
        for mode in args.modes.split(","):
            for seed in (int(value) for value in args.seeds.split(",")):
                result = run(
                    mode, lr, seed, epochs=args.epochs, batch=args.batch, kl_clip=args.kl_clip
                )
                runs.append(result)
                print(
                    f"lr {lr:g} {mode} seed {seed}: best {max(result['accuracy']):.1%}, "
                    f"final {result['accuracy'][-1]:.1%}, {result['seconds']:.0f} s",
                    flush=True,
                )
    print(table(runs, args.target))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1) + "\n")
    if args.png:
        plot(runs, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
