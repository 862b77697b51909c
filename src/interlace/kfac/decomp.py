"""One factor's decomposition and the preconditioning that uses it, by a decomposition method.

Pure functions of tensors around the method objects of :mod:`interlace.kfac.methods` (the
retries, the checks, the dtypes); a diagonal factor (an embedding's ``A``) is kept as its
diagonal vector.
"""

from __future__ import annotations

import math

import torch

from interlace.kfac.enums import COMPUTE_METHODS
from interlace.kfac.methods import DecompositionMethod, FactorDecomposition, method_from

__all__ = [
    "COMPUTE_METHODS",
    "DecompositionError",
    "FactorDecomposition",
    "all_finite",
    "decompose",
    "precondition",
]

#: How many times a failing decomposition is retried, each time with ten times more damping on
#: the diagonal, before the caller falls back to the previous decomposition.
RETRIES = 3


class DecompositionError(RuntimeError):
    """A factor could not be decomposed into finite numbers, even with extra damping."""


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
    # Extra diagonal on a retry: zero first, then growing multiples of the damping (or of a
    # small floor when damping is zero), which lifts near-singular factors into range.
    extra = [0.0] + [max(damping, 1e-6) * 10.0**k for k in range(1, RETRIES + 1)]
    last_error = ""
    for shift in extra:
        try:
            result = chosen.decompose(work, damping, shift)
        except RuntimeError as error:  # torch.linalg.LinAlgError is a RuntimeError
            if not all_finite([work])[0]:
                raise DecompositionError("the factor holds non-finite values") from None
            last_error = str(error).splitlines()[0]
            continue
        # The factor is checked with the result, after the decomposition: one read back from
        # the device for both rather than one before and one after.
        factor_finite, *results_finite = all_finite([work, *result.tensors()])
        if not factor_finite:
            raise DecompositionError("the factor holds non-finite values")
        if all(results_finite):
            return result
        last_error = "non-finite result"
    raise DecompositionError(f"{chosen.name} decomposition failed: {last_error}")


def all_finite(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor is all finite, read back from the device once for all of them.

    A tensor's largest magnitude is finite exactly when all of it is (NaN propagates through
    the maximum), and it takes one reduction per tensor where ``isfinite(t).all()`` takes a
    comparison per element kind and a reduction.

    Args:
        tensors: The tensors to check.
    """
    if not tensors:
        return []
    peaks = [torch.linalg.vector_norm(t, float("inf")) for t in tensors]
    flags: list[bool] = torch.isfinite(torch.stack(peaks)).tolist()
    return flags


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
