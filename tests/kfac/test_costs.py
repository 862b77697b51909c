"""Measured cost models for SPD-KFAC's placement: decomposition fits and broadcast pricing."""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from interlace.comm.cost import CostModel
from interlace.kfac import costs
from interlace.kfac.costs import (
    BroadcastCostModel,
    DecompositionCostModel,
    broadcast_time,
    decomposition_numel,
    log_log_interpolate,
)

SIZES = (16, 32, 64, 128, 256, 512, 1024)


def test_time_is_the_cubic_and_zero_for_nothing_to_decompose() -> None:
    model = DecompositionCostModel(c3=2e-11, c2=3e-9, c0=5e-5)
    assert model.time(100) == pytest.approx(5e-5 + 3e-9 * 1e4 + 2e-11 * 1e6)
    assert model.time(100, diagonal=True) == 0.0
    assert model.time(0) == 0.0
    with pytest.raises(ValueError, match="c2 must be finite and >= 0"):
        DecompositionCostModel(c3=1.0, c2=-1.0, c0=0.0)
    with pytest.raises(ValueError, match="c0"):
        DecompositionCostModel(c3=1.0, c2=0.0, c0=float("nan"))


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0.0, 1e-9),
    st.floats(0.0, 1e-6),
    st.floats(0.0, 1e-3),
    st.integers(0, 5000),
    st.integers(0, 5000),
)
def test_time_never_decreases_with_size(c3: float, c2: float, c0: float, m: int, n: int) -> None:
    model = DecompositionCostModel(c3, c2, c0)
    small, large = sorted((m, n))
    assert 0.0 <= model.time(small) <= model.time(large)


@pytest.mark.parametrize(
    "c3, c2, c0",
    [(2e-11, 3e-9, 5e-5), (1e-10, 0.0, 2e-4), (0.0, 4e-8, 1e-5), (3e-11, 1e-9, 0.0)],
)
def test_fit_recovers_known_coefficients(c3: float, c2: float, c0: float) -> None:
    truth = DecompositionCostModel(c3, c2, c0)
    fitted = DecompositionCostModel.fit([(n, truth.time(n)) for n in SIZES])
    for got, want in ((fitted.c3, c3), (fitted.c2, c2), (fitted.c0, c0)):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-15)


def test_fit_keeps_coefficients_non_negative_and_is_the_nnls_optimum() -> None:
    # Times that fall with n^2 (noise on a flat curve) would give lstsq a negative c2.
    samples = [(n, 1e-3 + 1e-11 * n**3 - 1e-9 * n**2) for n in SIZES]
    fitted = DecompositionCostModel.fit(samples)
    coefficients = np.array([fitted.c3, fitted.c2, fitted.c0])
    assert np.all(coefficients >= 0)
    assert fitted.c2 == 0.0
    # Karush-Kuhn-Tucker conditions of the relative least squares the fit solves: the gradient
    # vanishes on the free coefficients and points into the feasible side on the clamped ones.
    n = np.array([s for s, _ in samples], dtype=np.float64)
    t = np.array([s for _, s in samples])
    design = np.stack([n**3, n**2, np.ones_like(n)], axis=1) / t[:, None]
    scale = np.linalg.norm(design, axis=0)
    gradient = (design / scale).T @ (design @ coefficients - 1.0)
    free = coefficients > 0
    assert np.all(np.abs(gradient[free]) < 1e-9)
    assert np.all(gradient[~free] > -1e-9)


def test_fit_needs_three_sizes_and_sane_times() -> None:
    with pytest.raises(ValueError, match="three distinct sizes"):
        DecompositionCostModel.fit([(32, 1e-4), (32, 1e-4), (64, 2e-4)])
    with pytest.raises(ValueError, match="samples"):
        DecompositionCostModel.fit([])
    with pytest.raises(ValueError, match="times >= 0"):
        DecompositionCostModel.fit([(32, -1.0), (64, 1.0), (128, 2.0)])
    with pytest.raises(ValueError, match="finite"):
        DecompositionCostModel.fit([(32, float("inf")), (64, 1.0), (128, 2.0)])


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Time single-threaded: on a shared CI box, an oversubscribed LAPACK thread pool makes
    single timings swing by 10-100x, which no median of three can hide."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_measure_predicts_a_fresh_timing_within_a_factor_of_three() -> None:
    model = DecompositionCostModel.measure("eigen", "cpu", sizes=(32, 64, 128, 256), repeats=3)
    generator = torch.Generator().manual_seed(1)
    matrices = [costs.random_spd(256, torch.float32, torch.device("cpu"), generator)] * 4
    fresh = statistics.median(costs.time_decomposition("eigen", m) for m in matrices)
    assert fresh / 3 <= model.time(256) <= fresh * 3
    assert model.time(32) < model.time(256)


@pytest.mark.usefixtures("one_thread")
def test_measure_times_the_inverse_too_and_refuses_unknown_methods() -> None:
    model = DecompositionCostModel.measure("inverse", "cpu", sizes=(16, 32, 64), repeats=1)
    assert model.time(64) > 0.0
    with pytest.raises(ValueError, match="method"):
        DecompositionCostModel.measure("cholesky", "cpu")
    with pytest.raises(ValueError, match="repeats"):
        DecompositionCostModel.measure("eigen", "cpu", repeats=0)


def test_broadcasts_are_priced_by_the_all_reduce_cost_model() -> None:
    assert BroadcastCostModel is CostModel
    assert decomposition_numel("eigen", 10) == 110  # eigenvectors and eigenvalues
    assert decomposition_numel("inverse", 10) == 100
    assert decomposition_numel("eigen", 10, diagonal=True) == 10
    with pytest.raises(ValueError, match="method"):
        decomposition_numel("svd", 10)
    model = CostModel(a=1e-4, b=1e-9)
    assert broadcast_time(model, "eigen", 10) == pytest.approx(1e-4 + 1e-9 * 440)
    assert broadcast_time(model, "inverse", 10, element_size=8) == pytest.approx(1e-4 + 8e-7)


def test_log_log_interpolation_and_its_end_segments() -> None:
    points = ((10, 1.0), (100, 100.0))
    # Slope 2 in log-log: t = (n / 10)^2 between the points, and on past 100 and below 10.
    assert log_log_interpolate(points, 10) == pytest.approx(1.0)
    assert log_log_interpolate(points, 32) == pytest.approx((32 / 10) ** 2)
    assert log_log_interpolate(points, 1000) == pytest.approx(10_000.0)
    assert log_log_interpolate(points, 5) == pytest.approx(0.25)


def test_a_fit_keeps_its_points_and_prices_through_them() -> None:
    # A solver that is latency-bound at small sizes (as on a GPU): 1 ms at 64, 5 ms at 256,
    # 10 ms at 1024. No cubic with non-negative coefficients passes near all three.
    samples = [(64, 1e-3), (64, 1.2e-3), (64, 0.8e-3), (256, 5e-3), (1024, 10e-3)]
    fitted = DecompositionCostModel.fit(samples)
    assert fitted.points == ((64, 1e-3), (256, 5e-3), (1024, 10e-3))  # medians per size
    assert fitted.time(256) == pytest.approx(5e-3)
    # Between and beyond the points, along the log-log segments.
    assert fitted.time(128) == pytest.approx(1e-3 * 5**0.5)
    assert fitted.time(16) == pytest.approx(1e-3 / 5)
    cubic = DecompositionCostModel(fitted.c3, fitted.c2, fitted.c0)
    # The cubic alone prices a 16 x 16 factor about as dear as a 64 x 64 one.
    assert cubic.time(16) > 3 * fitted.time(16)
    assert fitted.time(64, diagonal=True) == 0.0 and fitted.time(0) == 0.0


def test_fitted_points_never_fall_with_size_and_zero_times_keep_the_cubic() -> None:
    # Noise inverting two close sizes: the larger keeps the smaller's time.
    fitted = DecompositionCostModel.fit([(32, 2e-4), (64, 1.5e-4), (128, 8e-4)])
    assert fitted.points == ((32, 2e-4), (64, 2e-4), (128, 8e-4))
    below_resolution = DecompositionCostModel.fit([(32, 0.0), (64, 1e-4), (128, 8e-4)])
    assert below_resolution.points == ()
    assert below_resolution.time(64) == pytest.approx(
        below_resolution.c0 + below_resolution.c2 * 64**2 + below_resolution.c3 * 64**3
    )


@pytest.mark.parametrize(
    ("points", "message"),
    [
        (((64, 1e-3),), "points need >= 2 sizes"),
        (((64, 1e-3), (32, 2e-3)), "increasing"),
        (((32, 2e-3), (64, 1e-3)), "non-decreasing"),
        (((32, 0.0), (64, 1e-3)), "finite times > 0"),
    ],
)
def test_bad_points_are_refused(points: tuple[tuple[int, float], ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecompositionCostModel(0.0, 0.0, 1e-4, points=points)
