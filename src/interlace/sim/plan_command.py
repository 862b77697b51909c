"""``interlace plan``: which configuration to run for a model on a cluster, ranked by the simulator.

The flags, the tables (one ranked table at one worker count, a compact one per size in a sweep),
the optional plot and JSON rows. Torch-free; matplotlib only for ``--png``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

from interlace.errors import UsageError
from interlace.sim.experiments import parse_workers
from interlace.sim.network import NETWORK_HELP, Network, parse_network
from interlace.sim.plan import FAMILIES, Candidate, PlanResult, plan
from interlace.sim.trace import Trace, load_trace
from interlace.sim.traces import TRACES, trace_names

DEFAULT_NETWORK = "ring:10gbit"
DEFAULT_WORKERS = "4..2048"
#: Rows of the ranked table at one worker count, and per size in a sweep.
DEFAULT_TOP = 12
SWEEP_TOP = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``interlace plan``.

    Args:
        parser: The subcommand's parser.
    """
    parser.add_argument(
        "--trace",
        metavar="T",
        help=f"the model's trace: a shipped trace ({', '.join(trace_names())}) or an "
        "interlace-trace JSON (interlace trace / interlace profile --trace-out)",
    )
    parser.add_argument(
        "--model",
        metavar="M",
        help="a model with a shipped trace (resnet50, vgg11, ...): its H200 trace if there is one",
    )
    parser.add_argument(
        "--workers",
        help=f"GPUs: N, or a sweep 4,8,16 or LOW..HIGH for the powers of two between "
        f"(default {DEFAULT_WORKERS})",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        metavar="G",
        help="GPUs per node: a pipeline's stages sit on neighbouring GPUs and its replicas "
        "across nodes (default: the network's, or one flat network)",
    )
    parser.add_argument(
        "--network",
        default=DEFAULT_NETWORK,
        help=f"the cluster's network: {NETWORK_HELP}; two-level:G:INTRA:INTER prices links "
        f"inside a node apart from those between nodes (default {DEFAULT_NETWORK})",
    )
    parser.add_argument(
        "--gpu-memory",
        type=float,
        metavar="GB",
        help="leave out configurations estimated above this many GiB per GPU",
    )
    parser.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help=f"what to rank, comma-separated from {','.join(FAMILIES)} (default all)",
    )
    parser.add_argument(
        "--top", type=int, help=f"rows per table (default {DEFAULT_TOP}, {SWEEP_TOP} per size)"
    )
    parser.add_argument("--json", metavar="PATH", help="write every priced row as a JSON list")
    parser.add_argument(
        "--png",
        metavar="PATH",
        help="plot the best throughput of each family against workers ('none', the default: "
        "no plot, as for interlace simulate)",
    )


def trace_for(args: argparse.Namespace) -> Trace:
    """The trace ``--trace`` or ``--model`` names.

    Args:
        args: The parsed flags.

    Raises:
        UsageError: For neither or both, or a model without a shipped trace.
    """
    if bool(args.trace) == bool(args.model):
        raise UsageError("give --trace T or --model M (one of them)")
    if args.trace:
        return load_trace(args.trace)
    model = args.model.strip().lower()
    names = [n for n in TRACES if n.startswith(f"{model}-") and "-b" not in n[len(model) :]]
    if not names:
        models = sorted({n.rsplit("-", 1)[0] for n in TRACES if "-b" not in n})
        raise UsageError(
            f"--model {args.model!r} has no shipped trace; choose from {', '.join(models)}, or "
            "record one (interlace trace --model M --out T) and give --trace T"
        )
    return load_trace(next((n for n in names if n.endswith("-h200")), names[0]))


def parse_families(text: str) -> tuple[str, ...]:
    """``--families``: names of :data:`FAMILIES`, comma-separated.

    Args:
        text: The flag's value.

    Raises:
        UsageError: For an unknown or missing name.
    """
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        raise UsageError(
            f"--families: {unknown[0] if unknown else text!r} is not a family; choose from "
            f"{', '.join(FAMILIES)}"
        )
    return names


def _check(args: argparse.Namespace, network: Network, workers: Sequence[int]) -> None:
    per_node = args.gpus_per_node
    if per_node is not None and per_node < 1:
        raise UsageError(f"--gpus-per-node must be a positive integer, got {per_node}")
    if per_node is not None and network.node_size not in (None, per_node):
        raise UsageError(
            f"--gpus-per-node {per_node} contradicts --network {network.spec!r} "
            f"({network.node_size} per node); drop one"
        )
    per_node = per_node or network.node_size
    if per_node is not None:
        bad = [n for n in workers if n > per_node and n % per_node]
        if bad:
            raise UsageError(
                f"--gpus-per-node {per_node} does not divide {bad[0]} workers; give worker "
                f"counts that are multiples of {per_node} (or at most {per_node})"
            )
    if args.gpu_memory is not None and not args.gpu_memory > 0:
        raise UsageError(f"--gpu-memory must be a positive number of GiB, got {args.gpu_memory}")
    if args.top is not None and args.top < 1:
        raise UsageError(f"--top must be >= 1, got {args.top}")


def format_ranking(result: PlanResult, top: int) -> str:
    """The ranked table of one worker count: the fastest ``top`` configurations.

    Args:
        result: The planner's result.
        top: Rows to show.
    """
    lines = [
        "| # | family | configuration | iteration ms | samples/s | vs best | bound | GiB/GPU |",
        "|---:|---|---|---:|---:|---:|---|---:|",
    ]
    best = result.candidates[0].throughput if result.candidates else 1.0
    for rank, c in enumerate(result.candidates[:top], 1):
        name = c.name + (" (async)" if c.asynchronous else "")
        memory = "-" if c.memory_bytes is None else f"{c.memory_bytes / 2**30:.2f}"
        memory += "*" if c.memory_note else ""
        lines.append(
            f"| {rank} | {c.family} | {name} | {c.iteration_s * 1e3:.2f} | {c.throughput:,.0f} "
            f"| {c.throughput / best:.2f} | {c.bound} | {memory} |"
        )
    return "\n".join(lines)


def _best_of(result: PlanResult) -> dict[str, Candidate]:
    """The fastest configuration of each family (pipelines: synchronous and asynchronous)."""
    found: dict[str, Candidate] = {}
    for c in result.candidates:
        key = c.family + (" async" if c.asynchronous else "")
        found.setdefault(key, c)
    return found


def format_summary(results: Sequence[PlanResult]) -> str:
    """One line per worker count: the winner and each family's best.

    Args:
        results: The planner's results, one per worker count.
    """
    lines = [
        "| workers | best | samples/s | bound | data | kfac | pipeline | pipeline async |",
        "|---:|---|---:|---|---|---|---|---|",
    ]
    for result in results:
        if not result.candidates:
            continue
        first, best = result.candidates[0], _best_of(result)
        cells = [
            f"{best[k].name} {best[k].throughput:,.0f}" if k in best else "-"
            for k in ("data", "kfac", "pipeline", "pipeline async")
        ]
        lines.append(
            f"| {result.workers} | {first.family} {first.name} | {first.throughput:,.0f} | "
            f"{first.bound} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def plot_plan(
    results: Sequence[PlanResult], path: str | Path, title: str, per_gpu: float = 0.0
) -> Path:
    """Each family's best throughput against workers (log-log), beside the compute bound.

    Args:
        results: One per worker count.
        path: The PNG (folders are made).
        title: The plot's title.
        per_gpu: One GPU's samples per second computing alone (0: no bound drawn).
    """
    from matplotlib.figure import Figure  # noqa: PLC0415 - heavy import, only for a plot

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure = Figure(figsize=(7.0, 4.2), dpi=120)
    axes = figure.add_axes((0.11, 0.12, 0.86, 0.8))
    for marker, key in zip("osD^", ("data", "kfac", "pipeline", "pipeline async"), strict=True):
        points = [(r.workers, _best_of(r)[key].throughput) for r in results if key in _best_of(r)]
        if points:
            axes.plot(*zip(*points, strict=True), marker=marker, label=key, markersize=4)
    counts = [r.workers for r in results if r.candidates]
    if len(counts) > 1 and per_gpu > 0:
        axes.plot(counts, [n * per_gpu for n in counts], ":", color="grey", label="compute bound")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("GPUs")
    axes.set_ylabel("samples/s (best of each family)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    axes.set_title(title, fontsize=10)
    figure.savefig(path)
    return path


def _rows(results: Sequence[PlanResult]) -> list[dict[str, object]]:
    return [
        {
            "workers": c.workers,
            "family": c.family,
            "configuration": c.name,
            "asynchronous": c.asynchronous,
            "iteration_s": c.iteration_s,
            "samples_per_s": c.throughput,
            "bound": c.bound,
            "terms_s": c.terms,
            "memory_bytes": c.memory_bytes,
            "command": c.flags,
        }
        for result in results
        for c in result.candidates
    ]


def run(args: argparse.Namespace) -> int:
    """``interlace plan`` with parsed ``args``; the exit status.

    Args:
        args: The parsed flags.

    Raises:
        UsageError: For a bad flag value.
    """
    workers = parse_workers(args.workers or DEFAULT_WORKERS)
    network = parse_network(args.network)
    families = parse_families(args.families)
    _check(args, network, workers)
    trace = trace_for(args)
    memory = None if args.gpu_memory is None else args.gpu_memory * 2**30
    started = time.perf_counter()
    results = [
        plan(
            trace,
            network,
            count,
            families=families,
            gpus_per_node=args.gpus_per_node,
            gpu_memory_bytes=memory,
        )
        for count in workers
    ]
    elapsed = time.perf_counter() - started
    print(trace.describe())
    print(f"network: {network.describe()}")
    per_node = args.gpus_per_node or network.node_size
    if per_node and network.node_size is None:
        print(
            f"  {per_node} GPUs per node place the pipelines; a flat network prices every "
            "link alike"
        )
    priced = sum(len(r.candidates) for r in results)
    print(f"priced {priced} configurations at {len(workers)} worker count(s) in {elapsed:.3f} s")
    print("global batch: the trace's batch per GPU; pipelines: micro-batches of that batch\n")
    sweep = len(results) > 1
    top = args.top or (SWEEP_TOP if sweep else DEFAULT_TOP)
    for result in results:
        if sweep:
            print(f"## {result.workers} GPUs")
        print(format_ranking(result, top))
        print(result.why())
        if result.candidates:
            print(f"run it: {result.candidates[0].flags}")
        for line in result.left_out:
            print(line)
        print()
    if sweep:
        print("Best per family:\n" + format_summary(results))
    if any(c.memory_note for r in results for c in r.candidates):
        print("* memory without activations (the trace has no activation sizes)")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_rows(results), indent=1) + "\n")
    if args.png and args.png.lower() != "none":
        title = f"{trace.model}, {network.spec or network.describe()}: planned"
        compute = trace.forward_s + trace.backward_s + trace.step_s
        per_gpu = (trace.batch_size or 32) / compute if compute > 0 else 0.0
        print(f"\nplot: {plot_plan(results, args.png, title, per_gpu)}")
    return 0
