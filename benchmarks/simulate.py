"""The simulator's claims on the MG-WFBP GoogLeNet trace: the scaling table and its speed.

``python benchmarks/simulate.py [--per-layer] [--png docs/simulate/googlenet-osu.png]``; prints
the table beside the paper's speed-ups, checks MG-WFBP's claims and times the simulation.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from interlace.comm.strategies import PLANNED_STRATEGIES
from interlace.sim.experiments import (
    check_claims,
    format_paper_comparison,
    format_table,
    plot_scaling,
    scaling_rows,
    simulate_scaling,
)
from interlace.sim.network import parse_network
from interlace.sim.trace import load_trace

WORKERS = tuple(2**k for k in range(1, 12))  # 2..2048: 11 counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--traces",
        help="folder with googlenet_k80_8workers.log and OSU logs (default: the shipped ones)",
    )
    parser.add_argument("--per-layer", action="store_true", help="one message per layer")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (default 5)")
    parser.add_argument("--png", help="write the scaling-efficiency plot here")
    args = parser.parse_args()
    trace_source = (
        Path(args.traces) / "googlenet_k80_8workers.log" if args.traces else "googlenet-k80"
    )
    network_spec = f"osu:{args.traces}" if args.traces else "osu:10gbe"

    def run_once() -> tuple[object, list[object]]:
        trace = load_trace(trace_source)
        network = parse_network(network_spec)
        results = simulate_scaling(
            trace, network, WORKERS, tuple(PLANNED_STRATEGIES), per_layer=args.per_layer
        )
        return trace, [network, results]

    seconds = []
    for _ in range(max(args.repeats, 1)):
        started = time.perf_counter()
        run_once()
        seconds.append(time.perf_counter() - started)
    trace = load_trace(trace_source)
    network = parse_network(network_spec)
    results = simulate_scaling(
        trace, network, WORKERS, tuple(PLANNED_STRATEGIES), per_layer=args.per_layer
    )
    rows = scaling_rows(trace, results)
    print(trace.describe())
    print(f"network: {network.describe()} ({network_spec})")
    print(f"unit: {'one message per layer' if args.per_layer else 'one message per tensor'}\n")
    print(format_table(rows))
    print()
    print(format_paper_comparison(rows))
    for note in check_claims(rows):
        print(note)
    print(
        f"\nspeed: {len(PLANNED_STRATEGIES)} strategies x {len(WORKERS)} worker counts "
        f"({len(results)} simulated iterations), trace loading and OSU fit included: median "
        f"{statistics.median(seconds):.3f} s over {len(seconds)} runs "
        f"(min {min(seconds):.3f}, max {max(seconds):.3f})"
    )
    if args.png:
        plot_scaling(rows, args.png)
        print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
