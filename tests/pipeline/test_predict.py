"""Tests for SpecTrain weight prediction: version differences, the formula, SGD's state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import interlace.pipeline
from interlace.errors import UsageError
from interlace.pipeline.predict import (
    check_predictable,
    predict_weights,
    predicted_parameters,
    version_difference,
)


@pytest.fixture(autouse=True)
def _two_threads() -> None:
    torch.set_num_threads(2)


# --------------------------------------------------------------------------------------------
# version_difference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_stages", "expected"),
    [
        (1, [(0, 0)]),
        (2, [(1, 0), (0, 0)]),
        (3, [(2, 0), (1, 0), (1, 1)]),
        (4, [(3, 0), (2, 0), (2, 1), (1, 1)]),
        (5, [(4, 0), (3, 0), (3, 1), (2, 1), (2, 2)]),
    ],
)
def test_version_difference_hand_cases(num_stages: int, expected: list[tuple[int, int]]) -> None:
    assert [version_difference(k, num_stages) for k in range(num_stages)] == expected


def test_version_difference_forward_minus_backward_is_stages_after() -> None:
    # Between a micro-batch's forward and backward on stage k, the N - k - 1 later stages run.
    for n in range(1, 10):
        for k in range(n):
            s_fwd, s_bwd = version_difference(k, n)
            assert s_fwd - s_bwd == n - k - 1
            assert s_bwd >= 0


@pytest.mark.parametrize(("stage", "num_stages"), [(0, 0), (0, -1), (-1, 4), (4, 4), (7, 2)])
def test_version_difference_rejects_bad_arguments(stage: int, num_stages: int) -> None:
    with pytest.raises(ValueError, match=r"num_stages must be|stage must be"):
        version_difference(stage, num_stages)


# --------------------------------------------------------------------------------------------
# predict_weights
# --------------------------------------------------------------------------------------------


def test_the_documented_call_is_importable_from_the_package() -> None:
    # interlace.pipeline.predict_weights(weight, momentum_buffer, lr, s), argument names and all.
    weight = torch.tensor([1.0, 2.0])
    buffer = torch.tensor([2.0, -4.0])
    predicted = interlace.pipeline.predict_weights(
        weight=weight, momentum_buffer=buffer, lr=0.25, s=2
    )
    # W - s * lr * v = [1 - 1, 2 + 2].
    assert torch.equal(predicted, torch.tensor([0.0, 4.0]))
    assert interlace.pipeline.version_difference(stage=0, num_stages=4) == (3, 0)


def test_predict_weights_formula_by_hand() -> None:
    weight = torch.tensor([1.0, 2.0, -3.0])
    buffer = torch.tensor([0.5, -1.0, 2.0])
    # lr = 0.25, s = 2: W - 0.5 * v, all exactly representable.
    assert torch.equal(predict_weights(weight, buffer, 0.25, 2), torch.tensor([0.75, 2.5, -4.0]))
    # lr = 0.1, s = 3: W - 0.3 * v = [1 - 0.15, 2 + 0.3, -3 - 0.6].
    torch.testing.assert_close(
        predict_weights(weight, buffer, 0.1, 3), torch.tensor([0.85, 2.3, -3.6])
    )
    # A 2-D weight, lr = 0.5, s = 2: [[1, 2], [3, 4]] - 1.0 * [[1, 0], [0, -1]].
    weight_2d = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    buffer_2d = torch.tensor([[1.0, 0.0], [0.0, -1.0]])
    assert torch.equal(
        predict_weights(weight_2d, buffer_2d, 0.5, 2), torch.tensor([[0.0, 2.0], [3.0, 5.0]])
    )


def test_predict_weights_without_buffer_or_steps_is_a_copy() -> None:
    weight = nn.Parameter(torch.tensor([1.0, -2.0]))
    for buffer, s in ((None, 3), (torch.tensor([4.0, 5.0]), 0)):
        out = predict_weights(weight, buffer, 0.1, s)
        assert torch.equal(out, weight.detach())
        assert out.data_ptr() != weight.data_ptr()
        assert not out.requires_grad


def test_predict_weights_never_in_place() -> None:
    weight = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    buffer = torch.tensor([0.1, 0.2, 0.3])
    weight_before, buffer_before = weight.detach().clone(), buffer.clone()
    out = predict_weights(weight, buffer, 0.5, 2)
    assert torch.equal(weight.detach(), weight_before)
    assert torch.equal(buffer, buffer_before)
    assert out.data_ptr() not in (weight.data_ptr(), buffer.data_ptr())
    assert not out.requires_grad
    assert weight.requires_grad  # the parameter itself is untouched
    out.add_(100.0)  # writing to the prediction cannot reach the weight or the buffer
    assert torch.equal(weight.detach(), weight_before)
    assert torch.equal(buffer, buffer_before)


def test_predict_weights_rejects_bad_arguments() -> None:
    weight = torch.zeros(3)
    with pytest.raises(ValueError, match=">= 0"):
        predict_weights(weight, torch.zeros(3), 0.1, -1)
    with pytest.raises(ValueError, match="does not match"):
        predict_weights(weight, torch.zeros(2, 2), 0.1, 1)
    with pytest.raises(ValueError, match="finite"):
        predict_weights(weight, torch.zeros(3), float("nan"), 1)


# --------------------------------------------------------------------------------------------
# predicted_parameters against torch.optim.SGD
# --------------------------------------------------------------------------------------------


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def train_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: int
) -> list[dict[str, torch.Tensor]]:
    """Run ``steps`` SGD steps on fixed data; return each step's gradients and pre-step weights."""
    generator = torch.Generator().manual_seed(1)
    records = []
    for _ in range(steps):
        x = torch.randn(8, 3, generator=generator)
        target = torch.randn(8, 2, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), target).backward()
        record = {}
        for name, p in model.named_parameters():
            assert p.grad is not None
            record[f"grad:{name}"] = p.grad.clone()
            record[f"weight:{name}"] = p.detach().clone()
        records.append(record)
        optimizer.step()
    return records


def by_hand(
    model: nn.Module, optimizer: torch.optim.Optimizer, lr: float, s: int
) -> dict[str, torch.Tensor]:
    return {
        name: p.detach() - s * lr * optimizer.state[p]["momentum_buffer"]
        for name, p in model.named_parameters()
    }


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("s", [0, 1, 3])
def test_predicted_parameters_match_sgd_state(s: int) -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    records = train_steps(model, optimizer, 2)
    # The buffer is what the module docstring says: v = 0.9 * g1 + g2.
    for name, p in model.named_parameters():
        expected_v = 0.9 * records[0][f"grad:{name}"] + records[1][f"grad:{name}"]
        torch.testing.assert_close(optimizer.state[p]["momentum_buffer"], expected_v)
    before = snapshot(model)
    buffers_before = {
        id(p): optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()
    }
    predicted = predicted_parameters(model.named_parameters(), optimizer, s)
    assert set(predicted) == {name for name, _ in model.named_parameters()}  # no BN buffers
    for name, value in by_hand(model, optimizer, 0.1, s).items():
        torch.testing.assert_close(predicted[name], value)
        assert not predicted[name].requires_grad
    # Nothing changed: weights, BatchNorm running statistics, momentum buffers.
    after = snapshot(model)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    for p in model.parameters():
        assert torch.equal(optimizer.state[p]["momentum_buffer"], buffers_before[id(p)])


def test_predicted_parameters_with_weight_decay_use_the_buffer_alone() -> None:
    model = tiny_model()
    wd = 0.05
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=wd)
    records = train_steps(model, optimizer, 2)
    for name, p in model.named_parameters():
        g1 = records[0][f"grad:{name}"] + wd * records[0][f"weight:{name}"]
        g2 = records[1][f"grad:{name}"] + wd * records[1][f"weight:{name}"]
        # The decay is already inside v ...
        torch.testing.assert_close(optimizer.state[p]["momentum_buffer"], 0.9 * g1 + g2)
    predicted = predicted_parameters(model.named_parameters(), optimizer, 2)
    # ... so the prediction is W - s * lr * v, with no second decay term.
    for name, value in by_hand(model, optimizer, 0.1, 2).items():
        torch.testing.assert_close(predicted[name], value)


def test_predicted_parameters_with_nesterov_and_dampening_use_the_buffer() -> None:
    for kwargs in ({"nesterov": True}, {"dampening": 0.5}):
        model = tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, **kwargs)
        train_steps(model, optimizer, 2)
        predicted = predicted_parameters(model.named_parameters(), optimizer, 3)
        for name, value in by_hand(model, optimizer, 0.05, 3).items():
            torch.testing.assert_close(predicted[name], value)


def test_predicted_parameters_use_each_groups_lr() -> None:
    model = tiny_model()
    first, last = model[0], model[3]
    rest = [p for m in (model[1],) for p in m.parameters()]
    optimizer = torch.optim.SGD(
        [
            {"params": first.parameters(), "lr": 0.1},
            {"params": last.parameters(), "lr": 0.01},
            {"params": rest},
        ],
        lr=0.5,
        momentum=0.9,
    )
    train_steps(model, optimizer, 2)
    predicted = predicted_parameters(model.named_parameters(), optimizer, 2)
    lrs = {"0.": 0.1, "3.": 0.01, "1.": 0.5}
    for name, p in model.named_parameters():
        lr = lrs[name[:2]]
        expected = p.detach() - 2 * lr * optimizer.state[p]["momentum_buffer"]
        torch.testing.assert_close(predicted[name], expected)


def test_no_step_yet_predicts_the_current_weights() -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    predicted = predicted_parameters(model.named_parameters(), optimizer, 3)
    for name, p in model.named_parameters():
        assert torch.equal(predicted[name], p.detach())
        assert predicted[name].data_ptr() != p.data_ptr()
    assert len(optimizer.state) == 0  # looking did not create state entries


def test_parameters_the_optimizer_does_not_manage_keep_their_weights() -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    train_steps(model, optimizer, 2)
    predicted = predicted_parameters(model.named_parameters(), optimizer, 2)
    for name, p in model.named_parameters():
        if name.startswith("0."):
            expected = p.detach() - 2 * 0.1 * optimizer.state[p]["momentum_buffer"]
            torch.testing.assert_close(predicted[name], expected)
        else:
            assert torch.equal(predicted[name], p.detach())


def test_unpredictable_optimizers_raise_usage_error() -> None:
    model = tiny_model()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match=r"torch\.optim\.SGD with momentum > 0.*momentum=0"):
        predicted_parameters(model.named_parameters(), plain, 1)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    with pytest.raises(UsageError, match=r"torch\.optim\.SGD with momentum > 0, got Adam"):
        check_predictable(adam)
    mixed = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[3].parameters(), "momentum": 0.0}],
        lr=0.1,
        momentum=0.9,
    )
    with pytest.raises(UsageError, match="parameter group 1"):
        check_predictable(mixed)
    check_predictable(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def test_predicted_parameters_rejects_negative_steps() -> None:
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=">= 0"):
        predicted_parameters(model.named_parameters(), optimizer, -1)
