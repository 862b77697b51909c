"""Record a model's simulator trace on one device: per-layer forward, gradient-ready times, step.

On a GPU every time is read from CUDA events on the stream (device time, not the host's launch
time); on a CPU from the host clock. ``interlace trace`` is the command line over it.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from interlace.cliutil import add_model_shape_arguments
from interlace.clock import Mark, StreamClock
from interlace.errors import UsageError
from interlace.profile import layer_activations, layer_forward_times
from interlace.sim.profiled import buffer_broadcast_bytes, factor_sizes, from_ready
from interlace.sim.trace import Trace
from interlace.zoo import build_model, model_shape, token_cross_entropy

Progress = Callable[[int], None]


def example_batch(
    model: nn.Module,
    batch_size: int,
    input_shape: Sequence[int],
    num_classes: int,
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random batch for ``model``: token ids where its first layer is an Embedding, else
    normal inputs; class targets, one per sample or, for a model that scores every position
    (a language model's ``[batch, tokens, vocab]``), one per position.

    Args:
        model: The model the batch is for.
        batch_size: Samples.
        input_shape: One sample's shape.
        num_classes: Classes the targets are drawn from.
        device: Where the tensors go.
        seed: The generator's seed.
    """
    generator = torch.Generator().manual_seed(seed)
    leaves = (m for m in model.modules() if not any(True for _ in m.children()))
    first = next((m for m in leaves if any(True for _ in m.parameters(False))), None)
    if isinstance(first, nn.Embedding):
        inputs = torch.randint(
            0, first.num_embeddings, (batch_size, *input_shape), generator=generator
        )
    else:
        inputs = torch.randn(batch_size, *input_shape, generator=generator)
    inputs = inputs.to(device)
    shape: tuple[int, ...] = (batch_size,)
    if isinstance(first, nn.Embedding):
        with torch.no_grad():
            shape = tuple(model(inputs[:1]).shape[1:-1])
        shape = (batch_size, *shape)
    targets = torch.randint(0, num_classes, shape, generator=generator)
    return inputs, targets.to(device)


class _Marks:
    """Every mark of one iteration: forward, per-tensor ready, backward, step."""

    def __init__(self, clock: StreamClock) -> None:
        self.clock = clock
        self.ready: dict[str, Mark] = {}
        self.points: dict[str, Mark] = {}

    def point(self, name: str) -> None:
        self.points[name] = self.clock.mark()

    def seconds(self, start: str, end: str) -> float:
        return self.clock.seconds(self.points[start], self.points[end])


def record_trace(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    name: str,
    iters: int = 20,
    warmup: int = 5,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = token_cross_entropy,
    source: str = "",
    progress: Progress | None = None,
) -> Trace:
    """Time ``iters`` training iterations of ``model`` (SGD with momentum) and return its trace.

    Each gradient's ready time is taken from the start of backward to the moment it is
    accumulated, so a layer's backward is the gap between its gradients and the previous
    layer's; times are medians over the iterations. Each layer's forward is timed afterwards by
    :func:`~interlace.profile.layer_forward_times`, on the same clock. The trace also
    holds each layer's output shape (what crosses a pipeline stage boundary) and its K-FAC factor
    sizes. The model is trained by the iterations: pass a copy to keep it.

    Args:
        model: The model, on the device to time.
        inputs: One batch of inputs, on the same device.
        targets: Its targets.
        name: The model's name in the trace.
        iters: Iterations timed.
        warmup: Iterations run first, untimed (allocator, autotuning, lazy initialisation).
        loss_fn: ``loss_fn(output, targets)`` is the loss (default: cross-entropy over every
            scored position).
        source: Where it was measured, free text (the device's name is added).
        progress: Called with 1 after each iteration, warm-up included (a progress bar).

    Raises:
        UsageError: For ``iters < 1``, ``warmup < 0`` or a model without trainable parameters.
    """
    if iters < 1 or warmup < 0:
        raise UsageError(f"need iters >= 1 and warmup >= 0, got {iters} and {warmup}")
    params = {pname: p for pname, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise UsageError("the model has no trainable parameters to trace")
    clock = StreamClock(inputs.device)
    optimizer = torch.optim.SGD(params.values(), lr=1e-3, momentum=0.9)
    marks = _Marks(clock)
    handles = _install_hooks(params, lambda: marks)
    samples: list[dict[str, Any]] = []
    model.train()
    try:
        for iteration in range(warmup + iters):
            marks = _Marks(clock)
            marks.point("start")
            loss = loss_fn(model(inputs), targets)
            marks.point("forward")
            loss.backward()
            marks.point("backward")
            optimizer.step()
            marks.point("step")
            optimizer.zero_grad(set_to_none=True)
            if iteration >= warmup:
                samples.append(_read(marks))
            if progress is not None:
                progress(1)
    finally:
        for handle in handles:
            handle.remove()
    ready = {p: statistics.median(s["ready"][p] for s in samples) for p in samples[0]["ready"]}
    order = sorted(ready, key=lambda p: ready[p])
    layer_forward = layer_forward_times(model, inputs)
    trace = from_ready(
        name,
        names=order,
        layers=[_layer_of(p) for p in order],
        numels=[params[p].numel() for p in order],
        element_bytes=[params[p].element_size() for p in order],
        ready_s=[ready[p] for p in order],
        forward_s=statistics.median(s["forward"] for s in samples),
        backward_s=statistics.median(s["backward"] for s in samples),
        step_s=statistics.median(s["step"] for s in samples),
        layer_forward_s=layer_forward,
        factors=factor_sizes(model),
        source=(source + ", " if source else "") + _device_name(inputs.device),
        notes=(
            f"recorded by interlace trace: medians of {iters} iterations after {warmup} warm-up, "
            f"times from {clock.describe()}; a layer's backward is the gap between its "
            "gradients' ready times and the previous layer's"
        ),
        broadcast_bytes=buffer_broadcast_bytes(model),
    )
    return replace(
        trace,
        activations=layer_activations(model, inputs),
        batch_size=int(inputs.shape[0]),
        input_shape=tuple(int(d) for d in inputs.shape[1:]),
    )


def _layer_of(param_name: str) -> str:
    """A parameter's layer: its owning module's name (as DataParallel's traces name it)."""
    return param_name.rpartition(".")[0] or param_name


def _install_hooks(params: dict[str, nn.Parameter], current: Callable[[], _Marks]) -> list[Any]:
    """A gradient hook on every parameter that marks its ready time in the iteration's
    :class:`_Marks`."""

    def ready(pname: str) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            marks = current()
            marks.ready[pname] = marks.clock.mark()

        return hook

    return [param.register_post_accumulate_grad_hook(ready(p)) for p, param in params.items()]


def _read(marks: _Marks) -> dict[str, Any]:
    """One iteration's seconds, read from its marks."""
    start = marks.points["forward"]
    return {
        "forward": marks.seconds("start", "forward"),
        "backward": marks.seconds("forward", "backward"),
        "step": marks.seconds("backward", "step"),
        "ready": {p: marks.clock.seconds(start, m) for p, m in marks.ready.items()},
    }


def _device_name(device: torch.device) -> str:
    """The device a trace was recorded on, as its source says."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"CPU (torch {torch.__version__}, {torch.get_num_threads()} threads)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``interlace trace``'s flags to ``parser``.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument(
        "--model",
        default="resnet20",
        help="zoo name or package.module:callable, e.g. torchvision.models:resnet50 "
        "(default resnet20)",
    )
    parser.add_argument(
        "--data",
        default="synthetic-cifar10",
        help="data set whose sample shape and classes size the model (default synthetic-cifar10)",
    )
    add_model_shape_arguments(parser, defaults_from="the --data set's")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    parser.add_argument(
        "--device",
        default="auto",
        help="device to time on: cpu, cuda, cuda:N, or auto (cuda when available; default auto)",
    )
    parser.add_argument("--iters", type=int, default=20, help="iterations timed (default 20)")
    parser.add_argument(
        "--warmup", type=int, default=5, help="iterations before timing (default 5)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and batch")
    parser.add_argument("--name", help="the model's name in the trace (default: the --model spec)")
    parser.add_argument("--out", required=True, metavar="T", help="the trace file to write (JSON)")


def run(args: argparse.Namespace) -> int:
    """Record the trace the parsed flags describe and write it.

    Args:
        args: :func:`add_arguments`'s flags, parsed.

    Returns:
        0.

    Raises:
        UsageError: for a bad setting or a device that is not there.
    """
    from tqdm import tqdm  # noqa: PLC0415 - only the command line draws a bar

    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    device = _parse_device(args.device)
    input_shape, num_classes = model_shape(args.data, args.input_shape, args.classes)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        # What a GPU user trains with: cuDNN picks the fastest kernels for these shapes.
        torch.backends.cudnn.benchmark = True
    model = build_model(args.model, tuple(input_shape), num_classes).to(device)
    inputs, targets = example_batch(
        model, args.batch_size, input_shape, num_classes, device=device, seed=args.seed
    )
    with tqdm(total=args.warmup + args.iters, desc=f"tracing {args.model}", unit="iter") as bar:
        trace = record_trace(
            model,
            inputs,
            targets,
            name=args.name or args.model,
            iters=args.iters,
            warmup=args.warmup,
            source=(
                f"interlace trace --model {args.model} --data {args.data} "
                f"--batch-size {args.batch_size}"
            ),
            progress=bar.update,
        )
    written = trace.save(args.out)
    print(f"trace: {written} ({trace.describe()})")
    print(
        f"forward {trace.forward_s * 1e3:.2f} ms, backward {trace.backward_s * 1e3:.2f} ms, "
        f"step {trace.step_s * 1e3:.2f} ms per iteration of batch {args.batch_size} on "
        f"{_device_name(device)}"
    )
    return 0


def _parse_device(text: str) -> torch.device:
    """The device ``--device`` names, checked to be there."""
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError as exc:
        raise UsageError(
            f"--device {text!r} is not a device; use cpu, cuda, cuda:N or auto"
        ) from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {text}: no CUDA GPU is visible here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {text}: only cpu and cuda are timed; use one of those")
    return device
