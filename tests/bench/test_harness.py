"""The benchmark harness: launching, rounds, batches, contenders, parsing and quartiles."""

from __future__ import annotations

import argparse
import itertools
import math
import re
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from interlace.bench.harness import (
    DEFAULT_BATCH,
    FALLBACK_BATCH,
    NUM_CLASSES,
    Contender,
    LaunchFailedError,
    check_launch_args,
    default_batch,
    launch_on_ranks,
    max_over_ranks,
    parse_names,
    parse_ratios,
    parse_shape,
    quartiles,
    round_order,
    split_blocks,
    synthetic_batches,
    train_step,
)
from interlace.errors import UsageError
from interlace.testing import run_ranks


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


def _rank_maxima() -> list[float]:
    rank = dist.get_rank()
    return max_over_ranks([float(rank), 1.0 - rank, 5.0])


def test_max_over_ranks_takes_each_samples_slowest_rank() -> None:
    assert run_ranks(_rank_maxima, 2, timeout=120) == [[1.0, 1.0, 5.0], [1.0, 1.0, 5.0]]


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


# ---------------------------------------------------------------------------- rows


def test_quartiles_are_inclusive_and_one_sample_is_all_three() -> None:
    assert quartiles([5.0, 1.0, 3.0, 2.0, 4.0]) == pytest.approx((2.0, 3.0, 4.0))
    assert quartiles([1.0, 2.0]) == pytest.approx((1.25, 1.5, 1.75))
    assert quartiles([0.25]) == (0.25, 0.25, 0.25)


# ---------------------------------------------------------------------------- arguments


def test_each_model_has_its_batch_and_others_the_fallback() -> None:
    assert default_batch("resnet20") == DEFAULT_BATCH["resnet20"] == 8
    assert default_batch("mlp") == 512
    assert default_batch("pkg.mod:build") == FALLBACK_BATCH == 32


def test_names_shapes_and_ratios_are_parsed() -> None:
    assert parse_names(" a, b ,a,", None, "models", "model") == ("a", "b")
    assert parse_names("ddp", ("ddp", "wfbp"), "strategies", "strategy") == ("ddp",)
    with pytest.raises(UsageError, match="--strategies: unknown strategy 'x'; choose from ddp"):
        parse_names("ddp,x", ("ddp",), "strategies", "strategy")
    with pytest.raises(UsageError, match="name at least one"):
        parse_names(" , ", None, "models", "model")
    assert parse_shape("3,32,32") == parse_shape("3x32x32") == (3, 32, 32)
    for bad in ("3,0,32", "three", ""):
        with pytest.raises(UsageError, match="--input-shape"):
            parse_shape(bad)
    assert parse_ratios("0.5, 1,2,1") == (0.5, 1.0, 2.0)
    for bad in ("0", "-1", "inf", "nan", "one"):
        with pytest.raises(UsageError, match="--ratios"):
            parse_ratios(bad)
    assert math.isfinite(parse_ratios("1e-3")[0])


@pytest.mark.parametrize(
    ("models", "changes", "needle"),
    [
        (("resnet1000",), {}, "--models: unknown model 'resnet1000'"),
        (("mlp",), {"nprocs": 1}, "-n must be >= 2 (why), got 1"),
        (("mlp",), {"timeout": 0.0}, "--timeout must be > 0 seconds"),
        (("mlp",), {"collective_timeout": -1.0}, "--collective-timeout must be > 0 seconds"),
        (("mlp",), {"link": "1gbit", "no_netem": True}, "contradict"),
    ],
)
def test_launch_arguments_are_checked(
    models: tuple[str, ...], changes: dict[str, object], needle: str
) -> None:
    values: dict[str, object] = {
        "nprocs": 2,
        "timeout": 10.0,
        "collective_timeout": None,
        "link": None,
        "no_netem": False,
    }
    args = argparse.Namespace(**{**values, **changes})
    with pytest.raises(UsageError, match=re.escape(needle)):
        check_launch_args(args, models, prefix="--models: ", ranks_reason="why")


def test_good_launch_arguments_pass() -> None:
    args = argparse.Namespace(
        nprocs=2, timeout=10.0, collective_timeout=30.0, link=None, no_netem=True
    )
    check_launch_args(args, ("mlp", "pkg.mod:build"), prefix="", ranks_reason="why")
