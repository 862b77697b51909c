"""interlace's K-FAC against kfac-pytorch, head to head: every (model, link, decomposition
interval) as one ``interlace bench kfac --ablation --compare kfac-pytorch --memory`` run.

``python benchmarks/kfac_h2h.py run`` runs the missing ones (one at a time, each into its JSON
under docs/kfac/, in priority order); ``python benchmarks/kfac_h2h.py report`` gathers them into
docs/kfac/h2h.json and prints the table and the verdicts against the targets. With
``--emulated``, the same on the emulated H200 (the models' H200 traces, device time dilated 16x).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from interlace.bench.kfac_rank import DEFAULT_MODE
from interlace.bench.kfac_report import AblationRow, format_h2h_table, h2h_verdicts

OUT = Path("docs/kfac")
#: Decompositions every 10 steps first (the regime K-FAC is run in), then every step.
INVS = (10, 1)
#: Targets: interlace's fastest mode and its default against kfac-pytorch's default, in
#: whole-cycle throughput; peak RSS at most 10% above kfac-pytorch's.
FASTEST_TARGET, DEFAULT_TARGET, RSS_LIMIT = 1.3, 1.15, 1.10


@dataclass(frozen=True)
class Grid:
    """The runs of one head-to-head.

    Args:
        models: Zoo models (real compute) or H200 traces (emulated).
        links: The emulated links.
        report: The file ``report`` gathers the runs into.
        dilation: The emulated compute's dilation; None for real compute.
    """

    models: tuple[str, ...]
    links: tuple[str, ...]
    report: Path
    dilation: int | None = None

    def model_flags(self, model: str) -> list[str]:
        """The bench flags that pick ``model``."""
        if self.dilation is None:
            return ["--models", model]
        # Emulated launches take minutes; one of 20 timed steps can take more than the default.
        return ["--compute", f"emulated:{model}", "--dilation", str(self.dilation),
                "--timeout", "2400"]  # fmt: skip


#: Real compute on the CPUs, two links a regime apart.
REAL = Grid(("resnet20", "resnet32", "transformer"), ("200mbit", "1gbit"), OUT / "h2h.json")
#: The same models' H200 traces on a 10 Gbit/s link (16x dilated, as the K-FAC ablation's).
EMULATED = Grid(
    ("resnet20-h200", "resnet32-h200", "transformer-h200"),
    ("10gbit",),
    OUT / "h2h-emulated.json",
    dilation=16,
)


def run_path(model: str, link: str, inv: int) -> Path:
    """Where one run's rows go.

    Args:
        model: The zoo model or trace.
        link: The emulated link.
        inv: Steps between decompositions.
    """
    return OUT / f"h2h-{model}-{link}-inv{inv}.json"


def run_all(
    grid: Grid,
    *,
    iters: int,
    short_iters: int,
    warmup: int,
    memory: str | None,
    only: str | None,
) -> None:
    """Run every configuration whose JSON is missing, in priority order.

    Args:
        grid: The head-to-head's runs.
        iters: Timed iterations per run (rounded up to whole decomposition cycles).
        short_iters: Timed iterations of runs that decompose every step.
        warmup: Untimed iterations after the plans are final.
        memory: The modes whose peak RSS to measure (``--memory``), on the first link only
            (memory does not depend on the link); None: none.
        only: Run just this model.
    """
    configs = [(m, link, inv) for inv in INVS for link in grid.links for m in grid.models]
    for model, link, inv in configs:
        path = run_path(model, link, inv)
        if path.exists() or (only and model != only):
            continue
        cycles = -(-(iters if inv > 1 else short_iters) // inv) * inv
        command = [
            sys.executable, "-m", "interlace", "bench", "kfac", "--ablation",
            "--compare", "kfac-pytorch", *grid.model_flags(model), "--link", link,
            "--factor-update-steps", "1", "--inv-update-steps", str(inv),
            "--iters", str(cycles), "--warmup", str(warmup), "--json", str(path),
        ] + (["--memory", memory] if memory and link == grid.links[0] else [])  # fmt: skip
        started = time.monotonic()
        print(" ".join(command[1:]), flush=True)
        status = subprocess.run(command, check=False).returncode
        print(f"{model} {link} inv {inv}: status {status}, {time.monotonic() - started:.0f} s")


def report(grid: Grid) -> int:
    """Gather the runs into the grid's report file; print the table and the verdicts.

    Args:
        grid: The head-to-head's runs.
    """
    rows: list[AblationRow] = []
    for inv in sorted(INVS, reverse=True):
        for link in grid.links:
            for model in grid.models:
                path = run_path(model, link, inv)
                if path.exists():
                    rows += [AblationRow(**row) for row in json.loads(path.read_text())]
    if not rows:
        print("no runs yet: python benchmarks/kfac_h2h.py run")
        return 1
    verdicts = h2h_verdicts(rows)
    grid.report.write_text(
        json.dumps({"rows": [r.to_dict() for r in rows], "verdicts": verdicts}, indent=1) + "\n"
    )
    print(format_h2h_table(rows))
    print()
    print(
        "| model | link | inv every | fastest mode | its cycle speed-up | its median speed-up "
        f"| default ({DEFAULT_MODE}) cycle speed-up | default RSS / kfac-pytorch's |"
    )
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
        default=f"{DEFAULT_MODE},kfac-pytorch",
        help="modes whose peak RSS is measured (empty: none)",
    )
    parser.add_argument("--model", help="run only this model")
    parser.add_argument(
        "--emulated",
        action="store_true",
        help="the H200 traces on the emulated accelerator (no peak RSS: the device is emulated)",
    )
    args = parser.parse_args()
    grid = EMULATED if args.emulated else REAL
    if args.action == "run":
        memory = None if args.emulated else args.memory or None
        run_all(
            grid,
            iters=args.iters,
            short_iters=args.short_iters,
            warmup=args.warmup,
            memory=memory,
            only=args.model,
        )
        return 0
    return report(grid)


if __name__ == "__main__":
    raise SystemExit(main())
