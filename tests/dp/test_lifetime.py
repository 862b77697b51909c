"""The end of a DataParallel: closed, left by a ``with`` block or garbage-collected, it leaves its
module as it found it, and wrapping the module again is a first wrap. Also: one live wrapper per
module, no mode left on torch's stack after a step, planning whatever path each rank's forward
took, and no timing marks piling up once a saved plan is loaded.
"""

from __future__ import annotations

import copy
import gc
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from interlace.clock import StreamClock
from interlace.comm.cost import CostModel
from interlace.dp import DataParallel
from interlace.dp.forward_overlap import ForwardOverlap
from interlace.testing import raised_message, run_ranks

SETTINGS: dict[str, Any] = {
    "profile_steps": 1,
    "tune_steps": 0,
    "cost_model": CostModel(a=2e-4, b=1e-9),
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 10))


def _batches(count: int, seed: int = 100) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    return [
        (torch.randn(8, 12, generator=generator), torch.randint(0, 10, (8,), generator=generator))
        for _ in range(count)
    ]


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any]) -> None:
    for inputs, targets in batches:
        optimizer.zero_grad()
        functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()


def _same(first: nn.Module, second: nn.Module) -> bool:
    return all(
        torch.equal(a, b)
        for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    )


def _hooks(module: nn.Module) -> int:
    """Every hook torch keeps on ``module``, its submodules and its parameters."""
    count = 0
    for child in module.modules():
        for table in (
            child._forward_pre_hooks,
            child._forward_hooks,
            child._backward_pre_hooks,
            child._backward_hooks,
            child._state_dict_pre_hooks,
            child._state_dict_hooks,
            child._load_state_dict_pre_hooks,
            child._load_state_dict_post_hooks,
        ):
            count += len(table)
    for param in module.parameters():
        count += len(param._post_accumulate_grad_hooks or {}) + len(param._backward_hooks or {})
        count += type(param) is not nn.Parameter  # a pending mark's class left on the parameter
    return count


def _optimizer_hooks(optimizer: torch.optim.Optimizer) -> int:
    return (
        len(optimizer._optimizer_step_pre_hooks)
        + len(optimizer._optimizer_step_post_hooks)
        + len(optimizer._optimizer_state_dict_pre_hooks)
        + len(optimizer._optimizer_load_state_dict_pre_hooks)
    )


def _global_hooks() -> int:
    return len(_global_optimizer_pre_hooks) + len(_global_optimizer_post_hooks)


def _counts(overlap: str) -> dict[str, Any]:
    """Hooks on a fresh module, while wrapped, after close(); and after a dropped wrapper."""
    net = _net()
    fresh = _hooks(net)
    model = DataParallel(net, overlap=overlap, **SETTINGS)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, optimizer, _batches(3))
    wrapped = (_hooks(net), _global_hooks(), _optimizer_hooks(optimizer))
    pending = model.plan is not None and model.plan.overlaps_forward
    model.close()
    closed = (_hooks(net), _global_hooks(), _optimizer_hooks(optimizer))
    model.close()  # a no-op
    forward_error = raised_message(lambda: model(torch.randn(2, 12)))
    # Dropped without close(): freed (at once where nothing else still holds it, else by the
    # collector: a loaded machine can leave a collective's callback holding it a moment
    # longer, so the collector gets up to 10 s), and its hooks go.
    dropped = DataParallel(net, overlap=overlap, **SETTINGS)
    _train(dropped, optimizer, _batches(2))
    reference = weakref.ref(dropped)
    del dropped
    deadline = time.monotonic() + 10.0
    while reference() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    freed = reference() is None
    gone = (_hooks(net), _global_hooks(), _optimizer_hooks(optimizer))
    return {
        "fresh": fresh,
        "wrapped": wrapped,
        "pending": pending,
        "closed": closed,
        "freed": freed,
        "gone": gone,
        "forward_error": forward_error,
    }


def _rewrap(overlap: str) -> bool:
    """Train, close, wrap the same module again and train on: the same parameters as a copy
    of it wrapped for the first time at the close."""
    net = _net()
    batches = _batches(6)
    model = DataParallel(net, overlap=overlap, channels=2, **SETTINGS)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), batches[:3])
    model.close()
    twin = copy.deepcopy(net)
    with DataParallel(net, overlap=overlap, channels=2, **SETTINGS) as again:
        _train(again, torch.optim.SGD(again.parameters(), lr=0.05, momentum=0.9), batches[3:])
    with DataParallel(twin, overlap=overlap, channels=2, **SETTINGS) as first:
        _train(first, torch.optim.SGD(first.parameters(), lr=0.05, momentum=0.9), batches[3:])
    return _same(net, twin)


def _closing_applies_what_is_pending() -> dict[str, bool]:
    """A step's deferred updates land at close() and when a dropped wrapper is collected."""
    results = {}
    for ending in ("close", "drop"):
        net = _net()
        twin = copy.deepcopy(net)
        reference = DataParallel(twin, **SETTINGS)
        model = DataParallel(net, overlap="forward", **SETTINGS)
        batches = _batches(4)
        _train(reference, torch.optim.Adam(reference.parameters(), lr=1e-2), batches)
        _train(model, torch.optim.Adam(model.parameters(), lr=1e-2), batches)
        if ending == "close":
            model.close()
        else:
            del model
            gc.collect()
        results[ending] = _same(net, twin)
    return results


def _second_live_wrapper() -> dict[str, str]:
    net = _net()
    first = DataParallel(net, **SETTINGS)
    messages = {
        "same module": raised_message(lambda: DataParallel(net, **SETTINGS)),
        "a submodule": raised_message(lambda: DataParallel(net[2], **SETTINGS)),
    }
    first.close()
    messages["after close"] = raised_message(lambda: DataParallel(net, **SETTINGS).close())
    return messages


class Counting(TorchFunctionMode):
    """A user's mode around the step: counts torch calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _users_mode() -> dict[str, Any]:
    """A user's mode entered before optimizer.step() and left after it: gone after its block,
    every step, and the training equal to the one without the overlap."""
    net = _net()
    twin = copy.deepcopy(net)
    models = [DataParallel(twin, **SETTINGS), DataParallel(net, overlap="forward", **SETTINGS)]
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    stacks: list[int] = []
    counted = 0
    for inputs, targets in _batches(6):
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad()
            functional.cross_entropy(model(inputs), targets).backward()
            with Counting() as counting:
                optimizer.step()
            stacks.append(len(_get_current_function_mode_stack()))
            counted += counting.calls > 0
    overlapped = models[1].plan is not None and models[1].plan.overlaps_forward
    return {"stacks": stacks, "counted": counted, "same": _same(net, twin), "on": overlapped}


def _unrelated_optimizer() -> dict[str, int]:
    """An optimizer holding none of a wrapper's parameters never enters the wrapper's overlap."""
    entered: list[int] = []
    original = ForwardOverlap.before_step

    def counting(self: ForwardOverlap, optimizer: Any, closure: bool) -> None:
        entered.append(id(optimizer))
        original(self, optimizer, closure)

    ForwardOverlap.before_step = counting  # type: ignore[method-assign]
    try:
        model = DataParallel(_net(), overlap="forward", **SETTINGS)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        other = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
        _train(model, optimizer, _batches(3))
        for param in other.param_groups[0]["params"]:
            param.grad = torch.ones(3)
        other.step()
        model.close()
    finally:
        ForwardOverlap.before_step = original  # type: ignore[method-assign]
    return {"mine": entered.count(id(optimizer)), "other": entered.count(id(other))}


def _two_wrappers_one_optimizer() -> bool:
    """Two overlapping wrappers whose parameters one optimizer steps: DDP's numbers."""
    torch.manual_seed(0)
    encoder, head = nn.Sequential(nn.Linear(12, 16), nn.ReLU()), nn.Linear(16, 10)
    ddp = [
        DistributedDataParallel(copy.deepcopy(encoder)),
        DistributedDataParallel(copy.deepcopy(head)),
    ]
    ours = [
        DataParallel(encoder, overlap="forward", **SETTINGS),
        DataParallel(head, overlap="forward", **SETTINGS),
    ]
    for pair in (ddp, ours):
        optimizer = torch.optim.Adam([*pair[0].parameters(), *pair[1].parameters()], lr=1e-2)
        for inputs, targets in _batches(6):
            optimizer.zero_grad()
            functional.cross_entropy(pair[1](pair[0](inputs)), targets).backward()
            optimizer.step()
    for model in ours:
        model.close()
    return _same(ddp[0].module, encoder) and _same(ddp[1].module, head)


class Branching(nn.Module):
    """A branch only some ranks take, in some steps: the gates reached differ between ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(12, 16)
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, 10)
        self.take: Callable[[], bool] = lambda: True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        if self.take():
            h = h + self.branch(h)
        return self.head(h)


def _different_paths() -> dict[str, Any]:
    """Ranks whose forwards take different paths in the warm-up and the timed steps plan alike
    and train as without the overlap."""
    torch.manual_seed(0)
    net = Branching()
    twin = copy.deepcopy(net)
    step = [0]
    rank = dist.get_rank()
    # Rank 1 skips the branch in the warm-up and the profiled step, rank 0 takes it.
    for module in (net, twin):
        module.take = lambda: rank == 0 or step[0] >= 4
    models = [DataParallel(twin, **SETTINGS), DataParallel(net, overlap="forward", **SETTINGS)]
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.05) for model in models]
    for number, (inputs, targets) in enumerate(_batches(8)):
        step[0] = number
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad()
            functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
    overlapped = models[1].plan is not None and models[1].plan.overlaps_forward
    for model in models:
        model.close()
    return {"same": _same(net, twin), "on": overlapped}


def _scenarios(_: None) -> dict[str, Any]:
    return {
        "counts backward": _counts("backward"),
        "counts forward": _counts("forward"),
        "rewrap backward": _rewrap("backward"),
        "rewrap forward": _rewrap("forward"),
        "pending at the end": _closing_applies_what_is_pending(),
        "second live wrapper": _second_live_wrapper(),
        "user's mode": _users_mode(),
        "unrelated optimizer": _unrelated_optimizer(),
        "two wrappers, one optimizer": _two_wrappers_one_optimizer(),
        "different paths": _different_paths(),
    }


@pytest.fixture(scope="module")
def scenarios() -> dict[str, Any]:
    results = run_ranks(_scenarios, 2, None, timeout=200)
    differ = {key: (results[0][key], results[1][key]) for key in results[0]}
    assert results[0] == results[1], {k: v for k, v in differ.items() if v[0] != v[1]}
    return results[0]


@pytest.mark.parametrize("overlap", ["backward", "forward"])
def test_closing_leaves_no_hook_and_no_global_registration(
    scenarios: dict[str, Any], overlap: str
) -> None:
    result = scenarios[f"counts {overlap}"]
    hooks, global_hooks, optimizer_hooks = result["wrapped"]
    assert hooks > result["fresh"] == 0
    assert (global_hooks > 0) == (overlap == "forward") == result["pending"]
    assert result["closed"] == (0, 0, 0)
    assert result["freed"] and result["gone"] == (0, 0, 0)
    assert (optimizer_hooks > 0) == (overlap == "forward")  # a checkpoint waits for updates
    message = result["forward_error"]
    assert "this DataParallel was closed" in message and "\n" not in message


@pytest.mark.parametrize("overlap", ["backward", "forward"])
def test_wrapping_again_after_close_is_a_first_wrap(
    scenarios: dict[str, Any], overlap: str
) -> None:
    assert scenarios[f"rewrap {overlap}"]


def test_pending_updates_land_when_the_wrapper_ends(scenarios: dict[str, Any]) -> None:
    assert scenarios["pending at the end"] == {"close": True, "drop": True}


def test_a_module_has_one_live_wrapper(scenarios: dict[str, Any]) -> None:
    messages = scenarios["second live wrapper"]
    for key in ("same module", "a submodule"):
        assert "already wrapped by a live DataParallel" in messages[key]
        assert "\n" not in messages[key]
    assert messages["after close"] == "no error"


def test_a_users_mode_around_the_step_leaves_with_its_block(scenarios: dict[str, Any]) -> None:
    result = scenarios["user's mode"]
    assert result["on"] and result["same"]
    assert result["stacks"] == [0] * 12 and result["counted"] == 12


def test_an_optimizer_without_the_wrappers_parameters_never_enters_it(
    scenarios: dict[str, Any],
) -> None:
    result = scenarios["unrelated optimizer"]
    assert result["mine"] == 3 and result["other"] == 0


def test_two_overlapping_wrappers_sharing_an_optimizer_train_as_ddp(
    scenarios: dict[str, Any],
) -> None:
    assert scenarios["two wrappers, one optimizer"]


def test_ranks_taking_different_paths_plan_alike(scenarios: dict[str, Any]) -> None:
    result = scenarios["different paths"]
    assert result["on"] and result["same"]


def _marks_after_loading(device: str) -> list[int]:
    """Clock marks (CUDA events on a GPU) made per step once a backward-only plan is loaded
    into an overlapping wrapper."""
    made = [0]
    original = StreamClock.mark

    def counting(self: StreamClock) -> Any:
        made[0] += 1
        return original(self)

    net = _net().to(device)
    batches = [(x.to(device), y.to(device)) for x, y in _batches(8)]
    # On one GPU: the whole machinery, which the shortcut would skip.
    alone: dict[str, Any] = {"single_rank_shortcut": False}
    with DataParallel(copy.deepcopy(net), **SETTINGS, **alone) as planner:
        _train(planner, torch.optim.SGD(planner.parameters(), lr=0.05), batches[:3])
        state = planner.plan_state()
    assert state is not None
    StreamClock.mark = counting  # type: ignore[method-assign]
    per_step = []
    try:
        with DataParallel(net, overlap="forward", **SETTINGS, **alone) as model:
            model.load_plan_state(state)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            for batch in batches[3:]:
                before = made[0]
                _train(model, optimizer, [batch])
                per_step.append(made[0] - before)
    finally:
        StreamClock.mark = original  # type: ignore[method-assign]
    return per_step


def test_no_marks_pile_up_after_loading_a_backward_only_plan() -> None:
    for per_step in run_ranks(_marks_after_loading, 2, "cpu", timeout=60):
        assert per_step == [0] * 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_cuda_events_pile_up_after_loading_a_backward_only_plan() -> None:
    (per_step,) = run_ranks(_marks_after_loading, 1, "cuda", timeout=120, backend="nccl")
    assert per_step == [0] * 5
