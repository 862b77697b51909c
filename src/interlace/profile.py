"""``interlace profile``: one training iteration of every rank, as a picture and a trace.

Rank timelines are merged into ``timeline.json`` (Chrome trace) and ``timeline.png``; with
``--trace-out`` rank 0 also returns a simulator trace of the model (:func:`trace_from_plan`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional

from interlace import launch
from interlace.cliutil import (
    add_channel_arguments,
    add_collective_timeout_argument,
    add_deprecated_alias,
    add_model_shape_arguments,
    add_nprocs_argument,
    collective_timeout_of,
    report_failure,
)
from interlace.clock import Mark, StreamClock
from interlace.comm.links import parse_link
from interlace.comm.strategies import RUNTIME_STRATEGIES
from interlace.distenv import finish_distributed, init_distributed
from interlace.dp import DataParallel
from interlace.errors import UsageError
from interlace.kfac import KFAC
from interlace.sim.profiled import trace_from_plan
from interlace.sim.trace import ActivationTrace, Trace
from interlace.timeline import Event, Timeline
from interlace.wrapping import parse_channels, wrap_model
from interlace.zoo import build_model, model_shape

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ProfileConfig:
    """What to profile: a model, its input, a strategy, and how many iterations to look at.

    Args:
        model: a zoo name or package.module:callable.
        strategy: how gradients are averaged (ddp, wfbp, fixed, single, mgwfbp or optimal).
        channels: communication channels, an integer or "auto".
        compression: fp16 or bf16 gradient buckets, or None.
        input_shape: one sample's shape.
        num_classes: classes the model predicts.
        batch_size: per-rank batch size.
        warmup: iterations before measuring.
        steps: iterations measured.
        seed: seeds the model and the synthetic batches.
        trace: also return a simulator trace from rank 0.
        optimizer: sgd, or kfac (K-FAC with kfac-pytorch's defaults before each step, drawn on a
            kfac and a kfac comm lane).
    """

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
        """Reject impossible settings.

        Raises:
            UsageError: naming the flag.
        """
        if self.batch_size < 1 or self.steps < 1 or self.warmup < 0:
            raise UsageError("--batch-size and --iters must be >= 1 and --warmup >= 0")
        if self.optimizer not in ("sgd", "kfac"):
            raise UsageError(f"--optimizer must be sgd or kfac, got {self.optimizer!r}")


@dataclass(frozen=True)
class RankProfile:
    """One rank's representative iteration and the plan it ran with.

    Args:
        rank: the rank.
        events: its representative iteration.
        iteration_s: every measured iteration's seconds.
        plan: the communication plan it ran with, described.
        step_s: its median optimizer step, seconds.
        trace: the simulator trace (rank 0, when asked for).
    """

    rank: int
    events: list[Event]
    iteration_s: list[float]
    plan: str
    #: Median optimizer step of this rank, seconds.
    step_s: float = 0.0
    #: The simulator trace (rank 0, when asked for).
    trace: Trace | None = None


def profile_rank(config: ProfileConfig) -> RankProfile:
    """Run on every rank of a launched job; returns this rank's median iteration.

    Args:
        config: what to profile.
    """
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
            trace = replace(
                trace,
                activations=layer_activations(model, inputs),
                batch_size=config.batch_size,
                input_shape=tuple(config.input_shape),
            )
        return RankProfile(context.rank, chosen, times, plan, step_s, trace)
    finally:
        finish_distributed()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``interlace profile``'s flags to ``parser``.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("--model", default="resnet20", help="zoo name or package.module:callable")
    parser.add_argument(
        "--data",
        default="synthetic-cifar10",
        help="data set whose sample shape and classes size the model (default synthetic-cifar10)",
    )
    add_model_shape_arguments(parser, defaults_from="the --data set's")
    parser.add_argument(
        "--strategy", default="mgwfbp", help="ddp, wfbp, fixed, single, mgwfbp or optimal"
    )
    add_channel_arguments(parser)
    add_nprocs_argument(parser, default=4, help_text="ranks")
    parser.add_argument("--link", help="emulated link rate per rank, e.g. 1gbit (needs root)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    parser.add_argument(
        "--iters", dest="steps", metavar="ITERS", type=int, default=10, help="iterations measured"
    )
    add_deprecated_alias(parser, "--steps", "--iters", "steps", type=int)
    parser.add_argument("--warmup", type=int, default=8, help="iterations before measuring")
    parser.add_argument(
        "--optimizer",
        choices=("sgd", "kfac"),
        default="sgd",
        help="kfac: K-FAC (kfac-pytorch's defaults) before each SGD step, drawn on its own lanes",
    )
    parser.add_argument("--out", default="profile", help="folder for timeline.json/.png")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds allowed for the whole job (default 600)",
    )
    add_collective_timeout_argument(parser)
    parser.add_argument(
        "--trace-out",
        metavar="T",
        help="also write the model's trace for `interlace simulate` (JSON) to T",
    )


def run(args: argparse.Namespace) -> int:
    """Profile the job the parsed flags describe and write its timeline (and trace).

    Args:
        args: :func:`add_arguments`'s flags, parsed.

    Returns:
        The job's exit status.

    Raises:
        UsageError: for an impossible setting or a ``--link`` the launcher cannot emulate.
    """
    if args.nprocs < 1:
        raise UsageError(f"-n must be >= 1, got {args.nprocs}")
    if args.strategy not in RUNTIME_STRATEGIES:
        raise UsageError(
            f"unknown --strategy '{args.strategy}'; choose one of {', '.join(RUNTIME_STRATEGIES)}"
        )
    if args.link is not None:
        parse_link(args.link)
    collective_timeout = collective_timeout_of(args.collective_timeout)
    input_shape, num_classes = model_shape(args.data, args.input_shape, args.classes)
    config = ProfileConfig(
        model=args.model,
        strategy=args.strategy,
        channels=parse_channels(args.channels),
        compression=args.compression,
        input_shape=tuple(input_shape),
        num_classes=num_classes,
        batch_size=args.batch_size,
        warmup=args.warmup,
        steps=args.steps,
        trace=args.trace_out is not None,
        optimizer=args.optimizer,
    )
    config.validate()
    if args.trace_out is not None and args.strategy == "ddp":
        raise UsageError(
            "--trace-out needs an interlace strategy (wfbp, fixed, single, mgwfbp or optimal): "
            "the trace comes from the profile DataParallel plans with"
        )
    build_model(config.model, config.input_shape, config.num_classes)
    result = launch.run(
        profile_rank,
        args.nprocs,
        link=args.link,
        args=(config,),
        timeout=args.timeout,
        collective_timeout=collective_timeout,
    )
    if result.returncode != 0:
        return report_failure("interlace profile", result, args.timeout)
    link = args.link or "loopback"
    title = (
        f"{config.model}, {config.strategy}, {args.nprocs} ranks, {link}, "
        f"batch {config.batch_size}/rank"
        + (f", channels {config.channels}" if config.channels != 1 else "")
        + (f", {config.compression}" if config.compression else "")
        + (", K-FAC" if config.optimizer == "kfac" else "")
    )
    timeline = merge_profiles(result.values, title)
    trace, picture = write_profile(timeline, args.out)
    for profile in sorted(result.values, key=lambda p: p.rank):
        median = sorted(profile.iteration_s)[len(profile.iteration_s) // 2]
        print(f"rank {profile.rank}: median iteration {median * 1e3:.1f} ms")
    if result.values[0].plan:
        print(result.values[0].plan)
    print(timeline.caption("rank 0"))
    print(f"timeline: {picture}\ntrace:    {trace} (open in https://ui.perfetto.dev)")
    if args.trace_out is not None:
        profiled = next(p.trace for p in result.values if p.trace is not None)
        # An optimizer step ends when the slowest rank's does.
        profiled = replace(profiled, step_s=max(p.step_s for p in result.values))
        written = profiled.save(args.trace_out)
        print(f"simulator trace: {written} ({profiled.describe()})")
    return 0


def merge_profiles(profiles: list[RankProfile], title: str) -> Timeline:
    """One timeline with a lane group per rank.

    Args:
        profiles: every rank's profile.
        title: the timeline's title.
    """
    timeline = Timeline(title=title)
    for profile in sorted(profiles, key=lambda p: p.rank):
        timeline.extend(profile.events)
    return timeline


def write_profile(timeline: Timeline, out_dir: str | Path) -> tuple[Path, Path]:
    """``timeline.json`` (Chrome trace) and ``timeline.png`` in ``out_dir``.

    Args:
        timeline: the merged timeline.
        out_dir: the folder to write (made if missing).
    """
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    trace = timeline.to_chrome_trace(folder / "timeline.json")
    picture = timeline.to_png(folder / "timeline.png")
    return trace, picture


def layer_forward_times(
    module: nn.Module, inputs: torch.Tensor, repeats: int = 3
) -> dict[str, float]:
    """Median forward seconds of every layer, timed between hooks around it on the inputs'
    device (CUDA events on a GPU, the host clock elsewhere).

    A layer is a module owning parameters with no parameter-owning module inside (a parent's
    time would count its children's); a layer called twice in a pass counts both calls. Run
    apart from the measured iterations (the hooks cost a little each), without gradients.

    Args:
        module: The model.
        inputs: A batch.
        repeats: Passes timed.
    """
    clock = StreamClock(inputs.device)
    spans: list[dict[str, list[tuple[Mark, Mark]]]] = []
    starts: dict[str, Mark] = {}
    handles = []

    def before(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: object) -> None:
            starts[name] = clock.mark()

        return hook

    def after(name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: object, _output: object) -> None:
            spans[-1].setdefault(name, []).append((starts[name], clock.mark()))

        return hook

    for name, layer in timed_layers(module).items():
        handles.append(layer.register_forward_pre_hook(before(name)))
        handles.append(layer.register_forward_hook(after(name)))
    try:
        with torch.no_grad():
            for _ in range(repeats):
                spans.append({})
                module(inputs)
    finally:
        for handle in handles:
            handle.remove()
    # Read after every pass is queued: reading a CUDA event waits for it.
    totals = [
        {name: sum(clock.seconds(a, b) for a, b in pairs) for name, pairs in one.items()}
        for one in spans
    ]
    return {name: statistics.median(t[name] for t in totals) for name in totals[0]}


def timed_layers(module: nn.Module) -> dict[str, nn.Module]:
    """The modules owning parameters with no parameter-owning module inside, by name.

    Args:
        module: The model.
    """
    timed = {}
    for name, layer in module.named_modules():
        owns = any(True for _ in layer.parameters(recurse=False))
        inner = any(
            any(True for _ in child.parameters(recurse=False))
            for child in layer.modules()
            if child is not layer
        )
        if owns and not inner:
            timed[name] = layer
    return timed


def layer_activations(module: nn.Module, inputs: torch.Tensor) -> tuple[ActivationTrace, ...]:
    """One sample's output shape of every module that owns parameters, in forward order.

    A module called more than once keeps its first output. Run without gradients, apart from
    the measured iterations.

    Args:
        module: The model.
        inputs: A batch (its first dimension is the batch).
    """
    shapes: dict[str, tuple[int, ...]] = {}
    handles = []

    def record(name: str) -> object:
        def hook(_module: nn.Module, _inputs: object, output: object) -> None:
            if isinstance(output, torch.Tensor) and output.dim() >= 1 and name not in shapes:
                shapes[name] = tuple(output.shape[1:]) or (1,)

        return hook

    for name, layer in module.named_modules():
        if any(True for _ in layer.parameters(recurse=False)):
            handles.append(layer.register_forward_hook(record(name)))
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            module(inputs)
    finally:
        module.train(was_training)
        for handle in handles:
            handle.remove()
    return tuple(ActivationTrace(name, shape) for name, shape in shapes.items())
