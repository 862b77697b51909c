"""DataParallel's lifecycle: warm-up, profiled passes, trials, settled; what each forward owes."""

from __future__ import annotations

import pytest

from interlace.comm.choose import Candidate
from interlace.comm.cost import CostModel
from interlace.comm.plan import ReadyTensor
from interlace.comm.planners import make_plan
from interlace.dp.lifecycle import Due, Lifecycle

TENSORS = [ReadyTensor("a", 10, 0.0), ReadyTensor("b", 10, 1.0)]


def _candidate(label: str, cap: float) -> Candidate:
    plan = make_plan("fixed", TENSORS, CostModel(0.0, 0.0), cap_bytes=cap)
    return Candidate(plan, (1, 0), "", label)


def test_profiling_plans_after_the_warm_up_and_the_profiled_passes() -> None:
    life = Lifecycle(profile_steps=2)
    assert life.fresh and life.warming_up and life.profiling and life.candidate is None
    assert life.at_forward(0.0, training=True, sync=True) is Due.NOTHING
    life.passed(0.1, 0.2, [0.0, 0.1])  # the warm-up: not kept
    assert not life.warming_up and not life.fresh
    life.passed(0.1, 0.2, [0.0, 0.1])
    assert life.at_forward(1.0, training=True, sync=True) is Due.NOTHING
    life.passed(0.3, 0.4, [0.1, 0.3])
    # Inside no_sync() the plan waits for a forward whose backward averages.
    assert life.at_forward(2.0, training=True, sync=False) is Due.NOTHING
    assert life.at_forward(2.0, training=True, sync=True) is Due.PLAN
    assert life.profiled_medians() == pytest.approx([0.2, 0.3, 0.05, 0.2])


def test_trials_time_training_iterations_only_and_then_decide() -> None:
    life = Lifecycle(profile_steps=1)
    first, second = _candidate("one", 100), _candidate("two", 5)
    assert life.try_candidates([first, second], steps=1) is first
    clock = 0.0
    dues = []
    while True:
        life.synchronised(clock)
        clock += 1.0 if life.candidate is first else 2.0
        # An evaluation forward in between is not timed and changes nothing.
        assert life.at_forward(clock, training=False, sync=True) is Due.NOTHING
        life.synchronised(clock - (1.0 if life.candidate is first else 2.0))
        due = life.at_forward(clock, training=True, sync=True)
        dues.append(due)
        if due is Due.DECIDE:
            break
        assert len(dues) < 50
    assert Due.SWITCH in dues
    medians = life.trial_medians()
    assert medians == pytest.approx([1.0, 2.0])
    life.settle(first)
    assert life.settled and life.candidate is first
    assert life.at_forward(99.0, training=True, sync=True) is Due.NOTHING


def test_a_lone_candidate_is_settled_at_once() -> None:
    life = Lifecycle(profile_steps=3)
    only = _candidate("only", 100)
    assert life.try_candidates([only], steps=2) is only and life.settled
    assert not life.profiling and life.candidate is only
