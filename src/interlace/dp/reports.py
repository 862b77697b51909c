"""What a DataParallel reports of its plans and its latest step: read-only properties, kept
apart from the wrapper's work (:attr:`DataParallel.plan` itself is on the wrapper)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from interlace.comm.cost import CostModel
from interlace.timeline import Timeline

if TYPE_CHECKING:
    from interlace.dp.averaging import Averaging
    from interlace.dp.planning import Plans

__all__ = ["ONE_RANK", "PlanReports"]

#: :attr:`PlanReports.channel_choice` on one rank, where nothing is averaged.
ONE_RANK = "one rank: nothing to average, so no buckets (single_rank_shortcut)"


class PlanReports:
    """The reports of :class:`~interlace.dp.data_parallel.DataParallel`; its attributes below
    are None on one rank (nothing averaged)."""

    _plans: Plans | None
    _run: Averaging | None
    _names: list[str]
    _cost_model: CostModel | None

    @property
    def last_timeline(self) -> Timeline | None:
        """The latest iteration's timeline while :meth:`record_timeline` is on."""
        return None if self._run is None else self._run.last_timeline

    @property
    def channel_choice(self) -> str:
        """Why the plan uses the channels it does (set when planned)."""
        return ONE_RANK if self._plans is None else self._plans.channel_choice

    @property
    def tuning_summary(self) -> str:
        """The candidate plans' measured iteration times and which was kept (set when done)."""
        return "" if self._plans is None else self._plans.tuning_summary

    @property
    def tuning_results(self) -> list[tuple[str, int, float]]:
        """Per candidate tried: its label, its bucket count, its median iteration seconds on
        the slowest rank (set when the trials end)."""
        return [] if self._plans is None else self._plans.tuning_results

    @property
    def last_forward_start(self) -> float:
        """``time.perf_counter()`` at the start of the latest forward: :attr:`last_timeline`'s
        time origin."""
        return 0.0 if self._run is None else self._run.forward_start

    @property
    def cost_model(self) -> CostModel | None:
        """The cost model the plans are priced with (fitted at planning time if not given)."""
        return self._cost_model if self._plans is None else self._plans.cost_model

    @property
    def parameter_names(self) -> list[str]:
        """The trainable parameters' names, in registration order."""
        return list(self._names)

    @property
    def buckets(self) -> list[list[str]]:
        """The parameters of each bucket in use, in plan order (a bucket mixing dtypes counts
        as one per dtype); none on one rank."""
        groups = [] if self._plans is None else self._plans.engine.groups
        return [[self._names[i] for i in group] for group in groups]

    @property
    def bucket_channels(self) -> list[list[int]]:
        """The channel of each slice of each bucket in use (one entry unless partitioned)."""
        assignment = [] if self._plans is None else self._plans.engine.assignment
        return [list(channels) for channels in assignment]

    @property
    def waited_buckets(self) -> list[int]:
        """The buckets (indices into :attr:`buckets`) of the latest backward whose averages this
        rank has waited for so far: with ``overlap="forward"``, a layer's forward pre-hook sees
        the ones the forward has needed up to that layer; empty once all are applied."""
        return [] if self._plans is None else self._plans.engine.waited_buckets()
