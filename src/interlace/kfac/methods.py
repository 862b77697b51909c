"""How a factor becomes a preconditioner: eigendecompositions or damped inverses, one object each.

The runtime decomposes and preconditions with these objects and the simulator prices the same
ones (the numbers a decomposition sends, the products preconditioning takes). Only the methods
that compute import torch, so the simulator loads this module without it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from interlace.kfac.enums import ComputeMethod, coerce_choice

if TYPE_CHECKING:
    import torch

__all__ = [
    "EIGEN",
    "INVERSE",
    "DecompositionMethod",
    "Eigen",
    "FactorDecomposition",
    "Inverse",
    "method_from",
]


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
        import torch  # noqa: PLC0415 - the simulator prices this module without torch

        return torch.cat([t.reshape(-1) for t in self.tensors()])

    def load_flat(self, flat: torch.Tensor) -> None:
        """Take new values from a buffer laid out as :meth:`flatten` lays out this one's.

        The receiving side of a broadcast: this decomposition gives the shapes (it was made
        by :meth:`DecompositionMethod.empty`, or is the previous decomposition), ``flat`` the
        numbers. The new tensors are views of ``flat``.

        Args:
            flat: The 1-D buffer received.
        """
        import torch  # noqa: PLC0415 - the simulator prices this module without torch

        shapes = self.tensors()
        expected = sum(t.numel() for t in shapes)
        if flat.numel() != expected:
            raise ValueError(f"a flat decomposition of {flat.numel()} numbers, expected {expected}")
        pieces = torch.split(flat, [t.numel() for t in shapes])
        self.replace([piece.view_as(t) for piece, t in zip(pieces, shapes, strict=True)])


@runtime_checkable
class DecompositionMethod(Protocol):
    """What K-FAC asks of a decomposition method; :class:`Eigen` and :class:`Inverse` are two.

    A :class:`FactorDecomposition` made by a method holds any of
    ``values``, ``vectors`` and ``inverse``; the method alone says which, and what they mean.
    """

    @property
    def name(self) -> str:
        """The method's name in descriptions, records and checkpoints."""
        ...

    @property
    def precondition_products(self) -> int:
        """Products of a ``g x a`` gradient with a factor-sized matrix that preconditioning
        takes, each ``2 g a n`` flops with ``n`` the factor's side (the simulator's price)."""
        ...

    def numel(self, dim: int, diagonal: bool = False) -> int:
        """Numbers one factor's decomposition holds, and so sends.

        Args:
            dim: The factor's side.
            diagonal: Whether the factor is kept as a diagonal.
        """
        ...

    def decompose(self, factor: torch.Tensor, damping: float, shift: float) -> FactorDecomposition:
        """One attempt at a dense factor (a symmetric ``n x n``), ``shift`` added on its diagonal.

        Args:
            factor: The factor, in the dtype to compute in.
            damping: The damping.
            shift: Extra on the diagonal, so that a retry lifts a near-singular factor.
        """
        ...

    def decompose_diagonal(self, diagonal: torch.Tensor, damping: float) -> FactorDecomposition:
        """A diagonal factor's decomposition (kept as its diagonal vector).

        Args:
            diagonal: The factor's diagonal.
            damping: The damping.
        """
        ...

    def dense_from_diagonal(self, values: torch.Tensor) -> FactorDecomposition:
        """A dense factor's decomposition built from the decomposition of its diagonal only,
        in the dense shapes (a fallback that receivers' buffers can take).

        Args:
            values: What :meth:`decompose_diagonal` made of the factor's diagonal.
        """
        ...

    def empty(
        self, dim: int, diagonal: bool, dtype: torch.dtype, device: torch.device
    ) -> FactorDecomposition:
        """Buffers of the right shapes for receiving a broadcast decomposition.

        Args:
            dim: The factor's side.
            diagonal: Whether the factor is a diagonal.
            dtype: The buffers' dtype.
            device: The buffers' device.
        """
        ...

    def precondition(
        self,
        grad: torch.Tensor,
        a: FactorDecomposition,
        g: FactorDecomposition,
        damping: float,
    ) -> torch.Tensor:
        """The preconditioned ``(g_dim, a_dim)`` gradient, in the decompositions' dtype.

        Args:
            grad: The gradient, in the decompositions' dtype.
            a: ``A``'s decomposition (this method's).
            g: ``G``'s decomposition (this method's).
            damping: The damping.
        """
        ...

    def run(self, matrix: torch.Tensor) -> None:
        """The method's kernel on ``matrix`` once, for timing it.

        Args:
            matrix: A square matrix.
        """
        ...


@dataclass(frozen=True)
class Eigen:
    """Eigendecompositions (inverse-free): ``Q diag(d) Q^T`` of each factor; preconditioning
    rotates into both eigenbases, divides by the damped eigenvalue products and rotates back."""

    name: ClassVar[str] = "eigen"
    precondition_products: ClassVar[int] = 4

    def numel(self, dim: int, diagonal: bool = False) -> int:
        return dim if diagonal else dim * dim + dim

    def decompose(self, factor: torch.Tensor, damping: float, shift: float) -> FactorDecomposition:
        import torch  # noqa: PLC0415 - the simulator prices this module without torch

        values, vectors = torch.linalg.eigh(_with_diagonal(factor, shift))
        # Eigenvalues of a second moment are >= 0; rounding can make small ones negative.
        return FactorDecomposition(self, values=values.clamp(min=0.0), vectors=vectors)

    def decompose_diagonal(self, diagonal: torch.Tensor, damping: float) -> FactorDecomposition:
        return FactorDecomposition(self, values=diagonal.clamp(min=0.0))

    def dense_from_diagonal(self, values: torch.Tensor) -> FactorDecomposition:
        import torch  # noqa: PLC0415 - the simulator prices this module without torch

        eye = torch.eye(values.shape[0], dtype=values.dtype, device=values.device)
        return FactorDecomposition(self, values=values, vectors=eye)

    def empty(
        self, dim: int, diagonal: bool, dtype: torch.dtype, device: torch.device
    ) -> FactorDecomposition:
        import torch  # noqa: PLC0415 - the simulator prices this module without torch

        values = torch.empty(dim, dtype=dtype, device=device)
        if diagonal:
            return FactorDecomposition(self, values=values)
        vectors = torch.empty(dim, dim, dtype=dtype, device=device)
        return FactorDecomposition(self, values=values, vectors=vectors)

    def precondition(
        self,
        grad: torch.Tensor,
        a: FactorDecomposition,
        g: FactorDecomposition,
        damping: float,
    ) -> torch.Tensor:
        qg, dg = g.vectors, g.values
        assert qg is not None and dg is not None and a.values is not None
        rotated = qg.t() @ grad
        if a.vectors is not None:
            rotated = rotated @ a.vectors
        rotated = rotated / (dg.unsqueeze(1) * a.values.unsqueeze(0) + damping)
        result = qg @ rotated
        if a.vectors is not None:
            result = result @ a.vectors.t()
        return result

    def run(self, matrix: torch.Tensor) -> None:
        import torch  # noqa: PLC0415 - the simulator prices this module without torch

        torch.linalg.eigh(matrix)


@dataclass(frozen=True)
class Inverse:
    """Damped inverses ``(F + damping I)^-1`` of each factor; preconditioning multiplies by
    both (a diagonal factor's inverse is kept as its diagonal)."""

    name: ClassVar[str] = "inverse"
    precondition_products: ClassVar[int] = 2

    def numel(self, dim: int, diagonal: bool = False) -> int:
        return dim if diagonal else dim * dim

    def decompose(self, factor: torch.Tensor, damping: float, shift: float) -> FactorDecomposition:
        import torch  # noqa: PLC0415 - the simulator prices this module without torch

        return FactorDecomposition(
            self, inverse=torch.linalg.inv(_with_diagonal(factor, damping + shift))
        )

    def decompose_diagonal(self, diagonal: torch.Tensor, damping: float) -> FactorDecomposition:
        return FactorDecomposition(self, values=1.0 / (diagonal + damping))

    def dense_from_diagonal(self, values: torch.Tensor) -> FactorDecomposition:
        import torch  # noqa: PLC0415 - the simulator prices this module without torch

        return FactorDecomposition(self, inverse=torch.diag(values))

    def empty(
        self, dim: int, diagonal: bool, dtype: torch.dtype, device: torch.device
    ) -> FactorDecomposition:
        import torch  # noqa: PLC0415 - the simulator prices this module without torch

        if diagonal:
            return FactorDecomposition(self, values=torch.empty(dim, dtype=dtype, device=device))
        return FactorDecomposition(self, inverse=torch.empty(dim, dim, dtype=dtype, device=device))

    def precondition(
        self,
        grad: torch.Tensor,
        a: FactorDecomposition,
        g: FactorDecomposition,
        damping: float,
    ) -> torch.Tensor:
        assert g.inverse is not None
        result = g.inverse @ grad
        if a.inverse is not None:
            return result @ a.inverse
        assert a.values is not None
        return result * a.values.unsqueeze(0)

    def run(self, matrix: torch.Tensor) -> None:
        import torch  # noqa: PLC0415 - the simulator prices this module without torch

        torch.linalg.inv(matrix)


#: The built-in methods, one instance each.
EIGEN = Eigen()
INVERSE = Inverse()

_BY_CHOICE: dict[ComputeMethod, DecompositionMethod] = {
    ComputeMethod.EIGEN: EIGEN,
    ComputeMethod.INVERSE: INVERSE,
}


def _with_diagonal(factor: torch.Tensor, amount: float) -> torch.Tensor:
    """``factor + amount * I``; ``factor`` itself when ``amount`` is zero (the decompositions
    leave their input unchanged, and a copy plus an in-place diagonal add takes two kernels
    where building the identity takes three)."""
    if amount == 0.0:
        return factor
    shifted = factor.clone()
    shifted.diagonal().add_(amount)
    return shifted


def method_from(value: object, option: str = "compute_method") -> DecompositionMethod:
    """The method ``value`` names: a :class:`DecompositionMethod` as it is, or a
    :class:`~interlace.kfac.enums.ComputeMethod` (or its string, or kfac-pytorch's member).

    Args:
        value: What the caller passed.
        option: The option's name, for the error.

    Raises:
        OptionError: A value that is neither.
    """
    if not isinstance(value, str | enum.Enum) and isinstance(value, DecompositionMethod):
        return value
    return _BY_CHOICE[coerce_choice(ComputeMethod, value, option)]
