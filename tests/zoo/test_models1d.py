"""The 1-D models: the MNIST-1D paper's shapes, pipeline blocks, K-FAC on their convolutions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from interlace.errors import UsageError
from interlace.kfac import KFAC
from interlace.zoo.models import build_model


def test_the_paper_s_mlp_and_cnn_have_its_layer_sizes() -> None:
    mlp = build_model("mlp1d", (1, 40), 10)
    assert [(m.in_features, m.out_features) for m in mlp.modules() if isinstance(m, nn.Linear)] == [
        (40, 100),
        (100, 100),
        (100, 10),
    ]
    cnn = build_model("cnn1d", (1, 40), 10)
    convs = [m for m in cnn.modules() if isinstance(m, nn.Conv1d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size[0]) for c in convs] == [
        (1, 25, 5),
        (25, 25, 3),
        (25, 25, 3),
    ]
    (head,) = [m for m in cnn.modules() if isinstance(m, nn.Linear)]
    assert head.in_features == 125  # 25 channels x length 5


@pytest.mark.parametrize("name", ["mlp1d", "cnn1d", "resnet1d"])
def test_pipeline_blocks_compose_to_the_model(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(name, (1, 40), 10).eval()
    x = torch.randn(5, 1, 40)
    out = x
    for block in model.pipeline_blocks():  # type: ignore[operator]
        out = block(out)
    torch.testing.assert_close(out, model(x))
    assert model(x.squeeze(1)).shape == (5, 10)  # a [batch, length] input is one channel


def test_a_bad_input_shape_is_one_clear_error() -> None:
    with pytest.raises(UsageError, match="pass --input-shape 1,40"):
        build_model("cnn1d", (3, 8, 8), 10)


def test_kfac_preconditions_every_conv1d_of_the_cnn() -> None:
    torch.manual_seed(0)
    model = build_model("cnn1d", (1, 40), 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFAC(model, damping=0.03)
    x, y = torch.randn(16, 1, 40), torch.randint(0, 10, (16,))
    nn.functional.cross_entropy(model(x), y).backward()
    plain = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    precond.step()
    optimizer.step()
    convs = [name for name, m in model.named_modules() if isinstance(m, nn.Conv1d)]
    assert set(convs) <= set(precond.layers)
    changed = [p.grad for p in model.parameters() if p.grad is not None]
    assert any(not torch.allclose(a, b) for a, b in zip(plain, changed, strict=True))
