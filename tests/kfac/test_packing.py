"""Symmetric (upper-triangle) packing of K-FAC factors: exact, and about half the bytes."""

from __future__ import annotations

import pytest
import torch

from interlace.kfac import packing
from interlace.kfac.packing import pack_upper, packed_size, unpack_upper


def _symmetric(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n, generator=generator, dtype=torch.float64)
    # Symmetrised: a BLAS may round x @ x.T's two triangles differently.
    product = x @ x.T / n
    return ((product + product.T) / 2).to(dtype)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (tells -0.0 from 0.0, unlike ==)."""
    as_int = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return a.shape == b.shape and torch.equal(a.view(as_int[a.dtype]), b.view(as_int[b.dtype]))


def test_packed_size_is_the_upper_triangle() -> None:
    assert [packed_size(n) for n in range(5)] == [0, 1, 3, 6, 10]
    with pytest.raises(ValueError, match=">= 0"):
        packed_size(-1)


def test_pack_reads_the_upper_triangle_row_by_row() -> None:
    matrix = torch.tensor([[1.0, 2.0, 3.0], [9.0, 4.0, 5.0], [9.0, 9.0, 6.0]])
    assert pack_upper(matrix).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert unpack_upper(torch.arange(1.0, 7.0), 3).tolist() == [
        [1.0, 2.0, 3.0],
        [2.0, 4.0, 5.0],
        [3.0, 5.0, 6.0],
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2, 7, 64, 129])
def test_round_trip_is_bitwise_exact_for_symmetric_matrices(n: int, dtype: torch.dtype) -> None:
    matrix = _symmetric(n, dtype)
    matrix[0, n - 1] = matrix[n - 1, 0] = -0.0  # a signed zero must survive too
    packed = pack_upper(matrix)
    assert packed.shape == (packed_size(n),) and packed.dtype == dtype
    restored = unpack_upper(packed, n)
    assert restored.is_contiguous()
    assert _bitwise_equal(restored, matrix)


def test_averaging_packed_factors_equals_averaging_the_matrices() -> None:
    # What an all-reduce of packed factors computes: the sum over ranks, then / world size.
    matrices = [_symmetric(33, seed=seed) for seed in range(4)]
    packed_sum = pack_upper(matrices[0]).clone()
    dense_sum = matrices[0].clone()
    for matrix in matrices[1:]:
        packed_sum += pack_upper(matrix)
        dense_sum += matrix
    assert _bitwise_equal(unpack_upper(packed_sum / 4, 33), dense_sum / 4)


def test_bytes_nearly_halve_for_large_factors() -> None:
    matrix = _symmetric(1024)
    packed = pack_upper(matrix)
    ratio = packed.numel() * packed.element_size() / (matrix.numel() * matrix.element_size())
    assert ratio == pytest.approx(1025 / 2048)
    assert ratio < 0.51


def test_a_diagonal_factor_passes_through_unchanged() -> None:
    diagonal = torch.rand(5)
    assert pack_upper(diagonal) is diagonal
    assert unpack_upper(diagonal, 5, diagonal=True) is diagonal
    # One number is a 1 x 1 dense factor unless said otherwise.
    assert unpack_upper(torch.tensor([2.0]), 1).shape == (1, 1)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="square"):
        pack_upper(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="square"):
        pack_upper(torch.zeros(2, 2, 2))
    with pytest.raises(ValueError, match="has 6 numbers, got 5"):
        unpack_upper(torch.zeros(5), 3)
    with pytest.raises(ValueError, match="diagonal of a 3 x 3 factor has 3 numbers"):
        unpack_upper(torch.zeros(6), 3, diagonal=True)
    with pytest.raises(ValueError, match="1-D"):
        unpack_upper(torch.zeros(2, 3), 2)


def test_indices_are_cached_per_size_and_device() -> None:
    device = torch.device("cpu")
    first = packing.upper_flat_index(48, device)
    assert packing.upper_flat_index(48, device) is first
    assert packing.symmetric_gather_index(48, device) is packing.symmetric_gather_index(48, device)
    assert packing.upper_flat_index(49, device) is not first
    assert first.dtype == torch.int32  # half the memory of int64 for any realistic factor


def test_packing_into_a_given_tensor_writes_the_same_triangle_there() -> None:
    matrix = _symmetric(37)
    buffer = torch.full((packed_size(37) + 4,), -1.0)
    place = buffer[2 : 2 + packed_size(37)]
    written = pack_upper(matrix, out=place)
    assert written.data_ptr() == place.data_ptr()
    assert _bitwise_equal(place, pack_upper(matrix))
    assert buffer[:2].tolist() == [-1.0, -1.0] and buffer[-2:].tolist() == [-1.0, -1.0]
    diagonal = torch.rand(5)
    into = torch.zeros(5)
    assert pack_upper(diagonal, out=into) is into and torch.equal(into, diagonal)
    with pytest.raises(ValueError, match="has 703 numbers, got out of shape"):
        pack_upper(matrix, out=torch.zeros(700))
