"""K-FAC on ranks that disagree: one clear error on every rank, never a hang, an abort or
replicas that drift apart silently.

Every case runs in one 2-rank launch: a mismatch found by the check leaves the process group
usable, so the next case (and a final matching K-FAC that trains) runs on the same ranks.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from interlace.dp import DataParallel
from interlace.errors import UsageError
from interlace.kfac import KFAC, KFACWarning
from interlace.kfac.factor_modes import Pipelined
from interlace.testing import average_gradients, run_ranks


def _model(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, width), nn.ReLU(), nn.Linear(width, 3))


#: case -> (rank 0's keyword arguments, rank 1's); the model is :func:`_model`'s unless the
#: case names another.
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "inv_update_steps": ({"inv_update_steps": 1}, {"inv_update_steps": 3}),
    "factor_update_steps": ({"factor_update_steps": 1}, {"factor_update_steps": 2}),
    "factor_comm": ({"factor_comm": "bulk"}, {"factor_comm": "pipelined"}),
    "grad_worker_fraction": ({"grad_worker_fraction": 1.0}, {"grad_worker_fraction": 0.5}),
    "damping": ({"damping": 0.001}, {"damping": 0.5}),
    "kl_clip": ({"kl_clip": 0.001}, {"kl_clip": None}),
    "lr": ({"lr": 0.1}, {"lr": lambda step: 0.2}),
    "compute_method": ({"compute_method": "eigen"}, {"compute_method": "inverse"}),
    "placement": ({"placement": "greedy"}, {"placement": "round-robin"}),
    "fusion": ({"factor_comm": "pipelined"}, {"factor_comm": Pipelined(fusion="fixed")}),
    "factor_dtype": ({}, {"factor_dtype": torch.float64}),
    "g_normalization": ({}, {"g_normalization": "per-example"}),
    "skip_layers": ({}, {"skip_layers": ["0"]}),
    "damping_adaptation": ({}, {"damping_adaptation": "fixed"}),
    "layer list": ({}, {}),
    "layer list under DataParallel": ({}, {}),
}

EXPECTED = {
    "inv_update_steps": "K-FAC settings differ between ranks: inv_update_steps is 1 on rank 0 "
    "but 3 on rank 1; pass the same value on every rank",
    "factor_update_steps": "factor_update_steps is 1 on rank 0 but 2 on rank 1",
    "factor_comm": "factor_comm is 'bulk' on rank 0 but 'pipelined' on rank 1",
    "grad_worker_fraction": "grad_worker_fraction is 1.0 on rank 0 but 0.5 on rank 1",
    "damping": "damping is 0.001 on rank 0 but 0.5 on rank 1",
    "kl_clip": "kl_clip is 0.001 on rank 0 but None on rank 1",
    "lr": "lr is 0.1 on rank 0 but '0.2 at step 0 (a callable)' on rank 1",
    "compute_method": "compute_method is 'eigen' on rank 0 but 'inverse' on rank 1",
    "placement": "placement is 'greedy' on rank 0 but 'round-robin' on rank 1",
    "fusion": "fusion is 'merged' on rank 0 but 'fixed' on rank 1",
    "factor_dtype": "factor_dtype is None on rank 0 but torch.float64 on rank 1",
    "g_normalization": "g_normalization is 'kfac-pytorch' on rank 0 but 'per-example' on rank 1",
    "skip_layers": "skip_layers is [] on rank 0 but ['0'] on rank 1",
    "damping_adaptation": "damping_adaptation is 'LevenbergMarquardt(interval=5, omega=None, "
    "min_damping=None, max_damping=None)' on rank 0 but 'fixed' on rank 1",
    "layer list": "K-FAC's model differs between ranks: layer '0' is Linear weight (8, 6) float32 "
    "with bias, A 7, G 8 on rank 0 but Linear weight (9, 6) float32 with bias, A 7, G 9 on "
    "rank 1 (and 1 more differ: layer '2'); build the same model on every rank",
    "layer list under DataParallel": "DataParallel's model differs between ranks: parameter "
    "'0.weight' is shape (8, 6) float32 on rank 0 but shape (9, 6) float32 on rank 1",
}


def _every_case(_: None) -> dict[str, Any]:
    """Build K-FAC with each case's settings; the errors, then a matching run's parameters."""
    rank = dist.get_rank()
    errors: dict[str, str] = {}
    for case, settings in CASES.items():
        model = _model(9 if rank == 1 and case.startswith("layer list") else 8)
        try:
            wrapped = DataParallel(model) if case.endswith("DataParallel") else model
            KFAC(wrapped, **settings[rank])
        except UsageError as error:
            errors[case] = str(error)
    # The group still works: matching ranks train a step with averaged factors.
    model = _model()
    precond = KFAC(model)
    generator = torch.Generator().manual_seed(rank)
    inputs, targets = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,))
    functional.cross_entropy(model(inputs), targets).backward()
    average_gradients(model)
    precond.step()
    return {
        "errors": errors,
        "a": precond.kfac_layers["0"].a_factor.tolist(),
        "pipelined": {skip: _pipelined_factors(rank, skip) for skip in (False, True)},
    }


def _pipelined_factors(rank: int, skip: bool) -> list[list[float]]:
    """Pipelined factor all-reduces, with or without a bad batch whose step is skipped."""
    model = _model()
    precond = KFAC(model, factor_comm="pipelined")
    # Batch 2 is the bad one (inputs x inf); the clean run never sees it.
    batches = (
        [(0, 1.0), (1, 1.0), (2, math.inf), (3, 1.0)] if skip else [(0, 1.0), (1, 1.0), (3, 1.0)]
    )
    for seed, scale in batches:
        inputs = torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * seed + rank))
        model.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KFACWarning)
            functional.cross_entropy(
                model(inputs * scale), torch.zeros(8, dtype=torch.long)
            ).backward()
        if math.isfinite(scale):
            precond.step()
    layer = precond.kfac_layers["0"]
    assert layer.a_factor is not None and layer.g_factor is not None
    return [layer.a_factor.reshape(-1).tolist(), layer.g_factor.reshape(-1).tolist()]


@pytest.fixture(scope="module")
def outcome() -> list[dict[str, Any]]:
    return run_ranks(_every_case, 2, None, timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_each_mismatch_is_one_clear_error_on_every_rank(
    outcome: list[dict[str, Any]], case: str
) -> None:
    for rank in (0, 1):
        assert EXPECTED[case] in outcome[rank]["errors"][case]


def test_a_skipped_step_leaves_pipelined_factors_clean(outcome: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        clean, skipped = outcome[rank]["pipelined"][False], outcome[rank]["pipelined"][True]
        for ours, reference in zip(skipped, clean, strict=True):
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(reference))


def test_matching_ranks_still_average_their_factors(outcome: list[dict[str, Any]]) -> None:
    assert outcome[0]["a"] == outcome[1]["a"]
    # The running average after one step: decay * I + (1 - decay) * mean of the ranks' A.
    moments = []
    for rank in (0, 1):
        inputs = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))
        rows = torch.cat([inputs, torch.ones(8, 1)], dim=1)
        moments.append(rows.t() @ rows / 8)
    expected = 0.95 * torch.eye(7) + 0.05 * (moments[0] + moments[1]) / 2
    torch.testing.assert_close(torch.tensor(outcome[0]["a"]), expected)
