"""Decomposition methods as objects: what each sends and costs, and how an option names one."""

from __future__ import annotations

import enum

import pytest
import torch

from interlace.errors import OptionError
from interlace.kfac.decomp import FactorDecomposition
from interlace.kfac.enums import ComputeMethod
from interlace.kfac.methods import EIGEN, INVERSE, DecompositionMethod, Eigen, Inverse, method_from


def _their_eigen() -> enum.Enum:
    class ComputeMethod(enum.Enum):  # kfac-pytorch's enum, as its own module defines it
        EIGEN = 1
        INVERSE = 2

    return ComputeMethod.EIGEN


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("eigen", EIGEN),
        ("INVERSE", INVERSE),
        (ComputeMethod.INVERSE, INVERSE),
        (_their_eigen(), EIGEN),
        (Inverse(), INVERSE),
    ],
)
def test_an_option_names_a_method_by_enum_string_or_object(
    value: object, expected: DecompositionMethod
) -> None:
    assert method_from(value) == expected


def test_a_method_object_is_taken_as_it_is() -> None:
    mine = Eigen()
    assert method_from(mine) is mine
    assert isinstance(mine, DecompositionMethod) and not isinstance("eigen", DecompositionMethod)


def test_an_unknown_method_is_one_error_naming_the_option() -> None:
    with pytest.raises(
        OptionError, match="compute_method must be one of 'eigen', 'inverse'"
    ) as bad:
        method_from("cholesky")
    assert bad.value.option == "compute_method"


def test_what_a_decomposition_sends_and_what_preconditioning_costs() -> None:
    # Eigenvectors and eigenvalues, or the inverse; a diagonal factor sends its n values.
    assert (EIGEN.numel(10), INVERSE.numel(10)) == (110, 100)
    assert (EIGEN.numel(10, diagonal=True), INVERSE.numel(10, diagonal=True)) == (10, 10)
    assert (EIGEN.precondition_products, INVERSE.precondition_products) == (4, 2)


@pytest.mark.parametrize("method", [EIGEN, INVERSE])
@pytest.mark.parametrize("diagonal", [False, True])
def test_a_decomposition_holds_as_many_numbers_as_it_sends(
    method: DecompositionMethod, diagonal: bool
) -> None:
    buffers = method.empty(6, diagonal, torch.float64, torch.device("cpu"))
    assert sum(t.numel() for t in buffers.tensors()) == method.numel(6, diagonal)
    assert buffers.method is method


@pytest.mark.parametrize("method", [EIGEN, INVERSE])
def test_a_decomposition_from_a_diagonal_preconditions_as_that_diagonal(
    method: DecompositionMethod,
) -> None:
    # A = I and G = diag(2, 4), damping 0: the gradient is divided row by row by G's diagonal.
    def dense(diagonal: list[float]) -> FactorDecomposition:
        values = method.decompose_diagonal(torch.tensor(diagonal, dtype=torch.float64), 0.0).values
        assert values is not None
        return method.dense_from_diagonal(values)

    grad = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    expected = grad / torch.tensor([[2.0], [4.0]], dtype=torch.float64)
    torch.testing.assert_close(
        method.precondition(grad, dense([1.0, 1.0, 1.0]), dense([2.0, 4.0]), 0.0), expected
    )
