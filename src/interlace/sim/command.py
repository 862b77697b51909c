"""``interlace simulate``: scaling tables from a trace, or ``--validate`` against measured runs.

The flags, the plotting defaults (:func:`plot_path`) and the scaling run; ``--validate``'s
measuring side is passed in (:data:`ValidationRunner`, :mod:`interlace.bench.validate`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from interlace.cliutil import (
    add_collective_timeout_argument,
    add_model_shape_arguments,
    add_nprocs_argument,
)
from interlace.comm.strategies import PLANNED_STRATEGIES
from interlace.errors import UsageError
from interlace.sim import validate
from interlace.sim.caffe_log import CaffeMessages
from interlace.sim.experiments import (
    ScalingRow,
    check_claims,
    format_paper_comparison,
    format_phase_table,
    format_table,
    parse_strategies,
    parse_workers,
    plot_scaling,
    scaling_rows,
    simulate_scaling,
)
from interlace.sim.kfac import KFAC_STRATEGIES, check_trace
from interlace.sim.kfac_costs import KFAC_COSTS_HELP, KfacCosts, parse_kfac_costs
from interlace.sim.network import NETWORK_HELP, Network, parse_network
from interlace.sim.presets import PRESETS, Preset, check_preset, format_paper_table, preset_named
from interlace.sim.retime import with_forward_ratio
from interlace.sim.trace import Trace, load_trace
from interlace.sim.traces import trace_names

PROG = "interlace simulate"
DEFAULT_NETWORK = "ring:10gbit"
DEFAULT_WORKERS = "4..2048"
DEFAULT_PNG = "simulate/scaling.png"
DEFAULT_VALIDATION_PNG = "simulate/validation.png"

#: Runs ``--validate``: the parsed flags and the plot's path (None: no plot) in, the exit
#: status out (:func:`interlace.bench.validate.run`).
ValidationRunner = Callable[[argparse.Namespace, Path | None], int]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``interlace simulate``.

    Args:
        parser: The subcommand's parser.
    """

    parser.add_argument(
        "--trace",
        metavar="T",
        help="trace to simulate: a shipped trace's name "
        f"({', '.join(trace_names())}), an interlace-trace JSON (interlace profile "
        "--trace-out) or an MG-WFBP Caffe log",
    )
    parser.add_argument(
        "--preset",
        metavar="NAME",
        help=f"a named set-up ({', '.join(PRESETS)}): trace, its reading, network, workers and "
        "strategies, with its own table and checks; flags given beside it win",
    )
    parser.add_argument(
        "--workers",
        help=f"worker counts: 4,8,16 or LOW..HIGH for the powers of two between (default "
        f"{DEFAULT_WORKERS})",
    )
    parser.add_argument(
        "--network",
        help=f"how an all-reduce is priced: {NETWORK_HELP} (default {DEFAULT_NETWORK})",
    )
    parser.add_argument(
        "--trace-messages",
        choices=[str(unit) for unit in CaffeMessages],
        help="Caffe logs: 'tensors' (every line, a layer's weight and bias as two tensors; the "
        "default) or 'logged' (one message per line that logged an all-reduce, as the MG-WFBP "
        "authors' simulator read the logs)",
    )
    parser.add_argument(
        "--trace-iteration",
        type=int,
        metavar="N",
        help="Caffe logs: the logged iteration to read, from 1 (default: the last complete one)",
    )
    parser.add_argument(
        "--forward-per-backward",
        type=float,
        metavar="R",
        help="take every layer's forward as R x its backward (the MG-WFBP authors took 0.5; "
        "default: the trace's own forward)",
    )
    parser.add_argument(
        "--strategy",
        "--strategies",
        dest="strategy",
        help=f"comma-separated strategies, each optionally with /k=K for K channels "
        f"(default: all of {', '.join(PLANNED_STRATEGIES)}; "
        f"--validate: {','.join(validate.DEFAULT_STRATEGIES)}), or K-FAC strategies "
        f"({', '.join(KFAC_STRATEGIES)}; they need a trace with factor sizes)",
    )
    parser.add_argument(
        "--kfac-costs",
        metavar="SPEC",
        help=f"what K-FAC strategies take beyond the trace: {KFAC_COSTS_HELP}",
    )
    parser.add_argument(
        "--compression",
        choices=("none", "fp16", "bf16"),
        default="none",
        help="data-parallel strategies send gradients in this type: fp16 and bf16 halve the "
        "bytes on the wire and the planners plan with them, as DataParallel(compression=...) "
        "does (default none)",
    )
    parser.add_argument(
        "--per-layer",
        action="store_true",
        help="send a layer's tensors as one message (Caffe's unit, as the MG-WFBP paper did)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument(
        "--png",
        metavar="PATH",
        help=f"plot: scaling efficiency (default {DEFAULT_PNG}) or, with --validate, predicted "
        f"against measured (default {DEFAULT_VALIDATION_PNG}); 'none' for no plot",
    )
    parser.add_argument(
        "--timelines",
        type=int,
        metavar="N",
        help="also write each strategy's simulated timeline at N workers (PNG + Chrome trace) "
        "next to the plot",
    )
    group = parser.add_argument_group("validation against measured runs (--validate)")
    group.add_argument(
        "--validate",
        action="store_true",
        help="profile zoo models and run each strategy on the emulated cluster; print "
        "predicted vs measured iteration times (needs root)",
    )
    group.add_argument(
        "--model",
        help="zoo name(s) or package.module:callable, comma-separated "
        f"(default {','.join(validate.DEFAULT_MODELS)})",
    )
    add_model_shape_arguments(
        group, defaults_from="the benchmarks' synthetic data, 3,32,32 in 10 classes"
    )
    add_nprocs_argument(
        group,
        default=None,
        help_text=f"ranks (default: each of {','.join(map(str, validate.DEFAULT_RANKS))})",
    )
    group.add_argument(
        "--link",
        help=f"emulated link rate(s), comma-separated (default {','.join(validate.DEFAULT_LINKS)})",
    )
    group.add_argument(
        "--iters",
        type=int,
        default=validate.DEFAULT_ITERS,
        help=f"timed iterations per strategy (default {validate.DEFAULT_ITERS})",
    )
    group.add_argument(
        "--warmup",
        type=int,
        default=validate.DEFAULT_WARMUP,
        help=f"untimed iterations per strategy after planning (default {validate.DEFAULT_WARMUP})",
    )
    group.add_argument(
        "--rounds",
        type=int,
        default=validate.DEFAULT_ROUNDS,
        help=f"round-robin blocks (default {validate.DEFAULT_ROUNDS})",
    )
    group.add_argument("--batch-size", type=int, help="per-rank batch (default: per model)")
    group.add_argument(
        "--timeout", type=float, default=600.0, help="seconds allowed per launch (default 600)"
    )
    add_collective_timeout_argument(group)
    group.add_argument("--trace-dir", help="also save each launch's profiled trace here")
    group.add_argument(
        "--families",
        help="with --compute emulated:TRACE[,TRACE...]: what to validate, comma-separated from "
        f"{','.join(validate.FAMILIES)} (default all; K-FAC needs a trace with factor sizes, "
        "the pipeline one with activation sizes)",
    )
    group.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every launch this many times and summarise each run (default 1)",
    )


def plot_path(args: argparse.Namespace) -> Path | None:
    """Where ``--png`` asks the plot to go: the mode's default when not given, None for 'none'.

    Args:
        args: ``interlace simulate``'s parsed flags.
    """
    if args.validate:
        default = DEFAULT_VALIDATION_PNG
    elif getattr(args, "preset", None):
        default = f"simulate/{preset_named(args.preset).name}.png"
    else:
        default = DEFAULT_PNG
    chosen = args.png or default
    return None if chosen.lower() == "none" else Path(chosen)


def run(args: argparse.Namespace, runner: ValidationRunner | None = None) -> int:
    """``interlace simulate`` with parsed ``args``; the exit status.

    Args:
        args: The parsed flags.
        runner: Runs ``--validate`` (it measures on ranks, which the simulator does not).

    Raises:
        UsageError: For flags that do not go together or a bad value.
    """
    if args.validate:
        if args.trace:
            raise UsageError("--validate profiles its own traces; drop --trace")
        if runner is None:
            raise UsageError("--validate needs a runner that measures on ranks")
        return runner(args, plot_path(args))
    if not args.trace and not args.preset:
        raise UsageError("give --trace T (a trace to simulate), --preset NAME or --validate")
    return run_scaling(args)


def _setting(args: argparse.Namespace, flag: str, preset: Preset | None, default: object) -> Any:
    """A flag's value: as given, else the preset's, else ``default``."""
    given = getattr(args, flag)
    if given is not None:
        return given
    return getattr(preset, flag) if preset is not None else default


def _trace(args: argparse.Namespace, preset: Preset | None) -> Trace:
    """The trace the flags and preset name, read and retimed as they say; the preset's way of
    reading its trace applies to its own trace only."""
    own = preset if preset is not None and args.trace is None else None
    trace = load_trace(
        args.trace or (preset.trace if preset else ""),
        iteration=args.trace_iteration or (own.iteration if own else None),
        messages=args.trace_messages or (own.messages if own else CaffeMessages.TENSORS),
    )
    ratio = _setting(args, "forward_per_backward", preset, None)
    return trace if ratio is None else with_forward_ratio(trace, ratio)


def run_scaling(args: argparse.Namespace) -> int:
    """The scaling run: the tables, and the JSON rows, plot and timelines asked for.

    Args:
        args: ``interlace simulate``'s parsed flags.
    """
    preset = preset_named(args.preset) if args.preset else None
    workers = parse_workers(_setting(args, "workers", preset, DEFAULT_WORKERS))
    if args.timelines is not None and args.timelines < 1:
        raise UsageError(f"--timelines: a worker count must be >= 1, got {args.timelines}")
    if args.strategy is None and preset is not None:
        strategies = parse_strategies(",".join(preset.strategies))
    else:
        strategies = parse_strategies(args.strategy)  # a clear error before any work
    kfac = any(name in KFAC_STRATEGIES for name in strategies)
    if args.kfac_costs and not kfac:
        raise UsageError("--kfac-costs prices K-FAC strategies; name one with --strategy")
    compression = None if args.compression == "none" else args.compression
    if compression is not None and kfac:
        raise UsageError(
            "--compression prices data-parallel strategies only; drop it or the K-FAC ones"
        )
    network = parse_network(_setting(args, "network", preset, DEFAULT_NETWORK))
    trace = _trace(args, preset)
    if kfac:
        check_trace(trace, str(args.trace))
    kfac_costs = parse_kfac_costs(args.kfac_costs) if kfac else None
    started = time.perf_counter()
    results = simulate_scaling(
        trace,
        network,
        workers,
        strategies,
        per_layer=args.per_layer,
        kfac_costs=kfac_costs,
        compression=compression,
    )
    elapsed = time.perf_counter() - started
    rows = scaling_rows(trace, results)
    if preset is not None:
        print(f"preset {preset.name}: {preset.description}")
    print(trace.describe())
    if preset is not None and trace.notes:
        print(f"  {trace.notes}")
    unit = "layer" if args.per_layer else "tensor of the trace"
    sent = f"; gradients sent as {compression}" if compression else ""
    print(f"network: {network.describe()}; one message per {unit}{sent}")
    if kfac_costs is not None:
        print(kfac_costs.describe())
    print(
        f"simulated {len(strategies)} strategies x {len(workers)} worker counts in "
        f"{elapsed:.3f} s\n"
    )
    own = not any(
        getattr(args, flag) is not None
        for flag in (
            "trace",
            "network",
            "trace_messages",
            "trace_iteration",
            "forward_per_backward",
        )
    )
    _print_tables(rows, preset, own and not args.per_layer)
    _write_outputs(args, rows, preset)
    if args.timelines is not None:
        _write_timelines(args, trace, network, strategies, kfac_costs, compression)
    return 0


def _print_tables(rows: list[ScalingRow], preset: Preset | None, own: bool = True) -> None:
    """The preset's own table and checks first (if any; ``own``: in its own set-up), then every
    row and the K-FAC phases."""
    if preset is not None:
        print(
            "The paper's table (speed-up: throughput over one worker's; the last two columns "
            f"{preset.merge}'s speed-ups over WFBP and SyncEASGD):\n"
            + format_paper_table(rows, preset.merge)
        )
        for note in check_preset(rows, preset, own=own):
            print(note)
        print("\nEvery strategy:")
    print(format_table(rows))
    phases = format_phase_table(rows)
    if phases:
        print("\nK-FAC phases (ms):\n" + phases)
    comparison = None if preset is not None else format_paper_comparison(rows)
    notes = check_claims(rows)
    if comparison or notes:
        print()
    if comparison:
        print(comparison)
    for note in notes:
        print(note)


def _write_outputs(args: argparse.Namespace, rows: list[ScalingRow], preset: Preset | None) -> None:
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([row.to_dict() for row in rows], indent=1) + "\n")
    png = plot_path(args)
    if png is not None:
        plot_scaling(rows, png, speedup=preset is not None)
        print(f"\nscaling plot: {png}")


def _write_timelines(
    args: argparse.Namespace,
    trace: Trace,
    network: Network,
    strategies: tuple[str, ...],
    kfac_costs: KfacCosts | None,
    compression: str | None,
) -> None:
    png = plot_path(args)
    folder = png.parent if png is not None else Path("simulate")
    count = args.timelines
    for strategy in strategies:
        (result,) = simulate_scaling(
            trace,
            network,
            [count],
            [strategy],
            per_layer=args.per_layer,
            kfac_costs=kfac_costs,
            compression=compression,
        )
        timeline = result.timeline()
        stem = folder / f"timeline-{strategy.replace('/', '-')}-{count}w"
        timeline.to_png(stem.with_suffix(".png"))
        timeline.to_chrome_trace(stem.with_suffix(".json"))
    print(f"timelines at {count} workers: {folder}/timeline-<strategy>-{count}w.png/.json")
