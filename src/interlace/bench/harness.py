"""What every benchmark and validation shares on the rank side: starting the ranks, the job every
rank is told, synthetic batches, contenders, and undilating what they measured.

A run's launches are :mod:`~interlace.bench.session`'s; the command is
:mod:`~interlace.bench.skeleton`'s.
"""

from __future__ import annotations

import dataclasses
import io
import statistics
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from interlace import launch
from interlace.cliutil import collective_timeout_of
from interlace.emulate import Compute, ComputeKind
from interlace.emulate.model import EmulatedModel, EmulatedStep
from interlace.timeline import Event
from interlace.zoo import build_model

DEFAULT_INPUT_SHAPE: tuple[int, ...] = (3, 32, 32)
NUM_CLASSES = 10

#: Per-rank batch of each zoo model on CIFAR-10 shapes (see docs/notes/bench.md for how they
#: were chosen).
DEFAULT_BATCH: dict[str, int] = {
    "mlp": 512,
    "resnet20": 8,
    "resnet32": 8,
    "resnet56": 4,
    "vgg11": 8,
    "transformer": 8,
}
#: Batch of a model not in :data:`DEFAULT_BATCH` (a user's own ``package.module:callable``).
FALLBACK_BATCH = 32

#: Distinct synthetic batches cycled through, so no contender trains on one batch only.
BATCHES = 4

#: Every contender's SGD: the same learning rate and momentum in every benchmark.
LR = 0.01
MOMENTUM = 0.9

#: Warm-up steps a plan may take to become final; one that never does is a bug, reported instead
#: of looping forever.
MAX_PLAN_STEPS = 300

#: A launch whose rank was killed by a signal is run once more: a rare SIGABRT inside gloo that
#: no rerun repeats should not cost a long benchmark a row.
SIGNAL_RETRIES = 1

#: The name launch messages carry when a caller gives none.
PROG = "interlace bench"

#: The model's own kernels: what a job computes on unless it names a trace.
REAL_COMPUTE = Compute(ComputeKind.REAL)

_T = TypeVar("_T")


class LaunchFailedError(RuntimeError):
    """A benchmark launch failed for good: the message names the rank, its traceback and the
    ranks' last lines of output (or the timeout)."""


# ================================================================================ launching


def rank_entry(fn: Callable[[_T], Any], job: _T, collective_timeout_s: float) -> Any:
    """One rank: join the gloo group from torchrun's environment, run ``fn(job)``, leave.

    Args:
        fn: The rank code; it runs on every rank and rank 0's value is the launch's.
        job: What ``fn`` measures (picklable).
        collective_timeout_s: How long one collective may wait for its peers.

    Returns:
        ``fn(job)``.
    """
    # Models that fit their batches drive gradients towards denormal floats, which run an order
    # of magnitude slower on CPUs and would slow late iterations for no reason a GPU shares.
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=collective_timeout_s))
    value = fn(job)
    # Leave together: a rank tearing its group down while a peer still finishes the last
    # collective can abort that peer.
    dist.barrier()
    dist.destroy_process_group()
    return value


def launch_on_ranks(
    fn: Callable[[_T], Any],
    job: _T,
    *,
    nprocs: int,
    link: str | None,
    timeout_s: float,
    collective_timeout_s: float | None = None,
    env: dict[str, str] | None = None,
    cache_dir: str | None = None,
    note: Callable[[str], None] = print,
    prog: str = PROG,
) -> Any:
    """Run ``fn(job)`` on ``nprocs`` gloo ranks and return rank 0's value.

    Every benchmark's launches go through here, so all of them share the one retry rule
    (:data:`SIGNAL_RETRIES`).

    Args:
        fn: The rank code (run through :func:`rank_entry`).
        job: Its argument.
        nprocs: Ranks to start.
        link: The emulated link (``"1gbit"``), or None for loopback.
        timeout_s: Seconds allowed for the whole launch (``--timeout``).
        collective_timeout_s: Seconds any one collective may wait for its peers
            (``--collective-timeout``); None: ``$INTERLACE_COLLECTIVE_TIMEOUT``, else 300.
        env: Extra environment variables for the ranks.
        cache_dir: When given, the ranks' cost-model cache folder (``INTERLACE_CACHE_DIR``).
        note: Where the retry notice goes.
        prog: The name that notice starts with.

    Returns:
        Rank 0's value of ``fn(job)``.

    Raises:
        LaunchFailedError: A rank failed (after the retry) or the launch timed out.
    """
    if cache_dir is not None:
        env = {**(env or {}), "INTERLACE_CACHE_DIR": cache_dir}
    collective = collective_timeout_of(collective_timeout_s)
    detail = ""
    for attempt in range(SIGNAL_RETRIES + 1):
        sink = io.StringIO()
        result = launch.run(
            rank_entry,
            nprocs,
            link,
            args=(fn, job, collective),
            timeout=timeout_s,
            env=env,
            output=sink,
            collective_timeout=collective,
        )
        if result.ok:
            return result.values[0]
        if result.timed_out:
            detail = f"timed out after {timeout_s:g} s (--timeout)"
        else:
            rank = result.failed_rank
            trace = result.tracebacks.get(rank, "") if rank is not None else ""
            detail = f"rank {rank} failed with status {result.returncode}\n{trace.rstrip()}"
        output = sink.getvalue().strip()
        if output:
            detail += "\n--- output of the ranks (last lines) ---\n" + "\n".join(
                output.splitlines()[-20:]
            )
        killed = result.returncode > 128 and not result.timed_out
        if not killed or attempt == SIGNAL_RETRIES:
            break
        note(f"{prog}: a rank was killed by a signal; running the launch again\n{detail}")
    raise LaunchFailedError(detail)


# ================================================================================ rank jobs


def default_batch(model: str) -> int:
    """The per-rank batch of ``model``: :data:`DEFAULT_BATCH`'s, else :data:`FALLBACK_BATCH`.

    Args:
        model: A zoo name or ``package.module:callable``.
    """
    return DEFAULT_BATCH.get(model, FALLBACK_BATCH)


@dataclass(frozen=True, kw_only=True)
class RankJob:
    """What every rank of a launch is told: the model and its data, the counts, the compute.
    Each benchmark's job adds what it alone measures.

    Args:
        model: A zoo name or ``package.module:callable``; on emulated compute it names the
            rows (the trace is the model).
        batch: Samples per batch.
        input_shape: One sample's shape.
        iters: Timed iterations (or rounds).
        warmup: Untimed iterations first.
        seed: The model and data seed.
        num_classes: Classes the model predicts.
        compute: The model's own kernels, or a trace's device time.
    """

    model: str
    batch: int
    input_shape: tuple[int, ...]
    iters: int
    warmup: int
    seed: int = 0
    num_classes: int = NUM_CLASSES
    compute: Compute = REAL_COMPUTE

    #: Whether the emulated model returns its input, so that its batches are logits of
    #: :data:`NUM_CLASSES` classes and the loss is the same cross-entropy.
    emulated_takes_logits: ClassVar[bool] = True

    def emulated_module(self, trace: str, dilation: float) -> nn.Module:
        """The model of a trace, its device times multiplied by ``dilation``.

        Args:
            trace: A shipped trace's name or a trace file.
            dilation: The time-dilation factor.
        """
        return EmulatedModel(trace, dilation)

    def module(self) -> nn.Module:
        """The model every contender copies: the zoo's (or the user's), or the trace's."""
        if self.compute.emulated:
            assert self.compute.trace is not None
            return self.emulated_module(self.compute.trace, self.compute.dilation)
        return build_model(self.model, self.input_shape, self.num_classes)

    def batches(self, stream: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The job's synthetic batches of one stream of its seed.

        Args:
            stream: The rank for per-rank data, a constant for data the same on every rank.
        """
        if self.compute.emulated and self.emulated_takes_logits:
            return synthetic_batches(self.batch, (NUM_CLASSES,), self.seed, stream)
        return synthetic_batches(
            self.batch, self.input_shape, self.seed, stream, num_classes=self.num_classes
        )


# ================================================================================ on the ranks


def max_over_ranks(samples: Sequence[float]) -> list[float]:
    """Element-wise maximum across ranks (an event ends when its slowest rank is done).

    Collective: every rank calls it with as many samples.

    Args:
        samples: This rank's samples.

    Returns:
        Each sample's maximum over ranks.
    """
    tensor = torch.tensor(list(samples), dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    values: list[float] = tensor.tolist()
    return values


def max_over_ranks_each(series: Sequence[Sequence[float]]) -> list[list[float]]:
    """:func:`max_over_ranks` of several series, in one collective.

    Args:
        series: This rank's series (every rank calls it with as many, as long).
    """
    flat = max_over_ranks([value for values in series for value in values])
    maxima, start = [], 0
    for values in series:
        maxima.append(flat[start : start + len(values)])
        start += len(values)
    return maxima


def synthetic_batches(
    batch: int,
    input_shape: Sequence[int],
    seed: int,
    stream: int,
    count: int = BATCHES,
    *,
    num_classes: int = NUM_CLASSES,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` random ``(inputs, targets)`` batches of ``num_classes`` classes.

    Args:
        batch: Samples per batch.
        input_shape: Shape of one sample.
        seed: The benchmark's seed.
        stream: Which stream of that seed: the rank for per-rank data, a constant for data that
            is the same on every rank.
        count: Batches to make.
        num_classes: Classes the targets are drawn from (the model's ``--classes``).

    Returns:
        The batches, generated once so that data loading is never timed.
    """
    generator = torch.Generator().manual_seed(seed * 1000 + stream)
    return [
        (
            torch.randn(batch, *input_shape, generator=generator),
            torch.randint(0, num_classes, (batch,), generator=generator),
        )
        for _ in range(count)
    ]


def make_optimizer(
    model: nn.Module,
    parameters: Any = None,
    *,
    lr: float = LR,
    momentum: float = MOMENTUM,
) -> torch.optim.Optimizer:
    """A contender's optimizer: SGD with momentum, or on an emulated model the traced step's
    device time (:class:`EmulatedStep`; a real step would hold a core as a GPU's does not).

    Args:
        model: The contender's own model (emulated or not).
        parameters: The parameters it owns (default ``model.parameters()``; a wrapper's are the
            same tensors).
        lr: SGD's learning rate.
        momentum: SGD's momentum.
    """
    params = model.parameters() if parameters is None else parameters
    if isinstance(model, EmulatedModel):
        return EmulatedStep(model, params)
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


@dataclass
class Contender:
    """One contender on one rank: its own wrapped copy of the model and optimizer, and the
    seconds of its timed iterations (or blocks).

    Args:
        name: What the tables call it (a strategy, mode or schedule).
        wrapper: The module it trains (a data-parallel wrapper), None where it trains otherwise.
        optimizer: Its optimizer, None where it has its own way to train.
        times: Seconds of its timed iterations, filled in by the rank code.
        warmup_steps: Untimed steps it took before its timing started.
        clip_grad_norm: Clip the gradients to this total norm between backward and the step
            (None: no clipping).
    """

    name: str
    wrapper: Any = None
    optimizer: Any = None
    times: list[float] = field(default_factory=list)
    warmup_steps: int = 0
    clip_grad_norm: float | None = None


def train_step(contender: Contender, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """One training step of ``contender``: zero the gradients, forward, cross-entropy,
    backward, the clip (when it has one), optimizer step.

    Args:
        contender: Whose wrapper and optimizer step.
        inputs: The batch's inputs.
        targets: Its class labels.
    """
    contender.optimizer.zero_grad()
    loss = functional.cross_entropy(contender.wrapper(inputs), targets)
    loss.backward()
    if contender.clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(contender.wrapper.parameters(), contender.clip_grad_norm)
    contender.optimizer.step()


def steps_until(
    final: Callable[[int], bool],
    step: Callable[[int], object],
    what: str,
    *,
    limit: int = MAX_PLAN_STEPS,
) -> int:
    """Take warm-up steps until the plans are final; the steps taken.

    Args:
        final: Whether they are, given the steps taken so far (asked before every step).
        step: One warm-up step, given its index.
        what: Whose plans, for the error.
        limit: The most steps to take.

    Raises:
        RuntimeError: When ``limit`` steps did not make them final.
    """
    steps = 0
    while not final(steps):
        if steps >= limit:
            raise RuntimeError(f"{what}: the plans were not final after {steps} warm-up steps")
        step(steps)
        steps += 1
    return steps


def rotated(items: Sequence[_T], round_index: int) -> list[_T]:
    """``items`` starting at the ``round_index``-th, so that the first one changes every round.

    Args:
        items: The contenders, in their order.
        round_index: Which round (from 0).
    """
    first = round_index % len(items) if items else 0
    return [*items[first:], *items[:first]]


def event_record(event: Event, **changes: Any) -> dict[str, Any]:
    """``event`` as a plain dict (picklable across ranks; ``Event(**record)`` rebuilds it).

    Args:
        event: A timed event.
        **changes: Fields to set otherwise (``process``, ``lane``).
    """
    return {
        "name": event.name,
        "category": event.category,
        "start_s": event.start_s,
        "end_s": event.end_s,
        "lane": event.lane,
        "process": event.process,
        "args": dict(event.args),
        **changes,
    }


def split_blocks(iters: int, rounds: int) -> list[int]:
    """``iters`` split into ``rounds`` blocks as even as possible (no empty block).

    Args:
        iters: Timed iterations in all.
        rounds: Blocks wanted (fewer when there are fewer iterations).
    """
    rounds = max(1, min(rounds, iters))
    return [iters // rounds + (1 if index < iters % rounds else 0) for index in range(rounds)]


def round_order(slots: int, round_index: int) -> list[int]:
    """The order of ``slots`` in round ``round_index``: rows of a balanced Latin square
    (Williams design).

    Over ``slots`` rounds (twice that for an odd count) every slot runs once in every position
    and right after every other slot equally often, so what a block follows cannot favour one
    contender (see docs/notes/bench.md).

    Args:
        slots: How many things take turns.
        round_index: Which round (from 0).
    """
    first = [0]
    low, high = 1, slots - 1
    while low <= high:
        first.append(low)
        low += 1
        if low <= high:
            first.append(high)
            high -= 1
    row = [(slot + round_index) % slots for slot in first]
    if slots % 2 == 1 and (round_index // slots) % 2 == 1:
        row.reverse()
    return row


# ================================================================================ measurements


def undilated(value: _T, dilation: float, keys: Collection[str] | None = None) -> _T:
    """``value`` with its times divided by ``dilation`` (itself when that is 1): every float
    in it, through lists, tuples, dicts and dataclasses; with ``keys``, only what lies under
    those keys of a dict or fields of a dataclass at the top. Ints (counts, bytes) are no times.

    Args:
        value: What a launch measured on the dilated clock.
        dilation: The run's dilation (1 for real compute).
        keys: The top-level keys or fields that hold times (None: all of them).
    """
    if dilation == 1:
        return value
    divided: _T = _divided(value, dilation, keys)
    return divided


def _divided(value: Any, factor: float, keys: Collection[str] | None = None) -> Any:
    if isinstance(value, float):
        return value / factor
    if isinstance(value, list | tuple):
        return type(value)(_divided(item, factor) for item in value)
    if isinstance(value, dict):
        return {
            key: _divided(item, factor) if keys is None or key in keys else item
            for key, item in value.items()
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(
            value,
            **{
                item.name: _divided(getattr(value, item.name), factor)
                for item in dataclasses.fields(value)
                if keys is None or item.name in keys
            },
        )
    return value


def quartiles(samples: Sequence[float]) -> tuple[float, float, float]:
    """``(p25, median, p75)`` of ``samples`` (inclusive method; one sample is all three).

    Args:
        samples: At least one value.
    """
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    q1, q2, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, q2, q3
