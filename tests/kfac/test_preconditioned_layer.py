"""``KFACLayer``: one layer's factors, running averages, decompositions and state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from interlace.kfac.module_helpers import LinearHelper
from interlace.kfac.preconditioned_layer import KFACLayer


def _layer(method: str = "eigen") -> KFACLayer:
    torch.manual_seed(0)
    linear = nn.Linear(3, 2)
    return KFACLayer("fc", LinearHelper(linear), method, torch.float64)


def test_factors_are_summed_per_step_and_averaged_from_the_identity() -> None:
    layer = _layer()
    inputs = [torch.randn(4, 3), torch.randn(4, 3)]
    for batch in inputs:
        layer.add_input(batch, torch.float64)
    assert layer.a_count == 2
    rows = [torch.cat([x.double(), torch.ones(4, 1, dtype=torch.float64)], dim=1) for x in inputs]
    moments = [r.T @ r / 4 for r in rows]
    mean_a = (moments[0] + moments[1]) / 2
    grad = torch.randn(4, 2, dtype=torch.float64)
    # Two ranks: each rank's output gradient is twice a single process's, G is quadratic.
    layer.add_grad_output(grad, None, world_size=2, per_example=False)
    a, g = layer.batch_factors()
    torch.testing.assert_close(a, mean_a)
    torch.testing.assert_close(g, grad.T @ grad / 4 / 4)
    layer.update_factors(a, g, decay=0.75)
    torch.testing.assert_close(layer.a_factor, 0.75 * torch.eye(4, dtype=torch.float64) + 0.25 * a)
    torch.testing.assert_close(layer.g_factor, 0.75 * torch.eye(2, dtype=torch.float64) + 0.25 * g)
    layer.reset_batch()
    assert layer.a_sum is None and layer.g_count == 0


def test_per_example_g_scales_by_the_squared_global_batch() -> None:
    layer = _layer()
    grad = torch.randn(4, 2, dtype=torch.float64)
    g = layer.add_grad_output(grad, None, world_size=2, per_example=True)
    torch.testing.assert_close(g, grad.T @ grad / 4 / 4 * (4 * 2) ** 2)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_state_round_trips_and_preconditions_the_same(method: str) -> None:
    layer = _layer(method)
    a = torch.eye(4, dtype=torch.float64) * 2
    g = torch.eye(2, dtype=torch.float64) * 3
    layer.update_factors(a, g, decay=0.0)
    assert layer.decompose("A", 0.1) is None and layer.decompose("G", 0.1) is None
    grad = torch.ones(2, 4, dtype=torch.float64)
    # Both factors are multiples of the identity, so the answer is known in closed form.
    expected = grad / (2 * 3 + 0.1) if method == "eigen" else grad / ((2 + 0.1) * (3 + 0.1))
    torch.testing.assert_close(layer.precondition(grad, 0.1), expected)
    restored = _layer(method)
    restored.load_state_dict(layer.state_dict(), torch.device("cpu"))
    assert restored.decomposed
    torch.testing.assert_close(restored.precondition(grad, 0.1), expected)


def test_a_failed_decomposition_falls_back_to_the_diagonal(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer()
    factor = torch.tensor([[2.0, 0.5], [0.5, 3.0]], dtype=torch.float64)
    layer.update_factors(torch.eye(4, dtype=torch.float64), factor, decay=0.0)

    def broken(*args: object, **kwargs: object) -> object:
        raise torch.linalg.LinAlgError("the algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    failure = layer.decompose("G", 0.1)
    assert failure is not None and "uses the factor's diagonal" in failure
    fallback = layer.decomposition("G")
    assert fallback.vectors is not None and fallback.values is not None
    torch.testing.assert_close(fallback.vectors, torch.eye(2, dtype=torch.float64))
    torch.testing.assert_close(fallback.values, torch.tensor([2.0, 3.0], dtype=torch.float64))
