"""Averaging K-FAC factors across ranks as a mode says: in bulk at the step
(:mod:`interlace.kfac.factor_bulk`) or pipelined from the hooks
(:mod:`interlace.kfac.factor_pipeline`), with the first (bulk) step's discovery of the ready
order and ``"merged"``'s profiling and bucket trials.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from interlace.comm.calibrate import fit_cost_model
from interlace.comm.cost import CostModel
from interlace.comm.plan import Bucketing
from interlace.comm.tuning import PlanTrials, describe_trials, fastest
from interlace.kfac.decomp import all_finite
from interlace.kfac.factor_bulk import all_reduce_mean
from interlace.kfac.factor_modes import FactorCommMode, Pipelined
from interlace.kfac.factor_pipeline import FactorKey, FactorPipeline
from interlace.kfac.fusion import fusion_from, make_groups, merged_candidates
from interlace.kfac.packing import pack_upper, unpack_upper
from interlace.kfac.preconditioned_layer import KFACLayer
from interlace.kfac.sizes import factor_numel
from interlace.kfac.timing import SpanLog
from interlace.kfac.work_assignment import GroupRanks

__all__ = ["FactorComm", "FactorKey", "FactorPipeline", "all_reduce_mean"]

#: Rounds of the bucket trials (``Pipelined(tune_steps=)``): fewer than DataParallel's, because
#: a K-FAC step is dearer; forward then backward still spreads a drift of load evenly.
FACTOR_TRIAL_ROUNDS = 2


class FactorComm:
    """Averages the layers' factors across ranks as a mode says: in bulk, or pipelined from the
    hooks (``KFAC(factor_comm=)``, :mod:`interlace.kfac.factor_modes`).

    The first factor step is always bulk: it finds the layers whose hooks never fire, and
    rank 0's hook order becomes the ready order. Pipelining starts after it, with several
    ranks and ``accumulation_steps == 1`` only (with accumulation a factor is complete only
    after the last micro-batch). Constructing it creates the factor group (collective).

    Args:
        mode: :class:`~interlace.kfac.factor_modes.Bulk` or
            :class:`~interlace.kfac.factor_modes.Pipelined` (with its fusion's settings).
        ranks: The process group K-FAC runs on and this rank in it.
        bucket_bytes: The most bytes per bulk (and ``"fixed"``) all-reduce.
        accumulation_steps: Micro-batches per step.
        spans: Where timed spans go.
        symmetry_aware: Bulk all-reduces send each factor's upper triangle only (kfac-pytorch's
            ``symmetry_aware``); pipelined buckets always do.
    """

    def __init__(
        self,
        mode: FactorCommMode,
        *,
        ranks: GroupRanks,
        bucket_bytes: int,
        accumulation_steps: int,
        spans: SpanLog,
        symmetry_aware: bool = False,
    ) -> None:
        self.mode = mode
        self.world_size = ranks.world_size
        self.group = ranks.group
        self.global_ranks = ranks.global_ranks
        self.bucket_bytes = bucket_bytes
        self.symmetry_aware = symmetry_aware
        self.accumulation_steps = accumulation_steps
        #: The all-reduce cost model behind ``fusion="merged"`` (given, or fitted when needed).
        self.factor_cost: CostModel | None = (
            mode.factor_cost if isinstance(mode, Pipelined) else None
        )
        self.spans = spans
        #: The pipelined buckets in use (indices into :attr:`factor_order`); None until
        #: pipelining starts, singletons while ``"merged"`` profiles.
        self.factor_plan: list[list[int]] | None = None
        #: The factors' ready order pipelining uses.
        self.factor_order: list[FactorKey] = []
        #: The trials' outcome once ``"merged"`` has weighed its candidates (None before, or
        #: with one candidate or ``tune_steps=0``).
        self.tuning: str | None = None
        self._candidates: list[tuple[str, list[list[int]]]] = []
        self._trials: PlanTrials | None = None
        # Seconds from the step's first factor to the end of the wait for the last bucket:
        # what a bucket plan changes (the passes with their launches, and the exposed wait).
        self._timed_s: float | None = None
        self._pipe: FactorPipeline | None = None
        self._fired: list[FactorKey] = []
        #: This step's factors stay on this rank (folded into its own running averages, which
        #: are averaged when a decomposition needs them): the hooks launch nothing.
        self.holding = False
        #: Whether pipelining is to start at all: under ``factor_sync="at-decomposition"`` only
        #: factor steps that decompose all-reduce, so with decompositions rarer than factor
        #: steps the pipeline would hold buffers that no step uses.
        self.pipeline_wanted = True
        # Pipelined all-reduces start inside the hooks, while a data-parallel wrapper's
        # gradient all-reduces run on the default group: a group of their own keeps the two
        # sequences apart (new_group is collective, so every rank creates it here).
        self.factor_group: dist.ProcessGroup | None = None
        if mode.pipelined and ranks.distributed and ranks.world_size > 1:
            self.factor_group = dist.new_group(ranks.global_ranks)

    @property
    def pipelining(self) -> bool:
        """Whether the hooks launch the factor all-reduces this step (after the first factor
        step, unless the step's factors are held)."""
        return self._pipe is not None and not self.holding

    @property
    def can_pipeline(self) -> bool:
        """Whether pipelining will start: several ranks (a factor group) and no micro-batch
        accumulation."""
        return self.factor_group is not None and self.accumulation_steps == 1

    @property
    def plan_settled(self) -> bool:
        """Whether the factor buckets are final: no profiling or trials to come."""
        if not (self.can_pipeline and self.pipeline_wanted):
            return True
        pipe = self._pipe
        return pipe is not None and not pipe.profiling and self._trials is None

    def factor_ready(self, key: FactorKey, factor: torch.Tensor, count: int) -> None:
        """A hook computed a factor: send it, or note its ready order before pipelining.

        Args:
            key: Which factor.
            factor: This batch's factor.
            count: How many batches of it this step holds now.
        """
        if self.pipelining:
            assert self._pipe is not None
            self._pipe.offer(key, factor)
        elif self.mode.pipelined and count == 1:
            self._fired.append(key)

    def forget_ready_order(self) -> None:
        """Forget the factors noted this step (the step is over)."""
        self._fired = []

    def all_reduce_mean(
        self, tensors: list[torch.Tensor], *, packed: bool | None = None
    ) -> list[torch.Tensor]:
        """:func:`all_reduce_mean` on the K-FAC group.

        Args:
            tensors: The same shapes and dtypes on every rank.
            packed: Send each (symmetric) tensor's upper triangle only (None: as
                ``symmetry_aware`` says).
        """
        if packed is None:
            packed = self.symmetry_aware
        if not packed or self.world_size == 1:
            return all_reduce_mean(tensors, self.world_size, self.group, self.bucket_bytes)
        uppers = [pack_upper(tensor) for tensor in tensors]
        # A diagonal factor passes through pack_upper as itself; the all-reduce is in place.
        uppers = [p.clone() if p is t else p for p, t in zip(uppers, tensors, strict=True)]
        means = all_reduce_mean(uppers, self.world_size, self.group, self.bucket_bytes)
        return [
            unpack_upper(mean, tensor.shape[0], diagonal=tensor.dim() == 1)
            for mean, tensor in zip(means, tensors, strict=True)
        ]

    def _min_over_ranks(self, values: torch.Tensor, device: torch.device) -> list[int]:
        """Each of the integer ``values``' minimum over the K-FAC group's ranks (one small
        all-reduce on the main group; ``values`` as they are on one rank)."""
        values = values.to(device)
        if self.world_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MIN, group=self.group)
        return [int(value) for value in values.cpu().tolist()]

    def average_running(self, layers: Sequence[KFACLayer], device: torch.device) -> list[KFACLayer]:
        """Average the layers' running averages across ranks in place (their packed upper
        triangles, in bulk): what ``factor_sync="at-decomposition"`` does before decomposing.

        A layer whose running averages some ranks lack (it first ran, in a held step, on some
        ranks only) has them dropped everywhere, as averaging every update would not have
        started them: every rank then decomposes the same layers.

        Args:
            layers: The registered layers.
            device: Where the collectives' tensors live.

        Returns:
            The layers whose averages were not finite; they keep this rank's own.
        """
        if self.world_size == 1:
            return []
        present = torch.tensor([layer.a_factor is not None for layer in layers], dtype=torch.int32)
        held: list[KFACLayer] = []
        for layer, everywhere in zip(layers, self._min_over_ranks(present, device), strict=True):
            if everywhere:
                held.append(layer)
            else:
                layer.a_factor = layer.g_factor = None
        if not held:
            return []
        tensors: list[torch.Tensor] = []
        for layer in held:
            assert layer.a_factor is not None and layer.g_factor is not None
            tensors += [layer.a_factor, layer.g_factor]
        means = self.all_reduce_mean(tensors, packed=True)
        finite = all_finite(means)
        bad: list[KFACLayer] = []
        for index, layer in enumerate(held):
            if finite[2 * index] and finite[2 * index + 1]:
                layer.a_factor, layer.g_factor = means[2 * index], means[2 * index + 1]
            else:
                bad.append(layer)
        return bad

    def agree_presence(
        self, layers: Sequence[KFACLayer], device: torch.device
    ) -> tuple[dict[str, bool], dict[str, bool]]:
        """Which layers have both factors on every rank, and whose ``A`` any rank has.

        One small collective so that every rank agrees which layers have factors this step: a
        layer seen by some ranks only would otherwise desynchronise the buckets.

        Args:
            layers: The registered layers.
            device: Where the collective's tensor lives.

        Returns:
            ``everywhere`` and ``anywhere`` by layer name.
        """
        present = [[layer.a_count > 0, layer.g_count > 0] for layer in layers]
        # The minimum of -x is minus the maximum: "everywhere" and "anywhere" in one collective.
        flags = torch.tensor([[*both, -both[0]] for both in present], dtype=torch.int32)
        mins = self._min_over_ranks(flags.reshape(-1), device)
        return (
            {layer.name: bool(mins[3 * i] and mins[3 * i + 1]) for i, layer in enumerate(layers)},
            {layer.name: mins[3 * i + 2] < 0 for i, layer in enumerate(layers)},
        )

    def finish_pipelined(
        self,
        layers: Sequence[KFACLayer],
        phases: dict[str, float],
        device: torch.device,
        started: float,
    ) -> tuple[list[KFACLayer], list[torch.Tensor]]:
        """The factor step when the hooks have already launched the all-reduces.

        Flushes the buckets still open (a factor missing on this rank is sent as zeros, so every
        rank issues the same collectives), then one small all-reduce agrees which layers every
        rank has and whether any rank saw a layer twice (a module called twice per step): the
        sums sent then hold only the first call, so the step falls back to the bulk all-reduce
        of the accumulated factors.

        Args:
            layers: The registered layers.
            phases: Seconds per phase, updated in place.
            device: Where the collectives' tensors live.
            started: When the factor step started (``time.perf_counter()``).

        Returns:
            The layers with factors on every rank, and their averaged ``A`` and ``G``
            (alternating).
        """
        pipe = self._pipe
        assert pipe is not None
        pipe.flush()
        counts = torch.tensor(
            [[layer.a_count, layer.g_count] for layer in layers], dtype=torch.int64
        )
        present = (counts > 0).to(torch.int64).reshape(-1)
        # A layer seen twice, or restarted after a skipped step: the sums sent are stale.
        repeated = int(bool((counts > 1).any()) or any(layer.restarted for layer in layers))
        # On the main group, idle once backward has returned: on the factor group this small
        # all-reduce would queue behind the buckets still in flight and hide their wait here.
        mins = self._min_over_ranks(torch.cat([present, torch.tensor([-repeated])]), device)
        everywhere = [mins[i : i + 2] for i in range(0, len(mins) - 1, 2)]
        any_repeated = mins[-1] < 0
        ready = [layer for layer, both in zip(layers, everywhere, strict=True) if all(both)]
        # Launching the last buckets and a collective (mostly the wait for the slowest rank):
        # communication, as kfac-pytorch's all-reduce calls are.
        phases["factor_comm"] += time.perf_counter() - started
        with self.spans.timed(phases, "factor_comm", "comm", "factor all-reduce wait"):
            means = pipe.wait()
        if pipe.origin is not None:
            self._timed_s = time.perf_counter() - pipe.origin
        if any_repeated:
            tensors = [tensor for layer in ready for tensor in layer.batch_factors()]
            with self.spans.timed(phases, "factor_comm", "comm", "factor all-reduce"):
                return ready, self.all_reduce_mean(tensors)
        averaged = []
        for layer in ready:
            for which, local in (("A", layer.a_sum), ("G", layer.g_sum)):
                assert local is not None
                dim, diagonal = layer.dims(which)
                mean = means[pipe.index[(layer.name, which)]]
                averaged.append(unpack_upper(mean, dim, diagonal=diagonal).to(local.dtype))
        return ready, averaged

    def end_factor_step(self, layers: Sequence[KFACLayer], device: torch.device) -> None:
        """After the factors are folded: plan or reset the pipeline, or start it.

        Args:
            layers: The registered layers (their set is fixed from the first factor step).
            device: Where the collectives' tensors live.
        """
        pipe = self._pipe
        if pipe is None:
            if self.can_pipeline and self.pipeline_wanted:
                self._start_pipeline(layers, device)
            return
        if self.holding:
            return  # the hooks launched nothing: nothing to profile or time
        if pipe.profiling:
            pipe.record_profile()
            assert isinstance(self.mode, Pipelined)
            if pipe.profiled >= self.mode.profile_steps:
                self._plan_merged(pipe, device)
        elif self._trials is not None:
            # Every rank records every step, so all switch plans together.
            self._on_trial(self._trials, self._timed_s or 0.0, device)
        self._timed_s = None
        pipe.reset()

    def _start_pipeline(self, layers: Sequence[KFACLayer], device: torch.device) -> None:
        """After the first (bulk) factor step: fix the factors' ready order and first buckets.

        The ready order is rank 0's hook order, broadcast so that every rank indexes the plan
        the same way (factors rank 0 never saw go last, in layer order).
        """
        position = {layer.name: index for index, layer in enumerate(layers)}
        count = 2 * len(layers)
        codes = torch.full((count,), -1, dtype=torch.int64)
        seen = [
            2 * position[name] + (which == "G") for name, which in self._fired if name in position
        ]
        seen = list(dict.fromkeys(seen))
        codes[: len(seen)] = torch.tensor(seen, dtype=torch.int64)
        codes = codes.to(device)
        dist.broadcast(codes, src=self.global_ranks[0], group=self.factor_group)
        order = [int(code) for code in codes.cpu().tolist() if code >= 0]
        order += [code for code in range(count) if code not in set(order)]
        keys: list[FactorKey] = []
        numels: list[int] = []
        dtypes: list[torch.dtype] = []
        for code in order:
            layer, which = layers[code // 2], "G" if code % 2 == 1 else "A"
            dim, diagonal = layer.dims(which)
            numels.append(factor_numel(dim, diagonal=diagonal))
            factor = layer.factor(which)
            dtypes.append(layer.helper.weight.dtype if factor is None else factor.dtype)
            keys.append((layer.name, which))
        self.factor_order = keys
        self._pipe = FactorPipeline(
            keys, numels, dtypes, group=self.factor_group, device=device, spans=self.spans
        )
        assert isinstance(self.mode, Pipelined)  # only pipelined modes have a factor group
        fusion = fusion_from(self.mode.fusion)
        if fusion is Bucketing.MERGED:
            # Per-factor launches while the ready times are profiled.
            self._pipe.profiling = True
            self._set_plan(make_groups(Bucketing.PER_TENSOR, self._pipe.nbytes))
        else:
            self._set_plan(make_groups(fusion, self._pipe.nbytes, cap_bytes=self.bucket_bytes))

    def _set_plan(self, groups: list[list[int]]) -> None:
        assert self._pipe is not None
        self.factor_plan = groups
        self._pipe.groups = groups
        self._pipe.reset()

    def _plan_merged(self, pipe: FactorPipeline, device: torch.device) -> None:
        """Merged buckets from the profiled ready times (slowest rank's) and the cost model."""
        ready = torch.tensor(pipe.mean_ready_s(), dtype=torch.float64, device=device)
        # Every rank must derive the same plan: the same times, sizes and cost model.
        dist.all_reduce(ready, op=dist.ReduceOp.MAX, group=self.factor_group)
        if self.factor_cost is None:
            self.factor_cost = fit_cost_model(self.factor_group, device=device)
        pipe.profiling = False
        self._candidates = merged_candidates(pipe.nbytes, ready.cpu().tolist(), self.factor_cost)
        assert isinstance(self.mode, Pipelined)
        if self.mode.tune_steps > 0 and len(self._candidates) > 1:
            labels = [label for label, _ in self._candidates]
            self._trials = PlanTrials(labels, self.mode.tune_steps, FACTOR_TRIAL_ROUNDS)
        self._set_plan(self._candidates[0 if self._trials is None else self._trials.current][1])

    def _on_trial(self, trials: PlanTrials, seconds: float, device: torch.device) -> None:
        """One timed step of the bucket trials: the next candidate's buckets when its turn
        comes, and, after the last, the fastest by the slowest rank's medians (every rank
        keeps the same)."""
        if not trials.record(seconds):
            return
        if not trials.finished:
            self._set_plan(self._candidates[trials.current][1])
            return
        medians = torch.tensor(trials.medians(), dtype=torch.float64, device=device)
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=self.factor_group)
        slowest = medians.cpu().tolist()
        chosen = fastest(slowest)
        self.tuning = describe_trials(trials.labels, slowest, chosen)
        self._trials = None
        self._set_plan(self._candidates[chosen][1])
