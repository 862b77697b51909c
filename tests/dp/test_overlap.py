"""``overlap="forward"`` against the same training without it: the same parameters, bit for bit
on two ranks, whatever the training loop does around the step.

Every scenario trains a reference DataParallel (averages done when backward returns) and one with
``overlap="forward"`` side by side on the same batches; one launch runs them all.
"""

from __future__ import annotations

import copy
import importlib
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from interlace import KFAC
from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import Overlap
from interlace.dp import DataParallel
from interlace.errors import UsageError
from interlace.testing import raised_message, run_ranks

#: Several buckets on these small models, and the overlap plan from the first planned step.
SETTINGS: dict[str, Any] = {
    "profile_steps": 1,
    "tune_steps": 0,
    "cost_model": CostModel(a=2e-4, b=1e-9),
}
STEPS = 6


class Net(nn.Module):
    """Layers called in another order than registered, a parameter read outside its module,
    and a layer that forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.late = nn.Linear(16, 10)
        self.early = nn.Linear(12, 16)
        self.head = nn.Linear(10, 10)
        self.unused = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.early(x))
        h = self.late(h) * self.scale
        # The head's weight used without calling the head: it must be up to date here too.
        return functional.linear(h, self.head.weight, self.head.bias)


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    return [
        (torch.randn(8, 12, generator=generator), torch.randint(0, 10, (8,), generator=generator))
        for _ in range(count)
    ]


def _pair(
    build: Callable[[], nn.Module] = Net, settings: dict[str, Any] = SETTINGS
) -> tuple[DataParallel, DataParallel]:
    torch.manual_seed(0)
    model = build()
    reference = DataParallel(copy.deepcopy(model), **settings)
    overlapped = DataParallel(model, overlap="forward", **settings)
    return reference, overlapped


def _worst(first: nn.Module, second: nn.Module) -> float:
    """The largest difference between the two models' parameters and buffers."""
    worst = 0.0
    for (_, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        worst = max(worst, float((a.double() - b.double()).abs().max()))
    return worst


def _train(
    models: tuple[DataParallel, DataParallel],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    loop: Callable[[DataParallel, torch.optim.Optimizer, torch.Tensor, torch.Tensor, int], Any],
    steps: int = STEPS,
) -> dict[str, Any]:
    optimizers = [make_optimizer(model) for model in models]
    outputs: list[list[Any]] = [[], []]
    for step, (inputs, targets) in enumerate(_batches(steps)):
        for number, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            outputs[number].append(loop(model, optimizer, inputs, targets, step))
    plan = models[1].plan
    return {
        "worst": _worst(models[0].module, models[1].module),
        "same_outputs": _equal(outputs[0], outputs[1]),
        "close_outputs": _equal(outputs[0], outputs[1], rel=1e-6),
        "overlapped": plan is not None and plan.overlaps_forward,
        "optimizer_state": _same_state(optimizers[0], optimizers[1]),
    }


def _equal(first: Any, second: Any, rel: float = 0.0) -> bool:
    """Equal values (to ``rel``; 0: bit for bit), in nested lists and tuples."""
    if isinstance(first, torch.Tensor):
        return isinstance(second, torch.Tensor) and torch.allclose(first, second, rtol=rel, atol=0)
    if isinstance(first, (list, tuple)):
        return len(first) == len(second) and all(
            _equal(a, b, rel) for a, b in zip(first, second, strict=True)
        )
    if isinstance(first, float) and isinstance(second, float):
        return abs(first - second) <= rel * abs(second)
    return bool(first == second)


def _same_state(first: torch.optim.Optimizer, second: torch.optim.Optimizer) -> bool:
    for a, b in zip(first.state.values(), second.state.values(), strict=True):
        if a.keys() != b.keys() or not all(_equal(a[key], b[key]) for key in a):
            return False
    return True


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(model(inputs), targets)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    # Two groups with their own hyperparameters.
    params = list(model.parameters())
    return torch.optim.SGD(
        [{"params": params[:4]}, {"params": params[4:], "lr": 0.02, "weight_decay": 0.0}],
        lr=0.05,
        momentum=0.9,
        nesterov=True,
        weight_decay=1e-3,
    )


def _plain_loop(set_to_none: bool, scheduler: bool = False) -> Callable[..., Any]:
    schedulers: dict[int, Any] = {}

    def loop(model: DataParallel, opt: torch.optim.Optimizer, x: Any, y: Any, step: int) -> Any:
        if scheduler and id(opt) not in schedulers:
            schedulers[id(opt)] = torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=50)
        opt.zero_grad(set_to_none=set_to_none)
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        if scheduler:
            schedulers[id(opt)].step()
        return float(loss)

    return loop


def _clipped(model: DataParallel, opt: torch.optim.Optimizer, x: Any, y: Any, step: int) -> Any:
    opt.zero_grad()
    _loss(model, x, y).backward()
    # Reads every gradient before the step: it must see the averages.
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    opt.step()
    return float(norm)


def _scaled() -> Callable[..., Any]:
    scalers: dict[int, torch.amp.GradScaler] = {}

    def loop(model: DataParallel, opt: torch.optim.Optimizer, x: Any, y: Any, step: int) -> Any:
        scaler = scalers.setdefault(id(opt), torch.amp.GradScaler("cpu", init_scale=2.0**10))
        opt.zero_grad()
        loss = _loss(model, x, y)
        if step == 2:
            loss = loss * float("inf")  # this step is skipped, on every rank
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return scaler.get_scale()

    return loop


def _averaged_copy() -> Callable[..., Any]:
    averages: dict[int, torch.optim.swa_utils.AveragedModel] = {}

    def loop(model: DataParallel, opt: torch.optim.Optimizer, x: Any, y: Any, step: int) -> Any:
        average = averages.setdefault(
            id(opt),
            torch.optim.swa_utils.AveragedModel(
                model.module, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
            ),
        )
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
        # Reads the parameters right after the step, before the next forward updates them.
        average.update_parameters(model.module)
        return [p.detach().clone() for p in average.parameters()]

    return loop


def _checkpointed(
    model: DataParallel, opt: torch.optim.Optimizer, x: Any, y: Any, step: int
) -> Any:
    opt.zero_grad()
    _loss(model, x, y).backward()
    opt.step()
    # Saved between the step and the next forward: the deferred updates belong in it.
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    state = [
        [value.clone() for _, value in sorted(per_param.items())]
        for _, per_param in sorted(saved["optimizer"]["state"].items())
    ]
    return [v.clone() for v in saved["model"].values()], state


def _accumulated(model: DataParallel, opt: torch.optim.Optimizer, x: Any, y: Any, step: int) -> Any:
    opt.zero_grad()
    with model.no_sync():
        _loss(model, x[:4], y[:4]).backward()
    _loss(model, x[4:], y[4:]).backward()
    opt.step()
    # An evaluation pass without gradients between two steps.
    with torch.no_grad():
        return model(x).sum().item()


def _two_forwards(
    model: DataParallel, opt: torch.optim.Optimizer, x: Any, y: Any, step: int
) -> Any:
    opt.zero_grad()
    loss = _loss(model, x[:4], y[:4]) + _loss(model, x[4:], y[4:])
    loss.backward()
    opt.step()
    return float(loss)


def _closure(model: DataParallel, opt: torch.optim.Optimizer, x: Any, y: Any, step: int) -> Any:
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        return loss

    return float(opt.step(closure))


def _two_optimizers(
    models: tuple[DataParallel, DataParallel],
) -> dict[str, Any]:
    optimizers = []
    for model in models:
        params = list(model.parameters())
        optimizers.append(
            (
                torch.optim.SGD(params[:3], lr=0.1, momentum=0.9),
                torch.optim.Adam(params[3:], lr=1e-2),
            )
        )
    for inputs, targets in _batches(STEPS):
        for model, (first, second) in zip(models, optimizers, strict=True):
            first.zero_grad()
            second.zero_grad()
            _loss(model, inputs, targets).backward()
            first.step()
            second.step()
    plan = models[1].plan
    return {
        "worst": _worst(models[0].module, models[1].module),
        "same_outputs": True,
        "close_outputs": True,
        "overlapped": plan is not None and plan.overlaps_forward,
        "optimizer_state": True,
    }


def _kfac(models: tuple[DataParallel, DataParallel]) -> dict[str, Any]:
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) for model in models]
    preconditioners = [KFAC(model.module, lr=0.05, damping=0.01) for model in models]
    for inputs, targets in _batches(STEPS):
        for model, opt, precond in zip(models, optimizers, preconditioners, strict=True):
            opt.zero_grad()
            _loss(model, inputs, targets).backward()
            precond.step()  # reads and rewrites every gradient before the step
            opt.step()
    plan = models[1].plan
    return {
        "worst": _worst(models[0].module, models[1].module),
        "same_outputs": True,
        "close_outputs": True,
        "overlapped": plan is not None and plan.overlaps_forward,
        "optimizer_state": True,
    }


def _scenarios(_: None) -> dict[str, dict[str, Any]]:
    adam: Callable[[nn.Module], torch.optim.Optimizer] = lambda m: torch.optim.Adam(  # noqa: E731
        m.parameters(), lr=1e-2
    )
    adamw: Callable[[nn.Module], torch.optim.Optimizer] = lambda m: torch.optim.AdamW(  # noqa: E731
        m.parameters(), lr=1e-2, weight_decay=0.1
    )
    lbfgs: Callable[[nn.Module], torch.optim.Optimizer] = lambda m: torch.optim.LBFGS(  # noqa: E731
        m.parameters(), lr=0.5, max_iter=3
    )
    return {
        "sgd, groups, set_to_none": _train(_pair(), _sgd, _plain_loop(True)),
        "adam, zeroed in place": _train(_pair(), adam, _plain_loop(False)),
        "adamw, one-cycle schedule": _train(_pair(), adamw, _plain_loop(True, scheduler=True)),
        "clip_grad_norm_": _train(_pair(), _sgd, _clipped),
        "GradScaler, a step skipped": _train(_pair(), _sgd, _scaled()),
        "EMA after the step": _train(_pair(), adam, _averaged_copy()),
        "checkpoint after the step": _train(_pair(), adam, _checkpointed),
        "no_sync and no_grad evaluation": _train(_pair(), _sgd, _accumulated),
        "two forwards, one backward": _train(_pair(), adam, _two_forwards),
        "LBFGS closure": _train(_pair(), lbfgs, _closure),
        "two optimizers": _two_optimizers(_pair()),
        "K-FAC step": _kfac(_pair()),
        # Refusals last: the message each rank gets (the tests below).
        "hook refused": raised_message(_hook_refused),
        "unknown overlap": raised_message(_bad_overlap),
    }


@pytest.fixture(scope="module")
def scenarios() -> dict[str, Any]:
    results = run_ranks(_scenarios, 2, None, timeout=280)
    assert results[0] == results[1]
    return results[0]


SCENARIOS = [
    "sgd, groups, set_to_none",
    "adam, zeroed in place",
    "adamw, one-cycle schedule",
    "clip_grad_norm_",
    "GradScaler, a step skipped",
    "EMA after the step",
    "checkpoint after the step",
    "no_sync and no_grad evaluation",
    "two forwards, one backward",
    "LBFGS closure",
    "two optimizers",
    "K-FAC step",
]


#: Code that reads pending gradients gets the averages, but torch then takes its per-tensor path
#: rather than its batched one for them (their type is not a plain tensor's): equal to rounding.
TO_ROUNDING = {"clip_grad_norm_"}


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_overlap_trains_exactly_as_without_it(scenarios: dict[str, Any], name: str) -> None:
    result = scenarios[name]
    assert result["overlapped"], f"{name}: the overlap plan was not in use"
    if name in TO_ROUNDING:
        assert result["worst"] < 1e-6, (name, result["worst"])
        assert result["close_outputs"], name
    else:
        assert result["worst"] == 0.0, (name, result["worst"])
        assert result["same_outputs"], name
    assert result["optimizer_state"] or name in TO_ROUNDING, name


def _three_ranks(_: None) -> dict[str, Any]:
    return _train(_pair(), _sgd, _plain_loop(True), steps=8)


def test_three_ranks_train_as_without_the_overlap_to_rounding() -> None:
    # Three ranks add in an order that depends on the bucket layout: equal to rounding.
    for result in run_ranks(_three_ranks, 3, None, timeout=200):
        assert result["overlapped"]
        assert result["worst"] < 1e-6


def _hook_refused() -> None:
    model = DataParallel(nn.Linear(3, 3), overlap=Overlap.FORWARD)
    model.register_comm_hook(None, lambda state, bucket: None)


def test_a_communication_hook_is_refused_with_the_overlap(scenarios: dict[str, Any]) -> None:
    # Both ranks got the same message (the fixture compares them).
    assert "cannot run on into the next forward" in scenarios["hook refused"]


def _bad_overlap() -> None:
    DataParallel(nn.Linear(3, 3), overlap="sideways")


def test_an_unknown_overlap_names_the_choices(scenarios: dict[str, Any]) -> None:
    assert "unknown overlap 'sideways'; choose one of backward" in scenarios["unknown overlap"]
    assert issubclass(UsageError, Exception)


# ---------------------------------------------------------------------------- against torch DDP


class WithUnused(nn.Module):
    """Layers wide enough for a bucket each under :data:`SPLIT`, and one that never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.unused = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        out: torch.Tensor = self.head(x)
        return out


#: A slow link and cheap start-ups: the overlap plan sends about one bucket per layer.
SPLIT = {**SETTINGS, "cost_model": CostModel(a=1e-7, b=1e-6)}


def _ddp_batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(200 + dist.get_rank())
    return [
        (torch.randn(8, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))
        for _ in range(count)
    ]


def _train_against_ddp(
    build: Callable[[], nn.Module],
    wrap: Callable[[nn.Module], nn.Module],
    steps: int = STEPS,
    *,
    compiled: bool = False,
) -> tuple[list[torch.Tensor], list[float]]:
    torch.manual_seed(0)
    wrapped = wrap(build())
    # The wrapper compiled with the default (inductor) backend, as a user would.
    model = torch.compile(wrapped) if compiled else wrapped
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for inputs, targets in _ddp_batches(steps):
        optimizer.zero_grad()
        loss = functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    if isinstance(wrapped, DataParallel):
        wrapped.synchronize()
    return [param.detach().clone() for param in model.parameters()], losses


class LateUse(nn.Module):
    """Two layers unused in the first forwards (the ones checked and profiled); later, one's
    weight is read outside it before any layer runs, and the other runs."""

    def __init__(self) -> None:
        super().__init__()
        self.borrowed = nn.Linear(12, 12)
        self.body = nn.Linear(12, 10)
        self.extra = nn.Linear(10, 10)
        self.late = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.late:
            x = x + functional.linear(x, self.borrowed.weight)
        h: torch.Tensor = torch.tanh(self.body(x))
        return self.extra(h) if self.late else h


def _late_use(model: DataParallel, opt: torch.optim.Optimizer, x: Any, y: Any, step: int) -> Any:
    model.module.late = step >= 3
    return _plain_loop(True)(model, opt, x, y, step)


def _unused_layer(_: None) -> dict[str, Any]:
    ours, our_losses = _train_against_ddp(
        WithUnused, lambda m: DataParallel(m, overlap="forward", **SPLIT)
    )
    theirs, their_losses = _train_against_ddp(
        WithUnused, lambda m: DistributedDataParallel(m, find_unused_parameters=True)
    )
    # Which buckets each layer's gate has waited for when the layer runs, in a planned step.
    torch.manual_seed(0)
    model = DataParallel(WithUnused(), overlap="forward", **SPLIT)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: dict[str, list[int]] = {}
    for name, layer in [*model.module.layers.named_children(), ("head", model.module.head)]:
        layer.register_forward_pre_hook(
            lambda _m, _i, name=name: seen.__setitem__(name, model.waited_buckets)
        )
    for inputs, targets in _ddp_batches(4):
        optimizer.zero_grad()
        functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    plan = model.plan
    return {
        "late use": _train(_pair(LateUse, SPLIT), _sgd, _late_use),
        "worst": max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True)),
        "same_losses": our_losses == their_losses,
        "overlapped": plan is not None and plan.overlaps_forward,
        "buckets": model.buckets,
        "waited": seen,
    }


@pytest.fixture(scope="module")
def unused() -> list[dict[str, Any]]:
    return run_ranks(_unused_layer, 2, None, timeout=200)


def test_a_model_with_an_unused_layer_trains_as_ddp_with_find_unused_parameters(
    unused: list[dict[str, Any]],
) -> None:
    for result in unused:
        assert result["overlapped"]
        assert result["worst"] == 0.0 and result["same_losses"]


def test_layers_unused_while_planning_and_used_later_get_their_updates_first(
    unused: list[dict[str, Any]],
) -> None:
    for result in unused:
        late = result["late use"]
        assert late["overlapped"]
        assert late["worst"] == 0.0 and late["same_outputs"], late


def test_with_an_unused_layer_each_gate_waits_for_its_own_buckets_only(
    unused: list[dict[str, Any]],
) -> None:
    for result in unused:
        buckets: list[list[str]] = result["buckets"]
        assert len(buckets) >= 3, buckets  # else there is nothing to wait for selectively
        holding: set[int] = set()
        for layer in ["0", "1", "2", "3", "head"]:
            prefix = "head." if layer == "head" else f"layers.{layer}."
            holding |= {
                number
                for number, names in enumerate(buckets)
                if any(name.startswith(prefix) for name in names)
            }
            # Up to this layer: the buckets holding its and the earlier layers' parameters.
            assert result["waited"][layer] == sorted(holding), (layer, result)
        # Not every bucket before the first layer; the unused layer's, sent last, by no gate.
        assert len(result["waited"]["0"]) < len(buckets)
        idle = [n for n, names in enumerate(buckets) if all(x.startswith("unused.") for x in names)]
        assert not set(idle) & set(result["waited"]["head"]), result


def _compiled(_: None) -> dict[str, Any]:
    wrappers: list[DataParallel] = []

    def ours(model: nn.Module) -> nn.Module:
        wrappers.append(DataParallel(model, overlap="forward", **SPLIT))
        return wrappers[-1]

    torch._dynamo.reset()
    mine, my_losses = _train_against_ddp(WithUnused, ours, compiled=True)
    torch._dynamo.reset()
    theirs, their_losses = _train_against_ddp(
        WithUnused,
        lambda m: DistributedDataParallel(m, find_unused_parameters=True),
        compiled=True,
    )
    plan = wrappers[0].plan
    return {
        "worst": max(
            float((a - b).abs().max() / b.abs().max()) for a, b in zip(mine, theirs, strict=True)
        ),
        "losses": max(abs(a - b) / abs(b) for a, b in zip(my_losses, their_losses, strict=True)),
        "overlapped": plan is not None and plan.overlaps_forward,
    }


def _inductor_available() -> bool:
    """Whether inductor can build CPU kernels here (it needs a C++ compiler)."""
    try:
        importlib.import_module("torch._inductor.cpp_builder").get_cpp_compiler()
    except Exception:  # no compiler, or an inductor without this entry point
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _inductor_available(), reason="torch.compile's inductor needs a compiler")
def test_compiled_with_inductor_the_overlap_trains_as_compiled_ddp() -> None:
    for result in run_ranks(_compiled, 2, None, timeout=280):
        assert result["overlapped"]
        assert result["worst"] < 1e-5 and result["losses"] < 1e-5, result
