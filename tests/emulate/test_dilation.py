"""Time dilation: checked factors, dilated link rates, undilated times."""

from __future__ import annotations

import math

import pytest

from interlace.comm.cost import CostModel
from interlace.emulate import DEFAULT_DILATION, check_dilation, dilate_rate, undilate, undilate_cost
from interlace.errors import UsageError


def test_the_default_dilation_is_four() -> None:
    assert DEFAULT_DILATION == 4.0


def test_a_link_is_dilated_and_a_time_undilated_by_the_factor() -> None:
    assert dilate_rate("10gbit", 4) == pytest.approx(2.5e9)
    assert dilate_rate(4.63e9, 2.0) == pytest.approx(2.315e9)
    assert undilate(1.2, 4) == pytest.approx(0.3)
    assert undilate(0.8, 8) == pytest.approx(0.1)


def test_a_cost_fitted_on_the_dilated_cluster_is_undilated_in_both_terms() -> None:
    # At D = 4 a start-up measured as 2 ms is 0.5 ms, a byte measured at 4 ns is 1 ns.
    cost = undilate_cost(CostModel(2e-3, 4e-9), 4.0)
    assert (cost.a, cost.b) == (pytest.approx(5e-4), pytest.approx(1e-9))


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "fast"])
def test_a_dilation_that_is_not_a_finite_positive_number_is_one_line(bad: object) -> None:
    with pytest.raises(UsageError, match="dilation must be") as caught:
        check_dilation(bad)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)
    with pytest.raises(UsageError, match="dilation"):
        undilate(1.0, bad)  # type: ignore[arg-type]


def test_a_bad_rate_is_a_usage_error() -> None:
    with pytest.raises(UsageError):
        dilate_rate(0.0, 4)
    with pytest.raises(UsageError):
        dilate_rate("warp9", 4)
