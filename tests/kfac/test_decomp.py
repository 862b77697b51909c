"""Decompositions and preconditioning formulas, each against a reference written here in float64."""

from __future__ import annotations

import math

import pytest
import torch

from interlace.kfac.decomp import (
    COMPUTE_METHODS,
    RETRIES,
    DecompositionError,
    FactorDecomposition,
    all_finite,
    decompose,
    empty_like_decomposition,
    kl_clip_scale,
    precondition,
)

DAMPING = 0.01


def _spd(n: int, seed: int, rank: int | None = None) -> torch.Tensor:
    """A symmetric positive semi-definite float64 matrix (rank ``rank``, full by default)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, rank or n, generator=generator, dtype=torch.float64)
    product = x @ x.T / n
    return (product + product.T) / 2


def _kronecker_reference(
    grad: torch.Tensor, a: torch.Tensor, g: torch.Tensor, damping: float
) -> torch.Tensor:
    """``(G (x) A + damping I)^-1 vec(V)`` with a dense Kronecker product: what ``eigen`` means.

    Row-major ``vec(G V A) = (G (x) A^T) vec(V)``; ``A`` is symmetric (or a diagonal vector).
    """
    a_matrix = torch.diag(a) if a.dim() == 1 else a
    fisher = torch.kron(g, a_matrix.T.contiguous())
    identity = torch.eye(fisher.shape[0], dtype=fisher.dtype)
    solved = torch.linalg.solve(fisher + damping * identity, grad.reshape(-1))
    return solved.reshape(grad.shape)


def test_eigen_reconstructs_the_factor_with_orthonormal_vectors() -> None:
    factor = _spd(9, seed=0)
    result = decompose(factor, "eigen", DAMPING, torch.float64)
    assert result.method.name == "eigen" and result.inverse is None
    assert result.values is not None and result.vectors is not None
    assert result.values.shape == (9,) and result.vectors.shape == (9, 9)
    q, d = result.vectors, result.values
    torch.testing.assert_close(q.T @ q, torch.eye(9, dtype=torch.float64))
    torch.testing.assert_close(q @ torch.diag(d) @ q.T, factor)
    # Damping is not folded in: it enters at preconditioning time.
    reference = torch.linalg.eigvalsh(factor)
    torch.testing.assert_close(d, reference.clamp(min=0.0))


def test_eigenvalues_of_a_singular_factor_are_clamped_at_zero() -> None:
    factor = _spd(12, seed=1, rank=3).to(torch.float32)  # nine eigenvalues are zero
    result = decompose(factor, "eigen", DAMPING, torch.float32)
    assert result.values is not None
    assert bool((result.values >= 0).all())
    top = torch.linalg.eigvalsh(factor.double())[-3:]
    torch.testing.assert_close(result.values[-3:].double(), top, rtol=1e-4, atol=1e-5)


def test_inverse_is_the_damped_inverse() -> None:
    factor = _spd(7, seed=2)
    result = decompose(factor, "inverse", DAMPING, torch.float64)
    assert result.method.name == "inverse" and result.values is None and result.vectors is None
    assert result.inverse is not None and result.inverse.shape == (7, 7)
    damped = factor + DAMPING * torch.eye(7, dtype=torch.float64)
    torch.testing.assert_close(result.inverse, torch.linalg.inv(damped))
    torch.testing.assert_close(result.inverse @ damped, torch.eye(7, dtype=torch.float64))
    torch.testing.assert_close(result.inverse, result.inverse.T)


@pytest.mark.parametrize("method", COMPUTE_METHODS)
@pytest.mark.parametrize(
    ("given", "wanted"), [(torch.float64, torch.float32), (torch.float32, torch.float64)]
)
def test_decompositions_are_computed_in_the_requested_dtype(
    method: str, given: torch.dtype, wanted: torch.dtype
) -> None:
    factor = _spd(6, seed=3).to(given)
    result = decompose(factor, method, DAMPING, wanted)
    assert all(t.dtype == wanted for t in result.tensors())
    reference = decompose(factor.to(wanted), method, DAMPING, wanted)
    for got, expected in zip(result.tensors(), reference.tensors(), strict=True):
        torch.testing.assert_close(got, expected)


def test_a_diagonal_factor_is_kept_as_its_diagonal() -> None:
    diagonal = torch.tensor([0.5, 0.0, 2.0, -1e-9], dtype=torch.float64)
    eigen = decompose(diagonal, "eigen", DAMPING, torch.float64)
    assert eigen.vectors is None and eigen.inverse is None and eigen.values is not None
    torch.testing.assert_close(
        eigen.values, torch.tensor([0.5, 0.0, 2.0, 0.0], dtype=torch.float64)
    )
    inverse = decompose(diagonal, "inverse", DAMPING, torch.float64)
    assert inverse.vectors is None and inverse.inverse is None and inverse.values is not None
    dense = torch.linalg.inv(torch.diag(diagonal) + DAMPING * torch.eye(4, dtype=torch.float64))
    torch.testing.assert_close(inverse.values, torch.diagonal(dense))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_factor_is_refused(bad: float) -> None:
    factor = _spd(4, seed=4)
    factor[1, 2] = factor[2, 1] = bad
    for method in COMPUTE_METHODS:
        with pytest.raises(DecompositionError, match="factor holds non-finite values"):
            decompose(factor, method, DAMPING, torch.float64)


def test_a_non_finite_factor_is_named_when_the_solver_raises_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    factor = _spd(4, seed=4)
    factor[0, 0] = float("nan")

    def refusing(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise torch.linalg.LinAlgError("the algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", refusing)
    with pytest.raises(DecompositionError, match="factor holds non-finite values"):
        decompose(factor, "eigen", DAMPING, torch.float64)


@pytest.mark.parametrize("method", COMPUTE_METHODS)
def test_decomposing_leaves_the_factor_unchanged(method: str) -> None:
    factor = _spd(6, seed=6)
    before = factor.clone()
    decompose(factor, method, DAMPING, torch.float64)
    assert torch.equal(factor, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_all_finite_flags_each_tensor_holding_a_nan_or_an_infinity(dtype: torch.dtype) -> None:
    largest = torch.finfo(dtype).max
    tensors = [torch.ones(3, 4, dtype=dtype) for _ in range(6)]
    tensors[1][2, 3] = float("nan")
    tensors[2][0, 0] = float("inf")
    tensors[3][1, 1] = -float("inf")
    tensors[4].fill_(largest)  # finite, however large
    tensors[5] = torch.full((5,), -largest, dtype=dtype)
    expected = [bool(torch.isfinite(t).all()) for t in tensors]  # the reference: element by element
    assert all_finite(tensors) == expected == [True, False, False, False, True, True]
    assert all_finite([]) == []


def test_a_failing_solver_is_retried_with_ten_times_more_damping_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    factor = _spd(5, seed=5)
    real_eigh = torch.linalg.eigh
    seen: list[torch.Tensor] = []

    def flaky(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(matrix.clone())
        if len(seen) < 3:
            raise torch.linalg.LinAlgError("the algorithm failed to converge")
        values, vectors = real_eigh(matrix)
        return values, vectors

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    result = decompose(factor, "eigen", DAMPING, torch.float64)
    identity = torch.eye(5, dtype=torch.float64)
    # Tries with no extra diagonal, then damping * 10, then damping * 100.
    for attempt, shift in zip(seen, [0.0, DAMPING * 10, DAMPING * 100], strict=True):
        torch.testing.assert_close(attempt, factor + shift * identity)
    assert result.values is not None
    torch.testing.assert_close(
        result.values, torch.linalg.eigvalsh(factor + DAMPING * 100 * identity)
    )

    def broken(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise torch.linalg.LinAlgError("the algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    with pytest.raises(DecompositionError, match="eigen decomposition failed"):
        decompose(factor, "eigen", DAMPING, torch.float64)
    assert RETRIES == 3


@pytest.mark.parametrize("diagonal_a", [False, True])
def test_eigen_preconditioning_solves_the_damped_kronecker_system(diagonal_a: bool) -> None:
    a = torch.rand(4, dtype=torch.float64) if diagonal_a else _spd(4, seed=6)
    g = _spd(3, seed=7)
    grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    result = precondition(
        grad,
        decompose(a, "eigen", DAMPING, torch.float64),
        decompose(g, "eigen", DAMPING, torch.float64),
        DAMPING,
    )
    assert result.shape == grad.shape and result.dtype == grad.dtype
    torch.testing.assert_close(result, _kronecker_reference(grad, a, g, DAMPING))


@pytest.mark.parametrize("diagonal_a", [False, True])
def test_inverse_preconditioning_is_both_damped_inverses(diagonal_a: bool) -> None:
    a = torch.rand(4, dtype=torch.float64) if diagonal_a else _spd(4, seed=9)
    g = _spd(3, seed=10)
    grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    result = precondition(
        grad,
        decompose(a, "inverse", DAMPING, torch.float64),
        decompose(g, "inverse", DAMPING, torch.float64),
        DAMPING,
    )
    a_matrix = torch.diag(a) if diagonal_a else a
    expected = (
        torch.linalg.inv(g + DAMPING * torch.eye(3, dtype=torch.float64))
        @ grad
        @ torch.linalg.inv(a_matrix + DAMPING * torch.eye(4, dtype=torch.float64))
    )
    torch.testing.assert_close(result, expected)


@pytest.mark.parametrize("method", COMPUTE_METHODS)
def test_preconditioning_returns_the_gradient_s_dtype(method: str) -> None:
    a, g = _spd(4, seed=12), _spd(3, seed=13)
    grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(14))
    a_decomp = decompose(a, method, DAMPING, torch.float64)
    g_decomp = decompose(g, method, DAMPING, torch.float64)
    result = precondition(grad, a_decomp, g_decomp, DAMPING)
    assert result.dtype == torch.float32
    expected = precondition(grad.double(), a_decomp, g_decomp, DAMPING).float()
    torch.testing.assert_close(result, expected)


def test_kl_clip_scale_is_kfac_pytorch_s_formula() -> None:
    assert kl_clip_scale(5.0, None, 0.1) == 1.0
    # sqrt(kl_clip / |lr^2 * products|) when below one.
    assert kl_clip_scale(4.0, 1e-3, 0.1) == pytest.approx(math.sqrt(1e-3 / (0.01 * 4.0)))
    assert kl_clip_scale(-4.0, 1e-3, 0.1) == pytest.approx(math.sqrt(1e-3 / (0.01 * 4.0)))
    assert kl_clip_scale(1e-6, 1e-3, 0.1) == 1.0  # never scales up
    assert kl_clip_scale(0.0, 1e-3, 0.1) == 1.0
    # An overflowing sum clips to zero (kfac-pytorch's formula gives 0), never lets it through.
    assert kl_clip_scale(float("inf"), 1e-3, 0.1) == 0.0
    assert kl_clip_scale(float("nan"), 1e-3, 0.1) == 0.0
    assert kl_clip_scale(1e308, 1e-3, 10.0) == 0.0


@pytest.mark.parametrize("method", COMPUTE_METHODS)
@pytest.mark.parametrize("diagonal", [False, True])
def test_a_decomposition_travels_flat_into_an_empty_one(method: str, diagonal: bool) -> None:
    factor = torch.rand(5, dtype=torch.float64) if diagonal else _spd(5, seed=15)
    sent = decompose(factor, method, DAMPING, torch.float64)
    received = empty_like_decomposition(method, 5, diagonal, torch.float64, torch.device("cpu"))
    assert received.method.name == method
    assert [t.shape for t in received.tensors()] == [t.shape for t in sent.tensors()]
    flat = sent.flatten()
    assert flat.dim() == 1 and flat.numel() == sum(t.numel() for t in sent.tensors())
    received.load_flat(flat.clone())
    for got, expected in zip(received.tensors(), sent.tensors(), strict=True):
        assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="expected"):
        received.load_flat(flat[:-1])


def test_tensors_travel_in_a_fixed_order_and_replace_keeps_it() -> None:
    vectors, values = torch.eye(2), torch.tensor([1.0, 2.0])
    decomposition = FactorDecomposition("eigen", values=values, vectors=vectors)
    assert decomposition.tensors() == [vectors, values]
    new_vectors, new_values = torch.zeros(2, 2), torch.ones(2)
    decomposition.replace([new_vectors, new_values])
    assert decomposition.vectors is new_vectors and decomposition.values is new_values
