"""Uneven inputs: DataParallel under ``torch.distributed.algorithms.join.Join``.

A rank that ran out of batches shadows, in order, every collective the others issue in their
iteration, by running the same code with no gradients (docs/data-parallel.md, "Uneven inputs").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from interlace.distenv import collective_device
from interlace.dp.lifecycle import Due
from interlace.dp.planning import Plans
from interlace.dp.replicas import BufferBroadcast, broadcast_from_first
from interlace.errors import UsageError

__all__ = ["Iteration", "JoinState", "Shadowed"]

_DUES = list(Due)


class Shadowed(Protocol):
    """What a joined rank runs of DataParallel: its engine, lifecycle and buffers."""

    module: nn.Module
    process_group: dist.ProcessGroup | None
    broadcast_buffers: bool
    _params: list[nn.Parameter]
    _plans: Plans
    _buffer_sync: BufferBroadcast
    _join: JoinState


@dataclass(frozen=True)
class Iteration:
    """What the ranks still training do in the iteration a forward begins, as every rank learns
    it in one all-reduce.

    Args:
        will_sync: Its backward averages gradients (gradients on, outside ``no_sync()``).
        due: What the lifecycle does first (planning, switching or settling the buckets).
        recorded: The trials took an iteration time at this forward.
        syncs_buffers: The forward starts from one rank's buffers.
        active: How many ranks have not joined.
        src: The global rank buffers come from: the highest that has not joined, as DDP's.
    """

    will_sync: bool
    due: Due
    recorded: bool
    syncs_buffers: bool
    active: int
    src: int


class JoinState:
    """One DataParallel's part in ``Join``: the hook it hands out and what the latest iteration
    told it.

    Args:
        process_group: The group averaged over (None: the default group).
    """

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.process_group = process_group
        self.divide_by_initial_world_size = True
        self.latest: Iteration | None = None

    def hook(self, wrapper: Shadowed, forward_overlap: bool, **kwargs: Any) -> JoinHook:
        """The join hook ``Join`` runs on this rank once it has joined.

        Args:
            wrapper: The DataParallel.
            forward_overlap: Whether it runs with ``overlap="forward"``.
            **kwargs: ``Join``'s keyword arguments: ``divide_by_initial_world_size`` (default
                True: joined ranks count as ranks that sent zeros, as DDP's default); others
                are meant for other joinables.

        Raises:
            UsageError: With ``overlap="forward"``, or a non-bool ``divide_by_initial_world_size``.
        """
        if forward_overlap:
            raise UsageError(
                "Join cannot shadow overlap='forward', whose all-reduces run on into the next "
                "forward; wrap with overlap='backward' to train on uneven inputs"
            )
        divide = kwargs.get("divide_by_initial_world_size", True)
        if not isinstance(divide, bool):
            raise UsageError(f"divide_by_initial_world_size must be True or False, got {divide!r}")
        self.divide_by_initial_world_size = divide
        return _JoinHook(wrapper)

    def begin(
        self, joinable: Joinable, *, will_sync: bool, due: Due, recorded: bool, syncs_buffers: bool
    ) -> Iteration:
        """A forward on a rank that has not joined: tell ``Join``, then share what this
        iteration does with every rank (the joined ones learn what to shadow from it).

        Args:
            joinable: The DataParallel.
            will_sync: See :class:`Iteration`.
            due: See :class:`Iteration`.
            recorded: See :class:`Iteration`.
            syncs_buffers: See :class:`Iteration`.

        Raises:
            RuntimeError: From ``Join`` with ``throw_on_early_termination=True``, once a rank
                has joined.
        """
        work = Join.notify_join_context(joinable)
        shared = self._exchange((will_sync, due, recorded, syncs_buffers))
        if work is not None:
            work.wait()
        return shared

    def rescale(self, averaged: list[torch.Tensor | None]) -> None:
        """With ``divide_by_initial_world_size=False``: the averages of the latest iteration
        over the ranks that had not joined, not over the whole group.

        Args:
            averaged: The averaged gradients (summed over the group, divided by its size).
        """
        latest = self.latest
        if latest is None or self.divide_by_initial_world_size:
            return
        world = dist.get_world_size(self.process_group)
        grads = [grad for grad in averaged if grad is not None]
        if grads and latest.active != world:
            torch._foreach_mul_(grads, world / latest.active)

    def _exchange(self, mine: tuple[bool, Due, bool, bool] | None) -> Iteration:
        """One all-reduce: the training ranks' iteration (theirs agree), and which ranks train;
        a joined rank passes None."""
        group = self.process_group
        world = dist.get_world_size(group)
        values = torch.zeros(4 + world, dtype=torch.int64)
        if mine is not None:
            will_sync, due, recorded, syncs_buffers = mine
            values[:4] = torch.tensor([will_sync, _DUES.index(due), recorded, syncs_buffers])
            values[4 + dist.get_rank(group)] = 1
        values = values.to(collective_device(group))
        dist.all_reduce(values, group=group)
        counts = values.tolist()
        present = counts[4:]
        active = sum(present)
        # The training ranks agree on their iteration: a sum is ``active`` times its value.
        sync_sum, due_sum, recorded_sum, buffers_sum = counts[:4]
        highest = max(rank for rank, here in enumerate(present) if here)
        self.latest = Iteration(
            will_sync=sync_sum > 0,
            due=_DUES[due_sum // active],
            recorded=recorded_sum > 0,
            syncs_buffers=buffers_sum > 0,
            active=active,
            src=highest if group is None else dist.get_global_rank(group, highest),
        )
        return self.latest


class _JoinHook(JoinHook):
    """Shadows each iteration of the ranks still training, then leaves every rank with the last
    joiner's model (as DDP's join hook does)."""

    def __init__(self, wrapper: Shadowed) -> None:
        self.wrapper = wrapper

    def main_hook(self) -> None:
        """One iteration of the training ranks, with this rank's gradients zero."""
        wrapper = self.wrapper
        iteration = wrapper._join._exchange(None)
        wrapper._plans.lifecycle.follow(iteration.recorded)
        wrapper._plans.on_due(iteration.due)
        if iteration.syncs_buffers:
            sync_buffers(wrapper, iteration.src)
        if not iteration.will_sync:
            return
        engine = wrapper._plans.engine
        # No gradient arrived: every bucket goes out as zeros, marked unused, in plan order.
        engine.finish()
        engine.begin()
        wrapper._plans.lifecycle.passed(0.0, 0.0, [0.0] * len(wrapper._params))
        wrapper._plans.lifecycle.synchronised(time.perf_counter())

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of the highest-ranked last joiner.

        Args:
            is_last_joiner: Whether this rank was among the last to join.
        """
        wrapper = self.wrapper
        group = wrapper.process_group
        rank = dist.get_rank(group)
        chosen = torch.tensor(
            [rank if is_last_joiner else -1], dtype=torch.int64, device=collective_device(group)
        )
        dist.all_reduce(chosen, op=dist.ReduceOp.MAX, group=group)
        src = int(chosen.item())
        module = wrapper.module
        tensors = [*module.parameters(), *(module.buffers() if wrapper.broadcast_buffers else ())]
        broadcast_from_first(
            tensors, group, src=src if group is None else dist.get_global_rank(group, src)
        )
        wrapper._plans.lifecycle.interrupt()


def sync_buffers(wrapper: Shadowed, src: int) -> None:
    """``src``'s buffers on every rank, now (under ``Join`` rank 0 may have joined).

    Args:
        wrapper: The DataParallel.
        src: The global rank to copy from.
    """
    # A snapshot sent before the Join came from rank 0 and is out of date.
    wrapper._buffer_sync.discard()
    broadcast_from_first(list(wrapper.module.buffers()), wrapper.process_group, src=src)
