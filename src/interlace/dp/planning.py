"""DataParallel's plans: the lifecycle, the candidates, and the bucket engine of the plan in use.

Planning and deciding are collective (the slowest rank's timings and medians, rank 0's plans);
:class:`Plans` runs them when the lifecycle says they are due (docs/notes/dp.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from interlace.comm.calibrate import fit_concurrency, fit_cost_model
from interlace.comm.channels import Channels, check_same_everywhere, layout_of
from interlace.comm.choose import Candidate, PlanRequest, Timings, candidate_plans, settle_trials
from interlace.comm.cost import CostModel
from interlace.comm.engine import BucketEngine
from interlace.comm.forward_plan import GateTiming
from interlace.comm.hooks import HookSpec, layout_changed
from interlace.comm.plan import Plan
from interlace.comm.tuning import tie_margin
from interlace.distenv import collective_device
from interlace.dp.forward_overlap import ForwardOverlap
from interlace.dp.lifecycle import Due, Lifecycle
from interlace.dp.plan_state import plan_from_dict, plan_state_of
from interlace.errors import UsageError

__all__ = ["Plans"]

logger = logging.getLogger("interlace")


class Plans:
    """Which buckets a DataParallel sends, from profiling through the trials to the plan kept.

    Args:
        request: The wrapper's settings, as the plan choice takes them.
        names: The trainable parameters' names, in registration order.
        params: The parameters.
        process_group: The group averaged over.
        channels: The process groups buckets travel on.
        profile_steps: Timed backward passes before planning.
        cost_model: The all-reduce cost model (None: fitted when planning).
        forward_overlap: The forward-overlap runtime (``overlap="forward"``), or None.
        batched_copy: Copy a bucket's gradients in at once when it is complete.
    """

    def __init__(
        self,
        request: PlanRequest,
        names: Sequence[str],
        params: Sequence[nn.Parameter],
        process_group: dist.ProcessGroup | None,
        channels: Channels,
        *,
        profile_steps: int,
        cost_model: CostModel | None,
        forward_overlap: ForwardOverlap | None,
        batched_copy: bool,
    ) -> None:
        self.request = request
        self.names = list(names)
        self.params = list(params)
        self.process_group = process_group
        self.channels = channels
        self.cost_model = cost_model
        self.forward_overlap = forward_overlap
        self.batched_copy = batched_copy
        self.lifecycle = Lifecycle(profile_steps)
        self.candidates: list[Candidate] = []
        self.in_use: Candidate | None = None
        self.hook: HookSpec | None = None
        #: Why the plan uses the channels it does (set when planned).
        self.channel_choice = ""
        #: The candidate plans' measured iteration times and which was kept (set when done).
        self.tuning_summary = ""
        #: Per candidate tried: its label, its bucket count, its median iteration seconds on
        #: the slowest rank (set when the trials end).
        self.tuning_results: list[tuple[str, int, float]] = []
        self._rank = dist.get_rank(process_group)
        self._src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        # Until profiling is over: everything in one bucket, sent after backward.
        self.engine = BucketEngine(
            self.params,
            [list(reversed(range(len(self.params))))],
            process_group,
            channels=channels.groups,
            compression=request.compression,
            batched_copy=batched_copy,
        )

    @property
    def plan(self) -> Plan | None:
        """The plan whose buckets are in use (None while profiling)."""
        return None if self.in_use is None else self.in_use.plan

    def attach_hook(self, hook: HookSpec) -> None:
        """Average each bucket with a DDP communication hook from now on.

        Args:
            hook: The hook and its state.
        """
        self.hook = hook
        self._replace_engine(self.engine.groups, None)

    def on_due(self, due: Due) -> None:
        """Do what the lifecycle says a forward must do first (collective).

        Args:
            due: What is due.
        """
        if due is Due.PLAN:
            self._plan()
        elif due is Due.SWITCH:
            self.use(self.lifecycle.candidate, announce=False)
        elif due is Due.DECIDE:
            self._decide()

    def use(self, candidate: Candidate | None, *, announce: bool = True) -> None:
        """Rebuild the buckets for ``candidate`` (identical on every rank, checked), unless its
        plan is in use already; record and announce why it was chosen.

        Args:
            candidate: The plan to use.
            announce: Log why its channels were chosen.
        """
        assert candidate is not None
        if self.forward_overlap is not None:
            # The engine in use may still have averages in flight.
            self.forward_overlap.complete()
        if self.in_use is None or candidate.plan is not self.in_use.plan:
            plan = candidate.plan
            # The plan came from rank 0, so this holds unless a rank was built differently; if
            # it fails, every rank raises here instead of hanging on a collective later.
            check_same_everywhere(
                (plan.channels, plan.partition_bytes, layout_of(candidate.groups, plan.launches)),
                "the channel plan (channels, partition threshold, buckets and launches)",
                self.process_group,
            )
            self._replace_engine(candidate.groups, plan)
        self.in_use = candidate
        why = candidate.why if announce else ""
        self.channel_choice = why
        if self._rank == 0 and why:
            logger.info("interlace.DataParallel: %s", why)

    def _replace_engine(self, groups: Sequence[Sequence[int]], plan: Plan | None) -> None:
        recorder = self.engine.recorder
        previous = self.engine.groups
        self.engine = BucketEngine(
            self.params,
            groups,
            self.process_group,
            channels=self.channels.groups,
            launches=None if plan is None else plan.launches,
            compression=self.request.compression,
            hook=self.hook,
            batched_copy=self.batched_copy,
        )
        self.engine.recorder = recorder
        if self.hook is not None and plan is not None and self.engine.groups != previous:
            layout_changed(self.hook.state)

    def _plan(self) -> None:
        """Take the slowest rank's timings, plan on rank 0, share the candidates, use the first."""
        medians = self.lifecycle.profiled_medians()
        overlap = self.forward_overlap
        # Every gate, reached or not, so every rank sends as many numbers whatever path its
        # forwards took; -1: not reached on this rank.
        gates = [] if overlap is None else overlap.gates.offsets()
        step_s = 0.0 if overlap is None else overlap.step_s()
        timings = torch.tensor(
            [*medians, *(-1.0 if offset is None else offset for _, offset in gates), step_s],
            dtype=torch.float64,
            device=collective_device(self.process_group),
        )
        # The slowest rank's times: a bucket's all-reduce completes only once every rank has
        # produced it, so the plan must fit the rank that gets there last.
        dist.all_reduce(timings, op=dist.ReduceOp.MAX, group=self.process_group)
        forward_s, backward_s, *rest = timings.tolist()
        ready = rest[: len(self.params)]
        # The gates some rank reached, in forward order.
        reached = sorted(
            (
                (offset, name)
                for (name, _), offset in zip(gates, rest[len(self.params) : -1], strict=True)
                if offset >= 0.0
            ),
        )
        device = self.params[0].device
        if self.cost_model is None:
            self.cost_model = fit_cost_model(self.process_group, device=device)
        if len(self.channels) > 1 and len(self.cost_model.concurrency) < len(self.channels) - 1:
            self.cost_model = fit_concurrency(self.channels.groups, self.cost_model, device=device)
        shared: list[Any] = [None]
        if self._rank == 0:
            waits = {} if overlap is None else overlap.gates.waits
            measured = Timings(
                tuple(self.names),
                tuple(p.numel() * p.element_size() for p in self.params),
                forward_s,
                backward_s,
                tuple(ready),
                tuple(
                    GateTiming(name, tuple(waits.get(name, ())), offset) for offset, name in reached
                ),
                rest[-1],
            )
            shared[0] = candidate_plans(self.request, measured, self.cost_model)
        dist.broadcast_object_list(shared, src=self._src, group=self.process_group)
        self.candidates = shared[0]
        if overlap is not None:
            overlap.timing_steps = False
        first = self.lifecycle.try_candidates(self.candidates, self.request.tune_steps)
        # A candidate on trial is not a choice: nothing to announce until the trials end.
        self.use(first, announce=self.lifecycle.settled)

    def _decide(self) -> None:
        """The trials are over: keep the candidate the slowest rank measured fastest."""
        # The slowest rank's medians: an iteration is over only when every rank is done.
        # The noise of the medians rides along: the slowest rank's and the noisiest rank's.
        medians = torch.tensor(
            [*self.lifecycle.trial_medians(), self.lifecycle.trial_noise()],
            dtype=torch.float64,
            device=collective_device(self.process_group),
        )
        dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=self.process_group)
        *slowest, noise = medians.tolist()
        outcome = settle_trials(
            self.candidates, slowest, self.request.channels, margin=tie_margin(noise)
        )
        self.tuning_summary = outcome.summary
        self.tuning_results = outcome.results
        self.lifecycle.settle(outcome.kept)
        self.candidates = []
        self.use(outcome.kept)
        if self._rank == 0:
            logger.info("interlace.DataParallel: %s", self.tuning_summary)

    def state(self) -> dict[str, Any] | None:
        """The final plan as plain data (for a checkpoint); None while profiling or on trial."""
        candidate = self.in_use
        if not self.lifecycle.settled or candidate is None:
            return None
        return plan_state_of(
            self.names, candidate.order, candidate.plan, self.channel_choice, self.tuning_summary
        )

    def load(self, state: Mapping[str, Any]) -> None:
        """Use a saved plan from now on, with no profiling and no trials; collective.

        Args:
            state: What :meth:`state` returned for the same model.

        Raises:
            UsageError: When the plan is for other parameters or more channels than there are,
                runs on into the forward without ``overlap="forward"``, or ranks load different
                plans.
        """
        if list(state["names"]) != self.names:
            raise UsageError(
                "the saved DataParallel plan is for other parameters than this model's; "
                "load it into the model it was made for"
            )
        plan = plan_from_dict(state["plan"])
        if plan.channels > len(self.channels):
            raise UsageError(
                f"the saved DataParallel plan uses {plan.channels} channels; this wrapper has "
                f"{len(self.channels)} (pass channels={plan.channels} or 'auto')"
            )
        if plan.overlaps_forward and self.forward_overlap is None:
            raise UsageError(
                "the saved DataParallel plan runs its all-reduces on into the next forward; "
                "wrap with overlap='forward' to load it"
            )
        if self.cost_model is None:
            self.cost_model = plan.cost
        if self.forward_overlap is not None:
            # No profiling will read them: timing the steps now would only pile up marks.
            self.forward_overlap.timing_steps = False
        candidate = Candidate(plan, tuple(state["order"]), str(state.get("why", "")))
        self.lifecycle.settle(candidate)
        self.candidates = []
        self.use(candidate)
        self.tuning_summary = str(state.get("tuning_summary", ""))
