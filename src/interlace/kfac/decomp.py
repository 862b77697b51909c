"""One factor's decomposition and the preconditioning that uses it, by a decomposition method.

Pure functions of tensors around the method objects of :mod:`interlace.kfac.methods` (the
retries, the checks, the dtypes); a diagonal factor (an embedding's ``A``) is kept as its
diagonal vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from interlace.kfac.enums import COMPUTE_METHODS
from interlace.kfac.methods import DecompositionMethod, method_from

__all__ = [
    "COMPUTE_METHODS",
    "DecompositionError",
    "FactorDecomposition",
    "decompose",
    "precondition",
]

#: How many times a failing decomposition is retried, each time with ten times more damping on
#: the diagonal, before the caller falls back to the previous decomposition.
RETRIES = 3


class DecompositionError(RuntimeError):
    """A factor could not be decomposed into finite numbers, even with extra damping."""


@dataclass
class FactorDecomposition:
    """One factor's second-order information, as its method made it.

    ``eigen``: ``vectors`` (``n x n``, None for a diagonal factor) and ``values`` (``n``).
    ``inverse``: ``inverse`` (``n x n``), or for a diagonal factor ``values`` holding
    ``1 / (diag + damping)``.

    Args:
        method: The method that made it (or its name, ``"eigen"`` or ``"inverse"``).
        values: Eigenvalues, or a diagonal factor's numbers.
        vectors: Eigenvectors (``eigen``, dense factors).
        inverse: The damped inverse (``inverse``, dense factors).
    """

    method: DecompositionMethod
    values: torch.Tensor | None = None
    vectors: torch.Tensor | None = None
    inverse: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.method = method_from(self.method, "method")

    def tensors(self) -> list[torch.Tensor]:
        """The tensors that travel when the decomposition is broadcast, in a fixed order."""
        return [t for t in (self.vectors, self.values, self.inverse) if t is not None]

    def replace(self, tensors: list[torch.Tensor]) -> None:
        """Take new values for :meth:`tensors`, in the same order (after a broadcast).

        Args:
            tensors: New tensors in :meth:`tensors`' order (consumed).
        """
        if self.vectors is not None:
            self.vectors = tensors.pop(0)
        if self.values is not None:
            self.values = tensors.pop(0)
        if self.inverse is not None:
            self.inverse = tensors.pop(0)

    def flatten(self) -> torch.Tensor:
        """:meth:`tensors` back to back in one 1-D buffer, so one collective sends them all."""
        return torch.cat([t.reshape(-1) for t in self.tensors()])

    def load_flat(self, flat: torch.Tensor) -> None:
        """Take new values from a buffer laid out as :meth:`flatten` lays out this one's.

        The receiving side of a broadcast: this decomposition gives the shapes (it was made
        by :func:`empty_like_decomposition`, or is the previous decomposition), ``flat`` the
        numbers. The new tensors are views of ``flat``.

        Args:
            flat: The 1-D buffer received.
        """
        shapes = self.tensors()
        expected = sum(t.numel() for t in shapes)
        if flat.numel() != expected:
            raise ValueError(f"a flat decomposition of {flat.numel()} numbers, expected {expected}")
        pieces = torch.split(flat, [t.numel() for t in shapes])
        self.replace([piece.view_as(t) for piece, t in zip(pieces, shapes, strict=True)])


def empty_like_decomposition(
    method: DecompositionMethod | str,
    dim: int,
    diagonal: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> FactorDecomposition:
    """Buffers of the right shapes for receiving a broadcast decomposition.

    Args:
        method: The decomposition method (or its name).
        dim: The factor's side.
        diagonal: Whether the factor is a diagonal.
        dtype: The buffers' dtype.
        device: The buffers' device.
    """
    return method_from(method, "method").empty(dim, diagonal, dtype, device)


def decompose(
    factor: torch.Tensor, method: DecompositionMethod | str, damping: float, dtype: torch.dtype
) -> FactorDecomposition:
    """Decompose ``factor`` in ``dtype`` by ``method`` (eigendecomposition, damped inverse).

    A 1-D ``factor`` is a diagonal. Raises :class:`DecompositionError` when even
    :data:`RETRIES` escalations of the damping give no finite result.

    Args:
        factor: A symmetric ``n x n`` factor, or a diagonal factor as a vector.
        method: The decomposition method (or its name, ``"eigen"`` or ``"inverse"``).
        damping: The damping (``inverse`` adds it on the diagonal).
        dtype: The dtype to compute and return in.
    """
    chosen = method_from(method, "method")
    work = factor.to(dtype)
    if work.dim() == 1:
        return chosen.decompose_diagonal(work, damping)
    if not bool(torch.isfinite(work).all()):
        raise DecompositionError("the factor holds non-finite values")
    # Extra diagonal on a retry: zero first, then growing multiples of the damping (or of a
    # small floor when damping is zero), which lifts near-singular factors into range.
    extra = [0.0] + [max(damping, 1e-6) * 10.0**k for k in range(1, RETRIES + 1)]
    last_error = ""
    for shift in extra:
        try:
            result = chosen.decompose(work, damping, shift)
        except RuntimeError as error:  # torch.linalg.LinAlgError is a RuntimeError
            last_error = str(error).splitlines()[0]
            continue
        if all(bool(torch.isfinite(t).all()) for t in result.tensors()):
            return result
        last_error = "non-finite result"
    raise DecompositionError(f"{chosen.name} decomposition failed: {last_error}")


def precondition(
    grad: torch.Tensor,
    a: FactorDecomposition,
    g: FactorDecomposition,
    damping: float,
) -> torch.Tensor:
    """The preconditioned ``(g_dim, a_dim)`` gradient, in ``grad``'s dtype.

    Computed in the decompositions' dtype by their method.

    Args:
        grad: The ``(g_dim, a_dim)`` gradient.
        a: ``A``'s decomposition.
        g: ``G``'s decomposition (same method).
        damping: The damping.
    """
    work_dtype = g.tensors()[0].dtype
    return g.method.precondition(grad.to(work_dtype), a, g, damping).to(grad.dtype)


def kl_clip_scale(products: float, kl_clip: float | None, lr: float) -> float:
    """kfac-pytorch's KL-clip: ``min(1, sqrt(kl_clip / |lr^2 * sum <V', V>|))``.

    ``products`` is ``sum <V', V>`` over all preconditioned layers. A sum that is not finite
    (the preconditioned gradients overflow) gives 0, as kfac-pytorch's formula does.

    Args:
        products: ``sum <V', V>`` over all preconditioned layers.
        kl_clip: The bound, or None for no clip.
        lr: The learning rate.
    """
    if kl_clip is None:
        return 1.0
    total = abs(products * lr * lr)
    if not math.isfinite(total):
        return 0.0  # kfac-pytorch's formula gives 0 here too: an overflow is never let through
    if total == 0.0:
        return 1.0
    return min(1.0, math.sqrt(kl_clip / total))
