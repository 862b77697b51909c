"""The replicated pipeline cut: time plus each stage's all-reduce, against brute force."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from interlace.comm.cost import CostModel
from interlace.pipeline.balance import balance_spans, balance_stages
from interlace.pipeline.cut import StageCut, cut_stages, stage_cut
from interlace.pipeline.partition import gradient_bytes, plan_stages
from interlace.pipeline.replication import replicated
from interlace.pipeline.stages import local_stage
from interlace.testing import run_ranks


def _all_cuts(n: int, stages: int) -> list[list[tuple[int, int]]]:
    cuts = []
    for ends in itertools.combinations(range(1, n), stages - 1):
        edges = [0, *ends, n]
        cuts.append(list(itertools.pairwise(edges)))
    return cuts


def _brute_force_slowest(
    compute: list[float], sizes: list[float], stages: int, cost: CostModel
) -> float:
    """The least slowest-stage step over every contiguous cut, priced from scratch."""

    def step(start: int, end: int) -> float:
        nbytes = math.fsum(sizes[start:end])
        reduce_s = cost.a + cost.b * nbytes if nbytes > 0 else 0.0
        return math.fsum(compute[start:end]) + reduce_s

    return min(max(step(s, e) for s, e in cut) for cut in _all_cuts(len(compute), stages))


@pytest.mark.parametrize("seed", range(40))
def test_the_cut_reaches_the_brute_force_optimum(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 9)
    stages = rng.randint(1, n)
    compute = [rng.choice([0.0, rng.uniform(0, 2e-3)]) for _ in range(n)]
    sizes = [rng.choice([0.0, rng.uniform(0, 4e7)]) for _ in range(n)]
    cost = CostModel(rng.uniform(0, 1e-3), rng.uniform(1e-10, 2e-9))
    bounds = cut_stages(compute, sizes, stages, replicas=4, cost=cost)
    assert [start for start, _ in bounds] == [0, *(end for _, end in bounds[:-1])]
    assert bounds[-1][1] == n and all(end > start for start, end in bounds)
    reached = max(math.fsum(compute[s:e]) + cost.time(math.fsum(sizes[s:e])) for s, e in bounds)
    assert reached == pytest.approx(_brute_force_slowest(compute, sizes, stages, cost), rel=1e-9)


def test_vgg_like_gradients_are_split_by_bytes_not_by_time() -> None:
    # Equal compute per block, the bytes in the last blocks: by time the cut is in the middle,
    # with the all-reduce priced it moves to split the bytes.
    compute = [1e-4] * 8
    sizes = [1e5] * 5 + [1e7] * 3
    ring = CostModel.ring(4, 1e-5, 8 / 10e9)
    assert cut_stages(compute, sizes, 2) == balance_stages(compute, 2) == [(0, 4), (4, 8)]
    assert cut_stages(compute, sizes, 2, replicas=4, cost=ring) == [(0, 6), (6, 8)]


def test_one_replica_is_exactly_the_by_time_cut() -> None:
    rng = random.Random(7)
    for _ in range(50):
        n = rng.randint(1, 12)
        compute = [rng.uniform(0, 1) for _ in range(n)]
        stages = rng.randint(1, n)
        expected = balance_stages(compute, stages)
        assert cut_stages(compute, [1e9] * n, stages) == expected
        assert cut_stages(compute, [1e9] * n, stages, cost=CostModel(1.0, 1.0)) == expected


def test_balance_spans_of_a_sum_is_balance_stages() -> None:
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    prefix = [0.0, *itertools.accumulate(costs)]
    for stages in range(1, len(costs) + 1):
        assert balance_spans(lambda i, j: prefix[j] - prefix[i], len(costs), stages) == (
            balance_stages(costs, stages)
        )


def test_the_rules_are_named_and_auto_follows_the_replicas() -> None:
    assert stage_cut("time+allreduce") is StageCut.TIME_ALLREDUCE
    assert stage_cut(StageCut.PARAMS) is StageCut.PARAMS
    assert StageCut.AUTO.resolved(1) is StageCut.TIME
    assert StageCut.AUTO.resolved(2) is StageCut.TIME_ALLREDUCE
    assert StageCut.PARAMS.resolved(8) is StageCut.PARAMS
    with pytest.raises(ValueError, match="unknown stage cost 'flops'; choose one of time, params"):
        stage_cut("flops")


def test_bad_input_is_one_line() -> None:
    with pytest.raises(ValueError, match="2 block times but 1 block gradient sizes"):
        cut_stages([1.0, 2.0], [1.0], 1, replicas=2, cost=CostModel(0, 1))
    with pytest.raises(ValueError, match="needs the stage group's cost model"):
        cut_stages([1.0, 2.0], [1.0, 1.0], 1, replicas=2)
    with pytest.raises(ValueError, match="finite and >= 0"):
        cut_stages([1.0, -2.0], [1.0, 1.0], 1, replicas=2, cost=CostModel(0, 1))
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        cut_stages([1.0], [1.0], 1, replicas=0)


def _blocks() -> nn.Sequential:
    # Light compute everywhere, the parameters at the end (vgg's shape, in miniature).
    return nn.Sequential(
        *(nn.Linear(8, 8) for _ in range(5)), nn.Linear(8, 512), nn.Linear(512, 512)
    )


def test_plan_stages_prices_the_measured_blocks_and_their_bytes() -> None:
    torch.manual_seed(0)
    blocks, sample = _blocks(), torch.randn(4, 8)
    cost = CostModel(1e-6, 1e-3)  # the all-reduce dominates
    plan = plan_stages(blocks, 2, sample=sample, replicas=2, cost=cost, batch=16)
    assert plan.by == "time+allreduce" and len(plan.reduce_s) == 2
    sizes = [float(gradient_bytes(block)) for block in blocks]
    assert plan.bounds == tuple(cut_stages(plan.costs, sizes, 2, replicas=2, cost=cost))
    assert plan.bounds == ((0, 6), (6, 7))  # the bytes split, whatever the times measured
    assert "all-reduce" in plan.describe()
    assert plan_stages(blocks, 2, sample=sample).by == "time"
    with pytest.raises(ValueError, match="needs cost="):
        plan_stages(blocks, 2, by="time+allreduce", sample=sample, replicas=2)


def _local_stage_rank() -> dict[str, Any]:
    torch.manual_seed(0)
    sample = torch.randn(4, 8)
    groups = replicated(2)
    own = local_stage(
        _blocks(),
        num_stages=2,
        stage=groups.stage,
        sample=sample,
        data_parallel=groups.data_parallel,
    )
    made = local_stage(_blocks(), num_stages=2, stage=groups.stage, sample=sample)
    timed = local_stage(_blocks(), num_stages=2, stage=groups.stage, by="time", sample=sample)
    return {
        "rank": dist.get_rank(),
        "own": (own.plan.by, own.plan.bounds),
        "made": (made.plan.by, made.plan.bounds),
        "timed": timed.plan.by,
    }


def test_replicated_ranks_agree_on_the_time_plus_allreduce_cut(
    tmp_path: Any, monkeypatch: Any
) -> None:
    monkeypatch.setenv("INTERLACE_CACHE_DIR", str(tmp_path))
    results = run_ranks(_local_stage_rank, 4, timeout=120)
    assert {r["own"] for r in results} == {results[0]["own"]}
    assert {r["made"] for r in results} == {results[0]["made"]}
    assert results[0]["own"][0] == results[0]["made"][0] == "time+allreduce"
    assert {r["timed"] for r in results} == {"time"}
