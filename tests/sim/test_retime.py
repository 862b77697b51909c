"""Retimed traces: scaled compute, and a forward set as a fraction of backward."""

from __future__ import annotations

import pytest

from interlace.errors import UsageError
from interlace.sim.profiled import from_ready
from interlace.sim.retime import scaled, with_forward_ratio
from interlace.sim.trace import Trace


def small_trace() -> Trace:
    return from_ready(
        "toy",
        names=["fc.weight", "fc.bias", "conv.weight"],
        layers=["fc", "fc", "conv"],
        numels=[100, 10, 50],
        element_bytes=[4, 4, 4],
        ready_s=[0.001, 0.0012, 0.004],
        forward_s=0.002,
        backward_s=0.005,
        step_s=0.0005,
        layer_forward_s={"conv": 0.0015},
    )


def test_scaled_multiplies_every_compute_time() -> None:
    trace = scaled(small_trace(), 2.0)
    assert trace.ready_times() == pytest.approx([0.0024, 0.0024, 0.008])
    assert (trace.forward_s, trace.backward_s, trace.step_s) == pytest.approx((0.004, 0.01, 0.001))


def test_a_forward_ratio_sets_every_layers_forward_from_its_backward() -> None:
    original = small_trace()
    trace = with_forward_ratio(original, 0.5)
    assert trace.forward_s == pytest.approx(0.0025)
    for before, after in zip(original.tensors, trace.tensors, strict=True):
        assert after.layer_forward_s == pytest.approx(before.layer_backward_s / 2)
        assert after.layer_backward_s == before.layer_backward_s
    assert trace.ready_times() == original.ready_times()
    with pytest.raises(UsageError, match="forward per backward must be a number >= 0"):
        with_forward_ratio(original, -1.0)
