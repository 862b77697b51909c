"""K-FAC's checkpoints and memory account: what ``KFAC.state_dict`` keeps, how
``load_state_dict`` puts it back, and the bytes ``memory_usage`` reports."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from interlace.kfac.preconditioned_layer import KFACLayer
from interlace.kfac.warning import KFACWarning
from interlace.kfac.work_assignment import WorkAssignment

__all__ = [
    "PLAIN_HYPERPARAMETERS",
    "agree_on_decomposition",
    "load_state",
    "memory_usage",
    "save_state",
]

#: The hyperparameters a checkpoint keeps when they are numbers, in its order.
PLAIN_HYPERPARAMETERS = (
    "factor_update_steps",
    "inv_update_steps",
    "damping",
    "factor_decay",
    "kl_clip",
    "lr",
)


def save_state(
    steps: int,
    hyperparameters: Mapping[str, Any],
    layers: list[KFACLayer],
    include_factors: bool,
) -> dict[str, Any]:
    """The step count, the plain (non-callable) hyperparameters, and per layer its state.

    Args:
        steps: The step count.
        hyperparameters: :data:`PLAIN_HYPERPARAMETERS` as given (numbers or callables).
        layers: The registered layers.
        include_factors: Keep the layers' factors and decompositions.
    """
    state: dict[str, Any] = {"steps": steps}
    for key in PLAIN_HYPERPARAMETERS:
        value = hyperparameters[key]
        if not callable(value):
            state[key] = value
    if include_factors:
        state["layers"] = {layer.name: layer.state_dict() for layer in layers}
    return state


def load_state(
    state: Mapping[str, Any],
    layers: list[KFACLayer],
    assignment: WorkAssignment,
    device: torch.device,
    compute_inverses: bool,
) -> bool:
    """Load each layer's saved factors and decompositions (the caller restores the rest).

    Args:
        state: What :func:`save_state` returned.
        layers: The registered layers.
        assignment: Which layers this rank preconditions.
        device: Where the layers live.
        compute_inverses: Whether a gradient worker lacking a saved decomposition should
            decompose at the next step.

    Returns:
        Whether this rank needs a decomposition at the next step.

    Raises:
        ValueError: The state names layers this model does not precondition.
    """
    if "layers" not in state and compute_inverses:
        warnings.warn(
            "K-FAC state has no factors (saved with include_factors=False), so nothing can "
            "be decomposed until the next factor and decomposition steps",
            KFACWarning,
            stacklevel=3,
        )
    saved = state.get("layers", {})
    unknown = sorted(set(saved) - {layer.name for layer in layers})
    if unknown:
        raise ValueError(
            f"K-FAC state has layers this model does not precondition: {', '.join(unknown)}"
        )
    needs_decomposition = False
    for layer in layers:
        entry = saved.get(layer.name)
        if entry is None:
            continue
        layer.load_state_dict(entry, device)
        holds = layer.a_decomp is not None and layer.g_decomp is not None
        worker = assignment.is_grad_worker(layer.name)
        if compute_inverses and layer.decomposed and worker and not holds:
            needs_decomposition = True
    return needs_decomposition


def agree_on_decomposition(
    needs: bool, world_size: int, group: dist.ProcessGroup | None, device: torch.device
) -> bool:
    """After a load, whether any rank lacks a decomposition (then every rank decomposes).

    Args:
        needs: Whether this rank does.
        world_size: The ranks K-FAC runs on.
        group: Their process group.
        device: Where the flag is reduced.
    """
    if world_size == 1:
        return needs
    flag = torch.tensor([int(needs)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def memory_usage(layers: list[KFACLayer]) -> dict[str, int]:
    """Bytes the layers hold for K-FAC, by kind, as kfac-pytorch reports them.

    Args:
        layers: The registered layers.

    Returns:
        ``a_factors``, ``g_factors`` (running averages), ``a_batch``, ``g_batch`` (this
        step's sums), ``a_inverses``, ``g_inverses`` (decompositions) and ``total``.
    """
    sizes = dict.fromkeys(
        ("a_factors", "g_factors", "a_batch", "g_batch", "a_inverses", "g_inverses"), 0
    )
    for layer in layers:
        for key, tensors in layer.held_tensors().items():
            sizes[key] += sum(t.numel() * t.element_size() for t in tensors)
    sizes["total"] = sum(sizes.values())
    return sizes
