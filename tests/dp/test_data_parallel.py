"""interlace.DataParallel against torch DDP: same gradients, same training, clear errors."""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from interlace.comm.cost import CostModel
from interlace.comm.plan import Bucketing
from interlace.comm.tuning import PlanTrials
from interlace.dp import DataParallel
from interlace.errors import RankFailedError, UsageError
from interlace.testing import raised_message, run_ranks, run_scenarios
from interlace.zoo import build_model

# The 2-rank tests share one launch (the ``two_ranks`` fixture, set up in the first one's time).
pytestmark = pytest.mark.timeout(460)

#: Every bucketing, by the string a user passes.
BUCKETINGS = tuple(bucketing.value for bucketing in Bucketing)
#: The models every bucketing trains against DDP.
BUCKETING_MODELS = ("mlp", "resnet20", "transformer", "unused", "tied")
# A cost model that makes "merged" form several buckets on these small models.
COST = CostModel(a=2e-4, b=1e-9)


class WithUnusedParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.never_used = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


class WithTiedWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(64, 64, bias=False)
        self.mix = nn.Linear(64, 64)
        self.decode = nn.Linear(64, 64, bias=False)
        self.decode.weight = self.encode.weight  # tied: one parameter used twice
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.encode(x.flatten(1)))
        h = torch.relu(self.decode(self.mix(h)))
        out: torch.Tensor = self.head(h)
        return out


def _make(name: str) -> nn.Module:
    if name == "unused":
        return WithUnusedParameter()
    if name == "tied":
        return WithTiedWeights()
    return build_model(name, (1, 8, 8), 10)


def _relative(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _compare_with_ddp(name: str, steps: int) -> dict[str, Any]:
    """Train our wrapper (each bucketing) and DDP side by side; report the worst differences."""
    rank = dist.get_rank()
    report: dict[str, Any] = {}
    for bucketing in BUCKETINGS:
        torch.manual_seed(1234)
        reference = _make(name)
        ours_model = copy.deepcopy(reference)
        ddp = DistributedDataParallel(reference, find_unused_parameters=name == "unused")
        ours = DataParallel(ours_model, bucketing=bucketing, profile_steps=2, cost_model=COST)
        opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
        generator = torch.Generator().manual_seed(100 + rank)
        worst_grad, losses_ddp, losses_ours = 0.0, [], []
        for _ in range(steps):
            inputs = torch.randn(8, 1, 8, 8, generator=generator)
            targets = torch.randint(0, 10, (8,), generator=generator)
            for model, optimizer, losses in (
                (ddp, opt_ddp, losses_ddp),
                (ours, opt_ours, losses_ours),
            ):
                optimizer.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(inputs), targets)
                loss.backward()
                losses.append(float(loss))
            for p_ddp, p_ours in zip(reference.parameters(), ours_model.parameters(), strict=True):
                worst_grad = max(worst_grad, _relative(p_ours.grad, p_ddp.grad))
            opt_ddp.step()
            opt_ours.step()
        report[bucketing] = {
            "worst_grad": worst_grad,
            "losses_ddp": losses_ddp,
            "losses_ours": losses_ours,
            "buckets": len(ours.plan.buckets) if ours.plan else None,
        }
    return report


@pytest.mark.parametrize("name", BUCKETING_MODELS)
def test_every_bucketing_matches_ddp_for_twenty_steps(
    name: str, two_ranks: dict[str, list[Any]]
) -> None:
    report = two_ranks[f"ddp {name}"][0]
    for bucketing, result in report.items():
        assert result["buckets"] is not None, f"{bucketing}: never planned"
        assert result["worst_grad"] < 1e-6, (bucketing, result["worst_grad"])
        assert result["losses_ours"] == pytest.approx(result["losses_ddp"], rel=1e-6), bucketing
    assert report["single"]["buckets"] == 1
    assert report["per-tensor"]["buckets"] == sum(
        1 for p in _make(name).parameters() if p.requires_grad
    )


def test_three_ranks_average_like_ddp() -> None:
    report = run_ranks(_compare_with_ddp, 3, "mlp", 6, timeout=240)[0]
    for result in report.values():
        assert result["worst_grad"] < 1e-6


def _no_sync_accumulates() -> float:
    torch.manual_seed(0)
    reference = nn.Linear(6, 3)
    ours = DataParallel(copy.deepcopy(reference), bucketing="merged", cost_model=COST)
    ddp = DistributedDataParallel(reference)
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randn(4, 6, generator=generator) for _ in range(3)]
    for model in (ddp, ours):
        with model.no_sync():
            model(batches[0]).sum().backward()
            model(batches[1]).sum().backward()
        model(batches[2]).sum().backward()
    worst = 0.0
    for a, b in zip(ours.module.parameters(), reference.parameters(), strict=True):
        worst = max(worst, _relative(a.grad, b.grad))
    return worst


def test_no_sync_accumulates_then_averages_like_ddp(two_ranks: dict[str, list[Any]]) -> None:
    assert max(two_ranks["no_sync"]) < 1e-6


def _plan_is_shared(cache_dir: str) -> list[list[int]]:
    os.environ["INTERLACE_CACHE_DIR"] = cache_dir
    model = DataParallel(build_model("mlp", (1, 8, 8), 10), bucketing="merged", profile_steps=2)
    for _step in range(4):
        model(torch.randn(4, 1, 8, 8)).sum().backward()
    assert model.plan is not None and model.cost_model is not None
    return model.plan.groups


def test_ranks_agree_on_one_plan_with_a_fitted_cost_model(
    two_ranks: dict[str, list[Any]], cache_dir: Path
) -> None:
    plans = two_ranks["fitted plan"]
    assert plans[0] == plans[1]
    assert sorted(i for group in plans[0] for i in group) == list(range(26))
    # The fitted model was cached for the next start.
    assert (cache_dir / "cost_models.json").exists()


def _wrap_mismatched() -> str:
    width = 16 if dist.get_rank() == 0 else 17
    return raised_message(lambda: DataParallel(nn.Linear(4, width)))


def test_a_model_that_differs_across_ranks_is_refused_at_wrap_time(
    two_ranks: dict[str, list[Any]],
) -> None:
    # Both ranks returned (the launch has a time limit), each refused with both shapes named.
    for message in two_ranks["mismatched"]:
        assert re.search(r"on rank 0 but shape \(17, 4\) float32 on rank 1", message), message


def _wrap(kind: str) -> str:
    if kind == "frozen":
        return raised_message(lambda: DataParallel(nn.Linear(3, 3).requires_grad_(False)))
    if kind == "cap":
        return raised_message(
            lambda: DataParallel(nn.Linear(3, 3), bucketing="fixed", bucket_cap_mb=0)
        )
    return raised_message(lambda: DataParallel(nn.Linear(3, 3), bucketing="fastest"))


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("frozen", "no trainable parameters"),
        ("cap", "bucket caps must be > 0"),
        ("name", "fastest"),
    ],
)
def test_bad_settings_are_clear_errors(
    kind: str, needle: str, two_ranks: dict[str, list[Any]]
) -> None:
    for message in two_ranks[f"bad {kind}"]:
        assert needle in message, message


def test_an_uninitialised_process_group_is_a_clear_error() -> None:
    assert not dist.is_initialized()
    with pytest.raises(UsageError, match="init_process_group"):
        DataParallel(nn.Linear(2, 2))


def _die_mid_backward(_: None) -> None:
    model = DataParallel(build_model("mlp", (1, 8, 8), 10), bucketing="per-tensor", cost_model=COST)
    for step in range(50):
        loss = model(torch.randn(4, 1, 8, 8)).sum()
        if step == 3 and dist.get_rank() == 1:
            # Leave in the middle of backward: a hook on the first layer's weight exits.
            model.module.net[1].weight.register_hook(lambda grad: os._exit(7))
        loss.backward()


def test_a_rank_killed_mid_backward_ends_the_job_with_an_error() -> None:
    with pytest.raises(RankFailedError) as failure:
        run_ranks(_die_mid_backward, 2, None, timeout=60)
    assert failure.value.rank == 1
    assert failure.value.returncode == 7


def _tuned_run(settings: tuple[int, bool]) -> dict[str, Any]:
    tune_steps, evaluate = settings
    torch.manual_seed(5)
    model = DataParallel(
        build_model("mlp", (1, 8, 8), 10),
        profile_steps=2,
        tune_steps=tune_steps,
        # A start-up so small that the merge rule keeps several buckets, which DDP's single
        # bucket (this model is under 1 MB) then differs from.
        cost_model=CostModel(a=1e-6, b=1e-12),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    done_after = None
    for step in range(60):
        optimizer.zero_grad()
        model(torch.randn(8, 1, 8, 8)).sum().backward()
        optimizer.step()
        if evaluate and step % 7 == 3:
            # Evaluation passes in between: they must neither count nor break the trials.
            with torch.no_grad():
                model.eval()
                model(torch.randn(8, 1, 8, 8))
                model.train()
        if model.planning_done and done_after is None:
            done_after = step
    assert model.plan is not None
    return {
        "summary": model.tuning_summary,
        "results": model.tuning_results,
        "groups": model.plan.groups,
        "done_after": done_after,
    }


def _trial_iterations(candidates: int) -> int:
    """Iterations the trials take with one timed iteration per schedule entry."""
    schedule = PlanTrials([str(i) for i in range(candidates)], steps=1).schedule
    changes = sum(1 for before, after in itertools.pairwise(schedule) if before != after)
    return len(schedule) + 1 + changes


def test_candidate_plans_are_tried_and_the_fastest_measured_is_kept_on_every_rank(
    two_ranks: dict[str, list[Any]],
) -> None:
    first, second = two_ranks["tuned"]
    assert first["summary"].startswith("tuned by measured iteration time")
    assert first["summary"] == second["summary"] and first["groups"] == second["groups"]
    labels = [label for label, _, _ in first["results"]]
    assert labels[0].startswith("the cost model's plan")
    assert any(label.endswith("DDP's buckets (1 MiB first, 25 MiB)") for label in labels)
    assert any("even buckets" in label for label in labels)
    assert len(labels) >= 2
    # The plan kept is the candidate with the fewest buckets among those within the trials'
    # tie margin of the least median, and its buckets are in use.
    margin = float(re.search(r"ties within ([0-9.]+)%", first["summary"]).group(1)) / 100
    assert margin >= 0.02
    least = min(result[2] for result in first["results"])
    close = [result for result in first["results"] if result[2] <= least * (1 + margin) + 1e-12]
    kept = min(close, key=lambda result: (result[1], result[2]))
    assert first["summary"].endswith(f"kept {kept[0]}")
    assert len(first["groups"]) == kept[1]
    # Planned at step 3 (1 warm-up + 2 profiled passes). Then 1 timed iteration per entry of
    # the schedule, 1 untimed at the start and after each change of buckets; the winner is
    # chosen at the next forward.
    assert first["done_after"] == 3 + _trial_iterations(len(labels))


def test_evaluation_passes_during_the_trials_are_not_timed_and_break_nothing(
    two_ranks: dict[str, list[Any]],
) -> None:
    first, second = two_ranks["tuned with evaluation"]
    assert first["summary"].startswith("tuned by measured iteration time")
    assert first["groups"] == second["groups"]
    # A span with an evaluation pass in it is dropped, so the trials take longer.
    assert first["done_after"] > 3 + _trial_iterations(len(first["results"]))


def test_tune_steps_zero_keeps_the_cost_models_plan(two_ranks: dict[str, list[Any]]) -> None:
    for result in two_ranks["untuned"]:
        assert result["summary"] == "" and result["results"] == []
        assert result["done_after"] == 3


def _buffers_like_ddp() -> dict[str, float]:
    """BatchNorm statistics against DDP's (which re-sends rank 0's buffers before every forward)
    through training steps and an evaluation pass; then, after a training-mode pass without
    gradients on rank-specific data, a training step on the same batch everywhere must leave
    every rank with the same statistics (rank 0's, updated alike)."""
    torch.manual_seed(3)
    reference = build_model("resnet20", (1, 8, 8), 10)
    ours = DataParallel(copy.deepcopy(reference), bucketing="fixed", cost_model=COST)
    ddp = DistributedDataParallel(reference)
    generator = torch.Generator().manual_seed(50 + dist.get_rank())  # rank-specific batches
    worst = 0.0
    for step in range(5):
        inputs = torch.randn(4, 1, 8, 8, generator=generator)
        for model in (ddp, ours):
            if step == 3:
                model.eval()
                with torch.no_grad():
                    model(inputs)
                model.train()
            model(inputs).sum().backward()
        for a, b in zip(ours.module.buffers(), reference.buffers(), strict=True):
            worst = max(worst, _relative(a.double(), b.double()))
    with torch.no_grad():
        ours(torch.randn(4, 1, 8, 8, generator=generator) * 2)  # updates this rank's statistics
    shared = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(7))
    ours(shared).sum().backward()
    flat = torch.cat([b.double().reshape(-1) for b in ours.module.buffers()])
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    spread = max(_relative(other, gathered[0]) for other in gathered)
    return {"vs_ddp": worst, "across_ranks": spread}


def test_buffers_follow_rank_zero_before_every_training_forward_like_ddp(
    two_ranks: dict[str, list[Any]],
) -> None:
    for result in two_ranks["buffers"]:
        assert result["vs_ddp"] < 1e-6
        assert result["across_ranks"] < 1e-12


def _two_rank_scenarios(cache_dir: str) -> dict[str, Callable[[], Any]]:
    """The 2-rank scenarios above, by name. The fitted plan comes first (the others pass their
    cost model, so this fit is the process's first) and the refusals last."""
    scenarios: dict[str, Callable[[], Any]] = {"fitted plan": lambda: _plan_is_shared(cache_dir)}
    for name in BUCKETING_MODELS:
        scenarios[f"ddp {name}"] = functools.partial(_compare_with_ddp, name, 20)
    scenarios.update(
        {
            "no_sync": _no_sync_accumulates,
            "tuned": lambda: _tuned_run((1, False)),
            "tuned with evaluation": lambda: _tuned_run((1, True)),
            "untuned": lambda: _tuned_run((0, False)),
            "buffers": _buffers_like_ddp,
            "bad frozen": lambda: _wrap("frozen"),
            "bad cap": lambda: _wrap("cap"),
            "bad name": lambda: _wrap("name"),
            "mismatched": _wrap_mismatched,
        }
    )
    return scenarios


def _every_two_rank_scenario(cache_dir: str) -> dict[str, Any]:
    """Each scenario's result on this rank; a failure names its scenario."""
    return run_scenarios(_two_rank_scenarios(cache_dir))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ranks' cost-model cache folder (``INTERLACE_CACHE_DIR``)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def two_ranks(cache_dir: Path) -> dict[str, list[Any]]:
    """Every 2-rank scenario's results by rank, from one launch: starting ranks costs more than
    most scenarios do."""
    per_rank = run_ranks(_every_two_rank_scenario, 2, str(cache_dir), timeout=400)
    return {name: [results[name] for results in per_rank] for name in per_rank[0]}


def _one_rank() -> dict[str, Any]:
    torch.manual_seed(0)
    net = build_model("mlp", (1, 8, 8), 10)
    generator = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 1, 8, 8, generator=generator) for _ in range(5)]
    report: dict[str, Any] = {}
    for overlap in ("backward", "forward"):
        ddp = DistributedDataParallel(copy.deepcopy(net))
        ours = DataParallel(copy.deepcopy(net), bucket_cap_mb=2, overlap=overlap)
        for model in (ddp, ours):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for step, inputs in enumerate(batches):
                context = model.no_sync() if step == 1 else contextlib.nullcontext()
                with context:
                    model(inputs).square().mean().backward()
                if step != 1:
                    optimizer.step()
                    optimizer.zero_grad()
        inner = ours.module
        report[overlap] = {
            "same": all(
                torch.equal(a, b) for a, b in zip(ddp.parameters(), ours.parameters(), strict=True)
            ),
            "plan": ours.plan,
            "buckets": ours.buckets,
            "planning_done": ours.planning_done,
            "cap_bytes": ours.bucket_cap_bytes,
            "hooks": sum(len(p._post_accumulate_grad_hooks or {}) for p in inner.parameters())
            + sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in inner.modules()),
        }
        ours.close()
        report[overlap]["closed_forward"] = raised_message(functools.partial(ours, batches[0]))
    full = DataParallel(
        copy.deepcopy(net),
        single_rank_shortcut=False,
        cost_model=COST,
        tune_steps=0,
        profile_steps=1,
    )
    for inputs in batches:
        full(inputs).sum().backward()
    alone = DataParallel(copy.deepcopy(net))
    state = full.plan_state()
    assert state is not None
    alone.load_plan_state(state)
    report["full_buckets"] = len(full.buckets)
    report["alone_state"] = alone.plan_state()
    return report


def test_one_rank_takes_the_shortcut_with_ddps_numbers_and_no_hooks() -> None:
    report = run_ranks(_one_rank, 1, timeout=120)[0]
    for overlap in ("backward", "forward"):
        mode = report[overlap]
        assert mode["same"], overlap  # bit for bit, no_sync included
        assert mode["plan"] is None and mode["buckets"] == [] and mode["planning_done"]
        assert mode["cap_bytes"] == 2 * 2**20  # MiB, as torch DDP
        assert mode["hooks"] == 0
        assert "closed" in mode["closed_forward"]
    assert report["full_buckets"] >= 1  # single_rank_shortcut=False plans on one rank
    assert report["alone_state"] is None
