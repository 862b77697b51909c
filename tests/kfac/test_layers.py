"""Per-module K-FAC helpers: convolution patches against ``unfold``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional

from interlace.kfac.layers import Conv2dHelper


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
