"""The README's headline measurements and docs/features.md state what the committed result JSONs
say: each figure with a JSON behind it is recomputed here and must stand in its page's text, so a
re-measurement that changes a JSON fails this test until the pages say the new figure."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from interlace.bench.kfac_report import AblationRow, h2h_verdicts
from interlace.sim.validate import ValidationRow, error_summary

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
FEATURES = DOCS / "features.md"
HEADLINES = "## Headline measurements"
NUMBER_WORDS = ("none", "one", "two", "three", "four", "five", "six")


def _flat(text: str) -> str:
    """``text`` with every run of whitespace made one space, as a sentence reads across lines."""
    return " ".join(text.split())


def _headlines() -> str:
    text = README.read_text()
    start = text.index(HEADLINES)
    end = text.index("\n## ", start + len(HEADLINES))
    return text[start:end]


PAGES: dict[Path, Callable[[], str]] = {README: _headlines, FEATURES: FEATURES.read_text}


def _json(name: str) -> Any:
    return json.loads((DOCS / name).read_text())


def _script(name: str) -> ModuleType:
    """A script under benchmarks/, imported for its constants and functions."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _span(values: Iterable[float], digits: int = 2, unit: str = "x") -> str:
    """``lo-hi`` at ``digits`` decimals (one number when both print alike), then ``unit``."""
    printed = sorted({f"{value:.{digits}f}" for value in values}, key=float)
    return (printed[0] if len(printed) == 1 else f"{printed[0]}-{printed[-1]}") + unit


def _percent_span(fractions: Iterable[float], digits: int = 1) -> str:
    return _span([fraction * 100 for fraction in fractions], digits, "%")


def _median_epochs(epochs: Sequence[int | None]) -> float:
    """The median of epochs to a target, a run that never reached it counting as never."""
    return statistics.median([math.inf if epoch is None else epoch for epoch in epochs])


@dataclass(frozen=True)
class Figure:
    """Figures of one page that come from committed JSONs.

    Args:
        page: The page that states them.
        sources: The JSONs under docs/ they are computed from.
        says: The fragments, as the page must print them.
    """

    page: Path
    sources: tuple[str, ...]
    says: Callable[[], list[str]]

    @property
    def name(self) -> str:
        return f"{self.page.name}: {', '.join(self.sources)}"


FIGURES: list[Figure] = []


def figure(
    page: Path, *sources: str
) -> Callable[[Callable[[], list[str]]], Callable[[], list[str]]]:
    """Register the decorated function as the figures ``page`` states from ``sources``.

    Args:
        page: The page that states them.
        sources: The JSONs under docs/ they are computed from.
    """

    def register(says: Callable[[], list[str]]) -> Callable[[], list[str]]:
        FIGURES.append(Figure(page, sources, says))
        return says

    return register


# -- data parallelism ------------------------------------------------------------------------------


def _mgwfbp_against_ddp() -> tuple[list[float], float, int]:
    rows = [row for row in _json("bench-dp/rows.json") if row["strategy"] == "mgwfbp"]
    resnet20 = max(row["speedup_vs_ddp"] for row in rows if row["model"] == "resnet20")
    return [row["speedup_vs_ddp"] for row in rows], resnet20, len(rows)


@figure(README, "bench-dp/rows.json")
def _dp_readme() -> list[str]:
    speedups, resnet20, count = _mgwfbp_against_ddp()
    return [f"{_span(speedups)} over {count} model/link rows (resnet20 up to {_x(resnet20)})"]


def _best_sweep_bucketing() -> float:
    """The best speed-up over DDP's defaults of any bucketing the sweep timed."""
    best = 0.0
    for model in ("mlp", "resnet20", "transformer"):
        rows = _json(f"bench-dp/sweep/{model}.json")
        (ddp,) = (row["median_s"] for row in rows if row["contender"] == "ddp (defaults)")
        best = max(best, *(ddp / row["median_s"] for row in rows))
    return best


def _emulated_googlenet() -> dict[str, dict[str, Any]]:
    return {row["strategy"]: row for row in _json("bench-dp/emulated-googlenet-8ranks.json")}


@figure(
    FEATURES,
    "bench-dp/rows.json",
    "bench-dp/sweep/*.json",
    "bench-dp/emulated-googlenet-8ranks.json",
)
def _dp_features() -> list[str]:
    speedups, _, count = _mgwfbp_against_ddp()
    mg = _emulated_googlenet()["mgwfbp"]
    return [
        f"MG-WFBP is level with DDP ({_span(speedups)} over {count} model/link rows)",
        f"gains more than {_x(_best_sweep_bucketing())}",
        f"MG-WFBP {_x(mg['speedup_vs_ddp'])} DDP and {_x(mg['time_over_bound'])} the ideal bound",
    ]


def _auto_over_one_channel(name: str, base: str = "wfbp") -> list[float]:
    return [
        row["speedup_vs_one_channel"]
        for row in _json(name)
        if row["base_strategy"] == base and row["channels"] == "auto"
    ]


@figure(
    README,
    "bench-channels/latency.json",
    "bench-channels/bandwidth.json",
    "bench-dp/emulated-channels-transformer-h200.json",
)
def _channels_readme() -> list[str]:
    return [
        f"{_span(_auto_over_one_channel('bench-channels/latency.json'))} on mlp and transformer "
        "(latency-bound",
        f"{_span(_auto_over_one_channel('bench-channels/bandwidth.json'))} bandwidth-bound",
        f"{_span(_auto_over_one_channel('bench-dp/emulated-channels-transformer-h200.json'))} on "
        "emulated compute (H200 transformer)",
    ]


@figure(
    FEATURES,
    "bench-channels/latency.json",
    "bench-channels/bandwidth.json",
    "bench-dp/emulated-channels-transformer-h200.json",
    "compression/runs.json",
)
def _channels_features() -> list[str]:
    every_bandwidth_row = [
        row["speedup_vs_one_channel"]
        for row in _json("bench-channels/bandwidth.json")
        if row["channels"] == "auto"
    ]
    fp16, none, _ = _compression()
    return [
        f"auto {_span(_auto_over_one_channel('bench-channels/latency.json'))} one channel on both "
        "latency-bound models",
        f"every bandwidth-bound row {_x(min(every_bandwidth_row))} or better",
        f"{_span(_auto_over_one_channel('bench-dp/emulated-channels-transformer-h200.json'))} on "
        "emulated compute (H200 transformer)",
        f"fp16 {fp16:.2f}% mean test accuracy on the demo job, {none:.2f}% uncompressed",
    ]


def _compression() -> tuple[float, float, int]:
    runs = _json("compression/runs.json")

    def mean(compression: str) -> float:
        return 100 * statistics.fmean(
            run["final_test_accuracy"] for run in runs if run["compression"] == compression
        )

    return mean("fp16"), mean("none"), len({run["seed"] for run in runs})


@figure(README, "compression/runs.json")
def _compression_readme() -> list[str]:
    fp16, none, seeds = _compression()
    return [f"{fp16:.2f}% mean test accuracy, {none:.2f}% uncompressed, {seeds} seeds"]


@figure(README, "bench-dp/emulated-googlenet-8ranks.json", "simulate/googlenet-osu.json")
def _emulated_dp_readme() -> list[str]:
    rows = _emulated_googlenet()
    mg = rows["mgwfbp"]
    simulated = _googlenet_at(8)
    return [
        f"MG-WFBP {_x(mg['speedup_vs_ddp'])} DDP, {_x(mg['time_over_bound'])} the ideal bound at "
        "8 ranks",
        f"MG-WFBP {_x(rows['wfbp']['iteration_s'] / mg['iteration_s'])} WFBP and "
        f"{_x(rows['single']['iteration_s'] / mg['iteration_s'])} SyncEASGD",
        f"simulator {_x(simulated['mgwfbp']['speedup_vs_wfbp'])} and "
        f"{_x(simulated['mgwfbp']['speedup_vs_single'])})",
    ]


@figure(
    README,
    "bench-dp/emulated-h200-r50-25g.json",
    "bench-dp/emulated-h200-r50-100g.json",
    "bench-dp/emulated-h200-bert-25g.json",
    "bench-dp/emulated-h200-bert-100g.json",
)
def _emulated_h200_readme() -> list[str]:
    rows = [
        row
        for name in ("r50-25g", "r50-100g", "bert-25g", "bert-100g")
        for row in _json(f"bench-dp/emulated-h200-{name}.json")
        if row["strategy"] == "mgwfbp"
    ]
    return [
        f"{_span(row['speedup_vs_ddp'] for row in rows)} DDP",
        f"{_span(row['time_over_bound'] for row in rows)} the bound",
    ]


@figure(FEATURES, "bench-dp/overlap.json")
def _overlap_features() -> list[str]:
    rows = _json("bench-dp/overlap.json")
    return [
        f"{_span(row['ddp_s'] / row['overlap_s'] for row in rows)} DDP over {len(rows)} rows, "
        f"{_span(row['overlap_s'] / row['overlap_bound_s'] for row in rows)} the overlap bound"
    ]


@figure(README, "bench-dp/overlap.json")
def _overlap_readme() -> list[str]:
    rows = _json("bench-dp/overlap.json")
    errors = [abs(row["simulated_s"] / row["overlap_s"] - 1) for row in rows]
    return [
        f"{len(rows)} rows",
        f"{_span(row['ddp_s'] / row['overlap_s'] for row in rows)} DDP, "
        f"{_span(row['ddp_100mb_s'] / row['overlap_s'] for row in rows if row['ddp_100mb_s'])}"
        " DDP with 100 MB buckets, "
        f"{_span(row['overlap_s'] / row['overlap_bound_s'] for row in rows)} the overlap bound",
        f"simulator within {_percent_span([min(errors), max(errors)])}",
    ]


# -- the simulator ---------------------------------------------------------------------------------


def _googlenet_at(workers: int) -> dict[str, dict[str, Any]]:
    return {
        row["strategy"]: row
        for row in _json("simulate/googlenet-osu.json")
        if row["workers"] == workers
    }


@figure(README, "simulate/googlenet-osu.json")
def _googlenet_readme() -> list[str]:
    rows = _googlenet_at(64)
    return [
        f"MG-WFBP {_x(rows['mgwfbp']['speedup_vs_wfbp'])} WFBP and "
        f"{_x(rows['mgwfbp']['speedup_vs_single'])} SyncEASGD",
        f"the exact DP bucketing {_x(rows['optimal']['speedup_vs_single'])} SyncEASGD",
    ]


@figure(README, "simulate/mgwfbp-paper.json")
def _paper_model_readme() -> list[str]:
    rows = {
        row["strategy"]: row for row in _json("simulate/mgwfbp-paper.json") if row["workers"] == 64
    }
    return [
        f"MG-WFBP {_x(rows['mgwfbp']['speedup_vs_wfbp'])} WFBP and "
        f"{_x(rows['mgwfbp']['speedup_vs_single'])} SyncEASGD (paper"
    ]


def _validation(*names: str) -> list[ValidationRow]:
    return [ValidationRow(**row) for name in names for row in _json(name)]


EMULATED_VALIDATION = tuple(
    f"simulate/emulated-validation-{family}.json" for family in ("dp", "kfac", "pipeline")
)
REAL_VALIDATION = (
    "simulate/validation.json",
    *(f"simulate/validation-repeat-{run}.json" for run in (1, 2, 3)),
)


def _emulated_validation_runs() -> list[list[ValidationRow]]:
    rows = _validation(*EMULATED_VALIDATION)
    return [[row for row in rows if row.run == run] for run in sorted({row.run for row in rows})]


def _emulated_validation_text() -> tuple[str, str]:
    runs = _emulated_validation_runs()
    summaries = [error_summary(rows) for rows in runs]
    (count,) = {len(rows) for rows in runs}
    medians = _percent_span(median for median, _ in summaries)
    maxima = _percent_span((worst for _, worst in summaries), digits=0)
    return f"{len(runs)} runs x {count} rows", f"median {medians}, max {maxima}"


@figure(README, *EMULATED_VALIDATION, "simulate/validation.json")
def _validation_readme() -> list[str]:
    runs, errors = _emulated_validation_text()
    median, worst = error_summary(_validation("simulate/validation.json"))
    return [
        f"set by each launch's probes ({runs} of DP strategies",
        errors,
        f"`--compute real` ({median * 100:.1f}%/{worst * 100:.1f}%)",
    ]


@figure(FEATURES, *EMULATED_VALIDATION, *REAL_VALIDATION)
def _validation_features() -> list[str]:
    runs, errors = _emulated_validation_text()
    sets = [_validation(name) for name in REAL_VALIDATION]
    summaries = [error_summary(rows) for rows in sets]
    (count,) = {len(rows) for rows in sets}
    within = sum(worst <= 0.2 for _, worst in summaries)
    worst_row = max((row for rows in sets for row in rows), key=lambda row: abs(row.error))
    assert all(median <= 0.1 for median, _ in summaries)
    return [
        f"median error {_percent_span(m for m, _ in summaries)} and max "
        f"{_percent_span(w for _, w in summaries)} in the {NUMBER_WORDS[len(sets)]} runs kept "
        f"({count} rows each)",
        f"the 20% max in {NUMBER_WORDS[within]} of {NUMBER_WORDS[len(sets)]}",
        f"one row at {abs(worst_row.error) * 100:.1f}%: {worst_row.model} "
        f"{worst_row.strategy.upper()} on {worst_row.ranks} ranks",
        f"{runs}) {errors}",
    ]


# -- K-FAC -----------------------------------------------------------------------------------------


def _ablation(*names: str) -> list[AblationRow]:
    rows = []
    for name in names:
        data = _json(name)
        # A head-to-head report holds its rows beside its verdicts; a run's JSON is the rows.
        rows += [AblationRow(**row) for row in (data["rows"] if isinstance(data, dict) else data)]
    return rows


def _speedups(rows: Sequence[AblationRow], mode: str) -> dict[str, float]:
    return {row.model: row.speedup_vs_dkfac or 0.0 for row in rows if row.mode == mode}


@figure(README, "kfac/ablation.json", "kfac/ablation-1gbit.json")
def _spd_readme() -> list[str]:
    at_500 = _speedups(_ablation("kfac/ablation.json"), "spd")
    at_1g = _speedups(_ablation("kfac/ablation-1gbit.json"), "spd")
    return [
        f"{_span(at_500.values())} (resnet20/32, 500 Mbit/s), {_x(at_1g['resnet56'])} "
        "(resnet56, 1 Gbit/s)"
    ]


def _spd_emulated() -> tuple[float, str, float, float]:
    """SPD-KFAC over D-KFAC on emulated compute: the CPU trace, resnet32-h200 over the
    validation's runs (decompositions every step), resnet20-h200 at 10 Gbit/s, and
    resnet32-h200 with decompositions every 10 steps."""
    cpu = _speedups(_ablation("kfac/emulated-resnet20-cpu.json"), "spd")["resnet20-cpu"]
    rows = _validation("simulate/emulated-validation-kfac.json")
    measured = {(r.model, r.strategy, r.run): r.measured_s for r in rows}
    resnet32 = _span(
        measured[("resnet32-h200", "dkfac", run)] / measured[("resnet32-h200", "spd", run)]
        for run in {r.run for r in rows}
    )
    fast_link = _speedups(_ablation("kfac/emulated-resnet20-h200-10gbit.json"), "spd")
    every_10 = _speedups(_ablation("kfac/emulated-resnet32-h200.json"), "spd")
    return cpu, resnet32, fast_link["resnet20-h200"], every_10["resnet32-h200"]


@figure(
    README,
    "kfac/emulated-resnet20-cpu.json",
    "simulate/emulated-validation-kfac.json",
    "kfac/emulated-resnet20-h200-10gbit.json",
    "kfac/emulated-resnet32-h200.json",
)
def _spd_emulated_readme() -> list[str]:
    cpu, resnet32, fast_link, every_10 = _spd_emulated()
    return [
        f"{_x(cpu)} (CPU-profiled resnet20, 100 Mbit/s)",
        f"{resnet32} resnet32 (25 Gbit/s), {_x(fast_link)} resnet20 (10 Gbit/s)",
        f"{_x(every_10)} with decompositions every 10 steps (resnet32)",
    ]


def _h2h() -> ModuleType:
    return _script("kfac_h2h")


def _verdicts(name: str) -> dict[tuple[str, str, int], dict[str, Any]]:
    return {
        (v["model"], v["link"], v["inv_update_steps"]): v for v in h2h_verdicts(_ablation(name))
    }


def _targets_met(name: str) -> tuple[int, int, int]:
    """Rows meeting the fastest-mode target, the default's, and all rows."""
    h2h = _h2h()
    verdicts = _verdicts(name).values()
    fastest = sum(v["fastest_cycle_speedup"] >= h2h.FASTEST_TARGET for v in verdicts)
    default = sum(v["default_cycle_speedup"] >= h2h.DEFAULT_TARGET for v in verdicts)
    return fastest, default, len(verdicts)


@figure(
    FEATURES,
    "kfac/ablation.json",
    "kfac/ablation-1gbit.json",
    "kfac/emulated-resnet20-cpu.json",
    "simulate/emulated-validation-kfac.json",
    "kfac/emulated-resnet20-h200-10gbit.json",
    "kfac/h2h.json",
    "kfac/h2h-emulated.json",
)
def _spd_features() -> list[str]:
    at_500 = _ablation("kfac/ablation.json")
    at_1g = _ablation("kfac/ablation-1gbit.json")
    spd_500, spd_1g = _speedups(at_500, "spd"), _speedups(at_1g, "spd")
    halves = [
        _speedups(rows, mode)[model]
        for rows, model in ((at_500, "resnet20"), (at_500, "resnet32"), (at_1g, "resnet56"))
        for mode in ("pipelined", "lbp")
    ]
    assert min(halves) > 1.0, "each half of SPD-KFAC helps alone"
    cpu, resnet32, fast_link, _ = _spd_emulated()
    real, emulated = _targets_met("kfac/h2h.json"), _targets_met("kfac/h2h-emulated.json")
    h2h = _h2h()
    return [
        f"SPD {_x(spd_500['resnet20'])} / {_x(spd_500['resnet32'])} D-KFAC on resnet20 / "
        f"resnet32 at 500 Mbit/s, {_x(spd_1g['resnet56'])} on resnet56 at 1 Gbit/s, each half "
        "helping alone",
        f"on emulated compute {_x(cpu)} (CPU-profiled resnet20)",
        f"{resnet32} (resnet32, 25 Gbit/s) and {_x(fast_link)} (resnet20, 10 Gbit/s)",
        f"the fastest mode {h2h.FASTEST_TARGET}x or more on {real[0]} of {real[2]} CPU rows and "
        f"{emulated[0]} of {emulated[2]} emulated, the default {h2h.DEFAULT_TARGET}x or more on "
        f"{real[1]} of {real[2]} and {emulated[1]} of {emulated[2]}",
    ]


def _h2h_cells(
    verdicts: dict[tuple[str, str, int], dict[str, Any]],
    key: str,
    models: Sequence[str],
    links: Sequence[str],
) -> str:
    """``inv 10, inv 1`` speed-ups per (model, link), joined by `` / ``."""
    return " / ".join(
        f"{_x(verdicts[(model, link, 10)][key])}, {_x(verdicts[(model, link, 1)][key])}"
        for model in models
        for link in links
    )


@figure(README, "kfac/h2h.json", "kfac/h2h-emulated.json")
def _h2h_readme() -> list[str]:
    real, emulated = _verdicts("kfac/h2h.json"), _verdicts("kfac/h2h-emulated.json")
    links = ("200mbit", "1gbit")
    rows = [
        f"| {model}, 200 Mbit/s / 1 Gbit/s | "
        f"{_h2h_cells(real, 'fastest_cycle_speedup', [model], links)} | "
        f"{_h2h_cells(real, 'default_cycle_speedup', [model], links)} |"
        for model in ("resnet20", "resnet32", "transformer")
    ]
    traces = ("resnet20-h200", "resnet32-h200", "transformer-h200")
    rows.append(
        "| emulated H200, resnet20 / resnet32 / transformer, 10 Gbit/s | "
        f"{_h2h_cells(emulated, 'fastest_cycle_speedup', traces, ['10gbit'])} | "
        f"{_h2h_cells(emulated, 'default_cycle_speedup', traces, ['10gbit'])} |"
    )
    (fastest, default, count), (e_fastest, e_default, e_count) = (
        _targets_met("kfac/h2h.json"),
        _targets_met("kfac/h2h-emulated.json"),
    )
    return [
        *rows,
        f"met on {fastest} and {default} of {count} CPU rows, {e_fastest} and {e_default} of "
        f"{e_count} emulated",
    ]


@figure(README, "kfac/damping.json")
def _damping_readme() -> list[str]:
    runs = _json("kfac/damping.json")

    def finals(mode: str) -> list[float]:
        return [run["accuracy"][-1] for run in runs if run["mode"] == mode]

    return [
        f"fixed damping 0.001 collapses to {max(finals('fixed 0.001')):.0%}",
        f"adapted from 0.001, {_percent_span(finals('LM from 0.001'), digits=0)}",
    ]


def _race_rows() -> list[tuple[str, float, float, float, float]]:
    """Per model, at 96% of SGD's best: SGD's median epochs, fixed- and adaptive-damping
    K-FAC's (inf: never)."""
    fixed, adaptive = _json("kfac/race.json"), _json("kfac/race-lm.json")
    rows = []
    for first, second in zip(fixed["summary"], adaptive["summary"], strict=True):
        assert (first["model"], first["target"]) == (second["model"], second["target"])
        if first["target_rule"] != "fixed":
            rows.append(
                (
                    first["model"],
                    first["target"],
                    _median_epochs(first["sgd"]["epochs_to_target"]),
                    _median_epochs(first["kfac"]["epochs_to_target"]),
                    _median_epochs(second["kfac"]["epochs_to_target"]),
                )
            )
    return rows


def _race_cell(sgd: float, kfac: float) -> str:
    return "never" if math.isinf(kfac) else f"{kfac:.0f} ({_x(sgd / kfac)})"


@figure(README, "kfac/race.json", "kfac/race-lm.json")
def _race_readme() -> list[str]:
    rows = _race_rows()
    met = sum(max(sgd / fixed, sgd / adaptive) >= 1.3 for _, _, sgd, fixed, adaptive in rows)
    cells = ", ".join(
        f"{model} {_race_cell(sgd, fixed)} / {_race_cell(sgd, adaptive)}"
        for model, _, sgd, fixed, adaptive in rows
    )
    sgd_epochs = [f"{sgd:.0f}" for _, _, sgd, _, _ in rows]
    return [
        f"fixed / adaptive damping: {cells} against SGD's "
        f"{', '.join(sgd_epochs[:-1])} and {sgd_epochs[-1]}",
        f"met on {NUMBER_WORDS[met]} model of {NUMBER_WORDS[len(rows)]}",
    ]


#: The large-batch race and the per-step costs its wall-clock column is priced with.
LARGE_RACE = ("kfac/race-large-batch.json", "kfac/h2h-resnet20-h200-10gbit-inv10.json")


def _large_race() -> tuple[dict[str, float], dict[str, float], float]:
    """Per model, SGD's median epochs over K-FAC's and SGD's median wall-clock over K-FAC's at a
    global batch of 1,024, and a K-FAC step's cost over an SGD step's."""
    race = _script("kfac_race")
    costs = race.load_step_costs(DOCS / LARGE_RACE[1])
    epochs, clock = {}, {}
    for entry in _json(LARGE_RACE[0])["summary"]:
        sgd, kfac = entry["sgd"], entry["kfac"]
        epochs[entry["model"]] = race.ratio(sgd["median_epochs"], kfac["median_epochs"])
        clock[entry["model"]] = race.ratio(
            race.wall_clock(sgd, costs.sgd_s)["median_s"],
            race.wall_clock(kfac, costs.kfac_s)["median_s"],
        )
    return epochs, clock, costs.kfac_over_sgd


def _large_race_says() -> list[str]:
    epochs, clock, step = _large_race()
    met = sum(ratio >= 1.3 for ratio in epochs.values())
    faster = sum(ratio > 1 for ratio in clock.values())
    slower = "slower on all three" if faster == 0 else f"faster on {NUMBER_WORDS[faster]}"
    return [
        f"K-FAC needs {_x(epochs['cnn1d'])} fewer epochs than SGD on cnn1d but "
        f"{_x(epochs['mlp1d'])} and {_x(epochs['resnet1d'])} on mlp1d and resnet1d",
        f"so the 1.3x epochs target is met on {NUMBER_WORDS[met]} model of "
        f"{NUMBER_WORDS[len(epochs)]}",
        f"a K-FAC step {_x(step)} an SGD step",
        f"SGD's wall-clock to the target over K-FAC's is {_x(clock['cnn1d'])}, "
        f"{_x(clock['mlp1d'])} and {_x(clock['resnet1d'])}: K-FAC {slower}",
    ]


@figure(README, *LARGE_RACE)
def _large_race_readme() -> list[str]:
    return _large_race_says()


@figure(FEATURES, *LARGE_RACE)
def _large_race_features() -> list[str]:
    return _large_race_says()


@figure(FEATURES, "kfac/convergence.json", "kfac/race-lm.json")
def _kfac_convergence_features() -> list[str]:
    runs = _json("kfac/convergence.json")

    def of(model: str, optimizer: str, key: str) -> list[Any]:
        return [r[key] for r in runs if (r["model"], r["optimizer"]) == (model, optimizer)]

    sgd = _median_epochs(of("resnet20", "sgd", "epochs_to_target"))
    kfac = _median_epochs(of("resnet20", "kfac", "epochs_to_target"))
    assert sgd < kfac, "SGD reaches the target first on resnet20"
    mlp = statistics.median(of("mlp", "kfac", "final_test_accuracy"))
    (target,) = {r["target"] for r in runs}
    assert mlp < target and all(e is None for e in of("mlp", "kfac", "epochs_to_target"))
    adaptive = {model: sgd / lm for model, _, sgd, _, lm in _race_rows()}
    met = sum(ratio >= 1.3 for ratio in adaptive.values())
    return [
        f"on digits SGD reaches {target:.0%} first on resnet20 (median {sgd:.0f} against "
        f"{kfac:.0f} epochs) and K-FAC leaves the mlp at {mlp:.2%} (median)",
        f"K-FAC needs {_x(adaptive['resnet1d'])} fewer epochs than SGD on resnet1d but "
        f"{_x(adaptive['mlp1d'])} and {_x(adaptive['cnn1d'])} on mlp1d and cnn1d",
        f"1.3x met on {NUMBER_WORDS[met]} model of {NUMBER_WORDS[len(adaptive)]}",
    ]


# -- pipelines -------------------------------------------------------------------------------------


def _pipeline_accuracy() -> tuple[float, float, int, int]:
    runs = _json("pipeline/convergence.json")

    def median(schedule: str) -> float:
        return 100 * statistics.median(
            r["final_test_accuracy"] for r in runs if r["schedule"] == schedule
        )

    (stages,) = {r["stages"] for r in runs}
    return median("spectrain"), median("gpipe"), stages, len({r["seed"] for r in runs})


def _spectrain(name: str, model: str) -> dict[str, Any]:
    (row,) = (r for r in _json(name) if (r["model"], r["schedule"]) == (model, "spectrain"))
    return row


@figure(README, "pipeline/convergence.json", "pipeline/bench.json")
def _pipeline_readme() -> list[str]:
    spectrain, gpipe, stages, seeds = _pipeline_accuracy()
    vgg = _spectrain("pipeline/bench.json", "vgg11")
    return [
        f"{spectrain:.2f}% median test accuracy against GPipe's {gpipe:.2f}% (resnet20, "
        f"{stages} stages, {seeds} seeds)",
        f"on vgg11 at 100 Mbit/s {_x(vgg['vs_torch_gpipe'])} torch's ScheduleGPipe, "
        f"{_x(vgg['vs_dp'])} DataParallel",
    ]


@figure(
    README, "pipeline/emulated-vgg11-h200-100gbit.json", "pipeline/emulated-vgg11-h200-10gbit.json"
)
def _pipeline_emulated_readme() -> list[str]:
    fast = _spectrain("pipeline/emulated-vgg11-h200-100gbit.json", "vgg11-h200")
    slow = _spectrain("pipeline/emulated-vgg11-h200-10gbit.json", "vgg11-h200")
    return [
        f"{_x(fast['vs_torch_gpipe'])} torch's ScheduleGPipe and {_x(fast['vs_dp'])} "
        f"DataParallel at 100 Gbit/s, {_x(slow['vs_torch_gpipe'])} and {_x(slow['vs_dp'])} at "
        "10 Gbit/s"
    ]


@figure(
    FEATURES,
    "pipeline/convergence.json",
    "pipeline/bench.json",
    "pipeline/emulated-vgg11-h200-100gbit.json",
    "pipeline/emulated-vgg11-h200-10gbit.json",
)
def _pipeline_features() -> list[str]:
    spectrain, gpipe, _, _ = _pipeline_accuracy()
    vgg = _spectrain("pipeline/bench.json", "vgg11")
    emulated = [
        _spectrain(f"pipeline/emulated-vgg11-h200-{link}.json", "vgg11-h200")["vs_torch_gpipe"]
        for link in ("10gbit", "100gbit")
    ]
    return [
        f"SpecTrain {spectrain:.2f}% median test accuracy on digits, {gpipe - spectrain:.2f} "
        "points below GPipe",
        f"{_x(vgg['vs_dp'])} DataParallel where it is communication-bound and "
        f"{_x(vgg['vs_torch_gpipe'])} torch's ScheduleGPipe on vgg11",
        f"{_span(emulated)} torch's ScheduleGPipe at 10 and 100 Gbit/s",
    ]


# -- one GPU ---------------------------------------------------------------------------------------


@figure(README, "gpu/paths.json")
def _gpu_readme() -> list[str]:
    paths = _json("gpu/paths.json")
    (resnet20,) = (row for row in paths["training"] if row["model"] == "resnet20")
    (eigh,) = (
        row for row in paths["decompositions"] if (row["method"], row["n"]) == ("eigen", 4096)
    )
    return [
        f"DataParallel {resnet20['dataparallel'] * 1e3:.2f} ms per step against DDP's "
        f"{resnet20['ddp'] * 1e3:.2f} ({_x(resnet20['ddp'] / resnet20['dataparallel'])})",
        f"`eigh` of a 4096 factor {eigh['gpu_s'] * 1e3:.2f} ms on the GPU against "
        f"{eigh['cpu_s'] * 1e3:.2f} on the CPU",
    ]


@figure(README, "gpu/kfac-h2h.json", "gpu/kfac-h2h-repeat.json")
def _gpu_kfac_readme() -> list[str]:
    runs = [_json("gpu/kfac-h2h.json"), _json("gpu/kfac-h2h-repeat.json")]
    steps = [row for run in runs for row in run["steps"]]
    ratios = [row["kfac-pytorch"] / row["interlace"] for row in steps]
    return [
        f"one H200, 1 rank, batch {runs[0]['batch']}: K-FAC {_span(ratios)} kfac-pytorch's step "
        f"({len(runs)} runs, {len({row['model'] for row in steps})} models x decompositions "
        f"every {' and '.join(str(inv) for inv in sorted({row['inv'] for row in steps}))} steps)",
    ]


#: Figures of the two pages with no JSON committed behind them, each with the page that holds its
#: measurement, which must state it too.
NO_JSON: list[tuple[Path, str, str]] = [
    (README, "1.09x / 1.04x at 4", "data-parallel.md"),  # the 4-rank emulated GoogLeNet runs
    (README, "best plan is 1.15x on ResNet-50 at 100 Gbit/s", "data-parallel.md"),
    (README, "1.04-1.10x at 100 Mbit/s", "launcher.md"),  # benchmarks/link_allreduce.py
    (README, "at 1 Gbit/s 1.07-1.11x from 1 MB up, 2.30x at 0.25 MB", "launcher.md"),
    (README, "paper about 1.2x and 1.36x", "data-parallel.md"),  # the paper's own figures
    (FEATURES, "(1.33x and 1.35x in two more runs)", "pipeline.md"),
    (FEATURES, "held-out perplexity 4.38 against the unigram 25.71", "training.md"),
    (FEATURES, "GPT-2 and BERT runs equal to the Trainer's and Accelerate's", "integrations.md"),
]

#: How each of those reads on its measurement's page, where that differs.
NO_JSON_SOURCE_TEXT = {
    "1.09x / 1.04x at 4": ("MG-WFBP 1.09x DDP and 1.04x the ideal bound",),
    "best plan is 1.15x on ResNet-50 at 100 Gbit/s": (
        "The simulator's best plan is 1.15x the bound on resnet50-h200 at 100 Gbit/s",
    ),
    "1.04-1.10x at 100 Mbit/s": ("| 100 Mbit/s |", "1.04", "1.10"),
    "at 1 Gbit/s 1.07-1.11x from 1 MB up, 2.30x at 0.25 MB": ("| 1 Gbit/s | 0.25 |", "2.30x"),
    "paper about 1.2x and 1.36x": ("paper about 1.2x", "paper about 1.36x"),
    "(1.33x and 1.35x in two more runs)": ("1.35x (blocks of 12", "1.33x (blocks of 24"),
    "held-out perplexity 4.38 against the unigram 25.71": ("**4.378**", "**25.706**"),
    "GPT-2 and BERT runs equal to the Trainer's and Accelerate's": (
        "Trainer, GPT-2 and BERT",
        "0 (bit for bit)",
    ),
}


@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: f"{f.name} ({f.says.__name__})")
def test_a_figure_with_a_json_behind_it_is_stated_as_the_json_says(figure: Figure) -> None:
    text = _flat(PAGES[figure.page]())
    missing = [fragment for fragment in figure.says() if _flat(fragment) not in text]
    assert not missing, f"{figure.page.name} should say, from {figure.sources}: {missing}"


@pytest.mark.parametrize("page, fragment, source", NO_JSON, ids=lambda v: str(v)[:40])
def test_a_figure_without_a_json_matches_the_page_it_comes_from(
    page: Path, fragment: str, source: str
) -> None:
    assert _flat(fragment) in _flat(PAGES[page]())
    source_text = _flat((DOCS / source).read_text())
    for piece in NO_JSON_SOURCE_TEXT.get(fragment, (fragment,)):
        assert _flat(piece) in source_text, f"{source} should say {piece!r}"


def _stated(page: Path) -> list[str]:
    """Every fragment this test checks on ``page``."""
    fragments = [f for figure in FIGURES if figure.page == page for f in figure.says()]
    return [_flat(f) for f in fragments] + [_flat(f) for p, f, _ in NO_JSON if p == page]


def test_every_headline_measurement_is_checked() -> None:
    stated = _stated(README)
    bullets = [_flat(b) for b in _headlines().split("\n- ")[1:]]
    assert bullets
    unchecked = [b[:60] for b in bullets if not any(f in b for f in stated)]
    assert not unchecked


def test_every_status_with_a_figure_is_checked() -> None:
    stated = _stated(FEATURES)
    rows = [line for line in FEATURES.read_text().splitlines() if line.startswith("| ")]
    with_figures = [_flat(row) for row in rows if any(c.isdigit() for c in row.split("|")[-2])]
    assert with_figures
    unchecked = [row[:60] for row in with_figures if not any(f in row for f in stated)]
    assert not unchecked


def test_the_json_a_figure_names_exists() -> None:
    named = {source for figure in FIGURES for source in figure.sources if "*" not in source}
    assert [name for name in sorted(named) if not (DOCS / name).is_file()] == []
