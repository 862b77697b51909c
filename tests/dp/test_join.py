"""DataParallel under torch's ``Join`` with uneven inputs, against DDP under ``Join``."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from interlace.comm.cost import CostModel
from interlace.dp import DataParallel
from interlace.errors import UsageError
from interlace.testing import run_ranks

# A start-up so small that the merge rule keeps several buckets: the trials then weigh plans.
COST = CostModel(a=1e-6, b=1e-12)
#: Batches per rank in each case: rank 0 runs out first.
UNEVEN = (3, 5)


def _mlp(norm: bool = False) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(8, 16)]
    if norm:
        layers.append(nn.BatchNorm1d(16))
    layers.append(nn.Tanh())
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    layers.append(nn.Linear(16, 4))
    return nn.Sequential(*layers)


class Branchy(nn.Module):
    """Rank 1's batches use a head rank 0's never do: unused on one rank, used on the other."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()
        self.extra = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return self.extra(out) if x[0, 0] > 100 else out


def _batches(count: int, *, shift: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(10 + dist.get_rank())
    batches = []
    for _ in range(count):
        inputs = torch.randn(6, 8, generator=generator)
        if shift:
            inputs[0, 0] = 1000.0
        batches.append((inputs, torch.randint(0, 4, (6,), generator=generator)))
    return batches


def _step(model: Any, optimizer: torch.optim.Optimizer, batch: Any, accumulate: int) -> None:
    inputs, targets = batch
    optimizer.zero_grad()
    chunks = list(zip(inputs.chunk(accumulate), targets.chunk(accumulate), strict=True))
    for number, (x, y) in enumerate(chunks):
        context = model.no_sync() if number < len(chunks) - 1 else contextlib.nullcontext()
        with context:
            nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def _run(
    wrapped: nn.Module,
    setup: dict[str, Any],
    *,
    evaluate: bool = False,
) -> dict[str, Any]:
    """Train ``wrapped`` on this rank's uneven batches inside Join, then a few even steps."""
    counts = setup.get("counts", UNEVEN)
    rank = dist.get_rank()
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    even = _batches(setup.get("before", 0))
    for batch in even:
        _step(wrapped, optimizer, batch, 1)
    batches = _batches(counts[rank], shift=setup.get("shift", False) and rank == 1)
    with Join([wrapped], **setup.get("join", {})):
        for number, batch in enumerate(batches):
            _step(wrapped, optimizer, batch, setup.get("accumulate", 1))
            if evaluate and number % 2 == 0:
                with torch.no_grad():
                    wrapped(batch[0])
        # This rank is out of batches now; the others may still be training.
        done_at_own_end = getattr(wrapped, "planning_done", None)
    joined_planning_done = getattr(wrapped, "planning_done", None)
    at_join = torch.cat([p.detach().reshape(-1) for p in wrapped.parameters()])
    for batch in _batches(setup.get("after", 0)):
        _step(wrapped, optimizer, batch, 1)
    return {
        "params": [p.detach().clone() for p in wrapped.parameters()],
        "buffers": [b.detach().clone().double() for b in wrapped.buffers()],
        "planning_done_when_joined": joined_planning_done,
        "at_join": at_join,
        "planning_done_at_own_end": done_at_own_end,
    }


def _outcome(train: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return train()
    except RuntimeError as error:
        return {"error": f"{type(error).__name__}: {error}"}


CASES: dict[str, dict[str, Any]] = {
    # Default settings: still profiling when rank 0 joins, and after.
    "profiling": {"ours": {}},
    # Rank 1 alone plans (rank 0 shadows the MAX all-reduce and the broadcast of the plans),
    # switches candidates and keeps one; then both ranks train on with the same plan.
    "planning-and-trials": {
        "counts": (3, 60),
        "after": 3,
        "ours": {"profile_steps": 1, "tune_steps": 1, "cost_model": COST},
    },
    # Planned before the Join, no trials: the buckets are final.
    "settled": {
        "before": 4,
        "ours": {"profile_steps": 1, "tune_steps": 0, "cost_model": COST},
    },
    # BatchNorm statistics: under Join both take them from the highest rank still training.
    "buffers": {"norm": True, "after": 2, "ours": {"cost_model": COST}},
    "divide-by-active-ranks": {
        "join": {"divide_by_initial_world_size": False},
        "ours": {"profile_steps": 1, "cost_model": COST},
    },
    "no_sync-accumulation": {"accumulate": 2, "ours": {"profile_steps": 1, "cost_model": COST}},
    "unused-on-one-rank": {
        "model": "branchy",
        "shift": True,
        "ours": {"profile_steps": 1, "cost_model": COST},
        "ddp": {"find_unused_parameters": True},
    },
    "comm-hook": {"hook": True, "ours": {"profile_steps": 1, "cost_model": COST}},
    "gradient-as-bucket-view": {
        "ours": {"profile_steps": 1, "cost_model": COST, "gradient_as_bucket_view": True},
        "ddp": {"gradient_as_bucket_view": True},
    },
    # Evaluation forwards (no gradients) inside the Join: DDP would have its joined rank
    # shadow a backward for each (so it runs without them); the parameters must not change.
    "evaluation-forwards": {"evaluate": True, "ours": {"profile_steps": 1, "cost_model": COST}},
    "throw-on-early-termination": {"join": {"throw_on_early_termination": True}, "ours": {}},
}


def _case(name: str) -> dict[str, Any]:
    setup = CASES[name]
    torch.manual_seed(7)
    reference = Branchy() if setup.get("model") == "branchy" else _mlp(setup.get("norm", False))
    ours_model = copy.deepcopy(reference)

    def train_ddp() -> dict[str, Any]:
        ddp = DistributedDataParallel(reference, **setup.get("ddp", {}))
        if setup.get("hook"):
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return _run(ddp, setup)

    def train_ours() -> dict[str, Any]:
        ours = DataParallel(ours_model, **setup["ours"])
        if setup.get("hook"):
            ours.register_comm_hook(None, default_hooks.allreduce_hook)
        result = _run(ours, setup, evaluate=setup.get("evaluate", False))
        result["planning_done"] = ours.planning_done
        result["plan"] = None if ours.plan is None else ours.plan.groups
        result["summary"] = ours.tuning_summary
        return result

    ddp, ours = _outcome(train_ddp), _outcome(train_ours)
    if "error" in ddp or "error" in ours:
        return {"ddp_error": ddp.get("error"), "ours_error": ours.get("error")}
    worst = max(
        float((a - b).abs().max())
        for a, b in zip(
            [*ours["params"], *ours["buffers"]], [*ddp["params"], *ddp["buffers"]], strict=True
        )
    )
    flat = ours["at_join"]
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return {
        "vs_ddp": worst,
        "across_ranks": max(float((g - gathered[0]).abs().max()) for g in gathered),
        "planning_done": ours["planning_done"],
        "planning_done_when_joined": ours["planning_done_when_joined"],
        "planning_done_at_own_end": ours["planning_done_at_own_end"],
        "plan": ours["plan"],
        "summary": ours["summary"],
    }


def _refused_with_forward_overlap() -> str:
    model = DataParallel(_mlp(), overlap="forward", cost_model=COST)
    try:
        Join([model])
    except UsageError as error:
        return str(error)
    return "accepted"


def _every_case(_: None) -> dict[str, Any]:
    results: dict[str, Any] = {name: _case(name) for name in CASES}
    results["overlap-forward"] = _refused_with_forward_overlap()
    return results


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_every_case, 2, None, timeout=180)


TRAINING = [name for name in CASES if name != "throw-on-early-termination"]


@pytest.mark.parametrize("name", TRAINING)
def test_join_with_uneven_inputs_gives_ddps_parameters(
    results: list[dict[str, Any]], name: str
) -> None:
    for rank_result in results:
        result = rank_result[name]
        assert result.get("ddp_error") is None and result.get("ours_error") is None, result
        assert result["vs_ddp"] < 1e-6, result["vs_ddp"]
        # Join's end gives every rank the last joiner's model.
        assert result["across_ranks"] == 0.0


def test_the_plan_is_made_and_tried_while_a_rank_shadows(
    results: list[dict[str, Any]],
) -> None:
    first, second = (rank_result["planning-and-trials"] for rank_result in results)
    # Rank 0 ran out of batches during the trials; rank 1 finished them alone, rank 0
    # shadowing; both end on one plan, which they kept using after the Join.
    assert first["planning_done_at_own_end"] is False
    assert first["planning_done_when_joined"] and second["planning_done_when_joined"]
    assert first["summary"].startswith("tuned by measured iteration time")
    assert first["summary"] == second["summary"] and first["plan"] == second["plan"]


def test_a_plan_settled_before_the_join_stays(results: list[dict[str, Any]]) -> None:
    for rank_result in results:
        assert rank_result["settled"]["planning_done_when_joined"] is True
        assert rank_result["profiling"]["planning_done"] is False


def test_throw_on_early_termination_raises_on_every_rank_as_ddp(
    results: list[dict[str, Any]],
) -> None:
    for rank_result in results:
        result = rank_result["throw-on-early-termination"]
        assert result["ddp_error"] is not None and result["ours_error"] is not None
        assert result["ours_error"].split(":")[0] == result["ddp_error"].split(":")[0]


def test_forward_overlap_is_refused_clearly(results: list[dict[str, Any]]) -> None:
    for rank_result in results:
        assert "Join cannot shadow overlap='forward'" in rank_result["overlap-forward"]
