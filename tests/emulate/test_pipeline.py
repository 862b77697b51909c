"""Pipelines on emulated compute: blocks of traced device time and traced activation sizes."""

from __future__ import annotations

import time

import pytest
import torch
from torch.nn import functional

from interlace.emulate.pipeline import EmulatedBlock, EmulatedPipelineModel
from interlace.errors import UsageError
from interlace.pipeline.partition import pipeline_blocks
from interlace.sim.trace import ActivationTrace, TensorTrace, Trace, load_trace

MS = 1e-3
SLACK_S = 0.25


def pipeline_trace(activations: bool = True) -> Trace:
    """Backward order: fc (10 outputs), conv (4 x 6 x 6 outputs); traced at a batch of 8."""
    tensors = (
        TensorTrace("fc.weight", "fc", 1440, 5760, 2 * MS, 4 * MS),
        TensorTrace("fc.bias", "fc", 10, 40, 2 * MS, 4 * MS),
        TensorTrace("conv.weight", "conv", 108, 432, 6 * MS, 10 * MS),
    )
    return Trace(
        "toy",
        tensors,
        forward_s=8 * MS,
        backward_s=14 * MS,
        activations=(ActivationTrace("conv", (4, 6, 6)), ActivationTrace("fc", (10,)))
        if activations
        else (),
        batch_size=8,
    )


def test_blocks_follow_the_trace_in_forward_order_with_its_tensors_and_outputs() -> None:
    model = EmulatedPipelineModel(pipeline_trace(), dilation=1.0)
    blocks = pipeline_blocks(model)
    assert [b.name for b in blocks if isinstance(b, EmulatedBlock)] == ["conv", "fc"]
    assert [p.numel() for p in model.parameters()] == [108, 10, 1440]
    x = torch.randn(3, 3, 6, 6)
    hidden = blocks[0](x)
    assert hidden.shape == (3, 4, 6, 6)  # real activations of the traced size cross a cut
    assert blocks[1](hidden).shape == (3, 10)
    assert EmulatedPipelineModel(pipeline_trace(), classes=7)(x).shape == (3, 7)


@pytest.mark.parametrize("dilation", [1.0, 3.0])
def test_a_block_of_t_seconds_takes_t_times_dilation_scaled_to_its_batch(dilation: float) -> None:
    model = EmulatedPipelineModel(pipeline_trace(), dilation=dilation)
    conv = model.emulated_blocks()[0]
    x = torch.randn(4, 3, 6, 6, requires_grad=True)  # half the traced batch of 8
    start = time.perf_counter()
    out = conv(x)
    forward = time.perf_counter() - start
    start = time.perf_counter()
    out.sum().backward()
    backward = time.perf_counter() - start
    assert 0.5 * 6 * MS * dilation - 0.002 <= forward < 0.5 * 6 * MS * dilation + SLACK_S
    assert 0.5 * 10 * MS * dilation - 0.002 <= backward < 0.5 * 10 * MS * dilation + SLACK_S
    assert model.clock.spent_s == pytest.approx(0.5 * 16 * MS * dilation)
    assert model.device_s(4) == pytest.approx(0.5 * 22 * MS * dilation)


def test_the_passes_outside_the_layers_are_spread_over_the_blocks() -> None:
    trace = pipeline_trace()
    rest = Trace(  # the layers own 8 of 12 ms forward and 14 of 21 ms backward
        trace.model, trace.tensors, 12 * MS, 21 * MS, activations=trace.activations, batch_size=8
    )
    model = EmulatedPipelineModel(rest, dilation=2.0)
    conv, fc = model.emulated_blocks()
    assert (conv.forward_s, conv.backward_s) == pytest.approx((9 * MS, 15 * MS))
    assert (fc.forward_s, fc.backward_s) == pytest.approx((3 * MS, 6 * MS))
    assert model.device_s(8) == pytest.approx(2 * 33 * MS)  # the whole traced passes


def test_gradients_reach_every_parameter_and_the_input() -> None:
    model = EmulatedPipelineModel(pipeline_trace(), dilation=1.0)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    functional.cross_entropy(model(x), torch.tensor([1, 2])).backward()
    assert x.grad is not None and x.grad.shape == x.shape
    for param in model.parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all()
        assert param.grad.abs().sum() > 0


def test_a_trace_without_activation_sizes_is_refused() -> None:
    with pytest.raises(UsageError, match="no activation size"):
        EmulatedPipelineModel(pipeline_trace(activations=False))
    with pytest.raises(UsageError, match="no activation size"):
        EmulatedPipelineModel("googlenet-k80")


def test_the_shipped_cpu_traces_cut_into_pipeline_blocks() -> None:
    trace = load_trace("resnet20-cpu")
    model = EmulatedPipelineModel(trace, dilation=1.0, classes=10)
    assert len(pipeline_blocks(model)) == len(trace.layers)
    assert sum(p.numel() for p in model.parameters()) == trace.total_numel
