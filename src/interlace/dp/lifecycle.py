"""DataParallel's lifecycle as one object: profile, plan, try the candidate plans, settle on one.

Pure bookkeeping: the wrapper reports its passes and asks, at each forward, what is due; the
collectives (agreeing on timings and medians) stay in the wrapper (docs/notes/dp.md).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from interlace.comm.choose import Candidate
from interlace.comm.tuning import PlanTrials
from interlace.dp.iteration import ProfiledPasses

__all__ = ["Due", "Lifecycle", "Profiling", "Settled", "Trials"]


class Due(enum.Enum):
    """What a forward must do before it runs."""

    #: Nothing: keep the buckets in use.
    NOTHING = "nothing"
    #: Enough passes are profiled: plan (collective).
    PLAN = "plan"
    #: The trials move on: use :attr:`Lifecycle.candidate`'s buckets.
    SWITCH = "switch"
    #: The trials are over: agree on the medians and keep the fastest (collective).
    DECIDE = "decide"


@dataclass
class Profiling:
    """Backward passes sent in one bucket after backward, timed; the first is a warm-up.

    Args:
        needed: Timed passes before planning.
    """

    needed: int
    passes: ProfiledPasses = field(default_factory=ProfiledPasses)
    warmed_up: bool = False


@dataclass
class Trials:
    """Each candidate run for real in turn, its iterations timed.

    Args:
        candidates: The plans tried, in trial order.
        schedule: Which one runs when, and what each measured.
    """

    candidates: list[Candidate]
    schedule: PlanTrials
    #: When the iteration being timed began (None: the next one is not timed).
    timed_from: float | None = None


@dataclass
class Settled:
    """The plan in use from now on.

    Args:
        candidate: The plan kept.
    """

    candidate: Candidate


class Lifecycle:
    """Where DataParallel stands: profiling, on trial, or settled.

    Args:
        profile_steps: Timed backward passes before planning.
    """

    def __init__(self, profile_steps: int) -> None:
        self.phase: Profiling | Trials | Settled = Profiling(profile_steps)
        #: Synchronised backward passes so far.
        self.passes = 0
        #: Whether the latest :meth:`at_forward` took an iteration time for the trials.
        self.recorded = False

    @property
    def candidate(self) -> Candidate | None:
        """The plan whose buckets should be in use (None while profiling)."""
        if isinstance(self.phase, Trials):
            return self.phase.candidates[self.phase.schedule.current]
        if isinstance(self.phase, Settled):
            return self.phase.candidate
        return None

    @property
    def profiling(self) -> bool:
        """Whether passes are still being profiled (no plan yet)."""
        return isinstance(self.phase, Profiling)

    @property
    def warming_up(self) -> bool:
        """Whether the next pass is the first, the warm-up (profiled passes come after it)."""
        return isinstance(self.phase, Profiling) and not self.phase.warmed_up

    @property
    def fresh(self) -> bool:
        """Whether no backward pass has synchronised yet."""
        return self.passes == 0

    @property
    def settled(self) -> bool:
        """Whether the buckets are final."""
        return isinstance(self.phase, Settled)

    def passed(self, forward_s: float, backward_s: float, ready_s: Sequence[float]) -> None:
        """A synchronised backward pass ended with these timings (kept while profiling, after
        the warm-up pass; called for every pass).

        Args:
            forward_s: Its forward, seconds.
            backward_s: Its backward, seconds.
            ready_s: Each tensor's ready time from backward's start, seconds.
        """
        self.passes += 1
        phase = self.phase
        if not isinstance(phase, Profiling):
            return
        if not phase.warmed_up:
            # Pass 1 is a warm-up (allocator, lazy init); later ones are measured.
            phase.warmed_up = True
            return
        phase.passes.add(forward_s, backward_s, ready_s)

    def synchronised(self, forward_entered: float) -> None:
        """The iteration that began at ``forward_entered`` synchronised: the next forward ends
        it (timed while on trial).

        Args:
            forward_entered: ``time.perf_counter()`` when its forward was entered.
        """
        if isinstance(self.phase, Trials):
            self.phase.timed_from = forward_entered

    def at_forward(self, entered: float, *, training: bool, sync: bool) -> Due:
        """A forward is entered: what it must do first.

        Args:
            entered: ``time.perf_counter()`` now.
            training: Whether it is a training forward (gradients enabled, training mode).
            sync: Whether its backward will average (outside ``no_sync()``).
        """
        phase = self.phase
        self.recorded = False
        if isinstance(phase, Profiling):
            ready = len(phase.passes) >= phase.needed and sync
            return Due.PLAN if ready else Due.NOTHING
        if not isinstance(phase, Trials):
            return Due.NOTHING
        if not training:
            phase.timed_from = None  # an evaluation pass in between: that span is not training
            return Due.NOTHING
        if phase.timed_from is None or not sync:
            return Due.NOTHING
        seconds = entered - phase.timed_from
        phase.timed_from = None
        self.recorded = True
        if not phase.schedule.record(seconds):
            return Due.NOTHING
        return Due.DECIDE if phase.schedule.finished else Due.SWITCH

    def follow(self, recorded: bool) -> None:
        """Step as :meth:`at_forward` did on the ranks that still train, on a rank that ran out of
        inputs (``Join``): it times nothing, so an iteration time taken there counts as 0 here
        (the ranks agree on the slowest rank's times, so the 0 never wins).

        Args:
            recorded: Whether the training ranks' :meth:`at_forward` took an iteration time.
        """
        phase = self.phase
        if isinstance(phase, Trials):
            phase.timed_from = None
            if recorded:
                phase.schedule.record(0.0)

    def interrupt(self) -> None:
        """The iteration in progress is not one to time (the ranks left ``Join``)."""
        if isinstance(self.phase, Trials):
            self.phase.timed_from = None

    def profiled_medians(self) -> list[float]:
        """The profiled passes' medians: forward, backward, then each tensor's ready time."""
        assert isinstance(self.phase, Profiling)
        return self.phase.passes.medians()

    def try_candidates(self, candidates: Sequence[Candidate], steps: int) -> Candidate:
        """Planning is done: try ``candidates`` in turn (settle at once on a lone one);
        returns the one to use now.

        Args:
            candidates: The plans worth running, the cost model's own first.
            steps: Timed iterations per candidate and round.
        """
        if len(candidates) > 1:
            self.phase = Trials(list(candidates), PlanTrials([c.label for c in candidates], steps))
        else:
            self.phase = Settled(candidates[0])
        candidate = self.candidate
        assert candidate is not None
        return candidate

    def trial_medians(self) -> list[float]:
        """Each candidate's median iteration time, this rank's."""
        assert isinstance(self.phase, Trials)
        return self.phase.schedule.medians()

    def trial_noise(self) -> float:
        """The relative standard error of this rank's noisiest trial median."""
        assert isinstance(self.phase, Trials)
        return self.phase.schedule.noise()

    def settle(self, candidate: Candidate) -> None:
        """Keep ``candidate`` from now on.

        Args:
            candidate: The plan kept.
        """
        self.phase = Settled(candidate)
