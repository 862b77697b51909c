"""Upper-triangle packing of symmetric Kronecker factors, which nearly halves each all-reduce.

A diagonal factor (an embedding's ``A``, stored as its diagonal) passes through unchanged.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from interlace.kfac.sizes import packed_size

__all__ = [
    "pack_upper",
    "packed_size",
    "symmetric_gather_index",
    "unpack_upper",
    "upper_flat_index",
]

#: Distinct (size, device) pairs whose indices are kept; a ResNet-152 has about twenty sizes.
_CACHE_SIZE = 64


def _index_dtype(n: int) -> torch.dtype:
    # int32 halves the cached indices' memory; it addresses any factor below 46341 x 46341.
    return torch.int32 if n * n < 2**31 else torch.int64


@lru_cache(maxsize=_CACHE_SIZE)
def upper_flat_index(n: int, device: torch.device) -> torch.Tensor:
    """Row-major positions, in the flattened matrix, of the upper triangle's entries.

    Cached per ``(n, device)`` (``int32`` below 46341 x 46341), as :func:`pack_upper` uses it.

    Args:
        n: The matrix side.
        device: Where the indices live.
    """
    indices: torch.Tensor = torch.triu_indices(n, n, device=device)
    return (indices[0] * n + indices[1]).to(_index_dtype(n))


@lru_cache(maxsize=_CACHE_SIZE)
def symmetric_gather_index(n: int, device: torch.device) -> torch.Tensor:
    """For each entry ``(i, j)`` of the ``n x n`` matrix, its position in the packed vector.

    Entry ``(i, j)`` and its mirror ``(j, i)`` both read the packed ``(min, max)`` entry; row
    ``r`` of the upper triangle starts at ``r n - r(r-1)/2``. Cached like
    :func:`upper_flat_index`.

    Args:
        n: The matrix side.
        device: Where the indices live.
    """
    positions = torch.arange(n, device=device, dtype=torch.int64)
    low = torch.minimum(positions[:, None], positions[None, :])
    high = torch.maximum(positions[:, None], positions[None, :])
    index = low * (2 * n - low + 1) // 2 + (high - low)
    return index.reshape(-1).to(_index_dtype(n))


def pack_upper(matrix: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The upper triangle of a square matrix, row by row, as a 1-D tensor of ``n(n+1)/2``.

    A 1-D tensor (a diagonal factor) is returned unchanged, or copied into ``out``. Only the
    upper triangle is read: packing is lossless exactly when ``matrix`` is symmetric.

    Args:
        matrix: A symmetric ``n x n`` matrix, or a 1-D diagonal factor.
        out: Where to write the packed triangle (a 1-D tensor of its size; None: a new one).
    """
    if matrix.dim() == 1:
        return matrix if out is None else out.copy_(matrix)
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"packing needs a square matrix or a diagonal, got shape {matrix.shape}")
    n = matrix.shape[0]
    index = upper_flat_index(n, matrix.device)
    if out is None:
        return matrix.reshape(-1).index_select(0, index)
    if out.shape != (index.numel(),):
        raise ValueError(
            f"a packed {n} x {n} factor has {index.numel()} numbers, got out of shape {out.shape}"
        )
    return torch.index_select(matrix.reshape(-1), 0, index, out=out)


def unpack_upper(packed: torch.Tensor, n: int, *, diagonal: bool = False) -> torch.Tensor:
    """The symmetric ``n x n`` matrix whose upper triangle is ``packed`` (from :func:`pack_upper`).

    Every entry is copied, never computed, so ``unpack_upper(pack_upper(s), n)`` equals a
    symmetric ``s`` bit for bit. With ``diagonal`` the tensor is a diagonal factor's ``n``
    numbers and is returned unchanged (``n = 1`` alone could not tell the two apart).

    Args:
        packed: The packed upper triangle (or a diagonal factor).
        n: The matrix side.
        diagonal: Whether ``packed`` is a diagonal factor.
    """
    if packed.dim() != 1:
        raise ValueError(f"a packed factor is 1-D, got shape {packed.shape}")
    expected = n if diagonal else packed_size(n)
    if packed.numel() != expected:
        kind = "diagonal" if diagonal else "packed upper triangle"
        raise ValueError(
            f"a {kind} of a {n} x {n} factor has {expected} numbers, got {packed.numel()}"
        )
    if diagonal:
        return packed
    return packed.index_select(0, symmetric_gather_index(n, packed.device)).view(n, n)
