"""Gates: each parameter waits at the modules that hold it, or at the forward's start when a
checked forward saw it used elsewhere; one the checked forward did not use is idle."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from interlace.dp.forward_overlap.gates import ROOT, Gates


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.borrowed = nn.Linear(4, 4)  # its weight is used by the parent, not by calling it
        self.idle = nn.Linear(4, 4)  # never called
        self.scale = nn.Parameter(torch.ones(4))  # held by the root itself

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.second(self.first(x)) * self.scale  # called in registration order here
        return functional.linear(h, self.borrowed.weight, self.borrowed.bias)


def _names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def test_before_a_check_every_parameter_waits_at_its_module() -> None:
    model = Net()
    gates = Gates(model, list(model.parameters()), lambda name: None)
    names = _names(model)
    waits = {gate: [names[i] for i in indices] for gate, indices in gates.waits.items()}
    assert waits["first"] == ["first.weight", "first.bias"]
    assert waits["borrowed"] == ["borrowed.weight", "borrowed.bias"]
    assert waits[ROOT] == ["scale"]


def test_a_checked_forward_moves_parameters_used_elsewhere_to_the_start() -> None:
    model = Net()
    reached: list[str] = []
    gates = Gates(model, list(model.parameters()), reached.append)
    with gates.check():
        model(torch.randn(2, 4))
    names = _names(model)
    waits = {gate: [names[i] for i in indices] for gate, indices in gates.waits.items()}
    assert waits["first"] == ["first.weight", "first.bias"]
    assert waits["second"] == ["second.weight", "second.bias"]
    # Used outside its module's forward: the start.
    assert sorted(waits[ROOT]) == sorted(["scale", "borrowed.weight", "borrowed.bias"])
    assert waits["borrowed"] == []
    # Not used at all: still at its own module (the start would wait for its average before
    # anything runs), and idle.
    assert waits["idle"] == ["idle.weight", "idle.bias"]
    assert [names[i] for i in gates.idle] == ["idle.weight", "idle.bias"]
    # The pre-hooks fire in forward order, the root first.
    assert reached == [ROOT, "first", "second"]


def test_gates_are_timed_in_forward_order_and_removed_cleanly() -> None:
    model = Net()
    reached: list[str] = []
    gates = Gates(model, list(model.parameters()), reached.append)
    for _ in range(3):
        gates.time_pass()
        model(torch.randn(2, 4))
        gates.stop_timing()
    offsets = gates.offsets()
    unreached = ["borrowed", "idle"]
    # Every gate, in registration order; the ones no forward reached have no offset.
    assert sorted(name for name, _ in offsets) == sorted([ROOT, "first", "second", *unreached])
    assert all(offset is None for name, offset in offsets if name in unreached)
    reached = sorted((offset, name) for name, offset in offsets if offset is not None)
    assert [name for _, name in reached] == [ROOT, "first", "second"]
    gates.remove()
    reached.clear()
    model(torch.randn(2, 4))
    assert reached == []


def test_a_module_holding_a_tied_parameter_with_another_gates_it_at_either() -> None:
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight  # tied: one parameter, two holders
    gates = Gates(model, list(model.parameters()), lambda name: None)
    assert gates.owners == [["0", "1"]]
    assert gates.waits["0"] == [0] and gates.waits["1"] == [0]
