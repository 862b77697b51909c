"""The trials that choose among candidate plans by measured iteration time."""

from __future__ import annotations

import math

import pytest

from interlace.comm.cost import CostModel
from interlace.comm.tuning import (
    TIE_MARGIN,
    PlanTrials,
    describe_trials,
    fastest,
    scale_start_up,
    tie_margin,
)


def test_the_schedule_runs_the_candidates_forward_then_back() -> None:
    assert PlanTrials(["a", "b", "c"], steps=2, rounds=2).schedule == [0, 1, 2, 2, 1, 0]
    assert PlanTrials(["a", "b"], steps=2).schedule == [0, 1, 1, 0, 0, 1, 1, 0]
    assert PlanTrials(["a", "b"], steps=1, rounds=3).schedule == [0, 1, 1, 0, 0, 1]


def test_one_untimed_iteration_after_each_change_of_buckets() -> None:
    trials = PlanTrials(["a", "b"], steps=2, rounds=2)
    times = iter(range(100))
    switches = []
    while not trials.finished:
        before = trials.current
        if trials.record(float(next(times))):
            switches.append((before, trials.current if not trials.finished else None))
    # 0 warms up (t=0), times 1 and 2; 1 warms up (3), times 4, 5, then again 6, 7 without a
    # rebuild; 0 warms up (8) and times 9, 10.
    assert trials.samples == [[1.0, 2.0, 9.0, 10.0], [4.0, 5.0, 6.0, 7.0]]
    assert switches == [(0, 1), (1, 0), (0, None)]
    assert trials.medians() == [5.5, 5.5]
    with pytest.raises(RuntimeError, match="over"):
        trials.record(1.0)


def test_the_fastest_median_wins_and_a_tie_keeps_the_earlier_candidate() -> None:
    assert fastest([3.0, 1.0, 2.0]) == 1
    assert fastest([2.0, 2.0, 3.0]) == 0
    line = describe_trials(["model", "x4"], [0.0123, 0.0101], 1)
    assert line.endswith("model 12.3 ms, x4 10.1 ms; kept x4")


def test_start_ups_scale_and_the_per_byte_cost_stays() -> None:
    cost = CostModel(a=1e-3, b=2e-9, concurrency=((1.5e-3, 1.8), (2e-3, 2.5)))
    scaled = scale_start_up(cost, 4.0)
    assert scaled.a == pytest.approx(4e-3) and scaled.b == pytest.approx(2e-9)
    flat = [value for term in scaled.concurrency for value in term]
    assert flat == pytest.approx([6e-3, 1.8, 8e-3, 2.5])


def test_trials_need_two_candidates_and_positive_counts() -> None:
    with pytest.raises(ValueError, match="two candidates"):
        PlanTrials(["only"], steps=2)
    with pytest.raises(ValueError, match="steps >= 1"):
        PlanTrials(["a", "b"], steps=0)


def test_fastest_breaks_near_ties_by_fewer_buckets() -> None:
    medians = [10.0, 10.05, 9.9, 12.0]
    assert fastest(medians) == 2
    # 10.05 is within 2% of 9.9 and sends one bucket: it wins the tie.
    assert fastest(medians, buckets=[8, 1, 4, 1]) == 1
    # Outside the margin time decides, whatever the buckets.
    assert fastest(medians, buckets=[8, 1, 4, 1], margin=0.001) == 2
    with pytest.raises(ValueError, match="2 bucket counts for 4 medians"):
        fastest(medians, buckets=[1, 2])


def test_noise_is_the_worst_relative_standard_error_of_a_median() -> None:
    trials = PlanTrials(["a", "b"], steps=1, rounds=1)
    trials.samples = [[1.0, 2.0, 3.0, 4.0, 5.0], [10.0, 10.0, 10.0, 10.0]]
    # a: quartiles (exclusive method) 1.5 and 4.5, sigma 3 / 1.349, median 3, 5 samples.
    expected = 1.2533 * (3.0 / 1.349) / math.sqrt(5) / 3.0
    assert trials.noise() == pytest.approx(expected)
    assert tie_margin(0.0) == TIE_MARGIN
    assert tie_margin(expected) == pytest.approx(2 * expected)
