"""Traces built from measurements: ready times, factor sizes and buffer broadcasts."""

from __future__ import annotations

import pytest
from torch import nn

from interlace.sim.profiled import buffer_broadcast_bytes, factor_sizes, from_ready
from interlace.sim.trace import FactorTrace


def test_from_ready_keeps_run_ends_and_shares_forward_by_backward() -> None:
    trace = from_ready(
        "toy",
        names=["fc.weight", "fc.bias", "conv.weight"],
        layers=["fc", "fc", "conv"],
        numels=[100, 10, 50],
        element_bytes=[4, 4, 4],
        ready_s=[0.001, 0.0012, 0.004],
        forward_s=0.002,
        backward_s=0.005,
        layer_forward_s={"conv": 0.0015},
    )
    # A layer's tensors are ready when the layer's run ends.
    assert trace.ready_times() == pytest.approx([0.0012, 0.0012, 0.004])
    assert trace.tensors[0].layer_backward_s == pytest.approx(0.0012)
    assert trace.tensors[2].layer_backward_s == pytest.approx(0.0028)
    assert trace.tensors[2].layer_forward_s == pytest.approx(0.0015)  # measured
    # Not measured: a share of forward in proportion to backward (1.2 of 4 ms).
    assert trace.tensors[0].layer_forward_s == pytest.approx(0.002 * 1.2 / 4)
    per_layer = trace.ready_tensors(per_layer=True)
    assert [(t.name, t.nbytes) for t in per_layer] == [("fc", 440), ("conv", 200)]


def test_factor_sizes_cover_linear_and_conv_layers_with_their_bias_column() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Conv2d(2, 5, 3, bias=False))
    # Linear: A is its 3 inputs plus the bias's ones column; Conv2d: 2 channels x 3 x 3 patch.
    assert factor_sizes(model) == [FactorTrace("0", 4, 4), FactorTrace("2", 18, 5)]


def test_buffer_broadcasts_are_one_message_per_dtype() -> None:
    # BatchNorm1d(4): running mean and variance (4 float32 each), and a step count (int64).
    assert buffer_broadcast_bytes(nn.BatchNorm1d(4)) == [32, 8]
    assert buffer_broadcast_bytes(nn.Linear(3, 4)) == []
