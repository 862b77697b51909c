"""interlace's K-FAC against kfac-pytorch, head to head: every (model, link, decomposition
interval) as one ``interlace bench kfac --ablation --compare kfac-pytorch --memory`` run.

``python benchmarks/kfac_h2h.py run`` runs the missing ones (one at a time, each into its JSON
under docs/kfac/, in priority order); ``python benchmarks/kfac_h2h.py report`` gathers them into
docs/kfac/h2h.json and prints the table and the verdicts against the targets.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from interlace.bench.kfac_report import AblationRow, format_h2h_table, h2h_verdicts

OUT = Path("docs/kfac")
MODELS = ("resnet20", "resnet32", "transformer")
LINKS = ("200mbit", "1gbit")
#: Decompositions every 10 steps first (the regime K-FAC is run in), then every step.
INVS = (10, 1)
#: Targets: interlace's fastest mode and its default against kfac-pytorch's default, in
#: whole-cycle throughput; peak RSS at most 10% above kfac-pytorch's.
FASTEST_TARGET, DEFAULT_TARGET, RSS_LIMIT = 1.3, 1.15, 1.10


def run_path(model: str, link: str, inv: int) -> Path:
    """Where one run's rows go.

    Args:
        model: The zoo model.
        link: The emulated link.
        inv: Steps between decompositions.
    """
    return OUT / f"h2h-{model}-{link}-inv{inv}.json"


def run_all(
    iters: int, short_iters: int, warmup: int, memory: str | None, only: str | None
) -> None:
    """Run every configuration whose JSON is missing, in priority order.

    Args:
        iters: Timed iterations per run (rounded up to whole decomposition cycles).
        short_iters: Timed iterations of runs that decompose every step.
        warmup: Untimed iterations after the plans are final.
        memory: The modes whose peak RSS to measure (``--memory``), on the first link only
            (memory does not depend on the link); None: none.
        only: Run just this model.
    """
    configs = [(m, link, inv) for inv in INVS for link in LINKS for m in MODELS]
    for model, link, inv in configs:
        path = run_path(model, link, inv)
        if path.exists() or (only and model != only):
            continue
        cycles = -(-(iters if inv > 1 else short_iters) // inv) * inv
        command = [
            sys.executable, "-m", "interlace", "bench", "kfac", "--ablation",
            "--compare", "kfac-pytorch", "--models", model, "--link", link,
            "--factor-update-steps", "1", "--inv-update-steps", str(inv),
            "--iters", str(cycles), "--warmup", str(warmup), "--json", str(path),
        ] + (["--memory", memory] if memory and link == LINKS[0] else [])  # fmt: skip
        started = time.monotonic()
        print(" ".join(command[1:]), flush=True)
        status = subprocess.run(command, check=False).returncode
        print(f"{model} {link} inv {inv}: status {status}, {time.monotonic() - started:.0f} s")


def report() -> int:
    """Gather the runs into docs/kfac/h2h.json; print the table and the verdicts."""
    rows: list[AblationRow] = []
    for inv in sorted(INVS, reverse=True):
        for link in LINKS:
            for model in MODELS:
                path = run_path(model, link, inv)
                if path.exists():
                    rows += [AblationRow(**row) for row in json.loads(path.read_text())]
    if not rows:
        print("no runs yet: python benchmarks/kfac_h2h.py run")
        return 1
    verdicts = h2h_verdicts(rows)
    (OUT / "h2h.json").write_text(
        json.dumps({"rows": [r.to_dict() for r in rows], "verdicts": verdicts}, indent=1) + "\n"
    )
    print(format_h2h_table(rows))
    print()
    print("| model | link | inv every | fastest mode | its cycle speed-up | its median speed-up "
          "| default (pipelined) cycle speed-up | default RSS / kfac-pytorch's |")  # fmt: skip
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for v in verdicts:
        rss = v["default_rss_ratio"]
        print(
            f"| {v['model']} | {v['link']} | {v['inv_update_steps']} | {v['fastest_mode']} | "
            f"{v['fastest_cycle_speedup']:.2f}x | {v['fastest_median_speedup']:.2f}x | "
            f"{v['default_cycle_speedup']:.2f}x | " + ("-" if rss is None else f"{rss:.2f}") + " |"
        )
    print(
        f"\ntargets: fastest >= {FASTEST_TARGET}x, default >= {DEFAULT_TARGET}x, median >= 1.00x, "
        f"RSS <= {RSS_LIMIT:.2f}"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("run", "report"))
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per run")
    parser.add_argument(
        "--short-iters", type=int, default=5, help="timed iterations, decompositions every step"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per run")
    parser.add_argument(
        "--memory",
        default="pipelined,kfac-pytorch",
        help="modes whose peak RSS is measured (empty: none)",
    )
    parser.add_argument("--model", help="run only this model")
    args = parser.parse_args()
    if args.action == "run":
        run_all(args.iters, args.short_iters, args.warmup, args.memory or None, args.model)
        return 0
    return report()


if __name__ == "__main__":
    raise SystemExit(main())
