"""Cost models: the paper's ring formula, the tree formula, least-squares fits, OSU logs."""

from __future__ import annotations

import math

import pytest

from interlace.comm.cost import CostModel, fit_osu_log, read_osu_log, ring_allreduce_time
from interlace.sim.traces import data_path

#: The measured OSU logs shipped with the simulator.
TRACES = data_path("osu_allreduce_2workers_10gbe.log").parent


@pytest.mark.parametrize("workers", [2, 4, 16, 64])
def test_ring_matches_the_mgwfbp_formula(workers: int) -> None:
    alpha, beta, gamma = 5e-5, 8e-10, 1e-10
    model = CostModel.ring(workers, alpha, beta, gamma)
    n = workers
    assert model.a == pytest.approx(2 * (n - 1) * alpha)
    assert model.b == pytest.approx(2 * (n - 1) / n * beta + (n - 1) / n * gamma)


def test_tree_pays_log_start_ups_and_a_constant_per_byte() -> None:
    model = CostModel.double_binary_tree(64, alpha=1e-5, beta=1e-9, gamma=0.0)
    assert model.a == pytest.approx(2 * 6 * 1e-5)
    assert model.b == pytest.approx(2e-9)
    # At 1024 workers the ring's start-up is 2046 alpha against the tree's 20 alpha.
    assert (
        CostModel.ring(1024, 1e-5, 1e-9).a > 100 * CostModel.double_binary_tree(1024, 1e-5, 1e-9).a
    )


def test_ring_time_on_an_emulated_link() -> None:
    # 16 MB on 4 ranks at 1 Gbit/s: 2*3/4 * 16e6 * 8 / 1e9 = 0.192 s (the ring formula).
    assert ring_allreduce_time(16e6, 4, 1e9) == pytest.approx(0.192)
    assert ring_allreduce_time(16e6, 1, 1e9) == 0.0


def test_fit_recovers_a_known_line_through_noise() -> None:
    sizes = [2**k for k in range(10, 25)]
    truth = CostModel(a=3e-4, b=2e-9)
    noisy = [truth.time(m) * (1 + 0.01 * math.sin(i)) for i, m in enumerate(sizes)]
    fitted = CostModel.fit_points(sizes, noisy)
    assert fitted.a == pytest.approx(3e-4, rel=0.1)
    assert fitted.b == pytest.approx(2e-9, rel=0.02)


def test_slope_fit_keeps_the_measured_start_up() -> None:
    sizes = [1e5, 1e6, 4e6]
    truth = CostModel(a=1e-3, b=3e-9)
    fitted = CostModel.fit_slope(1e-3, sizes, [truth.time(m) for m in sizes])
    assert fitted.a == 1e-3
    assert fitted.b == pytest.approx(3e-9)
    # Faster than the start-up alone (a shaped link's burst): the slope floors at zero.
    assert CostModel.fit_slope(1.0, [10.0], [0.5]).b == 0.0


def test_fit_keeps_the_model_physical() -> None:
    # Times that fall with size (noise) must not give a negative b.
    fitted = CostModel.fit_points([1, 2, 3], [3.0, 2.0, 1.0])
    assert fitted.b == 0.0 and fitted.a == pytest.approx(2.0)
    with pytest.raises(ValueError, match="two"):
        CostModel.fit_points([1.0], [1.0])
    with pytest.raises(ValueError):
        CostModel(a=-1.0, b=0.0)


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_osu_logs_fit_the_alpha_beta_model(workers: int) -> None:
    path = TRACES / f"osu_allreduce_{workers}workers_10gbe.log"
    points = read_osu_log(path)[workers]
    assert len(points) > 100
    (model,) = fit_osu_log(path, min_bytes=65536).values()
    # 10 GbE moves a byte in 0.8 ns; a ring all-reduce costs 2(N-1)/N of that and more.
    assert 0.8e-9 < model.b < 5e-9
    assert 1e-5 < model.a < 2e-3
    # The fit is faithful where it was fitted: a median error under 8%, none over 25%.
    errors = sorted(
        abs(model.time(nbytes) - seconds) / seconds
        for nbytes, seconds in points
        if nbytes >= 256 * 1024
    )
    assert errors[len(errors) // 2] < 0.08
    assert errors[-1] < 0.25
