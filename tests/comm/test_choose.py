"""Choosing a plan from measured times: ready order, candidates, channel margin, explanations."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from interlace.comm.choose import (
    AUTO_MARGIN,
    Candidate,
    PlanRequest,
    Timings,
    best_plan,
    candidate_plans,
    explain_choice,
    fewest_channels_within_margin,
    ready_order,
    settle_trials,
)
from interlace.comm.cost import CostModel
from interlace.comm.plan import Bucketing, ReadyTensor
from interlace.comm.planners import make_plan

MS = 1e-3
COST = CostModel(a=1 * MS, b=1e-9)
#: Start-ups that overlap across channels: more channels pay on paper.
CONCURRENT = CostModel(a=5 * MS, b=1e-9, concurrency=((5 * MS, 1.2), (5 * MS, 1.4), (5 * MS, 1.6)))
#: Eight tensors of 0.2 MB, registered first-layer-first, so backward makes them ready last-first.
TIMINGS = Timings(
    names=tuple(f"p{i}" for i in range(8)),
    nbytes=(200_000,) * 8,
    forward_s=3 * MS,
    backward_s=9 * MS,
    ready_s=tuple((8 - i) * MS for i in range(8)),
)


def test_ready_order_sorts_by_time_ties_last_registered_first_and_clamps() -> None:
    order, clamped = ready_order([2.0, 1.0, 1.0, -1.0, 9.0], backward_s=5.0)
    assert clamped == [2.0, 1.0, 1.0, 0.0, 5.0]
    assert order == [3, 2, 1, 0, 4]


def test_the_plan_is_the_planners_on_the_tensors_in_ready_order() -> None:
    candidate = best_plan(PlanRequest(Bucketing.MERGED), TIMINGS, COST)
    assert candidate.order == (7, 6, 5, 4, 3, 2, 1, 0)
    tensors = [ReadyTensor(f"p{i}", 200_000, (8 - i) * MS) for i in candidate.order]
    expected = make_plan("merged", tensors, COST, backward_s=9 * MS, forward_s=3 * MS)
    assert candidate.plan == expected
    assert candidate.groups == [[candidate.order[i] for i in g] for g in expected.groups]
    assert candidate.why == ""  # one channel, as asked: nothing to explain


def test_compression_halves_the_bytes_the_planner_sees() -> None:
    plan = best_plan(PlanRequest(Bucketing.SINGLE, compression="fp16"), TIMINGS, COST).plan
    assert plan.buckets[0].nbytes == 8 * 100_000


def _labels(candidates: list[Candidate]) -> list[str]:
    return [candidate.label for candidate in candidates]


def test_tune_steps_zero_weighs_only_the_cost_models_plan() -> None:
    request = PlanRequest(Bucketing.MERGED, tune_steps=0)
    assert _labels(candidate_plans(request, TIMINGS, COST)) == ["the cost model's plan"]


def test_merged_weighs_larger_start_ups_ddps_and_even_buckets_each_plan_once() -> None:
    candidates = candidate_plans(PlanRequest(Bucketing.MERGED), TIMINGS, COST)
    labels = " | ".join(_labels(candidates))
    assert labels.startswith("the cost model's plan")
    for needle in ("start-up x4", "start-up x64", "DDP's buckets (1 MiB first, 25 MiB)"):
        assert needle in labels
    assert "4 even buckets" in labels and "8 even buckets" in labels
    keys = [(tuple(map(tuple, c.plan.groups)), c.plan.partition_bytes) for c in candidates]
    assert len(set(keys)) == len(keys)
    # Plans found twice are tried once, under both names.
    assert len(candidates) < 7 and " = " in labels


def test_per_tensor_on_one_channel_has_no_candidates_to_weigh() -> None:
    request = PlanRequest(Bucketing.PER_TENSOR)
    assert len(candidate_plans(request, TIMINGS, COST)) == 1


def _plan(channels: int, predicted_s: float) -> Any:
    return SimpleNamespace(channels=channels, predicted_s=predicted_s)


def test_more_channels_only_for_a_predicted_gain_above_the_margin() -> None:
    one, two = _plan(1, 1.0), _plan(2, 1.0 / (1 + AUTO_MARGIN) + 1e-6)
    assert fewest_channels_within_margin([one, two]) is one
    faster = _plan(2, 0.8)
    assert fewest_channels_within_margin([one, faster]) is faster


def test_auto_channels_are_weighed_and_explained() -> None:
    request = PlanRequest(Bucketing.PER_TENSOR, channels="auto", channel_groups=4, tune_steps=0)
    candidate = best_plan(request, TIMINGS, CONCURRENT)
    assert candidate.plan.channels > 1
    assert candidate.why.startswith("channels='auto' chose")
    for count in range(1, 5):
        assert f"k={count}:" in candidate.why
    assert "a(2)=5.00 ms c(2)=1.20" in candidate.why
    with_trials = candidate_plans(
        PlanRequest(Bucketing.PER_TENSOR, channels="auto", channel_groups=4), TIMINGS, CONCURRENT
    )
    for count in range(1, 5):
        assert any(f"{count} channel(s)" in label for label in _labels(with_trials))


def test_a_fixed_channel_count_is_explained_only_above_one() -> None:
    plan = best_plan(PlanRequest(Bucketing.PER_TENSOR), TIMINGS, COST).plan
    assert explain_choice(plan, [plan], 1) == ""
    on_two = best_plan(
        PlanRequest(Bucketing.PER_TENSOR, channels=2, channel_groups=2), TIMINGS, CONCURRENT
    )
    assert on_two.why.startswith("2 channel(s), partition")


def test_the_trials_keep_the_fastest_measured_and_say_so() -> None:
    candidates = candidate_plans(
        PlanRequest(Bucketing.PER_TENSOR, channels="auto", channel_groups=4), TIMINGS, CONCURRENT
    )
    medians = [0.010 + 0.001 * index for index in range(len(candidates))]
    medians[-1] = 0.005
    outcome = settle_trials(candidates, medians, "auto")
    assert outcome.kept.plan is candidates[-1].plan
    assert outcome.kept.why.startswith(
        f"channels='auto' kept {candidates[-1].plan.channels} channel(s) by measured"
    )
    assert outcome.summary.endswith(f"kept {candidates[-1].label}")
    assert outcome.results[-1] == (candidates[-1].label, len(candidates[-1].plan.buckets), 0.005)
    fixed = settle_trials(candidates, medians, 1)
    assert fixed.kept is candidates[-1]


@pytest.mark.parametrize("partition_mb", [None, 0.1])
def test_a_partition_threshold_that_is_given_is_the_only_one_weighed(
    partition_mb: float | None,
) -> None:
    request = PlanRequest(Bucketing.SINGLE, channels=2, channel_groups=2, partition_mb=partition_mb)
    plan = best_plan(request, TIMINGS, CONCURRENT).plan
    expected = None if partition_mb is None else partition_mb * 2**20  # MiB, as bucket caps
    assert plan.partition_bytes == expected
