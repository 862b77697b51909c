"""K-FAC's factor step: average the factors the hooks summed across ranks and fold them into
each layer's running averages (or fold this rank's own, to be averaged when a decomposition needs
them); at the first training step, drop layers that never ran."""

from __future__ import annotations

import time
import warnings

import torch

from interlace.kfac.decomp import all_finite
from interlace.kfac.factor_comm import FactorComm
from interlace.kfac.preconditioned_layer import KFACLayer
from interlace.kfac.timing import SpanLog
from interlace.kfac.warning import KFACWarning

__all__ = ["FactorUpdate"]


class FactorUpdate:
    """Runs the factor steps of one preconditioner.

    Args:
        comm: How factors are averaged across ranks.
        spans: Where the work is timed.
        rank: This rank in the K-FAC group (rank 0 warns).
    """

    def __init__(self, comm: FactorComm, spans: SpanLog, rank: int) -> None:
        self._comm = comm
        self._spans = spans
        self._rank = rank
        self._hooks_checked = False
        self._warned_unregistered = False
        #: Whether some running averages hold this rank's factors only (steps whose factors
        #: were held): :meth:`sync` averages them.
        self.pending = False

    def run(
        self,
        layers: list[KFACLayer],
        *,
        skipped: dict[str, str],
        decay: float,
        step: int,
        device: torch.device,
        phases: dict[str, float],
    ) -> list[KFACLayer]:
        """Average this step's factors across ranks and fold them into the running averages.

        Args:
            layers: The registered layers.
            skipped: Modules left to the optimiser, with the reason; layers dropped here are
                added.
            decay: The running averages' decay at this step.
            step: The step count, for messages.
            device: Where the layers live.
            phases: This step's phase times, added to.

        Returns:
            The layers still registered (``layers`` itself when none was dropped).
        """
        if self._comm.pipelining:
            started = time.perf_counter()
            ready, averaged = self._comm.finish_pipelined(layers, phases, device, started)
        else:
            if self._comm.holding and self._hooks_checked:
                # Nothing is sent, so nothing needs the ranks to agree: each folds what it has.
                ready = [layer for layer in layers if layer.a_count > 0 and layer.g_count > 0]
            else:
                # A collective: its time is mostly the wait for the slowest rank's backward.
                with self._spans.timed(phases, "factor_comm", "comm", "factor presence"):
                    everywhere, anywhere = self._comm.agree_presence(layers, device)
                if not self._hooks_checked:
                    if not any(everywhere.values()):
                        self._wait_for_training_step(step)
                        return layers
                    self._hooks_checked = True
                    layers = self._drop_silent_layers(layers, skipped, anywhere)
                ready = [layer for layer in layers if everywhere[layer.name]]
            averaged = [tensor for layer in ready for tensor in layer.batch_factors()]
            if self._comm.holding:
                self.pending = True  # folded as they are; sync() averages the running averages
            else:
                with self._spans.timed(phases, "factor_comm", "comm", "factor all-reduce"):
                    averaged = self._comm.all_reduce_mean(averaged)
        self._fold(ready, averaged, decay, step, phases)
        self._comm.end_factor_step(layers, device)
        return layers

    def sync(
        self,
        layers: list[KFACLayer],
        step: int,
        device: torch.device,
        phases: dict[str, float],
    ) -> None:
        """Average the running averages across ranks if some hold this rank's factors only.

        Args:
            layers: The registered layers.
            step: The step count, for messages.
            device: Where the layers live.
            phases: This step's phase times, added to.
        """
        if not self.pending:
            return
        with self._spans.timed(phases, "factor_comm", "comm", "running-average all-reduce"):
            bad = self._comm.average_running(layers, device)
        self.pending = bool(bad)
        if bad:
            warnings.warn(
                f"K-FAC: the running averages of {', '.join(layer.name for layer in bad)} are "
                f"not finite on some rank at step {step}; each rank keeps its own until the "
                "next decomposition step",
                KFACWarning,
                stacklevel=4,
            )

    def _fold(
        self,
        ready: list[KFACLayer],
        averaged: list[torch.Tensor],
        decay: float,
        step: int,
        phases: dict[str, float],
    ) -> None:
        """Fold each ready layer's averaged ``A`` and ``G`` (alternating in ``averaged``) into its
        running averages, dropping a layer's non-finite factors for this step."""
        with self._spans.timed(phases, "factor_compute", "factor", "running averages"):
            finite = all_finite(averaged)
            for index, layer in enumerate(ready):
                if not (finite[2 * index] and finite[2 * index + 1]):
                    warnings.warn(
                        f"K-FAC: non-finite factors for layer {layer.name} at step "
                        f"{step}; this step's factors are dropped, the running "
                        "averages are kept",
                        KFACWarning,
                        stacklevel=4,
                    )
                    continue
                layer.update_factors(averaged[2 * index], averaged[2 * index + 1], decay)

    def _wait_for_training_step(self, step: int) -> None:
        """No layer has both factors: no training-mode forward and backward ran since the last
        step. Which layers never run can only be told after one that did, so none is dropped."""
        if self._rank == 0 and not self._warned_unregistered:
            self._warned_unregistered = True
            warnings.warn(
                f"K-FAC step {step} had no training-mode forward and backward behind it "
                "(step() before the first backward, or the model in eval() mode or under "
                "no_grad); nothing is preconditioned yet, and K-FAC takes its layers from the "
                "first step that has one",
                KFACWarning,
                stacklevel=4,
            )

    def _drop_silent_layers(
        self, layers: list[KFACLayer], skipped: dict[str, str], anywhere: dict[str, bool]
    ) -> list[KFACLayer]:
        """Unregister layers whose forward hook fired on no rank in the first training step."""
        keep: list[KFACLayer] = []
        for layer in layers:
            if anywhere[layer.name]:
                keep.append(layer)
                continue
            layer.remove_hooks()
            reason = (
                "its forward never ran in the first training step (its weight is used "
                "functionally by its parent)"
            )
            skipped[layer.name] = reason
            if self._rank == 0:
                warnings.warn(
                    f"K-FAC skips layer {layer.name}: {reason}; the optimizer updates it "
                    "unpreconditioned",
                    KFACWarning,
                    stacklevel=4,
                )
        return keep if len(keep) != len(layers) else layers
