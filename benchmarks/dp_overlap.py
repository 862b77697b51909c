"""DataParallel's ``overlap="forward"`` on the emulated H200 and K80 traces: the measured rows
against torch DDP, the bounds and the simulator's prediction.

``python benchmarks/dp_overlap.py run`` runs every row (``interlace bench dp`` on the emulated
cluster, root needed, about two hours on a quiet 2-core machine) into
``docs/bench-dp/overlap-*.json``; ``python benchmarks/dp_overlap.py report`` prints the table
from those files and writes ``docs/bench-dp/overlap.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from interlace.comm.cost import CostModel
from interlace.sim.simulation import simulate
from interlace.sim.trace import load_trace

DOCS = Path(__file__).resolve().parents[1] / "docs" / "bench-dp"

#: Each row: its name, then ``interlace bench dp`` arguments.
ROWS: dict[str, list[str]] = {
    "r50-25g-n4": [
        "--compute",
        "emulated:resnet50-h200",
        "--dilation",
        "16",
        "--link",
        "25gbit",
        "-n",
        "4",
        "--strategies",
        "ddp,ddp-100mb,mgwfbp,overlap,fsdp2",
    ],
    "r50-100g-n4": [
        "--compute",
        "emulated:resnet50-h200",
        "--dilation",
        "64",
        "--link",
        "100gbit",
        "-n",
        "4",
        "--strategies",
        "ddp,ddp-100mb,mgwfbp,overlap",
    ],
    "bert-25g-n4": [
        "--compute",
        "emulated:bert-base-h200",
        "--dilation",
        "16",
        "--link",
        "25gbit",
        "-n",
        "4",
        "--strategies",
        "ddp,overlap",
    ],
    "bert-100g-n4": [
        "--compute",
        "emulated:bert-base-h200",
        "--dilation",
        "64",
        "--link",
        "100gbit",
        "-n",
        "4",
        "--strategies",
        "ddp,overlap",
    ],
    "r50-25g-n8": [
        "--compute",
        "emulated:resnet50-h200",
        "--dilation",
        "32",
        "--link",
        "25gbit",
        "-n",
        "8",
        "--strategies",
        "ddp,ddp-100mb,mgwfbp,overlap",
    ],
    "gnet-5g-n8": [
        "--compute",
        "emulated:googlenet-k80",
        "--dilation",
        "8",
        "--link",
        "5gbit",
        "-n",
        "8",
        "--strategies",
        "ddp,mgwfbp,overlap",
        "--network",
        "osu:10gbe",
    ],
}
COMMON = ["--iters", "20", "--rounds", "4", "--warmup", "1", "--timeout", "4000"]
#: A label and its median in the trials' summary: "start-up x4 1075.1 ms".
TRIAL = re.compile(r"(?:^|, )(?P<label>[^,:]+?(?:: [^,]+?)?) (?P<ms>[0-9.]+) ms")


@dataclass(frozen=True)
class Summary:
    """One row of the table (times undilated, in seconds)."""

    row: str
    model: str
    ranks: int
    link: str
    ddp_s: float
    overlap_s: float
    overlap_p25_s: float
    overlap_p75_s: float
    overlap_bound_s: float
    ideal_bound_s: float
    ddp_100mb_s: float | None
    backward_only_s: float | None
    backward_only: str
    fsdp2_s: float | None
    simulated_s: float
    kept: str

    @property
    def versus_ddp(self) -> float:
        return self.ddp_s / self.overlap_s


def _rows(path: Path) -> dict[str, dict[str, Any]]:
    return {row["strategy"]: row for row in json.loads(path.read_text())}


def _dilation(row: dict[str, Any]) -> float:
    match = re.search(r"D=([0-9.]+)", row["compute"])
    return float(match.group(1)) if match else 1.0


def _trials(tuning: str) -> dict[str, float]:
    """The trials' medians by candidate (dilated seconds), from DataParallel's summary line."""
    body = tuning.split(": ", 1)[1].split("; kept", maxsplit=1)[0]
    return {m["label"]: float(m["ms"]) / 1e3 for m in TRIAL.finditer(body)}


def summarise(name: str, path: Path) -> Summary:
    """The table row of one measured launch.

    Args:
        name: The row's name.
        path: Its ``interlace bench dp`` JSON.
    """
    rows = _rows(path)
    ddp, overlap = rows["ddp"], rows["overlap"]
    trace = load_trace(overlap["compute"].split(":", 1)[1].split(" ")[0])
    cost = CostModel(overlap["startup_s"], overlap["per_byte_s"])
    simulated = simulate(trace, "overlap", cost, workers=overlap["ranks"]).iteration_s
    if "mgwfbp" in rows:
        backward_s: float | None = rows["mgwfbp"]["iteration_s"]
        backward = "mgwfbp row"
    else:
        # The backward-only candidates the overlap's own trials ran, in the same launch.
        trials = {k: v for k, v in _trials(overlap["tuning"] or "").items() if "overlap" not in k}
        best = min(trials, key=lambda label: trials[label]) if trials else ""
        backward_s = trials[best] / _dilation(overlap) if trials else None
        backward = f"trials: {best}"
    kept = (overlap["tuning"] or "").rsplit("kept ", 1)[-1]
    return Summary(
        name,
        overlap["model"],
        overlap["ranks"],
        overlap["link"],
        ddp["iteration_s"],
        overlap["iteration_s"],
        overlap["iteration_p25_s"],
        overlap["iteration_p75_s"],
        overlap["overlap_bound_s"],
        overlap["bound_s"],
        rows["ddp-100mb"]["iteration_s"] if "ddp-100mb" in rows else None,
        backward_s,
        backward,
        rows["fsdp2"]["iteration_s"] if "fsdp2" in rows else None,
        simulated,
        kept,
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _x(numerator: float | None, denominator: float) -> str:
    return "-" if numerator is None else f"{numerator / denominator:.2f}x"


def report(directory: Path) -> list[Summary]:
    """Print the table of every measured row and write ``overlap.json`` beside them.

    Args:
        directory: Where the rows' JSON files are.
    """
    summaries = [
        summarise(name, directory / f"overlap-{name}.json")
        for name in ROWS
        if (directory / f"overlap-{name}.json").exists()
    ]
    print(
        "| trace, link, ranks | DDP ms | overlap ms (p25-p75) | vs DDP | vs DDP 100 MB | vs best "
        "backward-only | / overlap bound | overlap bound ms | simulator ms (error) | FSDP2 vs DDP |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in summaries:
        error = (s.simulated_s - s.overlap_s) / s.overlap_s
        print(
            f"| {s.model}, {s.link}, {s.ranks} | {_ms(s.ddp_s)} | {_ms(s.overlap_s)} "
            f"({_ms(s.overlap_p25_s)}-{_ms(s.overlap_p75_s)}) | {s.versus_ddp:.2f}x | "
            f"{_x(s.ddp_100mb_s, s.overlap_s)} | {_x(s.backward_only_s, s.overlap_s)} | "
            f"{s.overlap_s / s.overlap_bound_s:.2f} | {_ms(s.overlap_bound_s)} | "
            f"{_ms(s.simulated_s)} ({error:+.1%}) | "
            f"{'-' if s.fsdp2_s is None else f'{s.ddp_s / s.fsdp2_s:.2f}x'} |"
        )
    errors = [abs(s.simulated_s - s.overlap_s) / s.overlap_s for s in summaries]
    if errors:
        print(
            f"simulator: median error {statistics.median(errors):.1%}, "
            f"max {max(errors):.1%} over {len(errors)} rows"
        )
    (directory / "overlap.json").write_text(
        json.dumps([{**asdict(s), "versus_ddp": s.versus_ddp} for s in summaries], indent=1) + "\n"
    )
    return summaries


def run(directory: Path, names: list[str]) -> None:
    """Measure ``names`` one after another (each its own launch).

    Args:
        directory: Where the rows' JSON files go.
        names: Rows of :data:`ROWS`.
    """
    for name in names:
        argv = [sys.executable, "-m", "interlace.cli", "bench", "dp", *ROWS[name], *COMMON]
        argv += ["--json", str(directory / f"overlap-{name}.json")]
        argv += ["--png", str(directory / f"overlap-{name}.png")]
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
