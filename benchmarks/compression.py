"""Accuracy effect of fp16/bf16 gradient compression on the demo job, three seeds each.

``python benchmarks/compression.py [--seeds 0 --epochs 4 --json rows.json]`` (about 5 minutes);
prints each run's final test accuracy and the mean and spread per compression.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
from pathlib import Path

from tqdm import tqdm

from interlace import launch
from interlace.train import TrainConfig, train_rank

COMPRESSIONS: tuple[str | None, ...] = (None, "fp16", "bf16")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--nprocs", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--model", default="resnet20", help="zoo model (default resnet20)")
    parser.add_argument("--epochs", type=int, default=12, help="epochs per run (default 12)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--json", metavar="PATH", help="write the runs as a JSON list")
    args = parser.parse_args()
    seeds = [int(part) for part in args.seeds.split(",")]

    rows = []
    with tempfile.TemporaryDirectory(prefix="interlace-compression-") as runs:
        jobs = [(seed, compression) for seed in seeds for compression in COMPRESSIONS]
        for seed, compression in tqdm(jobs, unit="run", desc="compression"):
            config = TrainConfig(
                model=args.model,
                data="digits",
                epochs=args.epochs,
                seed=seed,
                compression=compression,
                progress=False,
                runs_dir=runs,
            )
            config.validate()
            run_dir = str(Path(runs) / f"{compression or 'none'}-seed{seed}")
            result = launch.run(
                train_rank, args.nprocs, args=(config, run_dir), output=io.StringIO()
            ).check()
            outcome = result.values[0]
            rows.append(
                {
                    "compression": compression or "none",
                    "seed": seed,
                    "final_test_accuracy": outcome.final_test_accuracy,
                    "final_train_loss": outcome.final_train_loss,
                    "samples_per_s": outcome.samples_per_s,
                }
            )

    print(
        f"\n{args.model} on digits, {args.nprocs} ranks, {args.epochs} epochs, MG-WFBP "
        f"DataParallel; final test accuracy per seed ({', '.join(map(str, seeds))})\n"
    )
    print(
        "| compression | accuracy per seed (%) | mean (%) | spread (max-min, pts) | vs none (pts) |"
    )
    print("|---|---|---:|---:|---:|")
    baseline = None
    for compression in COMPRESSIONS:
        name = compression or "none"
        accuracies = [100 * r["final_test_accuracy"] for r in rows if r["compression"] == name]
        mean = statistics.mean(accuracies)
        baseline = mean if baseline is None else baseline
        print(
            f"| {name} | {', '.join(f'{a:.2f}' for a in accuracies)} | {mean:.2f} | "
            f"{max(accuracies) - min(accuracies):.2f} | {mean - baseline:+.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
