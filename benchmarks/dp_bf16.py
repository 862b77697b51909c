"""bf16 gradient compression: DataParallel (the forward overlap and MG-WFBP) against torch DDP
with its bf16 hook at 25, 50 and 100 MB buckets, on the emulated H200 traces.

``python benchmarks/dp_bf16.py run`` runs every row (``interlace bench dp`` on the emulated
cluster, root needed, 10-20 minutes a launch) into ``docs/bench-dp/bf16-*.json``;
``python benchmarks/dp_bf16.py report`` prints the table from those files, with the compressed
bound, the simulator's price and the host's share of the cores of each contender, and writes
``docs/bench-dp/bf16.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from interlace.comm.cost import CostModel
from interlace.comm.strategies import STRATEGIES, Strategy
from interlace.sim.simulation import WIRE_SCALES, simulate
from interlace.sim.trace import Trace, load_trace

DOCS = Path(__file__).resolve().parents[1] / "docs" / "bench-dp"

#: Plain DDP, DDP with torch's bf16 hook at each cap, and the forward overlap with bf16.
CONTENDERS = "ddp,ddp/bf16,ddp-50mb/bf16,ddp-100mb/bf16,overlap/bf16"
#: DDP's caps with the hook: (first bucket, every other), float32 bytes. ``ddp`` keeps torch's
#: 1 MB first bucket; a cap passed explicitly applies to the first bucket too.
DDP_CAPS: dict[str, tuple[float, float]] = {
    "ddp": (1e6, 25e6),
    "ddp-50mb": (50e6, 50e6),
    "ddp-100mb": (100e6, 100e6),
}

#: Each row: its name, then trace, dilation, link, contenders, iterations and rounds. The
#: ranks' host work (gradient writes, bucket copies, casts, gloo's sums, the kernel's network
#: stack) is real CPU time, not dilated: about 0.6 s a ResNet-50 iteration over 4 ranks with or
#: without bf16. Halving the bytes halves the dilated iteration, so the compressed rows need a
#: dilation at which that work stays a small share of the cores (the ``host`` column of the
#: report); at D = 16 it took most of a 2-core machine (docs/data-parallel.md).
ROWS: dict[str, tuple[str, str, str, str, str, str]] = {
    "r50-25g": ("emulated:resnet50-h200", "64", "25gbit", "ddp,ddp/bf16,overlap/bf16", "12", "3"),
    "r50-25g-d32": ("emulated:resnet50-h200", "32", "25gbit", CONTENDERS, "12", "3"),
    "r50-100g": (
        "emulated:resnet50-h200",
        "64",
        "100gbit",
        "ddp,ddp/bf16,ddp-50mb/bf16,mgwfbp/bf16,overlap/bf16",
        "12",
        "3",
    ),
    # BERT-base: each copy holds 440 MB of weights and as much of gradients and of buckets, so
    # one contender a launch (4 ranks of two contenders ran out of memory on a 23 GB machine).
    "bert-25g": ("emulated:bert-base-h200", "64", "25gbit", "overlap/bf16", "8", "2"),
    "bert-25g-hook": ("emulated:bert-base-h200", "64", "25gbit", "ddp/bf16", "8", "2"),
    "bert-25g-ddp": ("emulated:bert-base-h200", "64", "25gbit", "ddp", "8", "2"),
    "bert-100g": ("emulated:bert-base-h200", "64", "100gbit", "overlap/bf16", "8", "2"),
    "bert-100g-hook": ("emulated:bert-base-h200", "64", "100gbit", "ddp/bf16", "8", "2"),
    "bert-100g-ddp": ("emulated:bert-base-h200", "64", "100gbit", "ddp", "8", "2"),
}
COMMON = ["-n", "4", "--warmup", "1", "--timeout", "1800", "--png", "none"]


def command(name: str, directory: Path) -> list[str]:
    """The ``interlace bench dp`` command line of row ``name``.

    Args:
        name: A key of :data:`ROWS`.
        directory: Where its JSON goes.
    """
    compute, dilation, link, contenders, iters, rounds = ROWS[name]
    return [
        *("interlace", "bench", "dp", "--compute", compute, "--dilation", dilation),
        *("--link", link, "--strategies", contenders, "--iters", iters, "--rounds", rounds),
        *COMMON,
        *("--json", str(directory / f"bf16-{name}-n4.json")),
    ]


@dataclass(frozen=True)
class Line:
    """One contender of one row (times undilated, in seconds)."""

    row: str
    model: str
    link: str
    contender: str
    iteration_s: float
    p25_s: float
    p75_s: float
    versus_best_hook: float
    best_hook: str
    versus_ddp: float | None
    compressed_bound_s: float
    simulated_s: float
    buckets: str
    kept: str
    dilation: str
    host_share: float | None


def simulated(trace: Trace, contender: str, cost: CostModel, ranks: int) -> float:
    """The simulator's iteration time of ``contender`` (a variant label of :data:`CONTENDERS`).

    DDP's caps count float32 bytes and the simulator's count wire bytes, so DDP with the hook is
    priced as ``fixed`` with its caps scaled to the wire.

    Args:
        trace: The row's trace.
        contender: ``ddp``, ``ddp[-50mb|-100mb]/bf16``, ``mgwfbp/bf16`` or ``overlap/bf16``.
        cost: The row's measured all-reduce cost (float32 bytes).
        ranks: The worker count.
    """
    base, _, compression = contender.partition("/")
    strategy: str | Strategy = base
    if base in DDP_CAPS:
        scale = WIRE_SCALES[compression] if compression else 1.0
        first, cap = DDP_CAPS[base]
        strategy = replace(
            STRATEGIES["fixed"], cap_bytes=cap * scale, first_cap_bytes=first * scale
        )
    return simulate(
        trace, strategy, cost, workers=ranks, compression=compression or None
    ).iteration_s


#: Launch suffixes of a row measured one contender a launch (``bert-25g``, ``bert-25g-hook``...).
PART_SUFFIXES = ("-hook", "-ddp")


def group(name: str) -> str:
    """The table row a launch belongs to: ``bert-25g-hook`` is part of ``bert-25g``.

    Args:
        name: A key of :data:`ROWS`.
    """
    for suffix in PART_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def summarise(name: str, paths: list[Path]) -> list[Line]:
    """The table lines of one row, from its launches (one, or one per contender).

    Args:
        name: The row's name.
        paths: Its ``interlace bench dp`` JSON files.
    """
    rows: dict[str, dict[str, Any]] = {
        row["strategy"]: row
        for path in paths
        for row in json.loads(path.read_text())
        if row["samples"]
    }
    ddp = rows.get("ddp")
    # The bound comes from plain DDP's measured times where the row has it.
    plain = ddp or rows[next(iter(rows))]
    hooks = {
        label: rows[label]["iteration_s"]
        for label in rows
        if label.endswith("/bf16") and label.split("/")[0] in DDP_CAPS
    }
    best_hook = min(hooks, key=lambda label: hooks[label]) if hooks else ""
    trace = load_trace(plain["compute"].split(":", 1)[1].split(" ")[0])
    # The bound with every gradient sent in half the bytes: max(forward + backward, all-reduce
    # of everything / 2) + step, from the plain module's measured times.
    bound = max(plain["compute_s"], plain["allreduce_s"] / 2) + plain["step_s"]
    lines = []
    for label, row in rows.items():
        cost = CostModel(row["startup_s"], row["per_byte_s"])
        lines.append(
            Line(
                name,
                row["model"],
                row["link"],
                label,
                row["iteration_s"],
                row["iteration_p25_s"],
                row["iteration_p75_s"],
                hooks[best_hook] / row["iteration_s"] if hooks else float("nan"),
                best_hook,
                None if ddp is None else ddp["iteration_s"] / row["iteration_s"],
                bound,
                simulated(trace, label, cost, row["ranks"]),
                str(row["buckets"]),
                (row["tuning"] or "").rsplit("kept ", 1)[-1],
                ROWS[name][1] if name in ROWS else "-",
                row.get("host_cpu_share"),
            )
        )
    return lines


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def report(directory: Path) -> list[Line]:
    """Print the table of every measured row and write ``bf16.json`` beside them.

    Args:
        directory: Where the rows' JSON files are.
    """
    launches: dict[str, list[Path]] = {}
    for name in ROWS:
        if (directory / f"bf16-{name}-n4.json").exists():
            launches.setdefault(group(name), []).append(directory / f"bf16-{name}-n4.json")
    lines = [line for name, paths in launches.items() for line in summarise(name, paths)]
    print(
        "| trace, link, D | contender | ms (p25-p75) | vs DDP+hook at its best cap "
        "| vs plain DDP | / compressed bound | compressed bound ms | simulator ms (error) "
        "| buckets | host |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in lines:
        error = (s.simulated_s - s.iteration_s) / s.iteration_s
        hook = f"{s.versus_best_hook:.2f}x ({s.best_hook})" if s.best_hook else "-"
        host = "-" if s.host_share is None else f"{s.host_share:.0%}"
        print(
            f"| {s.model}, {s.link}, {s.dilation} | {s.contender} | {_ms(s.iteration_s)} "
            f"({_ms(s.p25_s)}-{_ms(s.p75_s)}) | {hook} | "
            f"{'-' if s.versus_ddp is None else f'{s.versus_ddp:.2f}x'} | "
            f"{s.iteration_s / s.compressed_bound_s:.2f} | "
            f"{_ms(s.compressed_bound_s)} | {_ms(s.simulated_s)} ({error:+.1%}) | {s.buckets} "
            f"| {host} |"
        )
    errors = [
        abs(s.simulated_s - s.iteration_s) / s.iteration_s for s in lines if "bf16" in s.contender
    ]
    if errors:
        print(
            f"simulator, compressed contenders: median error {statistics.median(errors):.1%}, "
            f"max {max(errors):.1%} over {len(errors)}"
        )
    (directory / "bf16.json").write_text(json.dumps([asdict(s) for s in lines], indent=1) + "\n")
    return lines


def run(directory: Path, names: list[str]) -> None:
    """Measure ``names`` one after another (each its own launch), at low priority.

    Args:
        directory: Where the rows' JSON files go.
        names: Rows of :data:`ROWS`.
    """
    for name in names:
        argv = command(name, directory)
        argv[:1] = ["nice", "-n", "5", sys.executable, "-m", "interlace.cli"]
        subprocess.run(argv, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("run", "report"))
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to run")
    parser.add_argument("--dir", type=Path, default=DOCS, help="where the JSON files are")
    args = parser.parse_args()
    if args.what == "run":
        run(args.dir, [name for name in args.rows.split(",") if name])
    report(args.dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
