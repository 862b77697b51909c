"""``interlace bench kfac --compare kfac-pytorch``'s phase clock, on stand-in objects shaped
like kfac-pytorch's layers, and kfac-pytorch on an emulated model (those tests skip without it)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from interlace.bench.kfac_peer import KfacPytorchPeer, PhaseClock
from interlace.emulate.kfac import EmulatedKFACModel, KFACDeviceCosts
from interlace.kfac import PHASES
from interlace.sim.trace import FactorTrace, TensorTrace, Trace

MS = 1e-3


class _Layer:
    """A stand-in with a kfac-pytorch layer's method names and future-holding attributes."""

    def __init__(self, future: torch.futures.Future[torch.Tensor]) -> None:
        self._a_factor: Any = future
        self.calls: list[str] = []

    def update_a_factor(self) -> str:
        # kfac-pytorch reads (and so waits on) the factor here: it must be resolved already.
        assert isinstance(self._a_factor, torch.Tensor)
        self.calls.append("update")
        return "updated"

    def compute_a_inv(self) -> None:
        self.calls.append("inverse")


class _Communicator:
    def __init__(self) -> None:
        self.flushes = 0

    def flush_allreduce_buckets(self) -> None:
        self.flushes += 1


def _done(value: float) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(torch.full((2, 2), value))
    return future


def test_wrapped_methods_resolve_their_futures_first_and_add_to_their_phase() -> None:
    clock = PhaseClock()
    layer = _Layer(_done(3.0))
    clock.wrap(layer, "update_a_factor", "factor_compute")
    assert layer.update_a_factor() == "updated"
    assert layer.calls == ["update"]
    assert torch.equal(layer._a_factor, torch.full((2, 2), 3.0))
    phases = clock.take()
    assert set(phases) == set(PHASES)
    assert phases["factor_compute"] > 0 and phases["factor_comm"] >= 0
    assert phases["decomposition"] == 0
    # take() starts afresh.
    assert all(value == 0 for value in clock.phases.values())


def test_a_chained_future_is_waited_for_too() -> None:
    # kfac-pytorch's collectives hand back ``future.then(...)``: the C++ future type.
    clock = PhaseClock()
    chained = _done(1.0).then(lambda done: done.value() * 2)
    assert not isinstance(chained, torch.futures.Future)
    layer = _Layer(chained)
    clock.wrap(layer, "update_a_factor", "factor_compute")
    layer.update_a_factor()
    assert torch.equal(layer._a_factor, torch.full((2, 2), 2.0))


def test_a_flush_counts_as_the_communication_after_the_last_phase() -> None:
    clock = PhaseClock()
    layer, tdc = _Layer(_done(1.0)), _Communicator()
    clock.wrap(layer, "compute_a_inv", "decomposition")
    clock.wrap_flush(tdc, "flush_allreduce_buckets")
    tdc.flush_allreduce_buckets()  # after the factors: factor communication
    assert clock.phases["factor_comm"] > 0 and clock.phases["decomposition_comm"] == 0
    layer.compute_a_inv()
    tdc.flush_allreduce_buckets()  # after the decompositions: their broadcast
    assert clock.phases["decomposition_comm"] > 0
    assert tdc.flushes == 2 and layer.calls == ["inverse"]
    clock.take()
    assert clock.flush_phase == "factor_comm"


def test_waiting_without_a_future_leaves_the_attribute_alone() -> None:
    clock = PhaseClock()
    layer = _Layer(_done(2.0))
    layer._a_factor = tensor = torch.ones(2)
    clock.wait_futures(layer, ("_a_factor", "_g_factor"))
    assert layer._a_factor is tensor
    assert clock.phases["factor_comm"] == pytest.approx(0.0)


# ---------------------------------------------------------------- on an emulated model


def _two_layer_trace() -> Trace:
    """Forward order: fc1 (6 -> 5, bias), fc2 (5 -> 3, no bias); 4 samples a batch."""
    tensors = (
        TensorTrace("fc2.weight", "fc2", 15, 60, 1 * MS, 2 * MS),
        TensorTrace("fc1.weight", "fc1", 30, 120, 1 * MS, 2 * MS),
        TensorTrace("fc1.bias", "fc1", 5, 20, 1 * MS, 2 * MS),
    )
    return Trace(
        "two-linear",
        tensors,
        forward_s=2 * MS,
        backward_s=4 * MS,
        factors=(FactorTrace("fc2", 5, 3), FactorTrace("fc1", 7, 5)),
        batch_size=4,
    )


# The emulated model's input needs no gradient, so the first layer's hook sees outputs only.
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_kfac_pytorch_on_an_emulated_model_spends_interlaces_device_time(method: str) -> None:
    pytest.importorskip("kfac.preconditioner", reason="kfac-pytorch is not installed")
    dilation = 2.0
    costs = KFACDeviceCosts(gemm_flops=1e9, kernel_s=1e-4)
    model = EmulatedKFACModel(_two_layer_trace(), dilation=dilation, costs=costs)
    peer = KfacPytorchPeer(
        model, factor_update_steps=1, inv_update_steps=1, compute_method=method, lr=0.1
    )
    assert peer.layers == ["layers.0", "layers.1"]
    model(torch.randn(4, 10)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    spent = model.clock.spent_s
    peer.step()
    peer.finish()

    layers = dict(peer.kfac_layers)
    assert layers["layers.0"].a_factor.shape == (7, 7)
    assert layers["layers.1"].g_factor.shape == (3, 3)
    # Decompositions and preconditioning of both layers, and for eigen the division by the
    # eigenvalues' outer product kfac-pytorch precomputes (three elementwise kernels a layer).
    sides = ((7, 5), (5, 3))
    step = sum(costs.decomposition_s(method, n) for pair in sides for n in pair)
    step += sum(costs.precondition_s(method, a, g) for a, g in sides)
    if method == "eigen":
        step += 2 * 3 * costs.kernel_s
    assert model.clock.spent_s - spent == pytest.approx(dilation * step)
    # Factors were priced in the hooks: 4 rows each.
    hooks = sum(costs.factor_s(4, n) for pair in sides for n in pair)
    assert spent == pytest.approx(dilation * hooks)
    # The replaced methods are still the ones the phase clock times.
    assert peer.last_phase_s["decomposition"] > 0 and peer.last_phase_s["precondition"] > 0
    # Identity decompositions leave kfac-pytorch's KL clip the only change to the gradients.
    squares = sum(float((g * g).sum()) for g in before)
    scale = min(1.0, math.sqrt(0.001 / (0.1**2 * squares)))
    for param, grad in zip(model.parameters(), before, strict=True):
        assert torch.allclose(param.grad, grad * scale)  # type: ignore[arg-type]
