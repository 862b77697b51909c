"""DataParallel on ranks that disagree: one clear error on every rank, never a hang or an abort.

Every case runs in one 2-rank launch: a mismatch found by the check leaves the process group
usable, so the next case (and a final matching wrap that trains) runs on the same ranks.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from interlace.comm.cost import CostModel
from interlace.dp import DataParallel
from interlace.errors import UsageError
from interlace.testing import run_ranks

COST = CostModel(a=2e-4, b=1e-9)


def _model(rank: int, case: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    if case == "buffer on one rank" and rank == 1:
        model.register_buffer("extra", torch.zeros(3))
    if case == "buffer dtype":
        model.register_buffer("scale", torch.ones(3, dtype=torch.int32 if rank else torch.float32))
    if case == "parameter shape" and rank == 1:
        model[2] = nn.Linear(8, 3)
    return model


#: case -> (rank 0's keyword arguments, rank 1's), the model built by :func:`_model`.
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "profile_steps": ({"profile_steps": 1}, {"profile_steps": 4}),
    "tune_steps": ({"tune_steps": 2}, {"tune_steps": 5}),
    "tune_steps zero": ({"tune_steps": 2}, {"tune_steps": 0}),
    "broadcast_buffers": ({"broadcast_buffers": True}, {"broadcast_buffers": False}),
    "buffer on one rank": ({}, {}),
    "buffer dtype": ({}, {}),
    "parameter shape": ({}, {}),
    "bucketing": ({"bucketing": "merged"}, {"bucketing": "per-tensor"}),
    "channels": ({"channels": 1}, {"channels": 2}),
    "partition_mb": ({"partition_mb": "auto"}, {"partition_mb": None}),
    "compression": ({"compression": None}, {"compression": "fp16"}),
    "bucket_cap_mb": ({"bucket_cap_mb": 25.0}, {"bucket_cap_mb": 5.0}),
    "cost_model": ({"cost_model": COST}, {}),
}

#: case -> what the error must say (rank 0's value, then rank 1's).
EXPECTED = {
    "profile_steps": "DataParallel settings differ between ranks: profile_steps is 1 on rank 0 "
    "but 4 on rank 1; pass the same value on every rank",
    "tune_steps": "tune_steps is 2 on rank 0 but 5 on rank 1",
    "tune_steps zero": "tune_steps is 2 on rank 0 but 0 on rank 1",
    "broadcast_buffers": "broadcast_buffers is True on rank 0 but False on rank 1",
    "buffer on one rank": "DataParallel's model differs between ranks: buffer 'extra' is absent "
    "on rank 0 but shape (3,) float32 on rank 1; build the same model on every rank",
    "buffer dtype": "buffer 'scale' is shape (3,) float32 on rank 0 but shape (3,) int32 on rank 1",
    "parameter shape": "parameter '2.weight' is shape (2, 8) float32 on rank 0 but shape (3, 8) "
    "float32 on rank 1",
    "bucketing": "bucketing is 'merged' on rank 0 but 'per-tensor' on rank 1",
    "channels": "channels is 1 on rank 0 but 2 on rank 1",
    "partition_mb": "partition_mb is 'auto' on rank 0 but None on rank 1",
    "compression": "compression is None on rank 0 but 'fp16' on rank 1",
    "bucket_cap_mb": "bucket_cap_mb is 25.0 on rank 0 but 5.0 on rank 1",
    "cost_model": "cost_model is 'given, with 0 concurrency term(s)' on rank 0 but 'fitted on "
    "the group' on rank 1",
}


def _every_case(_: None) -> dict[str, Any]:
    """Wrap with each case's settings; the errors, then a matching wrap's averaged gradient."""
    rank = dist.get_rank()
    errors: dict[str, str] = {}
    for case, settings in CASES.items():
        try:
            DataParallel(_model(rank, case), **settings[rank])
        except UsageError as error:
            errors[case] = str(error)
    # The group still works: a matching wrap averages the gradients.
    model = DataParallel(_model(rank, "same"), cost_model=COST)
    model(_inputs(rank)).square().sum().backward()
    grad = model.module[0].weight.grad
    assert grad is not None
    return {"errors": errors, "grad": grad.tolist()}


@pytest.fixture(scope="module")
def outcome() -> list[dict[str, Any]]:
    return run_ranks(_every_case, 2, None, timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_each_mismatch_is_one_clear_error_on_every_rank(
    outcome: list[dict[str, Any]], case: str
) -> None:
    for rank in (0, 1):
        assert EXPECTED[case] in outcome[rank]["errors"][case]


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))


def test_the_group_still_trains_after_the_refused_wraps(outcome: list[dict[str, Any]]) -> None:
    local = []
    for rank in (0, 1):
        model = _model(rank, "same")
        model(_inputs(rank)).square().sum().backward()
        assert model[0].weight.grad is not None
        local.append(model[0].weight.grad)
    expected = (local[0] + local[1]) / 2
    for rank in (0, 1):
        torch.testing.assert_close(torch.tensor(outcome[rank]["grad"]), expected)


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"channels": True}, "channels must be an integer >= 1 or 'auto', got True"),
        ({"channels": 2.0}, "channels must be an integer"),
        ({"tune_steps": True}, "tune_steps must be an integer >= 0"),
        ({"tune_steps": -1}, "tune_steps must be an integer >= 0"),
        ({"profile_steps": False}, "profile_steps must be an integer >= 1"),
        ({"bucket_cap_mb": float("inf")}, "bucket_cap_mb=inf"),
        ({"first_bucket_cap_mb": True}, "first_bucket_cap_mb=True"),
        ({"partition_mb": float("nan")}, "partition_mb must be > 0 and finite"),
        ({"partition_mb": True}, "partition_mb must be > 0 and finite"),
        ({"broadcast_buffers": "no"}, "broadcast_buffers must be True or False"),
        ({"cost_model": (1e-4, 1e-9)}, "cost_model must be an interlace CostModel"),
    ],
)
def test_bools_as_numbers_and_non_finite_numbers_are_refused(
    settings: dict[str, Any], needle: str
) -> None:
    # Refused before the process group is needed: no ranks to start.
    with pytest.raises(UsageError, match=re.escape(needle)):
        DataParallel(nn.Linear(2, 2), **settings)
