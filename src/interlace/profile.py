"""``interlace profile``: one training iteration of every rank, as a picture and a trace.

Each rank trains a few iterations on synthetic batches of the model's input shape with the chosen
strategy, records its timeline (forward, per-tensor backward, each bucket's all-reduce, the
optimizer step), and returns the iteration whose length is the median of the measured ones. The
launching process merges the ranks into one :class:`~interlace.timeline.Timeline` and writes
``timeline.json`` (Chrome trace: open it in https://ui.perfetto.dev) and ``timeline.png``.

With ``trace=True`` (``interlace profile --trace-out T``) rank 0 also returns a simulator
:class:`~interlace.sim.trace.Trace` of the model (:func:`trace_from_plan`): the ready times,
forward and backward times DataParallel measured to plan its buckets (communication held to the
end of backward, the slowest rank's medians), per-layer forward times from forward hooks, the
optimizer step, and the K-FAC factor sizes of every Linear and Conv2d layer.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn import functional

from interlace.distenv import init_distributed
from interlace.errors import UsageError
from interlace.sim.profiled import trace_from_plan
from interlace.timeline import Event, Timeline

if TYPE_CHECKING:
    from torch import nn

    from interlace.sim.trace import Trace


@dataclass(frozen=True)
class ProfileConfig:
    """What to profile: a model, its input, a strategy, and how many iterations to look at."""

    model: str = "resnet20"
    strategy: str = "mgwfbp"
    channels: int | str = 1
    compression: str | None = None
    input_shape: tuple[int, ...] = (3, 32, 32)
    num_classes: int = 10
    batch_size: int = 32
    warmup: int = 8
    steps: int = 10
    seed: int = 0
    trace: bool = False
    #: ``sgd``, or ``kfac``: :class:`interlace.KFAC` (kfac-pytorch's defaults) before each step,
    #: its phases drawn on a ``kfac`` and a ``kfac comm`` lane.
    optimizer: str = "sgd"

    def validate(self) -> None:
        if self.batch_size < 1 or self.steps < 1 or self.warmup < 0:
            raise UsageError("--batch-size and --steps must be >= 1 and --warmup >= 0")
        if self.optimizer not in ("sgd", "kfac"):
            raise UsageError(f"--optimizer must be sgd or kfac, got {self.optimizer!r}")


@dataclass(frozen=True)
class RankProfile:
    """One rank's representative iteration and the plan it ran with."""

    rank: int
    events: list[Event]
    iteration_s: list[float]
    plan: str
    #: Median optimizer step of this rank, seconds.
    step_s: float = 0.0
    #: The simulator trace (rank 0, when asked for).
    trace: Trace | None = None


def profile_rank(config: ProfileConfig) -> RankProfile:
    """Run on every rank of a launched job; returns this rank's median iteration."""
    from interlace.dp import DataParallel
    from interlace.kfac import KFAC
    from interlace.strategies import wrap_model
    from interlace.zoo import build_model

    config.validate()
    context = init_distributed()
    try:
        torch.manual_seed(config.seed)
        model = build_model(config.model, config.input_shape, config.num_classes)
        model = model.to(context.device)
        wrapped = wrap_model(
            model,
            config.strategy,
            device=context.device,
            channels=config.channels,
            compression=config.compression,
        )
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9)
        generator = torch.Generator().manual_seed(config.seed + context.rank)
        inputs = torch.randn(config.batch_size, *config.input_shape, generator=generator)
        targets = torch.randint(0, config.num_classes, (config.batch_size,), generator=generator)
        inputs, targets = inputs.to(context.device), targets.to(context.device)
        ours = wrapped if isinstance(wrapped, DataParallel) else None
        precond = KFAC(wrapped, lr=0.01) if config.optimizer == "kfac" else None

        def step() -> tuple[float, float, float, float, float]:
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = functional.cross_entropy(wrapped(inputs), targets)
            forward_end = time.perf_counter()
            loss.backward()
            backward_end = time.perf_counter()
            if precond is not None:
                precond.step()
            optimizer_start = time.perf_counter()
            optimizer.step()
            return started, forward_end, backward_end, optimizer_start, time.perf_counter()

        for _ in range(config.warmup):
            step()
        while ours is not None and not ours.planning_done:
            step()
        if ours is not None:
            ours.record_timeline()
        measured: list[tuple[float, list[Event]]] = []
        steps: list[float] = []
        for _ in range(config.steps):
            started, forward_end, backward_end, optimizer_start, ended = step()
            steps.append(ended - optimizer_start)
            if ours is not None and ours.last_timeline is not None:
                events = list(ours.last_timeline.events)
                # DataParallel's times count from its forward start, which follows `started`.
                offset = ours.last_forward_start - started
                events = [
                    replace(e, start_s=e.start_s + offset, end_s=e.end_s + offset) for e in events
                ]
            else:
                # torch DDP's all-reduces run inside its C++ reducer, out of our sight.
                events = [
                    Event("forward", "forward", 0.0, forward_end - started, lane="compute"),
                    Event(
                        "backward + DDP all-reduce",
                        "backward",
                        forward_end - started,
                        backward_end - started,
                        lane="compute",
                    ),
                ]
            if precond is not None:
                # K-FAC's hook work ran inside forward and backward; its step follows backward.
                events += [
                    replace(event, lane="kfac comm" if event.category == "comm" else "kfac")
                    for event in precond.take_events(origin_s=started)
                ]
            events.append(
                Event(
                    "optimizer step",
                    "optimizer",
                    optimizer_start - started,
                    ended - started,
                    lane="compute",
                )
            )
            measured.append((ended - started, events))
        times = [seconds for seconds, _ in measured]
        median = statistics.median(times)
        _, chosen = min(measured, key=lambda item: abs(item[0] - median))
        process = f"rank {context.rank}"
        chosen = [replace(event, process=process) for event in chosen]
        plan = ours.plan.describe() if ours is not None and ours.plan else ""
        if precond is not None:
            plan += "\n" + precond.describe().splitlines()[0]
        if ours is not None and ours.tuning_summary:
            plan += "\n" + ours.tuning_summary
        step_s = statistics.median(steps)
        trace = None
        if config.trace and context.rank == 0:
            if ours is None or ours.plan is None:
                raise UsageError("a trace needs an interlace strategy (not ddp) to profile with")
            trace = trace_from_plan(
                ours.plan,
                model,
                config.model,
                step_s=step_s,
                layer_forward_s=layer_forward_times(model, inputs),
                workers=context.world_size,
                source=f"interlace profile, {context.world_size} ranks, {config.strategy}",
            )
        return RankProfile(context.rank, chosen, times, plan, step_s, trace)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def merge_profiles(profiles: list[RankProfile], title: str) -> Timeline:
    """One timeline with a lane group per rank."""
    timeline = Timeline(title=title)
    for profile in sorted(profiles, key=lambda p: p.rank):
        timeline.extend(profile.events)
    return timeline


def write_profile(timeline: Timeline, out_dir: str | Path) -> tuple[Path, Path]:
    """``timeline.json`` (Chrome trace) and ``timeline.png`` in ``out_dir``."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    trace = timeline.to_chrome_trace(folder / "timeline.json")
    picture = timeline.to_png(folder / "timeline.png")
    return trace, picture


def layer_forward_times(
    module: nn.Module, inputs: torch.Tensor, repeats: int = 3
) -> dict[str, float]:
    """Median forward seconds of every module that owns parameters, timed with hooks.

    Run apart from the measured iterations (the hooks cost a little each), without gradients.
    """
    starts: dict[str, float] = {}
    samples: dict[str, list[float]] = {}
    handles = []

    def before(name: str) -> object:
        def hook(_module: nn.Module, _inputs: object) -> None:
            starts[name] = time.perf_counter()

        return hook

    def after(name: str) -> object:
        def hook(_module: nn.Module, _inputs: object, _output: object) -> None:
            samples.setdefault(name, []).append(time.perf_counter() - starts[name])

        return hook

    for name, layer in module.named_modules():
        if any(True for _ in layer.parameters(recurse=False)):
            handles.append(layer.register_forward_pre_hook(before(name)))
            handles.append(layer.register_forward_hook(after(name)))
    try:
        with torch.no_grad():
            for _ in range(repeats):
                module(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return {name: statistics.median(values) for name, values in samples.items()}
