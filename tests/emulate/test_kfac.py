"""K-FAC on emulated compute: registrable traced layers, device-time costs, real tensors."""

from __future__ import annotations

import math
import time
import warnings

import pytest
import torch

from interlace.emulate.kfac import (
    H100_EIGH_S,
    H100_INVERSE_S,
    H200_EIGH_S,
    EmulatedFactorLayer,
    EmulatedKFACModel,
    KFACDeviceCosts,
)
from interlace.kfac import KFAC
from interlace.sim.trace import ActivationTrace, FactorTrace, TensorTrace, Trace, load_trace

MS = 1e-3
SLACK_S = 0.25


def factor_trace() -> Trace:
    """Backward order: fc (8 -> 4, bias), norm (no factors), conv (2 -> 3 channels, 3x3, no
    bias, 5x5 outputs); forward order is conv, norm, fc."""
    tensors = (
        TensorTrace("fc.weight", "fc", 32, 128, 1 * MS, 2 * MS),
        TensorTrace("fc.bias", "fc", 4, 16, 1 * MS, 2 * MS),
        TensorTrace("norm.weight", "norm", 3, 12, 1 * MS, 1 * MS),
        TensorTrace("norm.bias", "norm", 3, 12, 1 * MS, 1 * MS),
        TensorTrace("conv.weight", "conv", 54, 216, 2 * MS, 3 * MS),
    )
    return Trace(
        "toy",
        tensors,
        forward_s=4 * MS,
        backward_s=6 * MS,
        factors=(FactorTrace("conv", 18, 3), FactorTrace("fc", 9, 4)),
        activations=(
            ActivationTrace("conv", (3, 5, 5)),
            ActivationTrace("norm", (3, 5, 5)),
            ActivationTrace("fc", (4,)),
        ),
        batch_size=16,
    )


# ---------------------------------------------------------------------- cost models


def test_decompositions_cost_the_h100_measurements_and_interpolate_log_log() -> None:
    costs = KFACDeviceCosts()
    for n, seconds in H100_EIGH_S:
        assert costs.decomposition_s("eigen", n) == pytest.approx(seconds)
    for n, seconds in H100_INVERSE_S:
        assert costs.decomposition_s("inverse", n) == pytest.approx(seconds)
    # Halfway in log n between 1024 and 2048 is the geometric mean of their times.
    (_, t1024), (_, t2048) = H100_EIGH_S[2], H100_EIGH_S[3]
    assert costs.decomposition_s("eigen", round(math.sqrt(1024 * 2048))) == pytest.approx(
        math.sqrt(t1024 * t2048), rel=1e-3
    )
    # Beyond the measurements the end segment goes on: 8192 is one more doubling.
    (_, t4096) = H100_EIGH_S[4]
    assert costs.decomposition_s("eigen", 8192) == pytest.approx(t4096 * t4096 / t2048)
    assert costs.decomposition_s("eigen", 0) == 0.0
    with pytest.raises(ValueError, match="method"):
        costs.decomposition_s("qr", 10)


def test_factor_and_precondition_costs_are_products_at_the_stated_rate() -> None:
    costs = KFACDeviceCosts(gemm_flops=1e12, kernel_s=1e-5)
    # X^T X of 1000 rows of 100: 2 * 1000 * 100^2 flops, two kernels.
    assert costs.factor_s(1000, 100) == pytest.approx(2e-5 + 2e7 / 1e12)
    flops = 2 * (4**2 * 9 + 4 * 9**2)
    assert costs.precondition_s("inverse", 9, 4) == pytest.approx(2e-5 + flops / 1e12)
    assert costs.precondition_s("eigen", 9, 4) == pytest.approx(5e-5 + 2 * flops / 1e12)


def test_lbp_prices_what_the_device_spends_in_dilated_seconds() -> None:
    costs = KFACDeviceCosts()
    model = costs.decomposition_model("inverse", dilation=4.0)
    assert min(model.c0, model.c2, model.c3) >= 0
    for n, seconds in H100_INVERSE_S:
        assert model.time(n) == pytest.approx(4.0 * seconds)
    # Between and below the measured sizes too: the same interpolation as the device's sleep.
    for n in (10, 16, 100, 300, 700, 3000):
        assert model.time(n) == pytest.approx(4.0 * costs.decomposition_s("inverse", n))


def test_bad_measurements_are_refused() -> None:
    with pytest.raises(ValueError, match="increasing size"):
        KFACDeviceCosts(eigen_s=((64, 1e-3), (32, 1e-3)))


# ---------------------------------------------------------------------- the model


def test_layers_with_traced_factor_sizes_are_registered_by_kfac() -> None:
    model = EmulatedKFACModel(factor_trace(), dilation=1.0)
    assert [layer.name for layer in model.factor_layers()] == ["conv", "fc"]
    assert all(isinstance(layer, EmulatedFactorLayer) for layer in model.factor_layers())
    # The parameters are the traced tensors, in forward order, as for the plain emulated model.
    assert [p.numel() for p in model.parameters()] == [54, 3, 3, 4, 32]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precond = KFAC(model, lr=0.1)
    assert list(precond) == ["layers.0", "layers.2"]
    assert set(precond.skipped) == {"layers.1"}


def test_a_step_moves_factors_of_the_traced_sizes_and_spends_the_modelled_device_time() -> None:
    dilation = 3.0
    costs = KFACDeviceCosts(gemm_flops=1e9, kernel_s=1e-4)
    model = EmulatedKFACModel(factor_trace(), dilation=dilation, costs=costs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precond = KFAC(model, lr=0.1, kl_clip=0.001)
    x = torch.randn(16, 10)
    model(x).sum().backward()
    before = {name: p.grad.clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]
    start = time.perf_counter()
    spent_before = model.clock.spent_s
    precond.step()
    elapsed = time.perf_counter() - start
    layers = precond.kfac_layers
    assert layers["layers.0"].a_factor.shape == (18, 18)  # type: ignore[union-attr]
    assert layers["layers.0"].g_factor.shape == (3, 3)  # type: ignore[union-attr]
    assert layers["layers.2"].a_factor.shape == (9, 9)  # type: ignore[union-attr]
    # conv: 16 samples x 25 positions; fc: 16 samples x 1.
    hooks = costs.factor_s(400, 18) + costs.factor_s(400, 3)
    hooks += costs.factor_s(16, 9) + costs.factor_s(16, 4)
    step = sum(costs.decomposition_s("eigen", n) for n in (18, 3, 9, 4))
    step += costs.precondition_s("eigen", 18, 3) + costs.precondition_s("eigen", 9, 4)
    assert model.clock.spent_s == pytest.approx(dilation * (hooks + step))
    assert model.clock.spent_s - spent_before == pytest.approx(dilation * step)
    assert dilation * step - 0.002 <= elapsed < dilation * step + SLACK_S
    # Preconditioning is the identity, so the gradients come back scaled by the KL-clip alone.
    squares = sum(float((g * g).sum()) for name, g in before.items() if "layers.1" not in name)
    scale = min(1.0, math.sqrt(0.001 / (0.1**2 * squares)))
    for name, param in model.named_parameters():
        expected = before[name] if "layers.1" in name else before[name] * scale
        assert torch.allclose(param.grad, expected)  # type: ignore[arg-type]


def test_the_shipped_cpu_and_gpu_traces_have_factor_layers() -> None:
    for name in ("resnet20-cpu", "resnet32-cpu", "resnet20-h200", "transformer-h200"):
        trace = load_trace(name)
        model = EmulatedKFACModel(trace, dilation=1.0)
        # Every convolution and the classifier: the traced factors, all matching their tensors.
        assert len(model.factor_layers()) == len(trace.factors)


def test_a_trace_without_matching_factors_is_refused() -> None:
    trace = factor_trace()
    bare = Trace("bare", trace.tensors, forward_s=trace.forward_s, backward_s=trace.backward_s)
    with pytest.raises(ValueError, match="no layer with K-FAC factor sizes"):
        EmulatedKFACModel(bare)


def test_h200_traces_are_priced_with_the_h200_measurements() -> None:
    model = EmulatedKFACModel("resnet20-h200", dilation=1.0)
    assert model.costs.device == "H200"
    for n, seconds in H200_EIGH_S:
        assert model.costs.decomposition_s("eigen", n) == pytest.approx(seconds)
    assert EmulatedKFACModel("resnet20-cpu", dilation=1.0).costs.device == "H100"


# ---------------------------------------------------------------------- the simulator's view


def test_the_simulator_prices_the_same_device_work() -> None:
    device = KFACDeviceCosts(gemm_flops=1e12, kernel_s=1e-5)
    for method in ("eigen", "inverse"):
        costs = device.kfac_costs(method)
        assert costs.compute_method == method
        for a_dim, g_dim in ((9, 4), (577, 64), (1, 1)):
            assert costs.precondition_s(a_dim, g_dim) == pytest.approx(
                device.precondition_s(method, a_dim, g_dim)
            )
        for n in (1, 64, 100, 300, 1024, 5000):
            assert costs.decomposition_s(n) == pytest.approx(device.decomposition_s(method, n))
        # LBP places with the fit of the same measurements, as the runtime's LBP does.
        assert costs.decomposition_model() == device.decomposition_model(method)
    with pytest.raises(ValueError, match="method"):
        device.kfac_costs("qr")


def test_the_kfac_trace_is_the_iteration_the_model_runs() -> None:
    base = factor_trace()
    # 2 ms of forward and 1 ms of backward belong to no layer, and a buffer is broadcast; the
    # norm's factors do not fit its tensors.
    trace = Trace(
        "toy",
        base.tensors,
        forward_s=6 * MS,
        backward_s=9 * MS,
        step_s=0.5 * MS,
        factors=(*base.factors, FactorTrace("norm", 7, 7)),
        activations=base.activations,
        batch_size=16,
        broadcast_bytes=(12,),
    )
    model = EmulatedKFACModel(trace, dilation=3.0)
    sim = model.kfac_trace()
    # The model sleeps the trace's whole passes, layers and the rest.
    assert (sim.forward_s, sim.backward_s) == (trace.forward_s, trace.backward_s)
    assert sim.step_s == trace.step_s and sim.broadcast_bytes == ()
    assert [f.layer for f in sim.factors] == ["conv", "fc"]
    # Named as the model's parameters (backward order), so a run's buckets name its tensors.
    assert [t.name for t in sim.tensors] == [name for name, _ in model.named_parameters()][::-1]


def test_the_kfac_costs_carry_each_layers_factor_time() -> None:
    device = KFACDeviceCosts(gemm_flops=1e9, kernel_s=1e-4)
    model = EmulatedKFACModel(factor_trace(), dilation=2.0, costs=device)
    costs = model.kfac_costs("inverse")
    # conv: 16 samples x 25 positions; fc: 16 samples x 1 (undilated seconds).
    assert costs.layer_factor_s == (
        ("conv", device.factor_s(400, 18), device.factor_s(400, 3)),
        ("fc", device.factor_s(16, 9), device.factor_s(16, 4)),
    )
    assert costs.decomposition_s(18) == pytest.approx(device.decomposition_s("inverse", 18))


def test_g_runs_before_its_layers_backward_on_the_one_device_stream() -> None:
    # G costs more than the conv's own backward: a device runs the two one after the other,
    # so backward takes every layer's backward plus every G.
    dilation = 2.0
    device = KFACDeviceCosts(gemm_flops=1e12, kernel_s=2e-3)
    model = EmulatedKFACModel(factor_trace(), dilation=dilation, costs=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        KFAC(model, lr=0.1)
    loss = model(torch.randn(16, 10)).sum()
    started = time.perf_counter()
    loss.backward()
    elapsed = time.perf_counter() - started
    g_s = device.factor_s(400, 3) + device.factor_s(16, 4)
    backward = (2 + 1 + 3) * MS
    assert elapsed >= dilation * (backward + g_s) - 0.002
