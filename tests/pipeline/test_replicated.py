"""Replicated pipelines (2 stages x 2 replicas on 4 ranks) against references in the test.

* Synchronous schedules: each replica trains on its half of a mini-batch; every rank's update
  uses the unpipelined model's gradient on the whole mini-batch (1e-6 relative, float64).
* Asynchronous schedules: both replicas fed the same data end exactly where one pipeline does;
  fed different halves, where one pipeline fed the whole mini-batches does (the replicas'
  average of two half-batch means is the whole batch's mean, with the same weights).
* Buffers: with BatchNorm and each replica on its half, ``broadcast_buffers`` leaves every
  replica with replica 0's statistics (those replica 0 reaches without it); off, they differ.
* Bad input: stages that do not divide the ranks, a layout for another job, one line each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from interlace.comm.cost import CostModel
from interlace.errors import UsageError
from interlace.pipeline import PipelineLayout, PipelineStage, StageDataParallel, replicated
from interlace.testing import run_ranks, run_scenarios

pytestmark = pytest.mark.timeout(300)

BATCH = 16
CLASSES = 3
LR, MOMENTUM = 0.05, 0.9
ASYNC = ("pipedream", "spectrain", "spectrain-reuse", "naive")
#: A fixed all-reduce price, so no case spends time fitting one.
COST = CostModel(a=1e-4, b=1e-9)


def _blocks() -> list[nn.Module]:
    """Two stages of a small float64 net (a conv stage, then a dense one)."""
    torch.manual_seed(0)
    first = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.Flatten())  # [B, 75]
    second = nn.Sequential(nn.Linear(75, 10), nn.Tanh(), nn.Linear(10, CLASSES))
    return [first.double(), second.double()]


def _data(count: int, seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(BATCH, 1, 5, 5, generator=generator, dtype=torch.float64),
            torch.randint(0, CLASSES, (BATCH,), generator=generator),
        )
        for _ in range(count)
    ]


def _half(batches: list[tuple[Tensor, Tensor]], replica: int) -> list[tuple[Tensor, Tensor]]:
    half = BATCH // 2
    cut = slice(replica * half, (replica + 1) * half)
    return [(x[cut], y[cut]) for x, y in batches]


class _RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it is handed at every step."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.seen: list[list[Tensor]] = []

    def step(self, closure: Any = None) -> Any:
        params = [p for group in self.param_groups for p in group["params"]]
        self.seen.append([p.grad.detach().clone() for p in params if p.grad is not None])
        return super().step(closure)


def _stage(
    schedule: str,
    *,
    replicate: bool,
    optimizer_type: type = torch.optim.SGD,
    blocks: Callable[[], list[nn.Module]] = _blocks,
    broadcast_buffers: bool = True,
    **options: Any,
) -> tuple[PipelineStage, torch.optim.Optimizer, Any]:
    groups = _GROUPS[0]
    module = blocks()[groups.stage]
    optimizer = optimizer_type(module.parameters(), lr=LR, momentum=MOMENTUM)
    data_parallel = (
        StageDataParallel(
            groups.data_parallel,
            bucketing="fixed",
            bucket_cap_mb=1e-3,
            cost_model=COST,
            broadcast_buffers=broadcast_buffers,
        )
        if replicate
        else None
    )
    stage = PipelineStage(
        module,
        optimizer,
        stage=groups.stage,
        num_stages=2,
        schedule=schedule,
        loss_fn=nn.functional.cross_entropy,
        ranks=groups.ranks,
        group=groups.pipeline,
        data_parallel=data_parallel,
        **options,
    )
    return stage, optimizer, groups


_GROUPS: list[Any] = []


def _sync_case(schedule: str) -> list[Tensor]:
    """One update of a replicated pipeline, each replica on its half: the gradient used."""
    stage, optimizer, groups = _stage(
        schedule, replicate=True, optimizer_type=_RecordingSGD, microbatches=2
    )
    stage.run(_half(_data(1), groups.replica), 1)
    assert isinstance(optimizer, _RecordingSGD)
    return optimizer.seen[0]


def _weights(stage: PipelineStage) -> list[Tensor]:
    return [p.detach().clone() for p in stage.module.parameters()]


def _async_case(schedule: str, count: int) -> dict[str, list[Tensor]]:
    """The weights after ``count`` mini-batches: one pipeline per replica on the whole
    batches, the replicated one on the same data, the replicated one on different halves."""
    groups = _GROUPS[0]
    data = _data(count)
    alone, _, _ = _stage(schedule, replicate=False)
    alone.run(data, count)
    same, _, _ = _stage(schedule, replicate=True)
    same.run(data, count)
    halves, _, _ = _stage(schedule, replicate=True)
    halves.run(_half(data, groups.replica), count)
    return {"alone": _weights(alone), "same": _weights(same), "halves": _weights(halves)}


def _one_stage_case() -> dict[str, Any]:
    """Four replicas of a one-stage pipeline (data parallelism): the whole-batch gradient, and
    an evaluation that each replica scores on its own."""
    groups = replicated(1)
    module = nn.Sequential(*_blocks())
    optimizer = _RecordingSGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    before = len(dist.distributed_c10d._world.pg_map)
    with PipelineStage(
        module,
        optimizer,
        stage=0,
        num_stages=1,
        schedule="gpipe",
        loss_fn=nn.functional.cross_entropy,
        microbatches=2,
        ranks=groups.ranks,
        group=groups.pipeline,
        data_parallel=StageDataParallel(groups.data_parallel, channels=2, cost_model=COST),
    ) as stage:
        made = len(dist.distributed_c10d._world.pg_map) - before
        quarter = BATCH // 4
        cut = slice(groups.replica * quarter, (groups.replica + 1) * quarter)
        stage.run([(x[cut], y[cut]) for x, y in _data(1)], 1)
        score = stage.evaluate(_data(1), 1)
        hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in module.parameters())
    left = len(dist.distributed_c10d._world.pg_map) - before
    return {
        "grads": optimizer.seen[0],
        "total": score.total,
        "groups": (made, left),
        "hooks": hooks,
    }


def _batchnorm_blocks() -> list[nn.Module]:
    """Two stages of a small float64 net with BatchNorm in each."""
    torch.manual_seed(0)
    first = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Tanh(), nn.Flatten())
    second = nn.Sequential(nn.Linear(75, 10), nn.BatchNorm1d(10), nn.Tanh(), nn.Linear(10, CLASSES))
    return [first.double(), second.double()]


def _buffers_case(schedule: str) -> dict[bool, list[Tensor]]:
    """Each replica's buffers after 3 mini-batches on its half, by ``broadcast_buffers``."""
    groups = _GROUPS[0]
    result = {}
    for broadcast in (True, False):
        stage, _, _ = _stage(
            schedule,
            replicate=True,
            blocks=_batchnorm_blocks,
            broadcast_buffers=broadcast,
            microbatches=2,
        )
        with stage:
            stage.run(_half(_data(3), groups.replica), 3)
        result[broadcast] = [b.detach().clone() for b in stage.module.buffers()]
    return result


def _bad_input() -> list[str]:
    errors = []
    for bad in (3, PipelineLayout(2, 3)):
        try:
            replicated(bad)
        except UsageError as error:
            errors.append(str(error))
    return errors


def _rank_main() -> dict[str, Any]:
    errors = _bad_input()  # before any group exists: raised on every rank alike
    _GROUPS.append(replicated(2))
    by_hand = replicated(2, use_mesh=False)
    layout = _GROUPS[0].layout.describe()
    same_groups = all(
        dist.get_process_group_ranks(getattr(_GROUPS[0], name))
        == dist.get_process_group_ranks(getattr(by_hand, name))
        for name in ("pipeline", "data_parallel")
    )
    cases: dict[str, Any] = {f"sync-{s}": (lambda s=s: _sync_case(s)) for s in ("gpipe", "1f1b")}
    cases.update({f"async-{s}": (lambda s=s: _async_case(s, 4)) for s in ASYNC})
    cases["one-stage"] = _one_stage_case
    cases.update({f"buffers-{s}": (lambda s=s: _buffers_case(s)) for s in ("gpipe", "pipedream")})
    results: dict[str, Any] = run_scenarios(cases)
    results["errors"] = errors
    results["layout"] = layout
    results["stage"] = _GROUPS[0].stage
    results["same_groups"] = same_groups
    return results


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_ranks(_rank_main, 4, timeout=240)


def _full_batch_gradients() -> list[Tensor]:
    model = nn.Sequential(*_blocks())
    inputs, targets = _data(1)[0]
    nn.functional.cross_entropy(model(inputs), targets).backward()
    return [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_synchronous_replicas_give_the_whole_batch_gradient(
    schedule: str, four_ranks: list[dict[str, Any]]
) -> None:
    expected = _full_batch_gradients()
    for replica in range(2):
        got = [
            g
            for rank in (2 * replica, 2 * replica + 1)
            for g in four_ranks[rank][f"sync-{schedule}"]
        ]
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-12, msg=f"replica {replica}")


@pytest.mark.parametrize("schedule", ASYNC)
def test_asynchronous_replicas_average_their_updates(
    schedule: str, four_ranks: list[dict[str, Any]]
) -> None:
    for rank, values in enumerate(four_ranks):
        case = values[f"async-{schedule}"]
        # The same data on both replicas: the average of two equal gradients is that gradient.
        for same, alone in zip(case["same"], case["alone"], strict=True):
            assert torch.equal(same, alone), f"rank {rank}"
        # Different halves: the whole batch's update, with no staleness added.
        for halves, alone in zip(case["halves"], case["alone"], strict=True):
            torch.testing.assert_close(halves, alone, rtol=1e-9, atol=1e-12, msg=f"rank {rank}")
        # The replicas of a stage hold the same weights.
        twin = four_ranks[(rank + 2) % 4][f"async-{schedule}"]["halves"]
        for mine, theirs in zip(case["halves"], twin, strict=True):
            assert torch.equal(mine, theirs)
    moved = four_ranks[0][f"async-{schedule}"]["halves"][0]
    assert not torch.equal(moved, next(_blocks()[0].parameters()).detach())


def test_one_stage_replicas_are_data_parallelism(four_ranks: list[dict[str, Any]]) -> None:
    expected = _full_batch_gradients()
    for values in four_ranks:
        case = values["one-stage"]
        assert case["total"] == BATCH
        # Its second channel's group exists while the stage lives, and is gone after close;
        # no gradient hook stays on a parameter between backwards.
        assert case["groups"] == (1, 0)
        assert case["hooks"] == 0
        for g, e in zip(case["grads"], expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "pipedream"])
def test_replicas_share_replica_0s_buffers(schedule: str, four_ranks: list[dict[str, Any]]) -> None:
    for rank in (0, 1):  # replica 0 of each stage; rank + 2 is its twin in replica 1
        mine = four_ranks[rank][f"buffers-{schedule}"]
        twin = four_ranks[rank + 2][f"buffers-{schedule}"]
        assert len(mine[True]) == 3  # running mean, running variance, batches tracked
        # On: both replicas hold exactly what replica 0 reaches on its own data.
        for own, shared, copied in zip(mine[False], mine[True], twin[True], strict=True):
            assert torch.equal(shared, own), f"stage {rank}"
            assert torch.equal(copied, own), f"stage {rank}"
        # Off: each replica's statistics are its own half's.
        means = (mine[False][0], twin[False][0])
        assert not torch.equal(*means), f"stage {rank}"


def test_the_layout_is_the_mesh_convention(four_ranks: list[dict[str, Any]]) -> None:
    assert [values["stage"] for values in four_ranks] == [0, 1, 0, 1]
    assert all(values["same_groups"] for values in four_ranks)
    assert "2 stages x 2 replicas" in four_ranks[0]["layout"]
    assert "stage 0 [0, 2]; stage 1 [1, 3]" in four_ranks[0]["layout"]


def test_bad_layouts_are_one_line_errors(four_ranks: list[dict[str, Any]]) -> None:
    errors = four_ranks[0]["errors"]
    assert len(errors) == 2
    assert "4 ranks cannot be cut into pipelines of 3 stages" in errors[0]
    assert "1, 2, 4" in errors[0]
    assert "holds 6 ranks but the job has 4" in errors[1]
    assert all("\n" not in error for error in errors)
