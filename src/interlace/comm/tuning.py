"""Choosing among candidate plans by the iteration time each one is measured to give.

:class:`PlanTrials` is pure bookkeeping: the runtime feeds it iteration times and rebuilds
buckets when it says so (why trials at all: docs/notes/dp.md).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from interlace.comm.cost import CostModel

#: Besides the fitted start-up, the merge rule is also run with the start-up times these factors:
#: each is one candidate of the trials (from "merge little" to "nearly one bucket").
START_UP_SCALES = (4.0, 16.0, 64.0)

#: Passes over the candidates, alternately forward and backward, so a drift of the machine's
#: load during the trials favours no candidate.
ROUNDS = 4


def scale_start_up(cost: CostModel, factor: float) -> CostModel:
    """``cost`` with every start-up (alone and concurrent) ``factor`` times larger.

    Args:
        cost: the cost model.
        factor: the factor.
    """
    return CostModel(
        cost.a * factor,
        cost.b,
        tuple((a_j * factor, c_j) for a_j, c_j in cost.concurrency),
    )


class PlanTrials:
    """Which candidate runs now, and the iteration times each one has shown so far.

    Args:
        labels: the candidates' names, in trial order (at least two).
        steps: timed iterations per candidate and round.
        rounds: passes over the candidates, alternately forward and backward.

    Raises:
        ValueError: for fewer than two candidates or counts below 1.
    """

    def __init__(self, labels: Sequence[str], steps: int, rounds: int = ROUNDS) -> None:
        if len(labels) < 2:
            raise ValueError(f"trials need at least two candidates, got {len(labels)}")
        if steps < 1 or rounds < 1:
            raise ValueError(f"trials need steps >= 1 and rounds >= 1, got {steps}, {rounds}")
        self.labels = list(labels)
        self.steps = steps
        forward = list(range(len(labels)))
        self.schedule: list[int] = []
        for round_index in range(rounds):
            self.schedule += forward if round_index % 2 == 0 else forward[::-1]
        self.samples: list[list[float]] = [[] for _ in labels]
        self.position = 0
        self._timed_here = 0
        self._warming_up = True

    @property
    def current(self) -> int:
        """The candidate whose buckets should be in use now."""
        return self.schedule[min(self.position, len(self.schedule) - 1)]

    @property
    def finished(self) -> bool:
        return self.position >= len(self.schedule)

    def record(self, seconds: float) -> bool:
        """Take one iteration's time; True when the next iteration needs other buckets (another
        candidate, or the trials are over and the winner must be chosen).

        Args:
            seconds: the iteration's time.
        """
        if self.finished:
            raise RuntimeError("the trials are over; no more iteration times are taken")
        if self._warming_up:
            self._warming_up = False
            return False
        self.samples[self.current].append(seconds)
        self._timed_here += 1
        if self._timed_here < self.steps:
            return False
        before = self.current
        self.position += 1
        self._timed_here = 0
        if self.finished:
            return True
        # The same candidate twice in a row (where the order turns): no rebuild, no warm-up.
        self._warming_up = self.current != before
        return self._warming_up

    def medians(self) -> list[float]:
        """Each candidate's median iteration time (all rounds together)."""
        return [statistics.median(samples) for samples in self.samples]

    def noise(self) -> float:
        """The largest relative standard error of a candidate's median: the spread (p25-p75,
        as a normal sigma) times 1.2533 over the square root of the samples, over the median."""
        worst = 0.0
        for samples in self.samples:
            if len(samples) < 2:
                continue
            q1, _, q3 = statistics.quantiles(samples, n=4)
            median = statistics.median(samples)
            if median > 0:
                sigma = (q3 - q1) / 1.349
                worst = max(worst, 1.2533 * sigma / math.sqrt(len(samples)) / median)
        return worst


#: Measured medians within this fraction of the fastest count as a tie, which the candidate with
#: fewer buckets wins: every bucket costs host work per step, and the trials' noise can hide it.
TIE_MARGIN = 0.02


def tie_margin(noise: float) -> float:
    """The margin within which candidates tie: :data:`TIE_MARGIN`, or two standard errors of
    the trials' medians where they are noisier (a difference inside it is not measured).

    Args:
        noise: :meth:`PlanTrials.noise`, the slowest rank's.
    """
    return max(TIE_MARGIN, 2.0 * noise)


def fastest(
    medians: Sequence[float], buckets: Sequence[int] | None = None, margin: float = TIE_MARGIN
) -> int:
    """The candidate with the least median time; the earlier one on a tie (the fitted model's
    own plan comes first). Given bucket counts, the fewest buckets among those within
    ``margin`` of the least median.

    Args:
        medians: each candidate's median time.
        buckets: each candidate's bucket count (None: time alone decides).
        margin: the fraction of the least median within which candidates tie.
    """
    if buckets is None:
        return min(range(len(medians)), key=lambda index: (medians[index], index))
    if len(buckets) != len(medians):
        raise ValueError(f"{len(buckets)} bucket counts for {len(medians)} medians")
    best = min(medians)
    close = [index for index, median in enumerate(medians) if median <= best * (1 + margin)]
    return min(close, key=lambda index: (buckets[index], medians[index], index))


def describe_trials(
    labels: Sequence[str], medians: Sequence[float], chosen: int, margin: float | None = None
) -> str:
    """One line: every candidate's measured median, and which was kept.

    Args:
        labels: the candidates' names.
        medians: their median times, in seconds.
        chosen: the index of the one kept.
        margin: the tie margin the choice used (None: time alone decided).
    """
    weighed = ", ".join(
        f"{label} {median * 1e3:.1f} ms" for label, median in zip(labels, medians, strict=True)
    )
    ties = "" if margin is None else f"; ties within {margin:.1%} go to the fewest buckets"
    return (
        f"tuned by measured iteration time (slowest rank, median): {weighed}{ties}; "
        f"kept {labels[chosen]}"
    )
