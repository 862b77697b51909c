"""K-FAC modes validated on emulated compute: cost conversion, predictions, rows, refusals, and
one small launch on the emulated cluster.

The prediction cases use two layers whose factors are 1 x 1 (a factor is one float32, 4
bytes), so that each message's time is read off the cost models.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from interlace.bench import harness
from interlace.bench.session import LaunchOptions
from interlace.bench.validate_kfac import (
    KfacMeasurement,
    LiveCosts,
    host_costs,
    kfac_validation_rows,
    live_costs,
    phase_pairs,
    predict_modes,
    rows_from_measurement,
)
from interlace.comm.cost import CostModel
from interlace.emulate import Compute, undilate_cost
from interlace.emulate.compute import ComputeKind
from interlace.errors import UsageError
from interlace.kfac.costs import DecompositionCostModel
from interlace.sim.kfac_costs import KfacCosts
from interlace.sim.trace import ActivationTrace, FactorTrace, TensorTrace, Trace, load_trace

MS = 1e-3
#: 1 ms per 4 bytes.
PER_BYTE = 0.25 * MS


def two_layers() -> Trace:
    """``l0`` and ``l1``: 2 ms forward, 4 ms backward, 4-byte gradients, 1 x 1 factors."""
    tensors = tuple(TensorTrace(f"l{i}.weight", f"l{i}", 1, 4, 2 * MS, 4 * MS) for i in (1, 0))
    return Trace(
        "two", tensors, 4 * MS, 8 * MS, 1 * MS, (FactorTrace("l0", 1, 1), FactorTrace("l1", 1, 1))
    )


def unit_costs() -> KfacCosts:
    """5 ms per decomposition, 0.5 ms to precondition a layer."""
    return KfacCosts(
        decomposition=DecompositionCostModel(c3=0.0, c2=0.0, c0=5 * MS),
        gemm_flops=1e30,
        precondition_overhead_s=0.5 * MS,
    )


def toy_trace(path: Path) -> Path:
    """A conv (2 -> 3 channels, 3x3, no bias) and an fc (8 -> 4, bias) with factor sizes, and a
    norm between them, saved to ``path``."""
    tensors = (
        TensorTrace("fc.weight", "fc", 32, 128, 1 * MS, 2 * MS),
        TensorTrace("fc.bias", "fc", 4, 16, 1 * MS, 2 * MS),
        TensorTrace("norm.weight", "norm", 3, 12, 1 * MS, 1 * MS),
        TensorTrace("norm.bias", "norm", 3, 12, 1 * MS, 1 * MS),
        TensorTrace("conv.weight", "conv", 54, 216, 2 * MS, 3 * MS),
    )
    trace = Trace(
        "toy",
        tensors,
        forward_s=4 * MS,
        backward_s=6 * MS,
        factors=(FactorTrace("conv", 18, 3), FactorTrace("fc", 9, 4)),
        activations=(
            ActivationTrace("conv", (3, 5, 5)),
            ActivationTrace("norm", (3, 5, 5)),
            ActivationTrace("fc", (4,)),
        ),
        batch_size=16,
    )
    return trace.save(path)


# ---------------------------------------------------------------------- pure conversions


def test_fitted_models_are_undilated_by_dividing_both_terms() -> None:
    fitted = CostModel(2e-3, 4e-9, concurrency=((1e-3, 1.5),))
    assert undilate_cost(fitted, 4.0) == CostModel(5e-4, 1e-9)
    value = {"costs": {"plan": (8e-3, 8e-9), "stream": (4e-3, 2e-9), "broadcast": (2e-3, 1e-9)}}
    assert live_costs(value, 2.0) == LiveCosts(
        plan=CostModel(4e-3, 4e-9),
        stream=CostModel(2e-3, 1e-9),
        broadcast=CostModel(1e-3, 0.5e-9),
    )


def test_a_mode_is_planned_by_the_fit_timed_by_the_stream_and_broadcast_as_measured() -> None:
    # dkfac: factors in the passes (forward 0..8, backward 8..20). The plan's a = 1 ms keeps
    # the gradients apart; the stream's a = 2 ms times them: 14..17 and 20..23, then the
    # agreement on which layers have factors (24 B) 23..31 and the bulk all-reduce of four
    # 4-byte factors 31..37. Greedy: 10 ms of decompositions on each rank, then two broadcasts
    # of 16 bytes at 0.5 ms per 4 bytes: 10 + 2 + 2. Preconditioning 1 ms, the step 1 ms:
    # 37 + 14 + 2 = 53 ms.
    live = LiveCosts(
        plan=CostModel(1 * MS, PER_BYTE),
        stream=CostModel(2 * MS, PER_BYTE),
        broadcast=CostModel(0.0, PER_BYTE / 2),
    )
    results = predict_modes(two_layers(), unit_costs(), ["dkfac"], live, 2)
    assert results["dkfac"].iteration_s == pytest.approx(53 * MS)
    assert results["dkfac"].phases["decomposition_comm"] == pytest.approx(4 * MS)
    # The run's own buckets: both gradients at once once l0's is ready, 20..24.
    measured = predict_modes(
        two_layers(),
        unit_costs(),
        ["dkfac"],
        live,
        2,
        gradient_buckets={"dkfac": [["l1.weight", "l0.weight"]]},
    )
    assert measured["dkfac"].iteration_s == pytest.approx(54 * MS)
    # A pipelined mode's kept factor buckets are priced as kept: here all four in one.
    kept = predict_modes(
        two_layers(),
        unit_costs(),
        ["pipelined"],
        live,
        2,
        factor_buckets={"pipelined": [["l0.A", "l1.A", "l1.G", "l0.G"]]},
    )
    assert kept["pipelined"].extra["factor_buckets"] == 1
    with pytest.raises(UsageError, match="unknown K-FAC mode 'kaisa'"):
        predict_modes(two_layers(), unit_costs(), ["kaisa"], live, 2)


def test_rows_compare_each_mode_with_its_measurement(tmp_path: Path) -> None:
    compute = Compute(ComputeKind.EMULATED, str(toy_trace(tmp_path / "toy.json")), 2.0)
    live = LiveCosts(CostModel(1e-4, 1e-9), CostModel(2e-4, 1e-9), CostModel(1e-4, 3e-9))
    medians = {
        mode: {
            "iteration": seconds,
            "kfac_passes": 0.02,
            "factor_comm": 1e-3,
            "decomposition": 2e-3,
            "decomposition_comm": 1e-3,
            "precondition": 1e-3,
            "optimizer": 0.0,
        }
        for mode, seconds in (("dkfac", 0.05), ("spd", 0.04))
    }
    measurement = KfacMeasurement(
        compute=compute,
        ranks=2,
        link="25gbit (emulated at 12.5gbit)",
        compute_method="eigen",
        modes=("dkfac", "spd"),
        live=live,
        medians=medians,
        placements={"dkfac": [[0, 0], [1, 1]], "spd": [[None, 0], [1, None]]},
        factor_buckets={"dkfac": None, "spd": 3},
        gradient_buckets={},
    )
    notes: list[str] = []
    rows = rows_from_measurement(measurement, notes.append)
    assert [(r.family, r.model, r.strategy, r.ranks) for r in rows] == [
        ("kfac", "toy", "dkfac", 2),
        ("kfac", "toy", "spd", 2),
    ]
    for row, measured in zip(rows, (0.05, 0.04), strict=True):
        assert row.link == "25gbit (emulated at 12.5gbit)"
        assert row.measured_s == measured
        assert math.isfinite(row.predicted_s) and row.predicted_s > 0.01  # passes alone: 10 ms
        assert row.error == pytest.approx((row.predicted_s - measured) / measured)
    assert [line.split(":")[0] for line in notes] == ["dkfac", "spd"]
    assert "factor buckets 1/-" in notes[0] and "owners" in notes[0]


def test_a_modes_host_work_is_priced_and_its_phases_line_up(tmp_path: Path) -> None:
    # Hooks: the K-FAC passes' host seconds beyond DataParallel's alone (3 - 1 ms); step():
    # 4 ms. The prediction grows by both (the toy's factors are computed in the passes).
    live = LiveCosts(CostModel(1e-4, 1e-9), CostModel(2e-4, 1e-9), CostModel(1e-4, 3e-9))
    measured = {
        "iteration": 0.05,
        "kfac_passes": 0.02,
        "factor_comm": 1e-3,
        "decomposition": 2e-3,
        "decomposition_comm": 1e-3,
        "precondition": 1e-3,
        "optimizer": 1e-3,
        "host_passes": 3e-3,
        "host_data_parallel": 1e-3,
        "host_step": 4e-3,
    }
    costs = host_costs(unit_costs(), measured)
    assert (costs.host_hooks_s, costs.host_step_s) == pytest.approx((2e-3, 4e-3))
    assert host_costs(unit_costs(), {"iteration": 0.05}) == unit_costs()
    plain = predict_modes(two_layers(), unit_costs(), ["dkfac"], live, 2)["dkfac"]
    hosted = predict_modes(
        two_layers(), unit_costs(), ["dkfac"], live, 2, mode_costs={"dkfac": costs}
    )["dkfac"]
    assert hosted.iteration_s == pytest.approx(plain.iteration_s + 6e-3)
    assert hosted.phases["host"] == pytest.approx(6e-3)
    pairs = {phase: (p, m) for phase, p, m in phase_pairs(hosted, measured)}
    # The passes predicted with the hooks' host work; step() measured as what is left.
    phases = hosted.breakdown
    assert pairs["passes"] == pytest.approx(
        (phases.forward_backward + phases.factor_compute + phases.gradient_comm + 2e-3, 0.02)
    )
    assert pairs["step()"][1] == pytest.approx(0.05 - 0.02 - 1e-3)
    assert pairs["step()"][0] + pairs["passes"][0] + pairs["optimizer"][0] == pytest.approx(
        hosted.iteration_s
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"compute": Compute(ComputeKind.REAL)}, "emulated compute"),
        ({"nprocs": 1}, "-n >= 2"),
        ({"modes": ("dkfac", "kaisa")}, "unknown K-FAC mode 'kaisa'"),
        ({"link": "fast"}, "fast"),
        ({"iters": 0}, "--iters"),
        ({"compute_method": "qr"}, "eigen or inverse"),
    ],
)
def test_bad_arguments_are_refused_in_one_line_before_any_launch(
    change: dict[str, object], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(harness, "launch_on_ranks", _no_launch)
    arguments: dict[str, object] = {
        "compute": Compute(ComputeKind.EMULATED, "resnet20-h200", 16.0),
        "nprocs": 4,
        "link": "25gbit",
        "modes": ("dkfac",),
        "compute_method": "eigen",
    }
    iters = change.pop("iters", 5)
    arguments.update(change)
    options = LaunchOptions(iters=iters)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=message) as refused:
        kfac_validation_rows(**arguments, options=options)  # type: ignore[arg-type]
    assert "\n" not in str(refused.value)


def test_a_trace_without_factor_sizes_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(harness, "launch_on_ranks", _no_launch)
    factored = load_trace(toy_trace(tmp_path / "toy.json"))
    bare = Trace("bare", factored.tensors, factored.forward_s, factored.backward_s)
    compute = Compute(ComputeKind.EMULATED, str(bare.save(tmp_path / "bare.json")), 2.0)
    with pytest.raises(UsageError, match="no layer with K-FAC factor sizes"):
        kfac_validation_rows(compute, 2, "1gbit")


def _no_launch(*args: object, **kwargs: object) -> None:
    raise AssertionError("bad arguments must be refused before any launch")


# ---------------------------------------------------------------------- on the emulated cluster


@pytest.mark.netns
def test_a_small_launch_gives_a_row_per_mode(tmp_path: Path) -> None:
    compute = Compute(ComputeKind.EMULATED, str(toy_trace(tmp_path / "toy.json")), 1.0)
    notes: list[str] = []
    rows = kfac_validation_rows(
        compute,
        2,
        "10gbit",
        ("dkfac", "spd"),
        options=LaunchOptions(iters=1, warmup=0, rounds=1, timeout_s=240, note=notes.append),
    )
    assert [row.strategy for row in rows] == ["dkfac", "spd"]
    for row in rows:
        assert row.family == "kfac" and row.link == "10gbit (emulated at 10gbit)"
        # No iteration is shorter than the toy's passes (10 ms); each prediction has them too.
        assert 0.01 <= row.measured_s < 1.0 and 0.01 <= row.predicted_s < 1.0
    assert any("owners" in line for line in notes)
