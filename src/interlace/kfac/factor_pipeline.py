"""The factor pipeline (SPD-KFAC): each factor's packed upper triangle all-reduced from its hook
as soon as it is computed, in the buckets :mod:`interlace.kfac.fusion` plans, on a process group
of its own."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from interlace.comm.engine import BucketEngine
from interlace.kfac.packing import pack_upper
from interlace.kfac.timing import SpanLog

__all__ = ["FactorKey", "FactorPipeline"]

#: A factor in the pipeline's ready order: ``(layer name, "A" or "G")``.
FactorKey = tuple[str, str]


class FactorPipeline:
    """The in-hook communicator of pipelined factor all-reduces (one factor step at a time).

    Factors are indexed by their position in the ready order (``keys``). :meth:`offer` packs a
    factor's upper triangle into its bucket of the communication core's bucket engine, which
    launches every bucket now complete, in plan order, on the factor group; :meth:`flush`
    launches the rest and :meth:`wait` collects the averages. While profiling it also notes each
    factor's ready time, seconds since the first factor of the step (about the start of the
    forward pass).

    Args:
        keys: The factors in ready order.
        numels: Each factor's packed size.
        dtypes: Each factor's dtype.
        group: The factor group.
        device: Where the buckets live.
        spans: Where each bucket's all-reduce is logged, from its launch to its wait.
    """

    def __init__(
        self,
        keys: list[FactorKey],
        numels: list[int],
        dtypes: list[torch.dtype],
        *,
        group: dist.ProcessGroup | None,
        device: torch.device,
        spans: SpanLog,
    ) -> None:
        self.index = {key: position for position, key in enumerate(keys)}
        self.numels = numels
        self.dtypes = dtypes
        self.group = group
        self.device = device
        self.spans = spans
        #: Packed bytes of each factor, in ready order.
        self.nbytes = [n * d.itemsize for n, d in zip(numels, dtypes, strict=True)]
        self.groups: list[list[int]] = [[i] for i in range(len(keys))]
        self.profiling = False
        self.profiled = 0
        self._ready_sum = [0.0] * len(keys)
        self._ready_count = [0] * len(keys)
        # The engine needs the factors' shapes and dtypes only: meta tensors cost no memory.
        self._shapes = [
            torch.empty(n, dtype=d, device="meta") for n, d in zip(numels, dtypes, strict=True)
        ]
        self._engine: BucketEngine | None = None
        self.reset()

    def reset(self) -> None:
        """Forget this step's factors (collectives must have been waited for); take up
        :attr:`groups` if they changed."""
        if self._engine is None or self._engine.groups != self.groups:
            # No recorder: its completion callback would run on the backend's thread and need
            # the GIL there, holding up the next bucket's all-reduce while the hooks run Python.
            self._engine = BucketEngine(self._shapes, self.groups, self.group, device=self.device)
        self._engine.begin()
        self._offered: set[int] = set()
        self.ready_s: dict[int, float] = {}
        self.origin: float | None = None

    def offer(self, key: FactorKey, factor: torch.Tensor) -> None:
        """A factor is ready: pack it into its bucket and launch every bucket now complete.

        Args:
            key: Which factor.
            factor: This batch's factor (this rank's, not yet averaged).
        """
        now = time.perf_counter()
        if self.origin is None:
            self.origin = now
        position = self.index.get(key)
        # A second call of the same module in one step is caught by the step's counts.
        if position is None or position in self._offered:
            return
        self._offered.add(position)
        assert self._engine is not None
        # Packed straight into its place in the bucket: one copy of the triangle, not two.
        slot = self._engine.slot(position)
        self._engine.add(position, pack_upper(factor.to(slot.dtype), out=slot))
        self.ready_s[position] = now - self.origin

    def flush(self) -> None:
        """Launch every bucket not launched yet (zeros for a factor this rank did not make)."""
        assert self._engine is not None
        self._engine.close()

    def wait(self) -> dict[int, torch.Tensor]:
        """Every factor's average across ranks (1-D, packed), by ready position."""
        engine = self._engine
        assert engine is not None
        for bucket, members in enumerate(engine.groups):
            engine.wait([bucket])
            # From its launch to when the wait saw it done (an upper bound of its end).
            launched = engine.launched_s[bucket]
            if launched is not None:
                name = f"factor bucket {bucket} ({len(members)})"
                self.spans.add(name, "comm", launched, time.perf_counter())
        views = engine.averaged(range(len(self.numels)))
        return {position: view for position, view in enumerate(views) if view is not None}

    def record_profile(self) -> None:
        """Add this step's ready times to the profile."""
        self.profiled += 1
        for position, ready in self.ready_s.items():
            self._ready_sum[position] += ready
            self._ready_count[position] += 1

    def mean_ready_s(self) -> list[float]:
        """Each factor's mean profiled ready time (0 for one never seen on this rank)."""
        return [
            total / count if count else 0.0
            for total, count in zip(self._ready_sum, self._ready_count, strict=True)
        ]
