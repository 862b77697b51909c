"""How many numbers K-FAC sends for one factor: pure arithmetic, shared by the preconditioner and
the simulator (which must not import torch)."""

from __future__ import annotations

__all__ = ["factor_numel", "packed_size"]


def packed_size(n: int) -> int:
    """Numbers in the packed upper triangle of an ``n x n`` matrix: ``n(n+1)/2``.

    Args:
        n: The matrix side.
    """
    if n < 0:
        raise ValueError(f"a matrix size must be >= 0, got {n}")
    return n * (n + 1) // 2


def factor_numel(n: int, *, diagonal: bool = False, packed: bool = True) -> int:
    """Numbers one factor's all-reduce carries: a diagonal factor (an embedding's ``A``, kept
    as a vector) its ``n`` values; any other its packed upper triangle, or with ``packed=False``
    the whole ``n x n``.

    Args:
        n: The factor's side.
        diagonal: Whether the factor is kept as a diagonal.
        packed: Whether a dense factor goes as its upper triangle.
    """
    if diagonal:
        if n < 0:
            raise ValueError(f"a matrix size must be >= 0, got {n}")
        return n
    return packed_size(n) if packed else n * n
