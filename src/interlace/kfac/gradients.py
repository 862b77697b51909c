"""The end of a K-FAC step: precondition each layer's gradient where the placement says, share
the results, scale them all by the KL-clip and write them back into ``.grad``."""

from __future__ import annotations

import warnings

import torch

from interlace.kfac.decomp import all_finite, kl_clip_scale
from interlace.kfac.preconditioned_layer import KFACLayer
from interlace.kfac.timing import SpanLog
from interlace.kfac.warning import KFACWarning
from interlace.kfac.work_assignment import WorkAssignment
from interlace.kfac.worker_groups import WorkerGroups

__all__ = ["GradientPreconditioning", "Preconditioned"]

#: Every preconditioned layer with its preconditioned (unscaled) and raw gradient matrices.
Preconditioned = list[tuple[KFACLayer, torch.Tensor, torch.Tensor]]


class GradientPreconditioning:
    """Turns the layers' averaged gradients into K-FAC's, in place.

    Args:
        assignment: Which rank preconditions each layer, and how results are shared.
        worker_groups: The gradient workers (they broadcast when not every rank is one).
        spans: Where the work is timed.
    """

    def __init__(
        self, assignment: WorkAssignment, worker_groups: WorkerGroups, spans: SpanLog
    ) -> None:
        self.assignment = assignment
        self.worker_groups = worker_groups
        self._spans = spans

    def precondition(
        self, layers: list[KFACLayer], damping: float, step: int, phases: dict[str, float]
    ) -> Preconditioned:
        """Every decomposed layer with a gradient, with its preconditioned and raw gradients.

        Gradient workers precondition; when not every rank is one, each worker sends its
        layers' results to its receiver group. Empty (with a :class:`KFACWarning`) when a
        gradient is not finite.

        Args:
            layers: The registered layers.
            damping: The damping at this step.
            step: The step count, for messages.
            phases: This step's phase times, added to.
        """
        # Both conditions are the same on every rank: decompositions are made in lockstep and
        # gradients are averaged, so every rank takes part in the same broadcasts.
        ready = [
            layer for layer in layers if layer.decomposed and layer.helper.weight.grad is not None
        ]
        if not ready:
            return []
        grads = {layer: layer.grad_matrix() for layer in ready}
        checked = [grad for grad in grads.values() if grad is not None]
        bad = [layer.name for layer, ok in zip(grads, all_finite(checked), strict=True) if not ok]
        if bad:
            warnings.warn(
                f"K-FAC: non-finite gradient in {', '.join(bad)} at step {step}; "
                "preconditioning is skipped for this step (factors are untouched)",
                KFACWarning,
                stacklevel=3,
            )
            return []
        work = self.assignment
        results: dict[KFACLayer, torch.Tensor] = {}
        with self._spans.timed(phases, "precondition", "precondition", "preconditioning"):
            for layer in ready:
                if work.is_grad_worker(layer.name):
                    grad = grads[layer]
                    assert grad is not None
                    results[layer] = layer.precondition(grad, damping)
        if self.worker_groups.broadcasts_gradients:
            with self._spans.timed(phases, "precondition_comm", "comm", "gradient broadcast"):
                work.share_gradients(ready, results, grads)
        return [(layer, results[layer], grads[layer]) for layer in ready]  # type: ignore[misc]

    def clip_and_write(
        self,
        results: Preconditioned,
        kl_clip: float | None,
        lr: float,
        step: int,
        phases: dict[str, float],
    ) -> None:
        """kfac-pytorch's KL-clip: scale every preconditioned gradient by one factor, write back.

        Args:
            results: What :meth:`precondition` returned (not empty).
            kl_clip: The KL-clip bound, or None for no clip.
            lr: The learning rate the clip assumes.
            step: The step count, for messages.
            phases: This step's phase times, added to.
        """
        with self._spans.timed(phases, "precondition", "precondition", "KL-clip and write-back"):
            # One sum on the device and one read back, not a device sync per layer.
            # Products formed in float64: float32's would overflow on large finite gradients
            # and turn the clip off exactly when it matters.
            per_layer = [
                torch.sum(result.to(torch.float64) * grad.to(torch.float64))
                for _, result, grad in results
            ]
            products = float(torch.stack(per_layer).sum())
            scale = kl_clip_scale(products, kl_clip, lr)
            if scale == 0.0:
                warnings.warn(
                    f"K-FAC: the preconditioned gradients overflow at step {step} (their "
                    "KL-clip sum is not finite); the KL-clip sets them to zero for this step",
                    KFACWarning,
                    stacklevel=4,
                )
            for layer, result, _ in results:
                # Zeros, not result * 0: an infinite entry times 0 is NaN.
                layer.set_grad(torch.zeros_like(result) if scale == 0.0 else result * scale)
