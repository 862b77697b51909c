"""benchmarks/kfac_race.py: its grids, target, pick, summary and resumption, on fake runs."""

from __future__ import annotations

import csv
import importlib.util
import io
import statistics
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from tqdm import tqdm

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kfac_race.py"


@pytest.fixture(scope="module")
def race() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kfac_race", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kfac_race"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _fake(optimizer: str, config: str, seed: int, accuracy: list[float]) -> dict[str, Any]:
    return {
        "model": "mlp1d",
        "optimizer": optimizer,
        "config": config,
        "seed": seed,
        "test_accuracy": accuracy,
        "epoch_s": [1.0 if optimizer == "sgd" else 2.0] * len(accuracy),
    }


def test_each_optimiser_gets_the_same_number_of_distinct_configurations(race: ModuleType) -> None:
    sgd = race.grid("cnn1d", "sgd", 25, 8)
    kfac = race.grid("cnn1d", "kfac", 25, 8)
    assert len(sgd) == len(kfac) == 8
    assert len({r.label for r in sgd}) == len({r.label for r in kfac}) == 8
    assert len({r.name for r in sgd + kfac}) == 16
    assert {r.momentum for r in kfac} == {0.9}
    assert race.grid("cnn1d", "kfac", 25, 3) == kfac[:3]
    config = kfac[0].config(25)
    assert (config.optimizer, config.data, config.batch_size, config.epochs) == (
        "kfac",
        "mnist1d",
        25,
        25,
    )
    assert config.kfac_damping == kfac[0].damping and config.kfac_kl_clip == kfac[0].kl_clip


def test_epochs_to_and_the_derived_target(race: ModuleType) -> None:
    assert race.epochs_to([0.1, 0.59, 0.6, 0.7], 0.6) == 3
    assert race.epochs_to([0.1, 0.59], 0.6) is None
    assert race.derived_target(0.769) == pytest.approx(0.73)  # 96% of it is 73.8%
    assert race.derived_target(0.9375) == pytest.approx(0.90)  # exactly 90.0%, kept
    assert race.derived_target(0.5, share=1.0) == pytest.approx(0.5)


def test_pick_prefers_fewest_epochs_then_shorter_time_then_best(race: ModuleType) -> None:
    late = _fake("sgd", "late", 0, [0.5, 0.55, 0.61, 0.9])
    early = _fake("sgd", "early", 0, [0.5, 0.61, 0.62, 0.63])
    assert race.pick([late, early], 0.6)["config"] == "early"
    slow = _fake("kfac", "slow", 0, [0.61, 0.7])
    fast = _fake("sgd", "fast", 0, [0.61, 0.65])  # same epochs, half the seconds per epoch
    assert race.pick([slow, fast], 0.6)["config"] == "fast"
    never_low = _fake("sgd", "low", 0, [0.3, 0.4])
    never_high = _fake("sgd", "high", 0, [0.3, 0.5])
    assert race.pick([never_low, never_high], 0.6)["config"] == "high"


def test_summary_medians_count_a_miss_as_never(race: ModuleType) -> None:
    runs = [
        _fake("kfac", "c", 0, [0.5, 0.6, 0.7]),
        _fake("kfac", "c", 1, [0.6, 0.7, 0.7]),
        _fake("kfac", "c", 2, [0.4, 0.5, 0.55]),
    ]
    row = race.summarise(runs, 0.6)
    assert row["epochs_to_target"] == [2, 1, None]
    assert row["median_epochs"] == 2  # sorted: 1, 2, never
    assert row["seconds_to_target"] == [4.0, 2.0, None]
    assert row["median_seconds"] == 4.0
    assert row["best_accuracy"] == [0.7, 0.7, 0.55]
    missed = race.summarise(runs[2:] * 2 + runs[:1], 0.6)
    assert missed["median_epochs"] is None
    assert race.ratio(6.0, 4.0) == 1.5
    assert race.ratio(None, 4.0) is None


def test_table_shows_the_epoch_ratio_and_the_spread(race: ModuleType) -> None:
    sgd = race.summarise([_fake("sgd", "s", k, [0.5] * k + [0.6]) for k in (5, 6, 8)], 0.6)
    kfac = race.summarise([_fake("kfac", "k", k, [0.5] * k + [0.6]) for k in (2, 3, 3)], 0.6)
    text = race.table([{"model": "mlp1d", "target": 0.6, "sgd": sgd, "kfac": kfac}])
    assert "| 7 [6-9] |" in text  # SGD reaches at epochs 6, 7, 9
    assert "| 4 [3-4] |" in text
    assert "1.75x" in text  # 7 / 4


def _write_metrics(run_dir: Path, accuracy: list[float]) -> None:
    run_dir.mkdir(parents=True)
    with (run_dir / "metrics.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["epoch", "train_loss", "test_loss", "test_accuracy", "epoch_s"])
        for epoch, acc in enumerate(accuracy, 1):
            writer.writerow([epoch, 1.0, 1.0, acc, 0.5])


def test_finished_runs_are_read_back_not_trained_again(
    race: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = race.grid("mlp1d", "sgd", 3, 2)
    _write_metrics(tmp_path / "mlp1d" / runs[0].name, [0.2, 0.4, 0.6])
    (tmp_path / "mlp1d" / runs[1].name).mkdir(parents=True)
    (tmp_path / "mlp1d" / runs[1].name / race.FAILED).write_text("rank 0 ended\n")

    def no_launch(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a finished run was launched again")

    monkeypatch.setattr(race.launch, "run", no_launch)
    with tqdm(total=6, file=io.StringIO()) as bar:
        records = race.execute(runs, tmp_path, nprocs=4, batch=25, link=None, bar=bar)
        assert bar.n == 6
    assert records[0]["test_accuracy"] == [0.2, 0.4, 0.6]
    assert records[0]["epoch_s"] == [0.5] * 3 and records[0]["failed"] is None
    assert records[1]["test_accuracy"] == [] and records[1]["failed"] == "rank 0 ended"
    assert race.pick(records, 0.6) is records[0]


def test_the_large_batch_grids_have_8_configurations_each_with_warm_up(race: ModuleType) -> None:
    sgd = race.grid("mlp1d", "sgd", 30, 8, large=True, train_samples=20_000)
    kfac = race.grid("mlp1d", "kfac", 30, 8, large=True, train_samples=20_000)
    assert len({r.label for r in sgd}) == len({r.label for r in kfac}) == 8
    assert len({r.name for r in sgd + kfac}) == 16
    assert {r.warmup for r in sgd} == {r.warmup for r in kfac} == {1.0, 3.0}
    assert "warm-up 3 ep" in sgd[0].label and sgd[0].name.endswith("-w3-n20000-e30-seed0")
    config = kfac[0].config(256)
    assert (config.warmup_epochs, config.synthetic_size, config.batch_size) == (3.0, 20_000, 256)
    small = race.grid("mlp1d", "sgd", 30, 8)
    assert not {r.name for r in small} & {r.name for r in sgd}  # batch-100 folders unchanged
    assert race.steps_per_epoch(20_000, 4, 256) == 19 and race.steps_per_epoch(None, 4, 25) == 40


def test_the_presets_change_defaults_and_explicit_flags_win(race: ModuleType) -> None:
    args = race.parse_args(["--large-batch", "--quick"])
    assert (args.batch_size, args.train_samples, args.targets, args.timing_rounds) == (
        256,
        20_000,
        "",
        0,
    )
    assert (args.models, args.configs, args.epochs, args.seeds) == ("mlp1d", 2, "3", "0,1")
    large = race.parse_args(["--large-batch", "--batch-size", "128"])
    assert (large.batch_size, large.configs, large.seeds) == (128, 8, "0,1,2")
    assert race.parse_args([]).batch_size == 25


def test_runs_in_the_json_are_not_trained_again_and_finished_ones_go_in(
    race: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = race.grid("mlp1d", "kfac", 3, 2, large=True, train_samples=20_000)
    _write_metrics(tmp_path / "out" / "mlp1d" / runs[0].name, [0.2, 0.4, 0.6])
    path = tmp_path / "race.json"
    trained: list[list[str]] = []

    def fake_launch(fn: Any, nprocs: int, *, args: Any, **kwargs: Any) -> Any:
        for _, run_dir in args[0]:  # train what is pending: write its metrics
            trained.append([Path(run_dir).name])
            _write_metrics(Path(run_dir), [0.5, 0.7, 0.8])
        return type("Result", (), {"ok": True})()

    monkeypatch.setattr(race.launch, "run", fake_launch)
    results = race.Results(path, {"grid": "large-batch"})
    with tqdm(total=6, file=io.StringIO()) as bar:
        records = race.execute(
            runs, tmp_path / "out", nprocs=4, batch=256, link=None, bar=bar, results=results
        )
    assert trained == [[runs[1].name]]  # the run on disk was read back, the other trained
    assert records[1]["test_accuracy"] == [0.5, 0.7, 0.8] and records[1]["steps_per_epoch"] == 19
    stored = race.json.loads(path.read_text())
    assert stored["grid"] == "large-batch" and len(stored["runs"]) == 2

    # A rerun with the run folders gone reads every run from the JSON: nothing is launched.
    monkeypatch.setattr(race.launch, "run", lambda *a, **k: pytest.fail("launched again"))
    again = race.Results(path, {"grid": "large-batch"})
    with tqdm(total=6, file=io.StringIO()) as bar:
        back = race.execute(
            runs, tmp_path / "gone", nprocs=4, batch=256, link=None, bar=bar, results=again
        )
    assert [r["test_accuracy"] for r in back] == [r["test_accuracy"] for r in records]
    assert race.Results(path, {}).get(runs[0], 4, 25) is None  # another batch: not the same run
    row = race.summarise(back, 0.6)
    assert row["steps_to_target"] == [57, 38] and row["median_steps"] == 47.5
    assert "| 2 of 2 |" in race.step_table(
        [{"model": "mlp1d", "target": 0.6, "sgd": row, "kfac": row}]
    )


def _bench_row(mode: str, inv_update_steps: int = 10) -> dict[str, Any]:
    """A row of `interlace bench kfac --ablation`'s JSON, with round numbers."""
    return {
        "mode": mode,
        "ranks": 4,
        "link": "10gbit",
        "batch": 32,
        "factor_update_steps": 1,
        "inv_update_steps": inv_update_steps,
        "compute": "emulated:resnet20-h200 D=16",
        "iteration_s": 0.015,
        "cycle_iteration_s": 0.02 if mode == "spd" else 0.03,
        "phases_s": {"forward_backward": 0.007, "gradient_comm": 0.0005, "optimizer": 0.0005},
    }


def test_wall_clock_to_target_is_steps_times_each_sides_step_cost(
    race: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert race.RACE_KFAC_MODE == "spd"  # the training job's K-FAC on the race's 4 ranks
    rows = [_bench_row("dkfac"), _bench_row("pipelined"), _bench_row("spd")]
    costs = race.step_costs(rows, "bench.json")
    # SGD: 7 + 0.5 + 0.5 ms; K-FAC: the spd row's whole-cycle iteration, 20 ms.
    assert costs.sgd_s == pytest.approx(0.008) and costs.kfac_s == pytest.approx(0.02)
    assert costs.kfac_over_sgd == pytest.approx(2.5)
    sgd = {"steps_to_target": [190, None, 228]}  # 1.52 s, never, 1.824 s
    kfac = {"steps_to_target": [95, 114, 133]}  # 1.90, 2.28, 2.66 s
    sgd_clock = race.wall_clock(sgd, costs.sgd_s)
    assert sgd_clock["seconds"][1] is None
    assert sgd_clock["median_s"] == pytest.approx(1.824)  # sorted: 1.52, 1.824, never
    assert race.wall_clock(kfac, costs.kfac_s)["median_s"] == pytest.approx(2.28)
    assert race.wall_clock({"steps_to_target": [None, None, 95]}, 0.02)["median_s"] is None

    summary = [
        {
            "model": "cnn1d",
            "target": 0.84,
            **{
                side: {
                    "config": side,
                    "epochs_to_target": [None if s is None else s // 19 for s in steps],
                    "median_epochs": statistics.median([s // 19 for s in steps if s]),
                    "steps_to_target": steps,
                    "best_accuracy": [0.9, 0.9, 0.9],
                }
                for side, steps in (
                    ("sgd", sgd["steps_to_target"]),
                    ("kfac", kfac["steps_to_target"]),
                )
            },
        }
    ]
    text = race.step_table(summary, costs)
    assert "| 8.00 | 1.82 [1.52-never] |" in text
    assert "| 20.00 | 2.28 [1.90-2.66] | 0.80x |" in text  # 1.824 / 2.28
    assert text.count("| - |") == 0 and "| - | - |" in race.step_table(summary)

    # The report reads the race's JSON and the bench's, trains nothing and rewrites neither.
    path, bench = tmp_path / "race.json", tmp_path / "bench.json"
    header = {"train_samples": 20_000, "nprocs": 4, "batch_size": 256, "global_batch": 1024}
    document = {**header, "link": "loopback", "seeds": [0, 1, 2], "grid": "large-batch"}
    path.write_text(race.json.dumps({**document, "summary": summary, "runs": []}))
    bench.write_text(race.json.dumps([_bench_row("spd")]))
    before = path.read_text()
    argv = ["--report", "--json", str(path), "--step-costs", str(bench)]
    assert race.main(argv) == 0
    printed = capsys.readouterr().out
    assert "SGD 8.00 ms, K-FAC 20.00 ms (2.50x)" in printed and "0.80x" in printed
    assert path.read_text() == before

    with pytest.raises(ValueError, match="decompositions every 1 steps"):
        race.step_costs([_bench_row("spd", inv_update_steps=1)], "inv1.json")
    with pytest.raises(ValueError, match="one row of mode 'spd'"):
        race.step_costs([_bench_row("dkfac")], "dkfac-only.json")
