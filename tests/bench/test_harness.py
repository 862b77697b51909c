"""The benchmarks' rank side: launching, rounds, jobs, batches, contenders, undilating and
quartiles."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from interlace.bench.harness import (
    DEFAULT_BATCH,
    FALLBACK_BATCH,
    NUM_CLASSES,
    Contender,
    LaunchFailedError,
    RankJob,
    default_batch,
    event_record,
    launch_on_ranks,
    make_optimizer,
    max_over_ranks,
    max_over_ranks_each,
    quartiles,
    rotated,
    round_order,
    split_blocks,
    steps_until,
    synthetic_batches,
    train_step,
    undilated,
)
from interlace.emulate import EmulatedStep, parse_compute
from interlace.sim.trace import TensorTrace, Trace
from interlace.testing import run_ranks
from interlace.timeline import Event


def test_timed_iterations_are_split_into_even_rounds() -> None:
    assert split_blocks(12, 3) == [4, 4, 4]
    assert split_blocks(8, 3) == [3, 3, 2]
    assert split_blocks(2, 5) == [1, 1]


@pytest.mark.parametrize("slots", [1, 2, 3, 4, 5, 6, 7])
def test_round_orders_balance_positions_and_predecessors(slots: int) -> None:
    # A balanced Latin square: over `slots` rounds (2x for an odd count) each slot takes every
    # position equally often and follows every other slot equally often.
    rounds = slots if slots % 2 == 0 else 2 * slots
    orders = [round_order(slots, index) for index in range(rounds)]
    for order in orders:
        assert sorted(order) == list(range(slots))
    per_round = rounds // slots
    for position in range(slots):
        assert Counter(order[position] for order in orders) == dict.fromkeys(
            range(slots), per_round
        )
    follows = Counter((a, b) for order in orders for a, b in itertools.pairwise(order))
    expected = {(a, b): per_round for a in range(slots) for b in range(slots) if a != b}
    assert follows == expected


def test_a_rotation_starts_each_round_one_further() -> None:
    assert [rotated("abc", index) for index in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert rotated([], 3) == []


def test_warm_up_steps_until_the_plans_are_final_and_not_forever() -> None:
    taken: list[int] = []
    assert steps_until(lambda steps: steps >= 3, taken.append, "m") == 3
    assert taken == [0, 1, 2]
    assert steps_until(lambda _: True, taken.append, "m") == 0
    with pytest.raises(RuntimeError, match="m: the plans were not final after 5 warm-up steps"):
        steps_until(lambda _: False, taken.append, "m", limit=5)


def test_an_event_travels_as_a_record_it_is_rebuilt_from() -> None:
    event = Event("F0", "forward", 1.0, 2.5, "compute", "stage 1", {"batch": 0})
    assert Event(**event_record(event)) == event
    assert event_record(event, process="rank 0")["process"] == "rank 0"


def test_the_old_rotation_would_have_kept_predecessors() -> None:
    # The reason for the design: with 6 slots, 5 rounds already put every slot behind at
    # least 3 different ones (a rotation gives each exactly one).
    orders = [round_order(6, index) for index in range(5)]
    for slot in range(6):
        before = {order[order.index(slot) - 1] for order in orders if order.index(slot) > 0}
        assert len(before) >= 3


# ---------------------------------------------------------------------------- batches and steps


def test_synthetic_batches_repeat_per_seed_and_stream() -> None:
    batches = synthetic_batches(6, (1, 4, 4), seed=3, stream=1)
    assert len(batches) == 4
    for inputs, targets in batches:
        assert inputs.shape == (6, 1, 4, 4) and inputs.dtype == torch.float32
        assert targets.shape == (6,) and targets.dtype == torch.int64
        assert int(targets.min()) >= 0 and int(targets.max()) < NUM_CLASSES
    again = synthetic_batches(6, (1, 4, 4), seed=3, stream=1)
    other = synthetic_batches(6, (1, 4, 4), seed=3, stream=2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
    assert not torch.equal(batches[0][0], other[0][0])
    assert len(synthetic_batches(2, (3,), seed=0, stream=0, count=7)) == 7


def test_a_train_step_is_one_sgd_step_on_the_cross_entropy() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    weight, bias = model.weight.detach().clone(), model.bias.detach().clone()
    contender = Contender("plain", model, torch.optim.SGD(model.parameters(), lr=0.1))
    inputs = torch.randn(4, 5)
    targets = torch.tensor([0, 2, 1, 2])
    train_step(contender, inputs, targets)
    # The gradient of the mean cross-entropy with respect to the logits: (softmax - onehot) / N.
    logits = inputs @ weight.T + bias
    probabilities = torch.exp(logits) / torch.exp(logits).sum(dim=1, keepdim=True)
    onehot = torch.zeros(4, 3)
    onehot[torch.arange(4), targets] = 1.0
    dlogits = (probabilities - onehot) / 4
    assert torch.allclose(model.weight, weight - 0.1 * dlogits.T @ inputs, atol=1e-6)
    assert torch.allclose(model.bias, bias - 0.1 * dlogits.sum(dim=0), atol=1e-6)
    assert contender.times == [] and contender.warmup_steps == 0


def _rank_maxima() -> tuple[list[float], list[list[float]]]:
    rank = dist.get_rank()
    series = [[float(rank), 1.0 - rank], [], [5.0 * rank]]
    return max_over_ranks([float(rank), 1.0 - rank, 5.0]), max_over_ranks_each(series)


def test_max_over_ranks_takes_each_samples_slowest_rank() -> None:
    expected = ([1.0, 1.0, 5.0], [[1.0, 1.0], [], [5.0]])
    assert run_ranks(_rank_maxima, 2, timeout=120) == [expected, expected]


def _world_plus(job: int) -> int:
    return dist.get_world_size() * 100 + dist.get_rank() + job


def _fail_on_rank_one(job: str) -> None:
    if dist.get_rank() == 1:
        raise RuntimeError(job)


def test_a_launch_returns_rank_zeros_value() -> None:
    assert launch_on_ranks(_world_plus, 7, nprocs=2, link=None, timeout_s=120) == 207


def test_a_failed_launch_names_the_rank_and_its_error() -> None:
    with pytest.raises(LaunchFailedError, match="rank 1 failed") as failed:
        launch_on_ranks(_fail_on_rank_one, "no such luck", nprocs=2, link=None, timeout_s=120)
    assert "no such luck" in str(failed.value)


# ---------------------------------------------------------------------------- jobs


def _trace_file(tmp_path: Path) -> Path:
    tensors = (TensorTrace("fc.weight", "fc", 40, 160, 1e-4, 2e-4),)
    return Trace("toy", tensors, forward_s=1e-4, backward_s=2e-4).save(tmp_path / "toy.json")


def test_a_job_builds_its_model_and_batches_for_its_compute(tmp_path: Path) -> None:
    job = RankJob(model="mlp", batch=4, input_shape=(1, 4, 4), iters=1, warmup=0, num_classes=7)
    model = job.module()
    inputs, targets = job.batches(stream=1)[0]
    assert model(inputs).shape == (4, 7) and int(targets.max()) < 7
    assert isinstance(make_optimizer(model), torch.optim.SGD)
    emulated = RankJob(
        model="toy",
        batch=4,
        input_shape=(1, 4, 4),
        iters=1,
        warmup=0,
        compute=parse_compute(f"emulated:{_trace_file(tmp_path)}", 2.0),
    )
    # The emulated model returns its input: its batches are logits of NUM_CLASSES classes.
    inputs, _ = emulated.batches(stream=1)[0]
    assert inputs.shape == (4, NUM_CLASSES)
    assert isinstance(make_optimizer(emulated.module()), EmulatedStep)


@dataclass(frozen=True)
class _Sample:
    seconds: list[float]
    cost_s: float | None
    count: int


def test_undilating_divides_every_float_or_the_named_ones_only() -> None:
    sample = _Sample([0.4, 0.8], 0.2, 3)
    assert undilated(sample, 2.0) == _Sample([0.2, 0.4], 0.1, 3)
    assert undilated(_Sample([0.4], None, 1), 4.0) == _Sample([0.1], None, 1)
    value = {"block_s": {"gpipe": [2.0]}, "losses": {"gpipe": 2.0}, "bytes": [8]}
    assert undilated(value, 2.0, ("block_s", "bytes")) == {
        "block_s": {"gpipe": [1.0]},
        "losses": {"gpipe": 2.0},
        "bytes": [8],
    }
    assert undilated(value, 1.0) is value


# ---------------------------------------------------------------------------- rows


def test_quartiles_are_inclusive_and_one_sample_is_all_three() -> None:
    assert quartiles([5.0, 1.0, 3.0, 2.0, 4.0]) == pytest.approx((2.0, 3.0, 4.0))
    assert quartiles([1.0, 2.0]) == pytest.approx((1.25, 1.5, 1.75))
    assert quartiles([0.25]) == (0.25, 0.25, 0.25)


# ---------------------------------------------------------------------------- defaults


def test_each_model_has_its_batch_and_others_the_fallback() -> None:
    assert default_batch("resnet20") == DEFAULT_BATCH["resnet20"] == 8
    assert default_batch("mlp") == 512
    assert default_batch("pkg.mod:build") == FALLBACK_BATCH == 32


def test_a_contender_with_a_clip_scales_its_gradients_to_the_norm_before_its_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    weight = model.weight.detach().clone()
    contender = Contender(
        "clipped", model, torch.optim.SGD(model.parameters(), lr=1.0), clip_grad_norm=1e-3
    )
    inputs, targets = torch.randn(4, 5), torch.tensor([0, 2, 1, 2])
    reference = torch.nn.Linear(5, 3)
    reference.load_state_dict(model.state_dict())
    torch.nn.functional.cross_entropy(reference(inputs), targets).backward()
    assert reference.weight.grad is not None and reference.bias.grad is not None
    grads = torch.cat([reference.weight.grad.flatten(), reference.bias.grad])
    norm = float(torch.sqrt((grads * grads).sum()))
    assert norm > 1e-3  # the clip is active
    train_step(contender, inputs, targets)
    expected = weight - reference.weight.grad * (1e-3 / (norm + 1e-6))
    assert torch.allclose(model.weight, expected, atol=1e-7)
