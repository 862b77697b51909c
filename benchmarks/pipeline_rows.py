"""Price every row of ``interlace bench pipeline`` JSONs as the bench set it up, beside what it
measured, and check the planner's first choice among the configurations measured.

    python benchmarks/pipeline_rows.py docs/pipeline/emulated-vgg11-h200-10gbit-4x2.json \
        docs/pipeline/emulated-vgg11-h200-10gbit-2x4.json [--measured-compute]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from interlace.sim.pipeline_bench import bench_rows, price_row, summary
from interlace.sim.trace import load_trace

#: The repository: recorded JSONs are found under it when not under the working folder.
ROOT = Path(__file__).resolve().parents[1]


def _found(path: str) -> Path:
    here = Path(path)
    return here if here.exists() or here.is_absolute() else ROOT / here


def main(argv: list[str] | None = None) -> int:
    """Print the priced rows of the JSONs given.

    Args:
        argv: The JSON paths (default: the command line's).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="interlace bench pipeline --json files")
    parser.add_argument(
        "--measured-compute",
        action="store_true",
        help="each stage's compute as the launch's interlace pipeline timed it, not the trace's",
    )
    args = parser.parse_args(argv)
    rows = [row for path in args.json for row in bench_rows(json.loads(_found(path).read_text()))]
    traces = {name: load_trace(name) for name in {row.model for row in rows}}
    priced = [
        price_row(traces[row.model], row, measured_compute=args.measured_compute) for row in rows
    ]
    print("\n".join(summary(priced)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
