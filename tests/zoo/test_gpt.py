"""The zoo's GPT: shapes, causality, its loss, its layers and its bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from interlace.errors import UsageError
from interlace.zoo import build_model, token_cross_entropy
from interlace.zoo.gpt import GPT


@pytest.fixture(autouse=True)
def _two_threads() -> None:
    torch.set_num_threads(2)


def _small(seq_len: int = 16, **kwargs: object) -> GPT:
    torch.manual_seed(0)
    return GPT((seq_len,), 256, dim=32, depth=2, heads=4, context=32, **kwargs)  # type: ignore[arg-type]


def test_logits_score_every_position_and_the_zoo_builds_it() -> None:
    model = build_model("gpt", (24,), 256)
    ids = torch.randint(0, 256, (3, 24))
    assert model(ids).shape == (3, 24, 256)
    assert model(ids[:, :5]).shape == (3, 5, 256)  # shorter than the context is fine


def test_a_later_token_does_not_change_earlier_logits() -> None:
    model = _small().eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = ids.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    with torch.no_grad():
        before, after = model(ids), model(changed)
    torch.testing.assert_close(after[:, :9], before[:, :9], rtol=0, atol=1e-6)
    assert (after[:, 9:] - before[:, 9:]).abs().amax() > 1e-3


def test_token_cross_entropy_is_the_mean_negative_log_probability_of_each_target() -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 7, generator=generator)
    targets = torch.randint(0, 7, (2, 5), generator=generator)
    # Reference: softmax written out, one position at a time.
    total = 0.0
    for b in range(2):
        for t in range(5):
            row = logits[b, t].double()
            total -= float(row[targets[b, t]] - torch.log(torch.exp(row).sum()))
    assert float(token_cross_entropy(logits, targets)) == pytest.approx(total / 10, rel=1e-6)
    # A classifier's logits: plain cross-entropy.
    flat = torch.nn.functional.cross_entropy(logits[0], targets[0])
    assert torch.equal(token_cross_entropy(logits[0], targets[0]), flat)


def test_every_weight_lives_in_a_linear_embedding_or_layernorm() -> None:
    model = _small()
    kinds = {
        type(module)
        for module in model.modules()
        if any(True for _ in module.parameters(recurse=False))
    }
    assert kinds == {nn.Linear, nn.Embedding, nn.LayerNorm}
    assert model.head.weight is not model.token.weight


def test_tied_weights_share_one_parameter() -> None:
    untied, tied = _small(), _small(tie_weights=True)
    assert tied.head.weight is tied.token.weight
    count = sum(p.numel() for p in tied.parameters())
    assert count == sum(p.numel() for p in untied.parameters()) - 256 * 32


def test_initial_loss_is_near_uniform_over_the_vocabulary() -> None:
    model = _small()
    ids = torch.randint(0, 256, (4, 16))
    with torch.no_grad():
        loss = float(token_cross_entropy(model(ids[:, :-1]), ids[:, 1:]))
    assert abs(loss - math.log(256)) < 0.1


@pytest.mark.parametrize(
    ("input_shape", "needles"),
    [
        ((64,), ("sequence length 64", "context of 32")),
        ((1, 8, 8), ("(seq_len,)", "(1, 8, 8)")),
    ],
)
def test_bad_shapes_are_one_line_errors(
    input_shape: tuple[int, ...], needles: tuple[str, ...]
) -> None:
    with pytest.raises(UsageError) as info:
        GPT(input_shape, 256, dim=32, depth=1, heads=4, context=32)
    assert "\n" not in str(info.value)
    for needle in needles:
        assert needle in str(info.value)


def test_a_sequence_longer_than_the_context_is_refused_at_forward() -> None:
    with pytest.raises(UsageError, match=r"sequence length 33 .* context of 32"):
        _small()(torch.zeros(1, 33, dtype=torch.long))


def test_sizes_that_do_not_fit_are_refused() -> None:
    with pytest.raises(UsageError, match="divisible"):
        GPT((8,), 256, dim=30, heads=4)
