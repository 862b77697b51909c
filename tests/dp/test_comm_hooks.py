"""DataParallel.register_comm_hook against DDP's with the same torch hook: same training."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)
from torch.nn.parallel import DistributedDataParallel

from interlace.comm.cost import CostModel
from interlace.dp import DataParallel
from interlace.errors import UsageError
from interlace.testing import run_ranks, run_scenarios

# Prices that make "per-tensor" and "merged" plans of several buckets on the tiny model.
COST = CostModel(a=2e-4, b=1e-9)
STEPS = 6


class Tiny(nn.Module):
    """Four matrices PowerSGD compresses (rank 1 is cheaper than each) and their biases."""

    def __init__(self, unused: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(32, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 16)
        )
        self.head = nn.Linear(16, 5)
        self.never_used = nn.Linear(4, 4) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.body(x))
        return out


def _bf16_for_ddp(state, bucket):  # type: ignore[no-untyped-def]
    """bf16_compress_hook under another name: DDP refuses that name without CUDA and NCCL, but
    gloo on CPUs sums bfloat16 as well. (Not annotated: DDP checks annotations against its own
    classes, and this module's annotations are strings.)"""
    return default_hooks.bf16_compress_hook(state, bucket)


def _hook_and_state(name: str, *, for_ddp: bool = False) -> tuple[Any, Any]:
    if name == "powersgd":
        state = PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=7
        )
        return state, powerSGD_hook
    hooks = {
        "allreduce": default_hooks.allreduce_hook,
        "fp16": default_hooks.fp16_compress_hook,
        "bf16": _bf16_for_ddp if for_ddp else default_hooks.bf16_compress_hook,
        "fp16-wrapped-allreduce": default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
    }
    return None, hooks[name]


def _train(name: str, bucketing: str) -> dict[str, Any]:
    """Train DDP and DataParallel side by side, each with its own copy of the hook's state."""
    rank = dist.get_rank()
    # PowerSGD's result depends on the order of the tensors in a bucket. DDP's first bucket
    # holds 1 MB: this model (< 20 kB) is one bucket there, as in "single". Without unused
    # parameters DDP rebuilds it after the first pass in the order gradients arrive, the order
    # of interlace's buckets; with them it keeps registration order.
    unused = name != "powersgd"
    torch.manual_seed(3)
    reference = Tiny(unused)
    ours_model = copy.deepcopy(reference)
    ddp = DistributedDataParallel(reference, find_unused_parameters=unused)
    ours = DataParallel(
        ours_model, bucketing=bucketing, profile_steps=1, cost_model=COST, tune_steps=0
    )
    ddp.register_comm_hook(*_hook_and_state(name, for_ddp=True))
    ours.register_comm_hook(*_hook_and_state(name))
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(50 + rank)
    losses: dict[str, list[float]] = {"ddp": [], "ours": []}
    grads_equal = True
    for _ in range(STEPS):
        inputs = torch.randn(16, 32, generator=generator)
        targets = torch.randint(0, 5, (16,), generator=generator)
        for key, model, optimizer in (("ddp", ddp, opt_ddp), ("ours", ours, opt_ours)):
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()
            losses[key].append(loss.item())
        for p_ddp, p_ours in zip(reference.parameters(), ours_model.parameters(), strict=True):
            grads_equal &= _same(p_ddp.grad, p_ours.grad)
        opt_ddp.step()
        opt_ours.step()
    return {
        "losses": losses,
        "grads_equal": grads_equal,
        "weights_equal": all(
            torch.equal(a, b)
            for a, b in zip(reference.parameters(), ours_model.parameters(), strict=True)
        ),
        "unused_grad": ours_model.never_used.weight.grad if ours_model.never_used else None,
        "buckets": len(ours.buckets),
    }


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


#: (hook, interlace bucketing): the elementwise hooks on buckets unlike DDP's as well.
CASES = (
    ("allreduce", "merged"),
    ("allreduce", "per-tensor"),
    ("fp16", "per-tensor"),
    ("bf16", "fixed"),
    ("fp16-wrapped-allreduce", "single"),
    ("powersgd", "single"),
)


def _train_every_case() -> dict[tuple[str, str], dict[str, Any]]:
    return {case: _train(*case) for case in CASES}


@pytest.mark.timeout(460)  # above the harness's own limit, which reports better
def test_torch_hooks_train_exactly_as_under_ddp(two_ranks: dict[str, list[Any]]) -> None:
    results = two_ranks["cases"]
    for by_case in results:
        for case, result in by_case.items():
            assert result["grads_equal"], case
            assert result["weights_equal"], case
            assert result["losses"]["ours"] == result["losses"]["ddp"], case
            # No rank used it: no gradient, as without a hook.
            assert result["unused_grad"] is None, case
    ours = {case: result["losses"]["ours"] for case, result in results[0].items()}
    assert results[0][("allreduce", "per-tensor")]["buckets"] > 1
    # The hooks did run: rounding to fp16 and PowerSGD's low rank show in later losses (the
    # first loss comes before any averaged step).
    plain = ours[("allreduce", "per-tensor")]
    for case in (("fp16", "per-tensor"), ("powersgd", "single")):
        assert ours[case][0] == plain[0]
        assert ours[case] != plain, case


def _misuse() -> dict[str, str]:
    hook = default_hooks.allreduce_hook
    messages: dict[str, str] = {}
    attempts = {
        "compression": lambda: DataParallel(nn.Linear(3, 3), compression="fp16"),
        "channels": lambda: DataParallel(nn.Linear(3, 3), channels=2),
        "twice": lambda: DataParallel(nn.Linear(3, 3)),
        "late": lambda: DataParallel(nn.Linear(3, 3)),
    }
    for kind, wrap in attempts.items():
        model = wrap()
        if kind == "twice":
            model.register_comm_hook(None, hook)
        elif kind == "late":
            model(torch.ones(2, 3)).sum().backward()
        try:
            model.register_comm_hook(None, hook)
        except UsageError as error:
            messages[kind] = str(error)
    return messages


@pytest.mark.timeout(460)  # it may be the first to ask for the shared launch
def test_misuse_is_a_clear_error(two_ranks: dict[str, list[Any]]) -> None:
    for messages in two_ranks["misuse"]:
        assert "compression='fp16' cannot be combined" in messages["compression"]
        assert "channels=2 cannot be combined" in messages["channels"]
        assert "only be called once" in messages["twice"]
        assert "before the first backward" in messages["late"]


def _every_scenario(_: None) -> dict[str, Any]:
    """Both tests' work on this rank, in one job: starting ranks costs more than the training.
    A failure names its scenario."""
    return run_scenarios({"cases": _train_every_case, "misuse": _misuse})


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list[Any]]:
    """Each scenario's results by rank, from one 2-rank launch."""
    per_rank = run_ranks(_every_scenario, 2, None, timeout=400)
    return {name: [results[name] for results in per_rank] for name in per_rank[0]}
