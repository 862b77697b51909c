"""Tests for cutting models into pipeline stages: balancing, block sequences, plans, stages."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch import nn

from interlace.errors import UsageError
from interlace.pipeline.partition import (
    StagePlan,
    balance_stages,
    pipeline_blocks,
    plan_stages,
    profile_block_times,
    stage_module,
)
from interlace.zoo.models import build_model


@pytest.fixture(autouse=True)
def _two_threads() -> None:
    torch.set_num_threads(2)


# --------------------------------------------------------------------------------------------
# balance_stages
# --------------------------------------------------------------------------------------------


def all_splits(n: int, num_stages: int) -> list[list[tuple[int, int]]]:
    """Every way to cut ``n`` blocks into ``num_stages`` contiguous non-empty ranges, in order."""
    splits = []
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        edges = [0, *cuts, n]
        splits.append(list(itertools.pairwise(edges)))
    return splits


def bottleneck(costs: list[float], bounds: list[tuple[int, int]]) -> float:
    return max(sum(costs[a:b]) for a, b in bounds)


def assert_valid(bounds: list[tuple[int, int]], n: int, num_stages: int) -> None:
    assert len(bounds) == num_stages
    assert bounds[0][0] == 0
    assert bounds[-1][1] == n
    for (_, end), (start, _) in itertools.pairwise(bounds):
        assert end == start
    assert all(end > start for start, end in bounds)


def test_balance_stages_matches_brute_force_on_integer_costs() -> None:
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 8)
        costs = [float(rng.randint(0, 9)) for _ in range(n)]
        for num_stages in range(1, n + 1):
            bounds = balance_stages(costs, num_stages)
            assert_valid(bounds, n, num_stages)
            splits = all_splits(n, num_stages)
            optimum = min(bottleneck(costs, split) for split in splits)
            assert bottleneck(costs, bounds) == optimum, (costs, num_stages, bounds)
            # The documented tie rule: among optimal cuts, the lexicographically largest ends.
            optimal = [split for split in splits if bottleneck(costs, split) == optimum]
            assert bounds == max(optimal, key=lambda split: [end for _, end in split])


def test_balance_stages_matches_brute_force_on_float_costs() -> None:
    rng = random.Random(1)
    for _ in range(100):
        n = rng.randint(1, 8)
        costs = [rng.uniform(0.0, 5.0) for _ in range(n)]
        for num_stages in range(1, n + 1):
            bounds = balance_stages(costs, num_stages)
            assert_valid(bounds, n, num_stages)
            optimum = min(bottleneck(costs, split) for split in all_splits(n, num_stages))
            assert math.isclose(bottleneck(costs, bounds), optimum, rel_tol=1e-12)


@pytest.mark.parametrize(
    ("costs", "num_stages", "expected"),
    [
        ([1, 2, 3, 4, 5], 2, [(0, 3), (3, 5)]),  # 6 | 9 beats 10 | 5
        ([1, 2, 3, 4, 5], 3, [(0, 3), (3, 4), (4, 5)]),  # 6 | 4 | 5
        ([5, 1, 1, 1, 1, 1], 2, [(0, 1), (1, 6)]),  # 5 | 5
        ([1, 1, 1, 1], 3, [(0, 2), (2, 3), (3, 4)]),  # ties: the first stage takes two
        ([0, 0, 0], 2, [(0, 2), (2, 3)]),
        ([3, 1, 4], 1, [(0, 3)]),
        ([3, 1, 4], 3, [(0, 1), (1, 2), (2, 3)]),
        ([10, 0, 0, 1], 2, [(0, 3), (3, 4)]),  # zero-cost blocks join the earlier stage
    ],
)
def test_balance_stages_hand_cases(
    costs: list[float], num_stages: int, expected: list[tuple[int, int]]
) -> None:
    assert balance_stages(costs, num_stages) == expected


@pytest.mark.parametrize(
    ("costs", "num_stages", "message"),
    [
        ([1.0, 2.0], 0, "num_stages must be >= 1"),
        ([1.0, 2.0], 3, "cannot cut 2 block"),
        ([], 1, "cannot cut 0 block"),
        ([1.0, -1.0], 1, "finite and >= 0"),
        ([1.0, math.nan], 1, "finite and >= 0"),
        ([math.inf, 1.0], 2, "finite and >= 0"),
    ],
)
def test_balance_stages_rejects_bad_input(
    costs: list[float], num_stages: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        balance_stages(costs, num_stages)


# --------------------------------------------------------------------------------------------
# pipeline_blocks on the zoo
# --------------------------------------------------------------------------------------------

ZOO = ["mlp", "resnet20", "vgg11", "transformer"]


def test_pipeline_blocks_returns_a_sequential_as_is() -> None:
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert pipeline_blocks(seq) is seq


def test_pipeline_blocks_rejects_models_that_cannot_be_cut() -> None:
    class Opaque(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(UsageError, match=r"nn\.Sequential or define pipeline_blocks\(\)"):
        pipeline_blocks(Opaque())

    class Empty(Opaque):
        def pipeline_blocks(self) -> list[nn.Module]:
            return []

    with pytest.raises(UsageError, match="non-empty list"):
        pipeline_blocks(Empty())


@pytest.mark.parametrize("name", ZOO)
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 8, 8)])
def test_zoo_pipeline_blocks_compose_to_the_model(name: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = build_model(name, shape, 10).eval()
    blocks = pipeline_blocks(model)
    assert len(blocks) >= 3
    x = torch.randn(2, *shape)
    with torch.no_grad():
        torch.testing.assert_close(blocks(x), model(x))
        # Block by block, as a pipeline runs them.
        out = x
        for block in blocks:
            out = block(out)
        torch.testing.assert_close(out, model(x))


def test_transformer_on_token_ids_composes_to_the_model() -> None:
    torch.manual_seed(0)
    model = build_model("transformer", (12,), 5).eval()
    x = torch.randint(0, 1000, (3, 12))
    with torch.no_grad():
        torch.testing.assert_close(pipeline_blocks(model)(x), model(x))


@pytest.mark.parametrize("name", ZOO)
def test_zoo_pipeline_blocks_share_every_parameter_once(name: str) -> None:
    model = build_model(name, (3, 8, 8), 10)
    blocks = pipeline_blocks(model)
    per_block = [id(p) for block in blocks for p in block.parameters()]
    assert len(per_block) == len(set(per_block)), "a parameter sits in two blocks"
    assert set(per_block) == {id(p) for p in model.parameters()}
    total = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in nn.Sequential(*blocks).parameters()) == total
    # The model's own registration is unchanged (pos stays on the transformer).
    assert {n for n, _ in model.named_parameters()} == {
        n for n, _ in build_model(name, (3, 8, 8), 10).named_parameters()
    }
    if name == "transformer":
        assert "pos" in dict(model.named_parameters())


@pytest.mark.parametrize("name", ZOO)
def test_zoo_pipeline_blocks_train_the_models_parameters(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(name, (1, 8, 8), 10)
    pipeline_blocks(model)(torch.randn(4, 1, 8, 8)).sum().backward()
    for param_name, p in model.named_parameters():
        assert p.grad is not None, param_name


# --------------------------------------------------------------------------------------------
# plans and stages
# --------------------------------------------------------------------------------------------


def small_sequential() -> nn.Sequential:
    torch.manual_seed(0)
    # Parameter counts: 20, 0, 40, 0, 18.
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_plan_stages_by_params() -> None:
    blocks = small_sequential()
    plan = plan_stages(blocks, 2, by="params")
    assert plan.costs == (20.0, 0.0, 40.0, 0.0, 18.0)
    assert plan.bounds == ((0, 2), (2, 5))  # 20 | 58 (the alternative is 60 | 18)
    assert plan.stage_costs == (20.0, 58.0)
    assert plan.imbalance == pytest.approx(58.0 / 39.0)
    assert plan.by == "params"
    plan3 = plan_stages(blocks, 3, by="params")
    assert plan3.bounds == ((0, 2), (2, 4), (4, 5))  # 20 | 40 | 18
    table = plan3.describe()
    assert "imbalance" in table
    assert len(table.splitlines()) == 1 + 3 + 1


def test_plan_stages_by_time_covers_all_blocks_and_leaves_the_model_alone() -> None:
    torch.manual_seed(0)
    blocks = nn.Sequential(
        nn.Linear(6, 16),
        nn.ReLU(inplace=True),  # an in-place op on a block's input must not fail on the leaf
        nn.Linear(16, 16),
        nn.BatchNorm1d(16),
        nn.Linear(16, 3),
    )
    state_before = {k: v.clone() for k, v in blocks.state_dict().items()}
    sample = torch.randn(8, 6)
    sample_before = sample.clone()
    for num_stages in (1, 3, 5):
        plan = plan_stages(blocks, num_stages, sample=sample)
        assert plan.by == "time"
        assert len(plan.costs) == len(blocks)
        assert all(c >= 0 for c in plan.costs)
        assert_valid(list(plan.bounds), len(blocks), num_stages)
        assert "ms" in plan.describe()
    assert all(p.grad is None for p in blocks.parameters())
    for key, value in blocks.state_dict().items():
        assert torch.equal(value, state_before[key]), key  # BatchNorm statistics restored
    assert torch.equal(sample, sample_before)


def test_profile_block_times_on_a_zoo_model_with_token_ids() -> None:
    blocks = pipeline_blocks(build_model("transformer", (6,), 3))
    times = profile_block_times(blocks, torch.randint(0, 1000, (2, 6)), repeats=1)
    assert len(times) == len(blocks)
    assert all(t >= 0 for t in times)
    with pytest.raises(ValueError, match="repeats"):
        profile_block_times(blocks, torch.randint(0, 1000, (2, 6)), repeats=0)


def test_plan_stages_rejects_bad_arguments() -> None:
    blocks = small_sequential()
    with pytest.raises(ValueError, match="choose one of time, params"):
        plan_stages(blocks, 2, by="flops")
    with pytest.raises(ValueError, match="needs sample="):
        plan_stages(blocks, 2)
    with pytest.raises(ValueError, match="cannot cut 5 block"):
        plan_stages(blocks, 6, by="params")


def test_stage_modules_share_parameters_and_compose() -> None:
    model = build_model("resnet20", (1, 8, 8), 10).eval()
    blocks = pipeline_blocks(model)
    plan = plan_stages(blocks, 3, by="params")
    stages = [stage_module(blocks, plan, k) for k in range(3)]
    for stage, (start, end) in zip(stages, plan.bounds, strict=True):
        assert len(stage) == end - start
        for offset, block in enumerate(stage):
            assert block is blocks[start + offset]
    stage_params = [id(p) for stage in stages for p in stage.parameters()]
    assert sorted(stage_params) == sorted(id(p) for p in model.parameters())
    # Keys keep the block indices, so stage state dicts map back onto the block sequence.
    assert next(iter(stages[1].state_dict())).split(".")[0] == str(plan.bounds[1][0])
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        out = x
        for stage in stages:
            out = stage(out)
        torch.testing.assert_close(out, model(x))
    with pytest.raises(ValueError, match="stage must be in"):
        stage_module(blocks, plan, 3)
    with pytest.raises(ValueError, match="the plan covers"):
        stage_module(blocks[:-1], plan, 0)


def test_stage_plan_rejects_inconsistent_bounds() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        StagePlan(bounds=((0, 1), (2, 3)), costs=(1.0, 1.0, 1.0), by="params")
    with pytest.raises(ValueError, match="do not cover"):
        StagePlan(bounds=((0, 1),), costs=(1.0, 1.0), by="params")
    zero = StagePlan(bounds=((0, 1), (1, 2)), costs=(0.0, 0.0), by="params")
    assert zero.imbalance == 1.0
