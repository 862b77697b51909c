"""What every benchmark shares: launching on ranks, synthetic batches, contenders, parsing.

Each benchmark is built the same way on top of this module: a job, the rank code that measures
it, rows made from what the ranks return, a table or plot of the rows, and its arguments.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.nn import functional

from interlace import launch
from interlace.cliutil import add_collective_timeout_argument, collective_timeout_of
from interlace.errors import UsageError
from interlace.launch import netem
from interlace.zoo import MODEL_NAMES

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

#: A launch whose rank was killed by a signal is run once more: a rare SIGABRT inside gloo that
#: no rerun repeats should not cost a long benchmark a row.
SIGNAL_RETRIES = 1

#: The name launch messages carry when a caller gives none.
PROG = "interlace bench"

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


def check_netem() -> None:
    """Make sure the emulated cluster can be built here.

    Raises:
        UsageError: It cannot (not root, or no iproute2); the message suggests ``--no-netem``.
    """
    netem.require("run as root, or pass --no-netem to measure on loopback")


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
    """

    name: str
    wrapper: Any = None
    optimizer: Any = None
    times: list[float] = field(default_factory=list)
    warmup_steps: int = 0


def train_step(contender: Contender, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """One training step of ``contender``: zero the gradients, forward, cross-entropy,
    backward, optimizer step.

    Args:
        contender: Whose wrapper and optimizer step.
        inputs: The batch's inputs.
        targets: Its class labels.
    """
    contender.optimizer.zero_grad()
    loss = functional.cross_entropy(contender.wrapper(inputs), targets)
    loss.backward()
    contender.optimizer.step()


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


# ================================================================================ rows


def quartiles(samples: Sequence[float]) -> tuple[float, float, float]:
    """``(p25, median, p75)`` of ``samples`` (inclusive method; one sample is all three).

    Args:
        samples: At least one value.
    """
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    q1, q2, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, q2, q3


def machine_load() -> str:
    """The 1, 5 and 15 minute load averages (``"n/a"`` where the system has none)."""
    try:
        return ", ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "n/a"


# ================================================================================ arguments


def default_batch(model: str) -> int:
    """The per-rank batch of ``model``: :data:`DEFAULT_BATCH`'s, else :data:`FALLBACK_BATCH`.

    Args:
        model: A zoo name or ``package.module:callable``.
    """
    return DEFAULT_BATCH.get(model, FALLBACK_BATCH)


def parse_ratios(text: str) -> tuple[float, ...]:
    """``"0.5,1,2"`` -> ``(0.5, 1.0, 2.0)``; every ratio must be a finite number > 0.

    Args:
        text: Comma-separated ratios (``--ratios``).

    Raises:
        UsageError: A ratio is not a number or not > 0.
    """
    ratios: list[float] = []
    for part in text.split(","):
        item = part.strip()
        try:
            value = float(item)
        except ValueError:
            raise UsageError(
                f"--ratios: {item!r} is not a number; give comma-separated communication/compute "
                "ratios such as 0.5,1,2"
            ) from None
        if not value > 0 or not math.isfinite(value):
            raise UsageError(f"--ratios: every ratio must be > 0, got {item}")
        ratios.append(value)
    return tuple(dict.fromkeys(ratios))


def parse_names(text: str, allowed: Sequence[str] | None, what: str, one: str) -> tuple[str, ...]:
    """Comma-separated names, duplicates dropped.

    Args:
        text: The flag's value.
        allowed: The names accepted, or None for any.
        what: The flag without its dashes (``"models"``), for messages.
        one: What a single item is called (``"model"``), for messages.

    Raises:
        UsageError: No name was given, or one is not in ``allowed``.
    """
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not names:
        raise UsageError(f"--{what}: name at least one")
    if allowed is not None:
        for name in names:
            if name not in allowed:
                raise UsageError(
                    f"--{what}: unknown {one} {name!r}; choose from {', '.join(allowed)}"
                )
    return names


def parse_shape(text: str) -> tuple[int, ...]:
    """``"3,32,32"`` (or ``3x32x32``) -> ``(3, 32, 32)``; every size a positive int.

    Args:
        text: The ``--input-shape`` value.

    Raises:
        UsageError: A size is not a positive integer.
    """
    parts = text.replace("x", ",").split(",")
    try:
        shape = tuple(int(part) for part in parts)
    except ValueError:
        raise UsageError(f"--input-shape: expected sizes such as 3,32,32, got {text!r}") from None
    if not shape or min(shape) < 1:
        raise UsageError(f"--input-shape: sizes must be positive, got {text!r}")
    return shape


def check_launch_args(
    args: argparse.Namespace, models: Sequence[str], *, prefix: str, ranks_reason: str
) -> None:
    """The checks every benchmark that trains on several ranks makes of its arguments: known
    models, at least two ranks, a positive ``--timeout`` and ``--collective-timeout``, and not
    both ``--link`` and ``--no-netem``.

    Args:
        args: The parsed arguments (``nprocs``, ``timeout``, ``collective_timeout``, ``link``,
            ``no_netem``).
        models: The models asked for.
        prefix: What an unknown model's message starts with (``"--models: "`` or ``""``).
        ranks_reason: Why at least two ranks are needed, for the message.

    Raises:
        UsageError: The first value that is wrong.
    """
    for model in models:
        if ":" not in model and model not in MODEL_NAMES:
            raise UsageError(
                f"{prefix}unknown model {model!r}; choose from {', '.join(MODEL_NAMES)} or give "
                "package.module:callable"
            )
    if args.nprocs < 2:
        raise UsageError(f"-n must be >= 2 ({ranks_reason}), got {args.nprocs}")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    collective_timeout_of(args.collective_timeout)
    if args.no_netem and args.link is not None:
        raise UsageError("--link and --no-netem contradict each other; give one of them")


def add_timeout_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: float
) -> None:
    """``--timeout`` (the bound on each launch) and ``--collective-timeout`` (the bound on any
    one collective in it), as every benchmark that launches ranks takes them.

    Args:
        parser: The benchmark's parser (or argument group).
        default: Seconds allowed per launch when ``--timeout`` is not given.
    """
    parser.add_argument(
        "--timeout",
        type=float,
        default=default,
        help=f"seconds allowed per launch (default {default:g})",
    )
    add_collective_timeout_argument(parser)
