"""DataParallel on several channels: same gradients as one channel, agreement, compression."""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from interlace.comm.calibrate import fit_concurrency, fit_cost_model
from interlace.comm.channels import Channels
from interlace.comm.cost import CostModel
from interlace.dp import DataParallel
from interlace.errors import UsageError
from interlace.testing import run_ranks, run_scenarios
from interlace.zoo import build_model

# The 2-rank tests share one launch (the ``two_ranks`` fixture, set up in the first one's time).
pytestmark = pytest.mark.timeout(460)

# Start-ups overlap and the link is only partly shared: several channels pay on paper, so the
# planner really spreads buckets (and slices) over the channels.
CONCURRENT = CostModel(a=2e-4, b=1e-9, concurrency=((2e-4, 1.2), (2e-4, 1.4), (2e-4, 1.6)))


def _relative(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _grads_against_one_channel(
    name: str, wrap: dict[str, Any], steps: int, lr: float = 0.05
) -> dict[str, Any]:
    """Train a one-channel wrapper and one built with ``wrap`` side by side."""
    rank = dist.get_rank()
    torch.manual_seed(7)
    reference_model = build_model(name, (1, 8, 8), 10)
    other_model = copy.deepcopy(reference_model)
    reference = DataParallel(reference_model, profile_steps=2, cost_model=CONCURRENT)
    other = DataParallel(other_model, profile_steps=2, cost_model=CONCURRENT, **wrap)
    optimizers = [
        torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) for model in (reference, other)
    ]
    generator = torch.Generator().manual_seed(50 + rank)
    worst = 0.0
    for _ in range(steps):
        inputs = torch.randn(8, 1, 8, 8, generator=generator)
        targets = torch.randint(0, 10, (8,), generator=generator)
        for model, optimizer in zip((reference, other), optimizers, strict=True):
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(inputs), targets).backward()
        for mine, theirs in zip(
            reference_model.parameters(), other_model.parameters(), strict=True
        ):
            worst = max(worst, _relative(theirs.grad, mine.grad))
        for optimizer in optimizers:
            optimizer.step()
    assert other.plan is not None
    return {
        "worst": worst,
        "channels": other.plan.channels,
        "slices": [list(bucket.channels) for bucket in other.plan.buckets],
        "engine_assignment": other.bucket_channels,
        "why": other.channel_choice,
    }


def test_three_channels_with_partitioning_match_one_channel_on_three_ranks() -> None:
    wrap = {"bucketing": "merged", "channels": 3, "partition_mb": 0.002}
    reports = run_ranks(_grads_against_one_channel, 3, "mlp", wrap, 6, timeout=240)
    first = reports[0]
    assert first["channels"] == 3
    # The case under test really happened: buckets cut into slices, all three channels used.
    assert any(len(slices) > 1 for slices in first["slices"])
    assert {c for slices in first["slices"] for c in slices} == {0, 1, 2}
    for report in reports:
        assert report["worst"] < 1e-6, report["worst"]
        assert report["slices"] == first["slices"]
        assert report["engine_assignment"] == reports[0]["engine_assignment"]


def test_per_tensor_on_two_channels_matches_one_channel(two_ranks: dict[str, Any]) -> None:
    reports = two_ranks["per-tensor"]
    assert {c for slices in reports[0]["slices"] for c in slices} == {0, 1}
    assert all(len(slices) == 1 for slices in reports[0]["slices"])
    assert max(report["worst"] for report in reports) < 1e-6


@pytest.mark.parametrize(("compression", "tolerance"), [("fp16", 2e-3), ("bf16", 2e-2)])
def test_compressed_buckets_average_close_to_float32(
    compression: str, tolerance: float, two_ranks: dict[str, Any]
) -> None:
    reports = two_ranks[compression]
    worst = max(report["worst"] for report in reports)
    # Rounding to the wire type happened (not bit-identical) but stays at its precision.
    assert 0 < worst < tolerance, worst


#: Start-ups of 5 ms that overlap across channels: with 55 per-tensor buckets they outweigh any
#: backward this machine can measure, so more channels pay however slow the profiled pass was.
LATENCY_BOUND = CostModel(a=5e-3, b=1e-9, concurrency=((5e-3, 1.2), (5e-3, 1.4), (5e-3, 1.6)))


def _auto_model(name: str, tune_steps: int) -> DataParallel:
    """Per-tensor buckets, ``channels="auto"``, the latency-bound cost model above."""
    torch.manual_seed(3)
    return DataParallel(
        build_model(name, (1, 8, 8), 10),
        bucketing="per-tensor",
        channels="auto",
        profile_steps=1,
        cost_model=LATENCY_BOUND,
        tune_steps=tune_steps,
    )


def _auto_choice() -> dict[str, Any]:
    # tune_steps=0: the planner's own choice; the measured one is tested below.
    model = _auto_model("transformer", tune_steps=0)
    for _ in range(3):
        model(torch.randn(4, 1, 8, 8)).sum().backward()
    assert model.plan is not None
    return {
        "channels": model.plan.channels,
        "partition": model.plan.partition_bytes,
        "assignment": model.bucket_channels,
        "why": model.channel_choice,
    }


def test_auto_chooses_the_same_channels_on_every_rank_and_says_why(
    two_ranks: dict[str, Any],
) -> None:
    reports = two_ranks["auto"]
    assert reports[0] == reports[1]
    # Per-tensor buckets of many small tensors under overlapping start-ups: more channels pay.
    assert reports[0]["channels"] > 1
    assert "channels='auto' chose" in reports[0]["why"]
    assert "k=1:" in reports[0]["why"]


def _measured_choice() -> dict[str, Any]:
    model = _auto_model("mlp", tune_steps=1)
    steps = 0
    while not model.planning_done:
        model(torch.randn(4, 1, 8, 8)).sum().backward()
        steps += 1
        assert steps < 100, "the trials never ended"
    assert model.plan is not None
    return {
        "channels": model.plan.channels,
        "assignment": model.bucket_channels,
        "why": model.channel_choice,
        "results": model.tuning_results,
        "summary": model.tuning_summary,
    }


def test_auto_keeps_the_channel_count_its_trials_measured_fastest_on_every_rank(
    two_ranks: dict[str, Any],
) -> None:
    reports = two_ranks["measured"]
    assert reports[0] == reports[1]
    first = reports[0]
    assert first["why"].startswith(f"channels='auto' kept {first['channels']} channel(s)")
    labels = [label for label, _, _ in first["results"]]
    # Every channel count was tried (alone or as the same plan as another candidate).
    for count in range(1, 5):
        assert any(f"{count} channel(s)" in label for label in labels), (count, labels)
    # The plan in use is the candidate with the fewest buckets among those within the trials'
    # tie margin of the least median (the model's own plan is also the best plan for its
    # channel count, so every label names a count).
    margin = float(re.search(r"ties within ([0-9.]+)%", first["summary"]).group(1)) / 100
    assert margin >= 0.02
    least = min(result[2] for result in first["results"])
    close = [result for result in first["results"] if result[2] <= least * (1 + margin) + 1e-12]
    kept = min(close, key=lambda result: (result[1], result[2]))
    assert f"{first['channels']} channel(s)" in kept[0]


def _mismatched_channels() -> str:
    """The error every rank gets (each must get one, or the other would hang)."""
    channels = 2 if dist.get_rank() == 1 else 1
    try:
        DataParallel(nn.Linear(4, 4), channels=channels)
    except UsageError as error:
        return str(error)
    return "no error"


def test_ranks_asking_for_different_channels_get_an_error_not_a_hang(
    two_ranks: dict[str, Any],
) -> None:
    # Both ranks returned (the launch has a time limit), each with the error that names both.
    for message in two_ranks["mismatched"]:
        assert "channels is 1 on rank 0 but 2 on rank 1" in message


def test_bad_channel_settings_are_clear_errors() -> None:
    with pytest.raises(UsageError, match="channels must be"):
        DataParallel(nn.Linear(2, 2), channels=0)


def _measure_concurrency(tmp: str) -> tuple[float, ...]:
    os.environ["INTERLACE_CACHE_DIR"] = tmp
    channels = Channels(3)
    base = fit_cost_model(use_cache=False)
    model = fit_concurrency(channels.groups, base, nbytes=256 * 1024, use_cache=True)
    again = fit_concurrency(channels.groups, base, nbytes=256 * 1024, use_cache=True)
    assert again == model  # the second call read the cache
    return tuple(value for term in model.concurrency for value in term)


def test_concurrency_is_measured_identically_on_every_rank(two_ranks: dict[str, Any]) -> None:
    reports = two_ranks["concurrency"]
    assert reports[0] == reports[1]
    assert len(reports[0]) == 4  # (a_2, c_2), (a_3, c_3)
    assert all(value > 0 for value in reports[0])


def _two_rank_scenarios(tmp: str) -> dict[str, Callable[[], Any]]:
    """The 2-rank scenarios above, by name. The mismatch comes last: the ranks then hold
    process groups of different channels."""
    return {
        "per-tensor": lambda: _grads_against_one_channel(
            "transformer", {"bucketing": "per-tensor", "channels": 2, "partition_mb": None}, 4
        ),
        # lr=0: every step's gradients come from the same weights. Training would let the deep
        # MLP amplify the rounding of earlier steps into the weights, which is not checked here.
        "fp16": lambda: _grads_against_one_channel("mlp", {"compression": "fp16"}, 4, 0.0),
        "bf16": lambda: _grads_against_one_channel("mlp", {"compression": "bf16"}, 4, 0.0),
        "auto": _auto_choice,
        "measured": _measured_choice,
        "concurrency": lambda: _measure_concurrency(tmp),
        "mismatched": _mismatched_channels,
    }


def _every_two_rank_scenario(tmp: str) -> dict[str, Any]:
    """Each scenario's result on this rank; a failure names its scenario."""
    return run_scenarios(_two_rank_scenarios(tmp))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """Every 2-rank scenario's results by rank, from one launch: starting ranks costs more than
    most scenarios do."""
    tmp = str(tmp_path_factory.mktemp("channels"))
    per_rank = run_ranks(_every_two_rank_scenario, 2, tmp, timeout=400)
    return {name: [results[name] for results in per_rank] for name in per_rank[0]}
