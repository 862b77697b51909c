"""Per-module K-FAC helpers: convolution patches against ``unfold``, factors against the
moments of their rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional

from interlace.kfac.module_helpers import (
    Conv1dHelper,
    Conv2dHelper,
    gram,
    input_moment,
    make_helper,
    second_moment,
)


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "dilation"),
    [((3, 3), (1, 1), (1, 1), (1, 1)), ((3, 2), (2, 1), (1, 0), (2, 1)), ((1, 1), (2, 2), 0, 1)],
)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
def test_conv_patches_are_unfold_s_columns_for_any_input_layout(
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int] | int,
    dilation: tuple[int, int] | int,
    layout: str,
) -> None:
    conv = nn.Conv2d(5, 7, kernel, stride=stride, padding=padding, dilation=dilation)
    generator = torch.Generator().manual_seed(5)
    if layout == "strided":  # every other channel of a wider tensor: a view with gaps
        inputs = torch.randn(4, 10, 11, 9, generator=generator)[:, ::2]
    else:
        inputs = torch.randn(4, 5, 11, 9, generator=generator)
        if layout == "channels_last":
            inputs = inputs.to(memory_format=torch.channels_last)
    # The reference: unfold's (batch, in*kh*kw, positions), samples laid side by side.
    unfolded = functional.unfold(inputs, kernel, dilation=dilation, padding=padding, stride=stride)
    expected = unfolded.permute(1, 0, 2).reshape(unfolded.shape[1], -1)
    assert torch.equal(Conv2dHelper(conv).patches(inputs), expected)


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "dilation", "bias"),
    [(5, 2, 1, 1, True), (3, 1, 0, 2, False), (1, 3, 2, 1, True)],
)
def test_conv1d_factors_are_the_moments_of_its_patches_and_output_gradients(
    kernel: int, stride: int, padding: int, dilation: int, bias: bool
) -> None:
    conv = nn.Conv1d(3, 4, kernel, stride=stride, padding=padding, dilation=dilation, bias=bias)
    helper = make_helper(conv)[0]
    assert isinstance(helper, Conv1dHelper)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(6, 3, 17, generator=generator, dtype=torch.float64)
    conv = conv.double()
    output = conv(inputs)
    grad_output = torch.randn(output.shape, generator=generator, dtype=torch.float64)
    positions = output.shape[2]
    # Reference, written out: one row per (sample, position) holding the receptive field in
    # the weight's (in, k) order, a ones column for the bias, each row divided by the number
    # of positions (spatial averaging), then rows^T rows / rows.
    padded = functional.pad(inputs, (padding, padding))
    rows = []
    for sample in range(inputs.shape[0]):
        for position in range(positions):
            start = position * stride
            taps = padded[sample, :, start : start + dilation * (kernel - 1) + 1 : dilation]
            row = taps.reshape(-1)
            if bias:
                row = torch.cat([row, torch.ones(1, dtype=torch.float64)])
            rows.append(row / positions)
    a_rows = torch.stack(rows)
    expected_a = a_rows.t() @ a_rows / a_rows.shape[0]
    g_rows = grad_output.permute(0, 2, 1).reshape(-1, 4) / positions
    expected_g = g_rows.t() @ g_rows / g_rows.shape[0]
    helper = Conv1dHelper(conv)
    assert helper.a_dim == 3 * kernel + int(bias)
    assert helper.g_dim == 4
    torch.testing.assert_close(helper.a_factor(inputs), expected_a)
    torch.testing.assert_close(helper.g_factor(grad_output), expected_g)


@pytest.mark.parametrize("width", [5, 255, 256, 300, 384, 1000])
@pytest.mark.parametrize("count", [3, 700])
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_gram_is_the_full_product_of_the_rows_with_themselves(
    width: int, count: int, layout: str
) -> None:
    generator = torch.Generator().manual_seed(width + count)
    if layout == "columns":  # a transposed view, as the convolutions pass their patches
        rows = torch.randn(width, count, generator=generator).t()
    else:
        rows = torch.randn(count, width, generator=generator)
    expected = rows.double().t() @ rows.double()
    product = gram(rows)
    assert product.dtype == rows.dtype and product.shape == (width, width)
    torch.testing.assert_close(product.double(), expected, rtol=1e-5, atol=1e-4 * count**0.5)
    assert torch.equal(second_moment(rows), second_moment(rows).t())


@pytest.mark.parametrize("by_padding", [None, False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_input_moment_is_the_scaled_moment_of_the_rows_with_a_ones_column(
    by_padding: bool | None, bias: bool, layout: str
) -> None:
    # Both ways (the sums, the CPU's default; padded rows, an accelerator's) on one device.
    generator = torch.Generator().manual_seed(int(bias) + 2 * (by_padding is True))
    if layout == "columns":
        rows = torch.randn(260, 90, generator=generator).t()
    else:
        rows = torch.randn(90, 260, generator=generator)
    reference = rows.double()
    if bias:
        reference = torch.cat([reference, torch.ones(90, 1, dtype=torch.float64)], dim=1)
    expected = 0.25 * reference.t() @ reference / 90
    moment = input_moment(rows, bias, 0.25, by_padding=by_padding)
    assert moment.dtype == rows.dtype and moment.shape == (260 + int(bias),) * 2
    torch.testing.assert_close(moment.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(moment, moment.t())


def test_wide_linear_factors_are_the_moments_with_a_ones_column() -> None:
    # Wide enough (300 in, 384 out) that the factors' products are cut into blocks.
    layer = nn.Linear(300, 384)
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(4, 50, 300, generator=generator)
    grads = torch.randn(4, 50, 384, generator=generator)
    helper = make_helper(layer)[0]
    assert helper is not None
    rows = torch.cat([inputs.reshape(-1, 300), torch.ones(200, 1)], dim=1).double()
    torch.testing.assert_close(helper.a_factor(inputs), (rows.t() @ rows / 200).float())
    g_rows = grads.reshape(-1, 384).double()
    torch.testing.assert_close(helper.g_factor(grads), (g_rows.t() @ g_rows / 200).float())


def test_wide_conv_factors_are_the_spatially_averaged_moments_of_unfold_s_patches() -> None:
    # 32 channels x 3x3 = 288-wide patches and 260 output channels: both products are cut.
    conv = nn.Conv2d(32, 260, 3, padding=1)
    generator = torch.Generator().manual_seed(4)
    inputs = torch.randn(2, 32, 6, 5, generator=generator)
    grads = torch.randn(2, 260, 6, 5, generator=generator)
    helper = make_helper(conv)[0]
    assert helper is not None
    positions = 30
    unfolded = functional.unfold(inputs, 3, padding=1).transpose(1, 2).reshape(-1, 288)
    rows = torch.cat([unfolded, torch.ones(60, 1)], dim=1).double() / positions
    torch.testing.assert_close(helper.a_factor(inputs), (rows.t() @ rows / 60).float())
    g_rows = grads.permute(0, 2, 3, 1).reshape(-1, 260).double() / positions
    torch.testing.assert_close(helper.g_factor(grads), (g_rows.t() @ g_rows / 60).float())


def _conv1d_and_linear(bias: bool) -> tuple[nn.Module, nn.Module]:
    """Two GPT-2 style ``Conv1D`` layers and the equivalent Linear layers (weights transposed)."""
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(0)
    ours = nn.Sequential(pytorch_utils.Conv1D(7, 5), nn.Tanh(), pytorch_utils.Conv1D(3, 7))
    linear = nn.Sequential(nn.Linear(5, 7, bias=bias), nn.Tanh(), nn.Linear(7, 3, bias=bias))
    with torch.no_grad():
        for conv, line in ((ours[0], linear[0]), (ours[2], linear[2])):
            if not bias:
                conv.bias.requires_grad_(False)  # zeros, frozen: K-FAC sees no bias
            else:
                conv.bias.normal_()
                line.bias.copy_(conv.bias)
            line.weight.copy_(conv.weight.t())
    return ours, linear


@pytest.mark.parametrize("bias", [True, False])
def test_transformers_conv1d_is_preconditioned_as_the_equivalent_linear(bias: bool) -> None:
    from interlace.kfac import KFAC  # noqa: PLC0415

    conv_model, linear_model = _conv1d_and_linear(bias)
    assert type(make_helper(conv_model[0])[0]).__name__ == "TransposedLinearHelper"
    preconds = [KFAC(m, damping_adaptation="fixed") for m in (conv_model, linear_model)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (conv_model, linear_model)]
    for step in range(3):
        x = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(step))
        for model, precond in zip((conv_model, linear_model), preconds, strict=True):
            model.zero_grad()
            model(x).square().mean().backward()
            precond.step()
        conv_layers, linear_layers = (p.kfac_layers for p in preconds)
        for name in ("0", "2"):
            for which in "AG":
                torch.testing.assert_close(
                    conv_layers[name].factor(which), linear_layers[name].factor(which)
                )
            conv_grad = conv_model.get_submodule(name).weight.grad
            linear_grad = linear_model.get_submodule(name).weight.grad
            torch.testing.assert_close(conv_grad, linear_grad.t())
            if bias:
                torch.testing.assert_close(
                    conv_model.get_submodule(name).bias.grad,
                    linear_model.get_submodule(name).bias.grad,
                )
        for optimizer in optimizers:
            optimizer.step()
