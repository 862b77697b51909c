"""``KFAC``: layer coverage, hyperparameters, robustness, state, wrappers (numerics elsewhere)."""

from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from interlace.dp import DataParallel
from interlace.kfac import KFAC, PHASES, KFACPreconditioner, KFACWarning
from interlace.kfac.methods import FactorDecomposition
from interlace.testing import run_ranks


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))


def _train_step(
    model: nn.Module, precond: KFAC, optimizer: torch.optim.Optimizer, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(16, 6, generator=generator)
    targets = torch.randint(0, 3, (16,), generator=generator)
    optimizer.zero_grad()
    functional.cross_entropy(model(inputs), targets).backward()
    precond.step()
    optimizer.step()


# -- the surface -----------------------------------------------------------------------------

#: kfac-pytorch's names (and aliases) that KFACPreconditioner maps onto KFAC's own.
KFAC_PYTORCH_ONLY = (
    "allreduce_bucket_cap_mb",
    "assignment_strategy",
    "colocate_factors",
    "compute_eigenvalue_outer_product",
    "update_factors_in_hook",
    "loglevel",
)


def test_kfac_takes_interlaces_own_keywords_and_the_compatibility_class_kfac_pytorchs() -> None:
    ours = inspect.signature(KFAC).parameters
    assert len(ours) <= 22
    assert [name for name in KFAC_PYTORCH_ONLY if name in ours] == []
    theirs = inspect.signature(KFACPreconditioner).parameters
    assert [name for name in KFAC_PYTORCH_ONLY if name not in theirs] == []
    with pytest.raises(TypeError, match="colocate_factors"):
        KFAC(_mlp(), colocate_factors=True)  # type: ignore[call-arg]


@dataclass(frozen=True)
class _Unpreconditioned:
    """A toy decomposition method, defined here only: it keeps nothing and changes nothing, so
    K-FAC without its KL-clip leaves the gradients as they are."""

    name: ClassVar[str] = "unpreconditioned"
    precondition_products: ClassVar[int] = 0

    def numel(self, dim: int, diagonal: bool = False) -> int:
        return dim

    def decompose(self, factor: torch.Tensor, damping: float, shift: float) -> FactorDecomposition:
        return FactorDecomposition(self, values=torch.ones(factor.shape[0], dtype=factor.dtype))

    def decompose_diagonal(self, diagonal: torch.Tensor, damping: float) -> FactorDecomposition:
        return FactorDecomposition(self, values=torch.ones_like(diagonal))

    def dense_from_diagonal(self, values: torch.Tensor) -> FactorDecomposition:
        return FactorDecomposition(self, values=values)

    def empty(
        self, dim: int, diagonal: bool, dtype: torch.dtype, device: torch.device
    ) -> FactorDecomposition:
        return FactorDecomposition(self, values=torch.empty(dim, dtype=dtype, device=device))

    def precondition(
        self,
        grad: torch.Tensor,
        a: FactorDecomposition,
        g: FactorDecomposition,
        damping: float,
    ) -> torch.Tensor:
        return grad

    def run(self, matrix: torch.Tensor) -> None:
        return None


def test_a_decomposition_method_is_one_class() -> None:
    model = _mlp()
    plain = copy.deepcopy(model)
    precond = KFAC(model, compute_method=_Unpreconditioned(), kl_clip=None)
    generator = torch.Generator().manual_seed(3)
    inputs, targets = torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,))
    for net in (model, plain):
        functional.cross_entropy(net(inputs), targets).backward()
    precond.step()
    assert precond.compute_method.name == "unpreconditioned"
    for ours, theirs in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)


# -- layers and registration -----------------------------------------------------------------


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.grouped = nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.norm = nn.BatchNorm2d(4)
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.grouped(self.conv(x)))
        tokens = x.flatten(2).transpose(1, 2)
        attended, _ = self.attention(tokens, tokens, tokens)
        return self.head(attended.mean(dim=1))


def test_unsupported_layers_are_listed_once_and_silent_layers_skipped_with_a_warning() -> None:
    torch.manual_seed(0)
    model = _Mixed()
    with pytest.warns(KFACWarning) as start_up:
        precond = KFAC(model)
    assert len(start_up) == 1
    listing = str(start_up[0].message)
    assert "grouped" in listing and "norm" in listing and "attention" in listing
    assert set(precond.layers) == {"conv", "attention.out_proj", "head"}

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = torch.randn(4, 2, 4, 4), torch.tensor([0, 1, 2, 0])
    # MultiheadAttention uses out_proj's weight without calling it: skipped, never a crash.
    with pytest.warns(KFACWarning, match=r"attention\.out_proj"):
        functional.cross_entropy(model(inputs), targets).backward()
        precond.step()
    optimizer.step()
    assert set(precond.layers) == {"conv", "head"}
    assert "forward never ran" in precond.skipped["attention.out_proj"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.zero_grad()
        functional.cross_entropy(model(inputs), targets).backward()
        precond.step()


def test_skip_layers_match_names_parents_and_classes() -> None:
    model = nn.Sequential(
        nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 2)
    )
    with pytest.warns(KFACWarning):
        by_parent = KFAC(model, skip_layers=["1"])
    assert set(by_parent.layers) == {"0", "2"}
    by_parent.remove_hooks()
    with pytest.raises(ValueError, match="no Linear, Conv1d, Conv2d or Embedding"):
        KFAC(model, skip_layers=["linear"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"compute_method": "cholesky"}, "compute_method"),
        ({"damping": -1.0}, "damping"),
        ({"factor_decay": 1.0}, "factor_decay"),
        ({"inv_update_steps": 0}, "inv_update_steps"),
        ({"kl_clip": 0.0}, "kl_clip"),
        ({"accumulation_steps": 0}, "accumulation_steps"),
        ({"grad_worker_fraction": -0.5}, "grad_worker_fraction"),
    ],
)
def test_bad_hyperparameters_are_clear_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KFAC(_mlp(), **kwargs)  # type: ignore[arg-type]


def test_a_model_without_supported_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="no Linear, Conv1d, Conv2d or Embedding"):
        KFAC(nn.Sequential(nn.BatchNorm1d(3)))


def test_hyperparameters_may_be_callables_of_the_step() -> None:
    model = _mlp()
    seen: list[int] = []

    def damping(step: int) -> float:
        seen.append(step)
        return 0.01 / (step + 1)

    precond = KFAC(
        model, damping=damping, inv_update_steps=lambda step: 2, damping_adaptation="fixed"
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for seed in range(3):
        _train_step(model, precond, optimizer, seed)
    assert precond.damping == pytest.approx(0.01 / 4)
    assert {0, 1, 2} <= set(seen)
    # Decompositions only on even steps: step 1 spent no time decomposing.
    assert precond.last_phase_s["decomposition"] > 0


# -- robustness ------------------------------------------------------------------------------


def test_a_non_finite_gradient_skips_preconditioning_and_keeps_the_factors() -> None:
    model = _mlp()
    precond = KFAC(model, factor_update_steps=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, precond, optimizer, 0)
    factors = copy.deepcopy(precond.state_dict()["layers"])

    inputs = torch.randn(16, 6)
    inputs[0, 0] = float("nan")
    optimizer.zero_grad()
    functional.cross_entropy(model(inputs), torch.zeros(16, dtype=torch.long)).backward()
    raw = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with pytest.warns(KFACWarning) as caught:
        precond.step()
    messages = " ".join(str(w.message) for w in caught)
    assert "non-finite factors" in messages and "non-finite gradient" in messages
    after = [p.grad for p in model.parameters() if p.grad is not None]
    for before, now in zip(raw, after, strict=True):
        torch.testing.assert_close(now, before, equal_nan=True)  # left as they were
    for name, saved in factors.items():
        state = precond.state_dict()["layers"][name]
        torch.testing.assert_close(state["A"], saved["A"])
        torch.testing.assert_close(state["G"], saved["G"])
        assert bool(torch.isfinite(state["A"]).all())


def test_a_failing_decomposition_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _mlp()
    precond = KFAC(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train_step(model, precond, optimizer, 0)
    kept = precond.state_dict()["layers"]["0"]["A_decomp"]["vectors"].clone()

    def broken(*args: object, **kwargs: object) -> object:
        raise torch.linalg.LinAlgError("the algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", broken)
    with pytest.warns(KFACWarning, match="keeps the previous decomposition"):
        _train_step(model, precond, optimizer, 1)
    torch.testing.assert_close(precond.state_dict()["layers"]["0"]["A_decomp"]["vectors"], kept)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())

    # With nothing earlier to keep, the factor's diagonal stands in.
    fresh = _mlp()
    fresh_precond = KFAC(fresh)
    with pytest.warns(KFACWarning, match="diagonal"):
        _train_step(fresh, fresh_precond, torch.optim.SGD(fresh.parameters(), lr=0.1), 0)
    assert all(bool(torch.isfinite(p).all()) for p in fresh.parameters())


# -- state -----------------------------------------------------------------------------------


def test_a_resumed_run_continues_exactly_between_decomposition_steps() -> None:
    def make() -> tuple[nn.Module, KFAC, torch.optim.Optimizer]:
        model = _mlp()
        precond = KFAC(model, inv_update_steps=3, factor_update_steps=2, kl_clip=0.01)
        return model, precond, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, precond, optimizer = make()
    for seed in range(4):  # stops between two decomposition steps (0, 3, 6)
        _train_step(model, precond, optimizer, seed)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), precond.state_dict()))
    for seed in range(4, 8):
        _train_step(model, precond, optimizer, seed)

    resumed, resumed_precond, resumed_optimizer = make()
    resumed.load_state_dict(saved[0])
    resumed_optimizer.load_state_dict(saved[1])
    resumed_precond.load_state_dict(saved[2])
    assert resumed_precond.steps == 4
    for seed in range(4, 8):
        _train_step(resumed, resumed_precond, resumed_optimizer, seed)
    for expected, got in zip(model.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_state_of_another_model_is_refused() -> None:
    precond = KFAC(_mlp())
    with pytest.raises(ValueError, match="does not precondition"):
        precond.load_state_dict({"steps": 1, "layers": {"encoder.fc": {"A": None, "G": None}}})


def test_phases_and_timeline_events_are_recorded() -> None:
    model = _mlp()
    precond = KFAC(model)
    _train_step(model, precond, torch.optim.SGD(model.parameters(), lr=0.1), 0)
    assert set(precond.last_phase_s) == set(PHASES)
    assert precond.last_phase_s["factor_compute"] > 0
    assert precond.last_phase_s["decomposition"] > 0
    assert precond.last_phase_s["precondition"] > 0
    events = precond.take_events()
    categories = {event.category for event in events}
    assert {"factor", "decomposition", "precondition"} <= categories
    assert precond.take_events() == []


# -- under data-parallel wrappers ------------------------------------------------------------


def _wrapped_training(wrapper: str) -> list[list[float]]:
    model = _mlp()
    wrapped: nn.Module = DistributedDataParallel(model) if wrapper == "ddp" else DataParallel(model)
    precond = KFAC(wrapped, grad_worker_fraction=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    for seed in range(4):
        generator = torch.Generator().manual_seed(seed)
        inputs = torch.randn(16, 6, generator=generator)
        targets = torch.randint(0, 3, (16,), generator=generator)
        local = slice(8 * rank, 8 * rank + 8)
        optimizer.zero_grad()
        functional.cross_entropy(wrapped(inputs[local]), targets[local]).backward()
        precond.step()
        optimizer.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["ddp", "interlace"])
def test_kfac_under_data_parallel_wrappers_matches_one_process(wrapper: str) -> None:
    ranks = run_ranks(_wrapped_training, 2, wrapper, timeout=120)
    assert ranks[0] == ranks[1]  # every rank holds the same model

    model = _mlp()
    precond = KFAC(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for seed in range(4):
        _train_step(model, precond, optimizer, seed)
    for got, expected in zip(ranks[0], model.parameters(), strict=True):
        torch.testing.assert_close(
            torch.tensor(got), expected.detach().reshape(-1), rtol=1e-4, atol=1e-6
        )


def test_per_example_g_is_the_mean_loss_g_times_the_squared_batch() -> None:
    """``g_normalization="per-example"``: G of each example's loss, A unchanged."""
    factors = {}
    for normalization in ("kfac-pytorch", "per-example"):
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        precond = KFAC(model, g_normalization=normalization, factor_decay=0.5)
        _train_step(model, precond, optimizer, seed=3)
        factors[normalization] = [
            (layer.a_factor, layer.g_factor) for layer in precond.kfac_layers.values()
        ]
    batch = 16  # _train_step's batch; one process, so the global batch
    for (a_mean, g_mean), (a_each, g_each) in zip(
        factors["kfac-pytorch"], factors["per-example"], strict=True
    ):
        assert a_mean is not None and g_mean is not None and g_each is not None
        torch.testing.assert_close(a_each, a_mean)
        # The running average starts from the identity (kfac-pytorch's convention): after one
        # step with decay 0.5 it is 0.5 I + 0.5 G, and only the G part scales.
        start = 0.5 * torch.eye(g_mean.shape[0])
        torch.testing.assert_close(g_each - start, (g_mean - start) * batch**2)
    with pytest.raises(ValueError, match="g_normalization must be one of"):
        KFAC(_mlp(), g_normalization="per-token")
