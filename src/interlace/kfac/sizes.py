"""How many numbers K-FAC sends for one factor: pure arithmetic, shared by the preconditioner and
the simulator (which must not import torch)."""

from __future__ import annotations

__all__ = ["packed_size"]


def packed_size(n: int) -> int:
    """Numbers in the packed upper triangle of an ``n x n`` matrix: ``n(n+1)/2``.

    Args:
        n: The matrix side.
    """
    if n < 0:
        raise ValueError(f"a matrix size must be >= 0, got {n}")
    return n * (n + 1) // 2
