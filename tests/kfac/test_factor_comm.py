"""Factor communication: pipelined all-reduces (SPD-KFAC) give the same results as bulk.

The multi-rank tests check that pipelined all-reduces (per factor, fixed buckets, merged buckets)
precondition exactly like the bulk all-reduce and like one process, alone and under
interlace.DataParallel, whose gradient all-reduces run at the same time as the factor all-reduces.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from interlace import KFAC
from interlace.comm.cost import CostModel
from interlace.dp import DataParallel
from interlace.kfac import factor_bulk, factor_comm, factor_pipeline
from interlace.kfac.factor_modes import Pipelined
from interlace.testing import average_gradients, run_ranks, run_scenarios

DTYPE = torch.float64
GLOBAL_BATCH = 8
STEPS = 4
VOCAB = 10
#: Start-up free, a second per byte: after the first factor's all-reduce the channel stays busy
#: past any real ready time, so MG-WFBP merges every later factor into one bucket whatever the
#: profiled times are: the plan [[0], [1, ..., n-1]], deterministic and really merged.
MERGING_COST = CostModel(0.0, 1.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"factor_comm": "eager"}, "factor_comm"),
        ({"fusion": "smart"}, "fusion"),
        ({"fusion": "fixed", "profile_steps": 0}, "profile_steps"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mode = kwargs["factor_comm"] if "factor_comm" in kwargs else Pipelined(**kwargs)
        KFAC(nn.Linear(3, 2), factor_comm=mode)


def test_the_split_modules_names_stay_importable_from_factor_comm() -> None:
    assert factor_comm.all_reduce_mean is factor_bulk.all_reduce_mean
    assert factor_comm.FactorPipeline is factor_pipeline.FactorPipeline
    assert set(factor_comm.__all__) >= {"FactorComm", "FactorPipeline", "all_reduce_mean"}


def test_pipelined_on_one_process_is_bulk() -> None:
    """One rank sends nothing: pipelined falls back to bulk and gives its numbers."""
    bulk = _train(0, 1, {})
    pipelined = _train(0, 1, {"factor_comm": Pipelined(fusion="merged")})
    for ours, theirs in zip(pipelined["grads"], bulk["grads"], strict=True):
        for name, value in theirs.items():
            torch.testing.assert_close(ours[name], value, rtol=0, atol=0)
    assert pipelined["plan"] is None


# -- equal results on several ranks ----------------------------------------------------------


class Pause(nn.Module):
    """Sleeps ``seconds`` in its forward: spaces the factors' ready times by at least that."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


class Net(nn.Module):
    """Embedding (a diagonal ``A``) -> mean over tokens -> three Linear layers (``pause_s``
    apart in the forward pass)."""

    def __init__(self, pause_s: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.body = nn.Sequential(
            nn.Linear(6, 16),
            nn.ReLU(),
            Pause(pause_s),
            nn.Linear(16, 12),
            nn.ReLU(),
            Pause(pause_s),
            nn.Linear(12, 3),
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(self.embed(tokens).mean(dim=1))
        return out


def _build(pause_s: float = 0.0) -> nn.Module:
    torch.manual_seed(4321)
    return Net(pause_s).to(DTYPE)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(200 + step)
    inputs = torch.randint(0, VOCAB, (GLOBAL_BATCH, 5), generator=generator)
    return inputs, torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)


def _train(
    rank: int,
    world: int,
    options: dict[str, Any],
    wrap: bool = False,
    steps: int = STEPS,
    pause_s: float = 0.0,
) -> dict[str, Any]:
    """``steps`` K-FAC steps on this rank's share of each global batch, plain SGD between."""
    model = _build(pause_s)
    wrapped: nn.Module = model
    if wrap:
        wrapped = DataParallel(model)
    precond = KFAC(
        wrapped,
        factor_update_steps=1,
        inv_update_steps=1,
        damping=0.01,
        factor_decay=0.5,
        inv_dtype=DTYPE,
        **options,
    )
    share = GLOBAL_BATCH // world
    grads = []
    comm_s = []
    for step in range(steps):
        inputs, targets = _batch(step)
        local = slice(rank * share, (rank + 1) * share)
        model.zero_grad(set_to_none=True)
        functional.cross_entropy(wrapped(inputs[local]), targets[local]).backward()
        if not wrap:
            average_gradients(model)
        precond.step()
        comm_s.append(precond.last_phase_s["factor_comm"])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})  # type: ignore[union-attr]
        with torch.no_grad():
            for param in model.parameters():
                param.sub_(0.1 * param.grad)
    spans = [event.name for event in precond.take_events() if event.category == "comm"]
    precond.remove_hooks()
    return {
        "grads": grads,
        "plan": precond.factor_plan,
        "settled": precond.factor_plan_settled,
        "tuning": precond.factor_tuning,
        "factors": len(precond.factor_order),
        "comm_s": comm_s,
        "spans": spans,
    }


CONFIGS: dict[str, dict[str, Any]] = {
    "bulk": {"factor_comm": "bulk"},
    "none": {"factor_comm": Pipelined(fusion="none")},
    # 1 KB: the four layers' packed factors (28 to 1088 bytes) fill several buckets.
    "fixed": {"factor_comm": Pipelined(fusion="fixed"), "bucket_cap_mb": 1 / 1024},
    # No trials: the cost model's plan is the one checked.
    "merged": {
        "factor_comm": Pipelined(
            fusion="merged", profile_steps=1, factor_cost=MERGING_COST, tune_steps=0
        ),
    },
}


def _rank_configs() -> dict[str, dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    return {name: _train(rank, world, options) for name, options in CONFIGS.items()}


def _labelled(what: str) -> Callable[[str], str]:
    """A message for assert_close that names the step and parameter."""
    return lambda message: f"{what}: {message}"


def _assert_same(
    ours: list[dict[str, torch.Tensor]], theirs: list[dict[str, torch.Tensor]]
) -> None:
    for step, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        for name, value in reference.items():
            # Sums in another order differ in the last bits, which decompositions amplify a little.
            atol = 1e-9 * float(value.abs().max())
            torch.testing.assert_close(
                mine[name], value, rtol=1e-6, atol=atol, msg=_labelled(f"step {step} {name}")
            )


@pytest.mark.slow
def test_pipelined_fusions_precondition_like_bulk_and_one_process() -> None:
    per_rank = run_ranks(_rank_configs, 4, timeout=180)
    single = _train(0, 1, {})
    for rank, records in enumerate(per_rank):
        for name, record in records.items():
            _assert_same(record["grads"], single["grads"])
            if name != "bulk":
                _assert_same(record["grads"], records["bulk"]["grads"])
            assert record["plan"] == per_rank[0][name]["plan"], f"rank {rank} {name}"
    records = per_rank[0]
    assert records["bulk"]["plan"] is None
    factors = records["none"]["factors"]
    assert factors == 8
    assert records["none"]["plan"] == [[i] for i in range(factors)]
    assert 1 < len(records["fixed"]["plan"]) < factors
    merged = records["merged"]["plan"]
    assert 1 < len(merged) < factors
    assert merged == [[0], list(range(1, factors))]
    assert any(span.startswith("factor bucket") for span in records["merged"]["spans"])


#: Start-up of a millisecond, nothing per byte: the cost model's plan sends the factors that
#: :data:`TRIAL_PAUSE_S` spaces apart on their own, and the trials' start-ups of 16 and 64 ms merge
#: them, so there are candidates to weigh whatever the machine's speed.
TRIAL_COST = CostModel(1e-3, 0.0)
TRIAL_PAUSE_S = 0.01


def _rank_trials() -> dict[str, Any]:
    options = {
        "factor_comm": Pipelined(
            fusion="merged", profile_steps=1, factor_cost=TRIAL_COST, tune_steps=1
        ),
    }
    # One bulk step, one profiled, then 2 rounds of each candidate (each after a warm-up step).
    return _train(dist.get_rank(), dist.get_world_size(), options, steps=16, pause_s=TRIAL_PAUSE_S)


@pytest.mark.slow
def test_merged_tries_coarser_plans_and_every_rank_keeps_the_same(
    two_ranks: dict[str, list[Any]],
) -> None:
    per_rank = two_ranks["trials"]
    single = _train(0, 1, {}, steps=16)
    first, second = per_rank
    for record in per_rank:
        # Whatever plan is in use, a step preconditions as one process does.
        _assert_same(record["grads"], single["grads"])
        assert record["settled"]
        assert record["tuning"] is not None
    assert first["plan"] == second["plan"]
    assert first["tuning"] == second["tuning"]  # the slowest rank's medians, on every rank
    tuning = first["tuning"]
    assert tuning.startswith("tuned by measured iteration time")
    assert "the cost model's plan" in tuning and "start-up x" in tuning
    kept = tuning.rsplit("kept ", 1)[1]
    assert kept in tuning.split("; kept")[0]


def _rank_data_parallel() -> dict[str, Any]:
    options = CONFIGS["merged"]
    return _train(dist.get_rank(), dist.get_world_size(), options, wrap=True)


@pytest.mark.slow
def test_pipelined_merged_under_data_parallel_matches_one_process(
    two_ranks: dict[str, list[Any]],
) -> None:
    per_rank = two_ranks["data parallel"]
    single = _train(0, 1, {})
    for record in per_rank:
        _assert_same(record["grads"], single["grads"])
        assert record["plan"] == [[0], list(range(1, record["factors"]))]


class Twice(nn.Module):
    """A layer called twice per forward: its hooks fire twice per step."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))
        return out


def _train_twice(rank: int, world: int, options: dict[str, Any]) -> list[list[float]]:
    torch.manual_seed(99)
    model = Twice().to(DTYPE)
    precond = KFAC(model, damping=0.01, factor_decay=0.5, inv_dtype=DTYPE, **options)
    share = GLOBAL_BATCH // world
    grads = []
    for step in range(3):
        generator = torch.Generator().manual_seed(300 + step)
        inputs = torch.randn(GLOBAL_BATCH, 6, generator=generator, dtype=DTYPE)
        targets = torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)
        local = slice(rank * share, (rank + 1) * share)
        model.zero_grad(set_to_none=True)
        functional.cross_entropy(model(inputs[local]), targets[local]).backward()
        average_gradients(model)
        precond.step()
        grads.append([float(v) for p in model.parameters() for v in p.grad.reshape(-1)])  # type: ignore[union-attr]
    return grads


def _rank_twice() -> list[list[float]]:
    options = {"factor_comm": Pipelined(fusion="fixed")}
    return _train_twice(dist.get_rank(), dist.get_world_size(), options)


@pytest.mark.slow
def test_a_layer_called_twice_falls_back_to_bulk_and_stays_exact(
    two_ranks: dict[str, list[Any]],
) -> None:
    """The pipeline sent only the first call's factors; step() notices and sends the sums."""
    per_rank = two_ranks["twice"]
    single = _train_twice(0, 1, {})
    for grads in per_rank:
        torch.testing.assert_close(torch.tensor(grads), torch.tensor(single), rtol=1e-6, atol=1e-12)


def _every_two_rank_scenario() -> dict[str, Any]:
    """Both 2-rank tests' work on this rank, in one job: starting ranks costs more than the
    training. A failure names its scenario."""
    return run_scenarios(
        {"data parallel": _rank_data_parallel, "twice": _rank_twice, "trials": _rank_trials}
    )


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list[Any]]:
    """Each 2-rank scenario's results by rank, from one launch."""
    per_rank = run_ranks(_every_two_rank_scenario, 2, timeout=180)
    return {name: [results[name] for results in per_rank] for name in per_rank[0]}
