"""``interlace bench pipeline`` rows priced as the bench ran them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from interlace.errors import UsageError
from interlace.sim.network import Link, Ring
from interlace.sim.pipeline import stage_costs
from interlace.sim.pipeline_bench import bench_rows, planner_choice, price_row, summary
from interlace.sim.trace import load_trace

DOCS = Path(__file__).resolve().parents[2] / "docs" / "pipeline"
RECORDED = ("emulated-vgg11-h200-10gbit-4x2.json", "emulated-vgg11-h200-10gbit-2x4.json")
PLAN = (
    "stage     blocks    n       cost (ms)   share\n"
    "    0          0    1           24.71   14.6%\n"
    "    1        1-7    7           42.78   25.2%\n"
    "    2       8-18   11           53.27   31.4%\n"
    "imbalance (max / mean stage cost): 1.256"
)


def _row(**regime: Any) -> dict[str, Any]:
    return {
        "model": "vgg11-h200",
        "schedule": "spectrain",
        "ranks": 6,
        "stages": 3,
        "batch": 48,
        "microbatches": 4,
        "block": 4,
        "samples_per_s": 1200.0,
        "regime": {"link_bps": 10e9, "plan": PLAN, **regime},
    }


def test_a_rows_stage_split_comes_from_its_bounds_or_else_its_plan() -> None:
    (old,) = bench_rows([_row()])
    assert old.bounds == ((0, 1), (1, 8), (8, 19))
    assert (old.replicas, old.configuration) == (2, "spectrain 3x2")
    assert old.measured_s == pytest.approx(48 / 1200)
    (new,) = bench_rows([_row(bounds=[[0, 5], [5, 11], [11, 19]])])
    assert new.bounds == ((0, 5), (5, 11), (11, 19))


def test_a_row_without_its_split_or_link_is_refused() -> None:
    with pytest.raises(UsageError, match="no stage split or link"):
        bench_rows([_row(plan="", link_bps=None)])


def test_the_recorded_replicated_rows_are_priced_and_the_planner_picks_the_fastest() -> None:
    trace = load_trace("vgg11-h200")
    rows = [row for name in RECORDED for row in bench_rows(json.loads((DOCS / name).read_text()))]
    priced = [price_row(trace, row) for row in rows]
    assert {p.row.configuration for p in priced} >= {"spectrain 4x2", "dp 8", "torch-gpipe 2x4"}
    for p in priced:
        assert p.predicted_s > 0 and p.planned_s > 0
        assert p.error == pytest.approx(p.predicted_s / p.row.measured_s - 1)
    chosen, fastest = planner_choice(priced)
    assert not chosen.row.schedule.startswith("torch")  # the planner offers interlace's
    assert fastest.row.measured_s / chosen.row.measured_s >= 0.95
    lines = summary(priced)
    assert lines[-2].startswith("error: median") and "within 5%" in lines[-1]


def test_measured_stage_compute_equal_to_the_traces_changes_nothing() -> None:
    trace = load_trace("vgg11-h200")
    (row,) = bench_rows([_row()])
    as_traced = price_row(trace, row)
    # The stages' own forward + backward + update per mini-batch, as if the launch had timed
    # exactly that: the measured-compute prediction is the traced one.
    costs = stage_costs(trace, row.bounds, row.batch // row.replicas)
    step = trace.step_s
    total = sum(t.nbytes for t in trace.tensors)
    shares = [
        sum(
            trace.tensors[i].nbytes for _, ix in list(reversed(trace.layers))[start:end] for i in ix
        )
        / total
        for start, end in row.bounds
    ]
    timed = tuple(
        c.forward_s + c.backward_s + step * share for c, share in zip(costs, shares, strict=True)
    )
    measured = price_row(trace, replace(row, stage_compute_s=timed), measured_compute=True)
    assert measured.predicted_s == pytest.approx(as_traced.predicted_s, rel=1e-9)
    assert measured.planned_s == pytest.approx(as_traced.planned_s, rel=1e-9)
    slower = price_row(
        trace, replace(row, stage_compute_s=tuple(2 * t for t in timed)), measured_compute=True
    )
    assert slower.predicted_s > as_traced.predicted_s
    with pytest.raises(UsageError, match="timed no stage"):
        price_row(trace, row, measured_compute=True)


def test_the_launchs_fitted_all_reduce_prices_the_stage_groups() -> None:
    trace = load_trace("vgg11-h200")
    ring = Ring(Link.from_rate(10e9)).cost(2)  # what the link's rate gives a group of 2
    (nominal,) = bench_rows([_row()])
    (fitted,) = bench_rows([_row(allreduce_costs={"spectrain": [[ring.a, ring.b]] * 6})])
    assert fitted.allreduce_cost == (ring.a, ring.b)
    same = price_row(trace, fitted)
    assert same.predicted_s == pytest.approx(price_row(trace, nominal).predicted_s, rel=1e-12)
    (slow,) = bench_rows([_row(allreduce_costs={"spectrain": [[ring.a, 2 * ring.b]] * 6})])
    assert price_row(trace, slow).predicted_s > same.predicted_s
    # torch's stages run on the same groups: they take the interlace stage's fit
    (torch_row,) = bench_rows(
        [
            {
                **_row(allreduce_costs={"spectrain": [[ring.a, 2 * ring.b]] * 6}),
                "schedule": "torch-gpipe",
            }
        ]
    )
    assert torch_row.allreduce_cost == (ring.a, 2 * ring.b)
