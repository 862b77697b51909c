"""The numbers one factor's all-reduce carries."""

from __future__ import annotations

import pytest

from interlace.kfac.sizes import factor_numel, packed_size


def test_a_diagonal_sends_its_n_values_and_a_dense_factor_its_triangle_or_all() -> None:
    assert factor_numel(5, diagonal=True) == 5
    assert factor_numel(5, diagonal=True, packed=False) == 5
    assert factor_numel(5) == packed_size(5) == 15
    assert factor_numel(5, packed=False) == 25


def test_a_negative_side_is_refused() -> None:
    for diagonal in (True, False):
        with pytest.raises(ValueError, match="must be >= 0"):
            factor_numel(-1, diagonal=diagonal)
