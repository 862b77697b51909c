"""The simulator against emulated compute: data-parallel strategies, K-FAC modes and pipeline
schedules on H200 traces, three repeated runs, one summary per run.

``python benchmarks/validate_emulated.py [--out docs/simulate] [--repeat 3]`` (root: it runs
``interlace simulate --validate`` on the emulated cluster); ``--merge-only`` re-reads the JSONs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from interlace.sim.validate import (
    ValidationRow,
    format_prediction_table,
    format_run_summaries,
    plot_validation,
)

#: (name, traces, families, links, dilation): each family on the traces it is cheapest to
#: measure on. K-FAC's decompositions make each of its launches several minutes, so it runs at
#: one link. The pipeline runs at the dilation its benchmark uses: its stages' host work (the
#: emulated gradients, the optimizer step, SpecTrain's prediction) is real CPU time, which the
#: dilation shrinks against device time.
PARTS: tuple[tuple[str, str, str, str, int], ...] = (
    ("dp", "resnet32-h200,transformer-h200,vgg11-h200", "dp", "10gbit,100gbit", 16),
    ("pipeline", "vgg11-h200", "pipeline", "10gbit,100gbit", 64),
    ("kfac", "resnet20-h200,resnet32-h200", "kfac", "25gbit", 16),
)
RANKS = 4
#: Strategies beyond a family's default: the data-parallel rows include the forward overlap.
STRATEGIES: dict[str, str] = {"dp": "wfbp,fixed,single,mgwfbp,overlap"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/simulate", help="where the JSONs and plot go")
    parser.add_argument("--repeat", type=int, default=3, help="runs of every launch")
    parser.add_argument("--merge-only", action="store_true", help="only summarise the JSONs")
    parser.add_argument(
        "--parts", default=",".join(p[0] for p in PARTS), help="which of dp,pipeline,kfac to run"
    )
    args = parser.parse_args()
    out = Path(args.out)
    for name, traces, families, links, dilation in PARTS:
        path = out / f"emulated-validation-{name}.json"
        if args.merge_only or name not in args.parts.split(","):
            continue
        command = [
            sys.executable, "-m", "interlace", "simulate", "--validate",
            "--compute", f"emulated:{traces}", "--dilation", str(dilation),
            "-n", str(RANKS), "--link", links, "--families", families,
            "--iters", "5", "--rounds", "4", "--warmup", "1",
            "--repeat", str(args.repeat), "--json", str(path), "--png", "none",
        ]  # fmt: skip
        if name in STRATEGIES:
            command += ["--strategy", STRATEGIES[name]]
        print("$", " ".join(command[1:]), flush=True)
        subprocess.run(command, check=False)
    rows = [
        ValidationRow(**row)
        for name, *_ in PARTS
        if (out / f"emulated-validation-{name}.json").is_file()
        for row in json.loads((out / f"emulated-validation-{name}.json").read_text())
    ]
    if not rows:
        print("no rows", file=sys.stderr)
        return 1
    rows.sort(key=lambda row: row.run)
    print(format_prediction_table(rows))
    print()
    print(format_run_summaries(rows))
    print(f"plot: {plot_validation(rows, out / 'emulated-validation.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
