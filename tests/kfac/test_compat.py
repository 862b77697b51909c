"""kfac-pytorch's constructor arguments, enums and methods, each with kfac-pytorch's meaning."""

from __future__ import annotations

import argparse
import enum
import logging
import warnings

import pytest
import torch
from torch import nn

from interlace import kfac  # kfac-pytorch's package name: its scripts read `kfac.enums...`
from interlace.errors import UsageError
from interlace.kfac import KFAC, KFACWarning
from interlace.kfac.balancing import decomposition_cost, memory_cost
from interlace.kfac.costs import DecompositionCostModel
from interlace.kfac.factor_modes import Bulk, Pipelined
from interlace.kfac.placements import LBP, Greedy
from interlace.kfac.preconditioner import KFACPreconditioner
from interlace.testing import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)


def _train(model: nn.Module, precond: KFAC, steps: int = 2, scale: float = 1.0) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _batch(step)
        optimizer.zero_grad()
        (nn.functional.cross_entropy(model(x), y) * scale).backward()
        precond.step()
        optimizer.step()


def test_kfac_pytorch_example_constructor_calls_run_unchanged() -> None:
    # The constructor calls of kfac-pytorch's README and example training scripts, verbatim
    # but for the values their argparse would supply.
    args = argparse.Namespace(
        kfac_factor_update_steps=1,
        kfac_inv_update_steps=10,
        kfac_damping=0.003,
        kfac_factor_decay=0.95,
        kfac_kl_clip=0.001,
        batches_per_allreduce=1,
        kfac_colocate_factors=True,
        kfac_inv_method=False,
        kfac_skip_layers=[],
        strategy="comm_opt",
        skip_layers=["embedding", "decoder"],
    )
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grad_worker_fraction = kfac.enums.DistributedStrategy.COMM_OPT
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KFACWarning)  # ReLU has no parameters; nothing skipped
        vision = kfac.preconditioner.KFACPreconditioner(
            model,
            factor_update_steps=args.kfac_factor_update_steps,
            inv_update_steps=args.kfac_inv_update_steps,
            damping=args.kfac_damping,
            factor_decay=args.kfac_factor_decay,
            kl_clip=args.kfac_kl_clip,
            lr=lambda x: optimizer.param_groups[0]["lr"],
            accumulation_steps=args.batches_per_allreduce,
            allreduce_bucket_cap_mb=25,
            colocate_factors=args.kfac_colocate_factors,
            compute_method=kfac.enums.ComputeMethod.INVERSE
            if args.kfac_inv_method
            else kfac.enums.ComputeMethod.EIGEN,
            grad_worker_fraction=grad_worker_fraction,
            grad_scaler=args.grad_scaler if "grad_scaler" in args else None,
            skip_layers=args.kfac_skip_layers,
        )
    _train(model, vision)
    checkpoint = {"preconditioner": vision.state_dict()}
    vision.remove_hooks()

    language = _model()
    strategy = kfac.enums.DistributedStrategy[args.strategy.upper()]
    precond = KFACPreconditioner(
        language,
        factor_update_steps=1,
        inv_update_steps=10,
        damping=0.003,
        factor_decay=0.95,
        kl_clip=0.001,
        lr=lambda x: optimizer.param_groups[0]["lr"],
        grad_worker_fraction=strategy,
        skip_layers=args.skip_layers,
        loglevel=logging.INFO,
    )
    precond.load_state_dict(checkpoint["preconditioner"])
    assert precond.steps == 2
    assert repr(precond).startswith("KFACPreconditioner(") and "steps=2," in repr(precond)


class ComputeMethod(enum.Enum):  # kfac-pytorch's enum, as its own module defines it
    EIGEN = 1
    INVERSE = 2


class DistributedStrategy(enum.Enum):
    COMM_OPT = 1
    MEM_OPT = 2
    HYBRID_OPT = 3


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (ComputeMethod.INVERSE, "inverse"),
        (kfac.ComputeMethod.EIGEN, "eigen"),
        ("INVERSE", "inverse"),
        ("eigen", "eigen"),
    ],
)
def test_compute_method_takes_either_library_s_enum_and_strings(
    value: object, expected: str
) -> None:
    precond = KFAC(_model(), compute_method=value)  # type: ignore[arg-type]
    assert precond.compute_method.name == expected


def test_memory_assignment_balances_squares_and_compute_cubes() -> None:
    assert memory_cost(3, 4) == 9 + 16 and memory_cost(5, 2, a_diagonal=True) == 5 + 4
    assert decomposition_cost(3, 4) == 27 + 64
    precond = KFACPreconditioner(_model(), assignment_strategy="MEMORY")
    assert precond.assignment_strategy is kfac.AssignmentStrategy.MEMORY
    assert precond.placement == Greedy(balance=kfac.AssignmentStrategy.MEMORY)


def test_update_factors_in_hook_is_the_pipelined_factor_comm() -> None:
    assert KFACPreconditioner(_model(), update_factors_in_hook=True).factor_comm == Pipelined()
    assert KFACPreconditioner(_model(), update_factors_in_hook=False).factor_comm == Bulk()
    with pytest.raises(UsageError, match="update_factors_in_hook=True means"):
        KFACPreconditioner(_model(), update_factors_in_hook=True, factor_comm="bulk")


def test_colocate_factors_false_places_factors_apart() -> None:
    with pytest.raises(UsageError, match="colocate_factors must be True to use"):
        KFACPreconditioner(_model(), colocate_factors=False)
    precond = KFACPreconditioner(
        _model(), colocate_factors=False, compute_eigenvalue_outer_product=False
    )
    assert precond.placement == LBP()
    with pytest.raises(UsageError, match="use placement='lbp'"):
        KFACPreconditioner(
            _model(),
            colocate_factors=False,
            compute_eigenvalue_outer_product=False,
            placement="greedy",
        )


def test_flat_spellings_become_the_policy_objects_settings() -> None:
    cost = DecompositionCostModel(c3=1e-9, c2=0.0, c0=1e-4)
    precond = KFACPreconditioner(
        _model(),
        fusion="none",
        profile_steps=2,
        tune_steps=0,
        placement="lbp",
        decomposition_cost=cost,
        damping_adaptation="levenberg-marquardt",
    )
    assert precond.factor_comm == Pipelined(fusion="none", profile_steps=2, tune_steps=0)
    assert precond.placement == LBP(decomposition_cost=cost)
    assert precond.adaptive_damping is not None  # KFAC's own keywords pass through
    # A cost model alone asks for the placement it prices.
    assert KFACPreconditioner(_model(), decomposition_cost=cost).placement == LBP(
        decomposition_cost=cost
    )
    with pytest.raises(UsageError, match="decomposition_cost prices LBP's placement"):
        KFACPreconditioner(_model(), placement="greedy", decomposition_cost=cost)


class _Scaler:
    """What KFAC reads of a ``torch.amp.GradScaler``."""

    def get_scale(self) -> float:
        return 1024.0


@pytest.mark.parametrize("scaler", [lambda: 1024.0, _Scaler()], ids=["callable", "get_scale"])
def test_grad_scaler_unscales_g_as_kfac_pytorch_does(scaler: object) -> None:
    plain_model, scaled_model = _model(), _model()
    plain = KFAC(plain_model, kl_clip=None)
    scaled = KFAC(scaled_model, kl_clip=None, grad_scaler=scaler)
    _train(plain_model, plain, steps=1)
    _train(scaled_model, scaled, steps=1, scale=1024.0)
    for name in plain:
        torch.testing.assert_close(
            scaled.kfac_layers[name].g_factor, plain.kfac_layers[name].g_factor
        )


def test_a_grad_scaler_that_is_neither_is_refused() -> None:
    with pytest.raises(UsageError, match="grad_scaler must be"):
        KFAC(_model(), grad_scaler=3.0)


def test_state_dict_without_factors_and_load_without_inverses() -> None:
    model = _model()
    precond = KFAC(model)
    _train(model, precond)
    small = precond.state_dict(include_factors=False)
    assert "layers" not in small and small["steps"] == 2
    other = KFAC(_model())
    with pytest.warns(KFACWarning, match="include_factors=False"):
        other.load_state_dict(small)
    other.load_state_dict(precond.state_dict(), compute_inverses=False)
    for name in precond:
        torch.testing.assert_close(
            other.kfac_layers[name].a_factor, precond.kfac_layers[name].a_factor
        )


def test_memory_usage_counts_factors_and_decompositions() -> None:
    model = _model()
    precond = KFAC(model)
    _train(model, precond, steps=1)
    usage = precond.memory_usage()
    factors = [precond.kfac_layers[name] for name in precond]
    a_bytes = sum(layer.a_factor.numel() * 4 for layer in factors)  # type: ignore[union-attr]
    assert usage["a_factors"] == a_bytes == (7 * 7 + 9 * 9) * 4
    assert usage["a_inverses"] > 0 and usage["g_inverses"] > 0
    assert usage["total"] == sum(v for k, v in usage.items() if k != "total")


def test_loglevel_logs_the_registered_layers(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="interlace.kfac"):
        KFACPreconditioner(_model(), loglevel=logging.INFO)
    assert "K-FAC registered 0: A 7, G 8" in caplog.text


def test_skip_layers_are_regular_expressions_too() -> None:
    model = nn.Sequential()
    model.add_module("encoder", nn.Linear(4, 4))
    model.add_module("decoder_head", nn.Linear(4, 2))
    with pytest.warns(KFACWarning):
        precond = KFAC(model, skip_layers=["decoder"])  # kfac-pytorch: re.search on the name
    assert set(precond.layers) == {"encoder"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"allreduce_bucket_cap_mb": -1.0}, "bucket_cap_mb must be a finite number >= 0"),
        ({"allreduce_bucket_cap_mb": 5.0, "bucket_cap_mb": 6.0}, "name the same setting"),
        ({"grad_worker_fraction": 1.5}, r"grad_worker_fraction must be a number in \[0, 1\]"),
        ({"grad_worker_fraction": "most"}, "grad_worker_fraction must be one of"),
        ({"compute_method": "cholesky"}, "compute_method must be one of"),
        ({"assignment_strategy": "speed"}, "assignment_strategy must be one of"),
        ({"symmetry_aware": 1}, "symmetry_aware must be True or False"),
    ],
)
def test_bad_kfac_pytorch_arguments_are_one_clear_error(
    kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(UsageError, match=match):
        KFACPreconditioner(_model(), **kwargs)


def _fractions_and_equivalent_comms() -> dict[str, object]:
    results: dict[str, object] = {}
    for label, fraction in [
        ("mem-opt", DistributedStrategy.MEM_OPT),
        ("zero", 0),
        ("hybrid", kfac.DistributedStrategy.HYBRID_OPT),
        ("comm-opt", "comm_opt"),
    ]:
        results[label] = KFAC(_model(), grad_worker_fraction=fraction).grad_worker_fraction
    grads = {}
    for label, kwargs in [
        ("bucketed", {}),
        ("unbucketed", {"allreduce_bucket_cap_mb": 0}),
        ("symmetric", {"symmetry_aware": True}),
    ]:
        model = _model()
        precond = KFACPreconditioner(model, **kwargs)
        rank = torch.distributed.get_rank()
        x, y = _batch(10 + rank)
        nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():  # average gradients as a data-parallel wrapper would
            torch.distributed.all_reduce(p.grad)  # type: ignore[arg-type]
            p.grad /= 2  # type: ignore[operator]
        precond.step()
        grads[label] = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        precond.remove_hooks()
    results["grads"] = grads
    return results


def test_grad_worker_fractions_and_bucket_options_on_two_ranks() -> None:
    results = run_ranks(_fractions_and_equivalent_comms, 2, timeout=120)
    for rank_result in results:
        assert rank_result["mem-opt"] == rank_result["zero"] == 0.5
        assert rank_result["hybrid"] == 0.5 and rank_result["comm-opt"] == 1.0
        grads = rank_result["grads"]
        for label in ("unbucketed", "symmetric"):
            for got, want in zip(grads[label], grads["bucketed"], strict=True):
                torch.testing.assert_close(got, want)


def test_the_loss_scale_is_read_once_per_backward() -> None:
    plain_model, scaled_model = _model(), _model()
    scales = [4.0, 8.0]  # the scaler changes its scale between the two backwards
    reads: list[float] = []

    def scale() -> float:
        reads.append(scales[min(len(reads), 1)])
        return reads[-1]

    plain = KFAC(plain_model, kl_clip=None)
    scaled = KFAC(scaled_model, kl_clip=None, grad_scaler=scale)
    for step, factor in enumerate(scales):
        x, y = _batch(step)
        for model, precond, times in ((plain_model, plain, 1.0), (scaled_model, scaled, factor)):
            model.zero_grad()
            (nn.functional.cross_entropy(model(x), y) * times).backward()
            precond.step()
    assert reads == scales  # once per backward, not once per layer (two layers)
    for name in plain:
        torch.testing.assert_close(
            scaled.kfac_layers[name].g_factor, plain.kfac_layers[name].g_factor
        )


def test_kfac_pytorchs_colocate_factors_true_keeps_greedy_where_auto_would_pick_lbp() -> None:
    # On 4 ranks under COMM-OPT the default placement is LBP; kfac-pytorch's explicit
    # colocate_factors=True asks for a layer's factors on one rank, which is greedy placement.
    assert KFACPreconditioner.check_options(4).placement == LBP()
    assert KFACPreconditioner.check_options(4, colocate_factors=True).placement == Greedy()
    apart = KFACPreconditioner.check_options(
        4, colocate_factors=False, compute_eigenvalue_outer_product=False
    )
    assert apart.placement == LBP()
    assert KFACPreconditioner.check_options(4, placement="auto").placement == LBP()


def test_a_warm_up_starting_at_rate_zero_is_taken_and_changes_no_gradient_scale() -> None:
    # A warm-up schedule's first rate is 0: the KL-clip's bound is then infinite (no clip),
    # so K-FAC preconditions as with kl_clip=None, and a negative rate is still refused.
    torch.manual_seed(0)
    clipped, unclipped = _model(), _model()
    unclipped.load_state_dict(clipped.state_dict())
    at_zero = KFAC(clipped, lr=lambda step: 0.0, kl_clip=0.001)
    no_clip = KFAC(unclipped, lr=0.1, kl_clip=None)
    for model, precond in ((clipped, at_zero), (unclipped, no_clip)):
        x, y = _batch()
        nn.functional.cross_entropy(model(x), y).backward()
        precond.step()
    for a, b in zip(clipped.parameters(), unclipped.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    with pytest.raises(UsageError, match="lr must be >= 0"):
        KFAC(_model(), lr=-0.1)
