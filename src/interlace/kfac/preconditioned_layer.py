"""One preconditioned layer: its factors, running averages, decompositions and preconditioning."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from interlace.kfac.decomp import (
    DecompositionError,
    FactorDecomposition,
    all_finite,
    decompose,
)
from interlace.kfac.methods import DecompositionMethod, method_from
from interlace.kfac.module_helpers import LayerHelper

__all__ = [
    "GradientMark",
    "KFACLayer",
    "PendingBroadcast",
    "describe_layers",
    "gradient_marks",
    "gradients_unchanged",
    "restart_non_finite",
    "unwrap",
]

GradientMark = tuple["weakref.ref[torch.Tensor]", int]
"""A gradient tensor, weakly held, and its in-place version counter."""


class PendingBroadcast:
    """An asynchronous broadcast and what to do with its buffer once it has arrived.

    Args:
        work: The collective's handle.
        arrived: Called after the wait (unpacks the buffer on a receiving rank), or None.
    """

    def __init__(self, work: dist.Work | None, arrived: Callable[[], None] | None = None) -> None:
        self.work = work
        self.arrived = arrived

    def wait(self) -> None:
        """Wait for the broadcast, then take its numbers."""
        assert self.work is not None
        self.work.wait()
        if self.arrived is not None:
            self.arrived()


class KFACLayer:
    """One preconditioned module's K-FAC state, and the per-layer steps of the algorithm.

    It holds this step's factor sums (from the hooks), the factors' running averages, their
    decompositions (computed here, or received from the rank that computed them), and it
    preconditions the module's gradient. Factors are named ``"A"`` (inputs) and ``"G"``
    (output gradients).

    Args:
        name: The module's name in the model.
        helper: The module's :class:`LayerHelper`.
        method: The decomposition method (see :mod:`interlace.kfac.methods`), or its name.
        inv_dtype: The dtype decompositions are computed and kept in.
    """

    def __init__(
        self,
        name: str,
        helper: LayerHelper,
        method: DecompositionMethod | str,
        inv_dtype: torch.dtype,
    ) -> None:
        self.name = name
        self.helper = helper
        self.method = method_from(method, "method")
        self.inv_dtype = inv_dtype
        #: The module's hooks, removed by :meth:`remove_hooks`.
        self.handles: list[RemovableHandle] = []
        #: This step's factor sums and how many batches they hold.
        self.a_sum: torch.Tensor | None = None
        self.g_sum: torch.Tensor | None = None
        self.a_count = 0
        self.g_count = 0
        #: Whether this step's sums were restarted (by :meth:`restart_batch`) after part of the
        #: step's factors had been sent: they must then be averaged anew.
        self.restarted = False
        #: The running averages (None until the first factor step reaches this layer).
        self.a_factor: torch.Tensor | None = None
        self.g_factor: torch.Tensor | None = None
        self.a_decomp: FactorDecomposition | None = None
        self.g_decomp: FactorDecomposition | None = None
        #: Whether a decomposition step has covered this layer (the same on every rank).
        self.decomposed = False

    # -- factors ---------------------------------------------------------------------------

    def add_input(self, layer_input: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """Add this batch's ``A`` to the step's sum; returns it.

        Args:
            layer_input: The module's first input.
            dtype: The dtype factors are computed in (None: the input's own).
        """
        layer_input = layer_input.detach()
        if dtype is not None and layer_input.is_floating_point():
            layer_input = layer_input.to(dtype)
        a = self.helper.a_factor(layer_input)
        self.a_sum = a if self.a_sum is None else self.a_sum + a
        self.a_count += 1
        return a

    def add_grad_output(
        self,
        grad_output: torch.Tensor,
        dtype: torch.dtype | None,
        world_size: int,
        per_example: bool,
    ) -> torch.Tensor:
        """Add this batch's ``G``, normalised to the global batch, to the step's sum; returns it.

        Each rank's output gradients are ``world_size`` times a single process's (the loss is
        a mean over the local batch), and ``G`` is quadratic in them, so ``G`` is divided by
        ``world_size^2``: W ranks then give exactly the single-process factor.

        Args:
            grad_output: The gradient with respect to the module's output.
            dtype: The dtype factors are computed in (None: the gradient's own).
            world_size: The ranks the global batch is split over.
            per_example: Scale ``G`` by the squared global batch (``g_normalization=
                "per-example"``), undoing the mean loss's ``1 / batch`` in each gradient.
        """
        grad_output = grad_output.detach()
        if dtype is not None:
            grad_output = grad_output.to(dtype)
        scale = 1.0 / float(world_size**2)
        if per_example:
            scale *= float(grad_output.shape[0] * world_size) ** 2
        g = self.helper.g_factor(grad_output)
        # One pass over the factor for both normalisations, none when they cancel.
        if scale != 1.0:
            g = g * scale
        self.g_sum = g if self.g_sum is None else self.g_sum + g
        self.g_count += 1
        return g

    def batch_factors(self) -> list[torch.Tensor]:
        """This step's mean ``A`` and ``G`` (both hooks must have run)."""
        assert self.a_sum is not None and self.g_sum is not None
        # A single batch's sum is its mean: no copy (callers do not write to it).
        return [
            total if count == 1 else total / count
            for total, count in ((self.a_sum, self.a_count), (self.g_sum, self.g_count))
        ]

    def reset_batch(self) -> None:
        """Forget this step's factor sums."""
        self.a_sum = self.g_sum = None
        self.a_count = self.g_count = 0
        self.restarted = False

    def restart_batch(self) -> None:
        """Forget the factor sums so far, within a step (after a batch whose step was skipped);
        :attr:`restarted` tells the factor communication that what it sent is stale."""
        self.a_sum = self.g_sum = None
        self.a_count = self.g_count = 0
        self.restarted = True

    def update_factors(self, a: torch.Tensor, g: torch.Tensor, decay: float) -> None:
        """Fold averaged factors into the running averages (which start from the identity).

        Args:
            a: This step's ``A``, averaged across ranks.
            g: This step's ``G``, averaged across ranks.
            decay: ``factor_decay``: the weight of the old average.
        """
        self.a_factor = _running_average(self.a_factor, a, decay)
        self.g_factor = _running_average(self.g_factor, g, decay)

    def factor(self, which: str) -> torch.Tensor | None:
        """The running average of ``"A"`` or ``"G"``.

        Args:
            which: ``"A"`` or ``"G"``.
        """
        return self.a_factor if which == "A" else self.g_factor

    def dims(self, which: str) -> tuple[int, bool]:
        """A factor's side and whether it is kept as a diagonal.

        Args:
            which: ``"A"`` or ``"G"``.
        """
        if which == "A":
            return self.helper.a_dim, self.helper.diagonal_a
        return self.helper.g_dim, False

    # -- decompositions --------------------------------------------------------------------

    def held_decomposition(self, which: str) -> FactorDecomposition | None:
        """A factor's decomposition, or None when this rank holds none.

        Args:
            which: ``"A"`` or ``"G"``.
        """
        return self.a_decomp if which == "A" else self.g_decomp

    def decomposition(self, which: str) -> FactorDecomposition:
        """A factor's decomposition, which must be held.

        Args:
            which: ``"A"`` or ``"G"``.
        """
        decomposition = self.held_decomposition(which)
        assert decomposition is not None
        return decomposition

    def _set_decomposition(self, which: str, decomposition: FactorDecomposition) -> None:
        if which == "A":
            self.a_decomp = decomposition
        else:
            self.g_decomp = decomposition

    def decompose(self, which: str, damping: float) -> str | None:
        """Decompose one factor in place, falling back when that fails.

        The fallback is the previous decomposition, or on the first step the factor's diagonal
        in the dense shapes (receivers' broadcast buffers expect those).

        Args:
            which: ``"A"`` or ``"G"``.
            damping: The damping (the inverse method adds it on the diagonal).

        Returns:
            None, or after a fallback what failed and what was used instead.
        """
        factor = self.factor(which)
        assert factor is not None
        try:
            result = self.helper.decompose(factor, self.method, damping, self.inv_dtype)
        except DecompositionError as error:
            fallback = self.held_decomposition(which)
            what = "keeps the previous decomposition"
            if fallback is None:
                # Nothing earlier to keep: the diagonal of the factor always decomposes.
                fallback = decompose(
                    torch.diagonal(factor).clone() if factor.dim() == 2 else factor,
                    self.method,
                    damping,
                    self.inv_dtype,
                )
                if factor.dim() == 2:  # in the dense shapes the broadcast buffers expect
                    assert fallback.values is not None
                    fallback = self.method.dense_from_diagonal(fallback.values)
                what = "uses the factor's diagonal"
            self._set_decomposition(which, fallback)
            return f"{error}; it {what}"
        self._set_decomposition(which, result)
        return None

    def allocate_decomposition(self, which: str, device: torch.device) -> None:
        """Receive buffers for one factor's broadcast decomposition.

        Args:
            which: ``"A"`` or ``"G"``.
            device: Where the buffers live.
        """
        dim, diagonal = self.dims(which)
        self._set_decomposition(
            which,
            self.method.empty(dim, diagonal, self.inv_dtype, device),
        )

    def broadcast_decompositions(
        self, src: int, group: dist.ProcessGroup | None, receive: bool, device: torch.device
    ) -> PendingBroadcast:
        """Start one broadcast of both factors' decompositions, packed in one buffer.

        Args:
            src: The sending rank (global).
            group: The process group of the broadcast.
            receive: Whether this rank receives (it allocates buffers on the first receive).
            device: Where receive buffers live.
        """
        if receive and self.a_decomp is None:
            self.allocate_decomposition("A", device)
            self.allocate_decomposition("G", device)
        a, g = self.decomposition("A"), self.decomposition("G")
        parts = a.tensors() + g.tensors()
        flat = torch.cat([t.reshape(-1) for t in parts])
        work = dist.broadcast(flat, src=src, group=group, async_op=True)

        def arrived() -> None:
            unpacked = list(torch.split(flat, [t.numel() for t in parts]))
            shaped = [u.view_as(t) for u, t in zip(unpacked, parts, strict=True)]
            count_a = len(a.tensors())
            a.replace(shaped[:count_a])
            g.replace(shaped[count_a:])

        return PendingBroadcast(work, arrived if receive else None)

    def broadcast_decomposition(
        self,
        which: str,
        src: int,
        group: dist.ProcessGroup | None,
        receive: bool,
        device: torch.device,
    ) -> PendingBroadcast:
        """Start the broadcast of one factor's decomposition.

        Args:
            which: ``"A"`` or ``"G"``.
            src: The sending rank (global).
            group: The process group of the broadcast.
            receive: Whether this rank receives (it allocates a buffer on the first receive).
            device: Where a receive buffer lives.
        """
        if receive and self.held_decomposition(which) is None:
            self.allocate_decomposition(which, device)
        # The owner's numbers, or a receive buffer shaped like them.
        flat = self.decomposition(which).flatten()
        work = dist.broadcast(flat, src=src, group=group, async_op=True)

        def arrived() -> None:
            self.decomposition(which).load_flat(flat)

        return PendingBroadcast(work, arrived if receive else None)

    # -- preconditioning -------------------------------------------------------------------

    def grad_matrix(self) -> torch.Tensor | None:
        """The module's gradient as a ``(g_dim, a_dim)`` matrix, or None when it has none."""
        return self.helper.grad_matrix()

    def precondition(self, grad: torch.Tensor, damping: float) -> torch.Tensor:
        """The preconditioned gradient ``(G + d)^-1 grad (A + d)^-1`` from the decompositions.

        Args:
            grad: The gradient, from :meth:`grad_matrix`.
            damping: The damping.
        """
        return self.helper.precondition(
            grad, self.decomposition("A"), self.decomposition("G"), damping
        )

    def set_grad(self, matrix: torch.Tensor) -> None:
        """Write a ``(g_dim, a_dim)`` matrix back into the module's gradients.

        Args:
            matrix: The new gradient.
        """
        self.helper.set_grad(matrix)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The running averages and any decompositions held: ``{"A", "G", "A_decomp", ...}``."""
        entry: dict[str, Any] = {"A": self.a_factor, "G": self.g_factor}
        for key, decomposition in (("A_decomp", self.a_decomp), ("G_decomp", self.g_decomp)):
            if decomposition is not None:
                entry[key] = {
                    "method": decomposition.method.name,
                    "values": decomposition.values,
                    "vectors": decomposition.vectors,
                    "inverse": decomposition.inverse,
                }
        return entry

    def load_state_dict(self, entry: dict[str, Any], device: torch.device) -> None:
        """Restore :meth:`state_dict`.

        Args:
            entry: What :meth:`state_dict` returned.
            device: Where the tensors go.
        """
        self.a_factor = None if entry["A"] is None else entry["A"].to(device)
        self.g_factor = None if entry["G"] is None else entry["G"].to(device)
        decomps: list[FactorDecomposition | None] = []
        for key in ("A_decomp", "G_decomp"):
            raw = entry.get(key)
            if raw is None:
                decomps.append(None)
                continue
            # A checkpoint names its method: this layer's own object when the names agree.
            method = self.method if raw["method"] == self.method.name else raw["method"]
            tensors = {
                k: (None if raw[k] is None else raw[k].to(device))
                for k in ("values", "vectors", "inverse")
            }
            decomps.append(FactorDecomposition(method, **tensors))
        self.a_decomp, self.g_decomp = decomps
        self.decomposed = self.a_factor is not None

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this layer holds, by kind (see ``KFAC.memory_usage``)."""
        held: dict[str, list[torch.Tensor]] = {
            "a_factors": [self.a_factor] if self.a_factor is not None else [],
            "g_factors": [self.g_factor] if self.g_factor is not None else [],
            "a_batch": [self.a_sum] if self.a_sum is not None else [],
            "g_batch": [self.g_sum] if self.g_sum is not None else [],
        }
        for key, decomposition in (("a_inverses", self.a_decomp), ("g_inverses", self.g_decomp)):
            held[key] = decomposition.tensors() if decomposition is not None else []
        return held

    def remove_hooks(self) -> None:
        """Remove the module's K-FAC hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _running_average(current: torch.Tensor | None, new: torch.Tensor, decay: float) -> torch.Tensor:
    """``decay * current + (1 - decay) * new``, starting from the identity (kfac-pytorch's)."""
    if current is None:
        current = (
            torch.ones_like(new)
            if new.dim() == 1
            else torch.eye(new.shape[0], dtype=new.dtype, device=new.device)
        )
    return decay * current + (1.0 - decay) * new


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DataParallel / DDP wrappers (they expose it as ``.module``).

    Args:
        model: A model, possibly wrapped (several times).
    """
    inner = getattr(model, "module", None)
    while isinstance(inner, nn.Module):
        model, inner = inner, getattr(inner, "module", None)
    return model


def describe_layers(layers: Iterable[KFACLayer]) -> dict[str, str]:
    """The registered layers as ranks compare them: kind, weight shape and dtype, bias, factor
    sides, and their order (the factor collectives are laid out in it).

    Args:
        layers: The registered layers, in order.

    Returns:
        ``{"layer '<name>'": "Linear weight (8, 6) float32 with bias, A 7, G 8", ...,
        "layer order": "<name>, ..."}``.
    """
    entries: dict[str, str] = {}
    for layer in layers:
        helper = layer.helper
        weight = helper.weight
        bias = "with bias" if helper.bias is not None else "without bias"
        dtype = str(weight.dtype).removeprefix("torch.")
        entries[f"layer '{layer.name}'"] = (
            f"{type(helper.module).__name__} weight {tuple(weight.shape)} {dtype} {bias}, "
            f"A {helper.a_dim}, G {helper.g_dim}"
        )
    entries["layer order"] = ", ".join(layer.name for layer in layers)
    return entries


def restart_non_finite(layers: Iterable[KFACLayer]) -> list[str]:
    """Restart the factor sums that are not finite (one read back for all layers).

    Args:
        layers: The registered layers.

    Returns:
        The names of the layers restarted.
    """
    held = [layer for layer in layers if layer.a_count or layer.g_count]
    if not held:
        return []
    sums = [[t for t in (layer.a_sum, layer.g_sum) if t is not None] for layer in held]
    finite = iter(all_finite([t for layer_sums in sums for t in layer_sums]))
    # A list inside all(), not a generator: every layer takes exactly its own flags.
    bad = [
        layer
        for layer, layer_sums in zip(held, sums, strict=True)
        if not all([next(finite) for _ in layer_sums])
    ]
    for layer in bad:
        layer.restart_batch()
    return [layer.name for layer in bad]


def gradient_marks(layers: Iterable[KFACLayer]) -> list[GradientMark | None]:
    """Each layer's weight gradient as a weak reference and its version, None when absent.

    A weak reference, not ``id()``: a gradient freed by ``zero_grad()`` and a new one allocated
    at the same address must not look the same.

    Args:
        layers: The registered layers.
    """
    marks: list[GradientMark | None] = []
    for layer in layers:
        grad = layer.helper.weight.grad
        marks.append(None if grad is None else (weakref.ref(grad), grad._version))
    return marks


def gradients_unchanged(marks: list[GradientMark | None], layers: Iterable[KFACLayer]) -> bool:
    """Whether every layer's gradient is still the very tensor ``marks`` saw, unmodified since.

    Args:
        marks: What :func:`gradient_marks` returned earlier.
        layers: The registered layers, in the same order.
    """
    current = [layer.helper.weight.grad for layer in layers]
    if len(current) != len(marks):
        return False
    for mark, grad in zip(marks, current, strict=True):
        if mark is None or grad is None:
            if (mark is None) != (grad is None):
                return False
            continue
        ref, version = mark
        if ref() is not grad or grad._version != version:
            return False
    return True
