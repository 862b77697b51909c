"""``interlace bench dp``, rank side: the jobs, what each rank measures, and what it returns.

Every strategy trains its own copy of the model in round-robin blocks; every sample is a
maximum over ranks.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from interlace.bench.harness import (
    NUM_CLASSES,
    Contender,
    RankJob,
    make_optimizer,
    max_over_ranks_each,
    round_order,
    split_blocks,
    steps_until,
    synthetic_batches,
    train_step,
    undilated,
)
from interlace.bench.probes import ContentionProbe, hooked_stream_sample
from interlace.comm.strategies import STRATEGIES
from interlace.emulate.model import EmulatedModel
from interlace.wrapping import wrap_model
from interlace.zoo import build_model

#: DDP rebuilds its buckets in gradient-ready order during its second iteration.
DDP_REBUILD_STEPS = 2
#: Width of ``--unused-layer``'s layer: 512 x 512 + 512 parameters, about 1 MB of gradients.
UNUSED_LAYER_FEATURES = 512


def variant_label(strategy: str, channels: int | str = 1, compression: str | None = None) -> str:
    """The name of a strategy run with ``channels`` and ``compression``: ``mgwfbp``,
    ``mgwfbp/k=auto``, ``mgwfbp/k=2/fp16``, ``ddp/fp16``.

    Args:
        strategy: The strategy's base name.
        channels: Its channel setting (an int or ``"auto"``).
        compression: Its gradient compression, or None.
    """
    label = strategy
    if channels != 1:
        label += f"/k={channels}"
    if compression is not None:
        label += f"/{compression}"
    return label


def parse_variant(label: str) -> tuple[str, int | str, str | None]:
    """``(strategy, channels, compression)`` of a :func:`variant_label`.

    Args:
        label: A name :func:`variant_label` made.
    """
    strategy, *options = label.split("/")
    channels: int | str = 1
    compression = None
    for option in options:
        if option.startswith("k="):
            value = option[2:]
            channels = value if value == "auto" else int(value)
        else:
            compression = option
    return strategy, channels, compression


@dataclass(frozen=True)
class CalibrationJob:
    """Measure compute and all-reduce times of ``models`` (one per-rank batch each)."""

    models: tuple[str, ...]
    batches: tuple[int, ...]
    input_shape: tuple[int, ...]
    seed: int = 0
    iters: int = 5
    warmup: int = 2
    num_classes: int = NUM_CLASSES


@dataclass(frozen=True)
class Calibration:
    """One model's compute time per iteration and all-reduce times at the calibration link."""

    model: str
    compute_s: float
    allreduce_s: float
    latency_s: float


@dataclass(frozen=True, kw_only=True)
class MeasureJob(RankJob):
    """Time ``strategies`` on ``model`` in round-robin blocks after a warm-up.

    Args:
        strategies: The strategies' variant labels (:func:`variant_label`).
        rounds: Round-robin blocks the timed iterations are split into.
        probe_contention: Also take the simulator's contention probes
            (:mod:`interlace.sim.contention`) in every round: the start-up and synchronisation
            probes as a block of their own, the bytes probe in the reference slot.
        clip_grad_norm: Every strategy clips its gradients to this total norm before its step
            (None: no clipping).
        probe_stream: Also time, in every round's reference slot, a plain iteration whose
            backward's hooks issue one all-reduce per gradient tensor, each of its size: the
            stream per-tensor WFBP issues, as it issues it.
    """

    strategies: tuple[str, ...]
    rounds: int
    probe_contention: bool = False
    clip_grad_norm: float | None = None
    unused_layer: bool = False
    probe_stream: bool = False

    def module(self) -> nn.Module:
        """The model, with :data:`UNUSED_LAYER_FEATURES` square layer its forward never calls
        when ``unused_layer`` is set (DDP then runs with ``find_unused_parameters=True``)."""
        model = super().module()
        if self.unused_layer:
            model.add_module(
                "unused_layer", nn.Linear(UNUSED_LAYER_FEATURES, UNUSED_LAYER_FEATURES)
            )
        return model


@dataclass(frozen=True)
class StrategySamples:
    """What one strategy's ranks measured in one launch."""

    strategy: str
    #: Seconds per timed iteration, each the maximum over ranks.
    iteration_s: list[float]
    #: Buckets per iteration (DDP's from its logging data), None where unknown.
    buckets: int | None
    warmup_steps: int
    #: DataParallel's predicted iteration time (without the step) and its cost model.
    predicted_s: float | None = None
    cost_a: float | None = None
    cost_b: float | None = None
    plan: str | None = None
    #: Channels the plan uses (``channels="auto"``: the ones it chose) and why.
    chosen_channels: int | None = None
    channel_choice: str | None = None
    #: The final plan's buckets as tensor names, in launch order (DataParallel only), and what
    #: its trials of candidate plans measured.
    bucket_tensors: list[list[str]] | None = None
    tuning: str | None = None
    #: Slices each bucket of the final plan was sent in (DataParallel only).
    bucket_parts: list[int] | None = None
    #: CPU seconds of every rank's process (all its threads, kernel time included) per timed
    #: iteration, summed over ranks: the host work the emulated device time does not cover.
    host_cpu_s: list[float] | None = None


@dataclass(frozen=True)
class Measurement:
    """Everything one (model, link) launch measured; per-sample values are maxima over ranks."""

    model: str
    batch: int
    ranks: int
    gradient_bytes: int
    tensors: int
    strategies: list[StrategySamples]
    forward_s: list[float]
    backward_s: list[float]
    step_s: list[float]
    allreduce_s: list[float]
    #: Iterations of the plain module with one all-reduce of all gradients running alongside
    #: backward (see :func:`_overlapped_sample`); empty when not measured.
    overlapped_s: list[float] = field(default_factory=list)
    #: The simulator's contention probes (a :class:`interlace.sim.contention.ContentionSamples`)
    #: when the job asked for them.
    contention: Any = None
    #: Seconds of an all-reduce of one float (the rate-independent start-up), per round's
    #: reference iteration; empty when not measured.
    latency_s: list[float] = field(default_factory=list)
    #: Seconds from backward's start to the end of the gradient stream
    #: (:attr:`MeasureJob.probe_stream`), per round's reference iteration; empty when not
    #: measured.
    stream_s: list[float] = field(default_factory=list)
    #: :meth:`Compute.label` of what the ranks computed on, and its dilation: every time above is
    #: as measured, on the dilated clock.
    compute: str = "real"
    dilation: float = 1.0
    #: Emulated compute: the trace's forward and backward device time (dilated), seconds.
    device_forward_s: float | None = None
    device_backward_s: float | None = None
    #: The cores the ranks could run on (their CPU affinity), for the host's share of them.
    cores: int = 0

    #: The fields that hold times (every float of the strategies' samples is one).
    TIMES: ClassVar[tuple[str, ...]] = (
        "strategies",
        "forward_s",
        "backward_s",
        "step_s",
        "allreduce_s",
        "overlapped_s",
        "latency_s",
        "stream_s",
        "device_forward_s",
        "device_backward_s",
    )

    def undilated(self) -> Measurement:
        """This measurement with every time divided by its dilation (itself when that is 1)."""
        return replace(undilated(self, self.dilation, self.TIMES), dilation=1.0)


def _compute_sample(
    model: Any, optimizer: Any, inputs: Any, targets: Any
) -> tuple[float, float, float]:
    """Forward, backward and step seconds of the plain module, started together on all ranks."""
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad()
    loss = functional.cross_entropy(model(inputs), targets)
    forward_end = time.perf_counter()
    loss.backward()
    backward_end = time.perf_counter()
    optimizer.step()
    return forward_end - start, backward_end - forward_end, time.perf_counter() - backward_end


def _overlapped_sample(
    model: Any, optimizer: Any, inputs: Any, targets: Any, flat: Any
) -> tuple[float, float, float]:
    """One plain iteration with an all-reduce of ``flat`` (all gradients' bytes) launched as
    backward starts and awaited before the step: seconds of the iteration, of its backward, and
    from backward's start to the all-reduce's end.

    The ideal-overlap bound assumes communication costs compute nothing. On a CPU that is false:
    gloo and the kernel's network stack run on the cores the ranks compute on. This is the
    ideal overlap as the machine can actually run it (every byte sendable from the start of
    backward, one start-up), so a strategy's distance from it is the strategy's own doing. The
    simulator's contention calibration reads the other two times.
    """
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad()
    loss = functional.cross_entropy(model(inputs), targets)
    backward_start = time.perf_counter()
    handle = dist.all_reduce(flat, async_op=True)
    ends = record_completion(handle)
    loss.backward()
    backward_end = time.perf_counter()
    if handle is not None:
        handle.wait()
    comm_end = ends[0] if ends else time.perf_counter()
    optimizer.step()
    return (
        time.perf_counter() - start,
        backward_end - backward_start,
        comm_end - backward_start,
    )


def settle(wrapper: Any) -> None:
    """Wait for what a wrapper still has in flight (DataParallel with ``overlap="forward"``).

    Args:
        wrapper: A data-parallel wrapper.
    """
    synchronize = getattr(wrapper, "synchronize", None)
    if callable(synchronize):
        synchronize()


def record_completion(handle: Any) -> list[float]:
    """A list that receives ``time.perf_counter()`` when the async collective ``handle``
    completes (empty until then; stays empty for a None handle).

    Read after waiting on it, the time is the collective's own end, which may lie before the
    wait: an end read when a wait after backward returns is never earlier than backward's.

    Args:
        handle: An async collective's work handle, or None.
    """
    ends: list[float] = []
    if handle is not None:
        # The callback runs on the backend's thread as the collective completes.
        handle.get_future().then(lambda _future: ends.append(time.perf_counter()))
    return ends


def _allreduce_sample(flat: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(flat)
    return time.perf_counter() - start


def _flat_gradients(model: Any) -> Any:
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return torch.zeros(numel, dtype=torch.float32)


def calibrate_rank(job: CalibrationJob) -> list[Calibration]:
    """Per model: median compute time per iteration, all-reduce of all gradients, tiny
    all-reduce (the rate-independent part); every sample is a maximum over ranks.

    Args:
        job: The models and batches to calibrate.
    """

    rank = dist.get_rank()
    results = []
    for name, batch in zip(job.models, job.batches, strict=True):
        torch.manual_seed(job.seed)
        model = build_model(name, job.input_shape, job.num_classes)
        optimizer = make_optimizer(model)
        batches = synthetic_batches(
            batch, job.input_shape, job.seed, rank, num_classes=job.num_classes
        )
        computes = []
        for index in range(job.warmup + job.iters):
            sample = _compute_sample(model, optimizer, *batches[index % len(batches)])
            if index >= job.warmup:
                computes.append(sum(sample))
        flat = _flat_gradients(model)
        _allreduce_sample(flat)
        allreduces = [_allreduce_sample(flat) for _ in range(job.iters)]
        tiny = torch.zeros(1)
        for _ in range(2):
            _allreduce_sample(tiny)
        latencies = [_allreduce_sample(tiny) for _ in range(2 * job.iters)]
        maxima = max_over_ranks_each([computes, allreduces, latencies])
        results.append(Calibration(name, *(statistics.median(values) for values in maxima)))
    return results


def _wrap(model: Any, label: str, unused: bool = False) -> Any:
    """The wrapper of ``model`` a :func:`variant_label` names; DDP with its own defaults (1 MB
    first bucket), and ``find_unused_parameters`` where the model has an ``unused`` layer."""

    strategy, channels, compression = parse_variant(label)
    return wrap_model(
        model,
        strategy,
        channels=channels,
        compression=compression,
        find_unused_parameters=unused,
    )


def _is_final(contender: Contender, steps: int) -> bool:
    """Whether the wrapper's buckets are what it will use from now on."""
    if STRATEGIES[parse_variant(contender.name)[0]].torch_wrapper is not None:
        return steps >= DDP_REBUILD_STEPS
    return bool(getattr(contender.wrapper, "planning_done", False))


def _warm_up(contender: Contender, next_batch: Callable[[], tuple[Any, Any]], warmup: int) -> None:
    """Train ``contender`` until its buckets are final, then ``warmup`` more steps."""
    steps = steps_until(
        lambda taken: _is_final(contender, taken),
        lambda _: train_step(contender, *next_batch()),
        contender.name,
    )
    for _ in range(warmup):
        train_step(contender, *next_batch())
    settle(contender.wrapper)
    contender.warmup_steps = steps + warmup


def _ddp_buckets(wrapper: Any) -> int | None:
    """DDP's bucket count after its rebuild, from its logging data (a private API: None if it
    is missing or changed)."""
    try:
        data = wrapper._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
    except Exception:
        return None
    if not isinstance(sizes, str) or not sizes.strip():
        return None
    return len(sizes.split(","))


def measure_rank(job: MeasureJob) -> Measurement:
    """Warm every strategy up, then time them all in round-robin blocks (a new order every
    round), with the plain module's compute and the all-reduce of all gradients measured in the
    same rounds.

    Args:
        job: The model, strategies and rounds to time.
    """

    rank = dist.get_rank()
    emulated = job.compute.emulated
    if emulated:
        # The cores belong to communication; an intra-op pool would spin through the sleeps.
        torch.set_num_threads(1)
    batches = job.batches(rank)
    contenders = []
    for strategy in job.strategies:
        torch.manual_seed(job.seed)
        model = job.module()
        wrapper = _wrap(model, strategy, job.unused_layer)
        optimizer = make_optimizer(model, wrapper.parameters())
        contenders.append(
            Contender(strategy, wrapper, optimizer, clip_grad_norm=job.clip_grad_norm)
        )
    torch.manual_seed(job.seed)
    plain = job.module()
    plain_optimizer = make_optimizer(plain)
    flat = _flat_gradients(plain)
    # On emulated compute nothing contends for the cores, so the contended bound is not taken
    # (and its second copy of every gradient, 440 MB a rank on BERT-base, is not allocated).
    contended = not emulated
    alongside = _flat_gradients(plain) if contended else flat
    tiny = torch.zeros(1)
    # Backward produces the gradients last layer first.
    stream = (
        {id(p): torch.zeros_like(p) for p in plain.parameters() if p.requires_grad}
        if job.probe_stream
        else {}
    )

    counter = 0

    def next_batch() -> tuple[Any, Any]:
        nonlocal counter
        counter += 1
        return batches[counter % len(batches)]

    for contender in contenders:
        _warm_up(contender, next_batch, job.warmup)
    for _ in range(max(job.warmup, 1)):
        _compute_sample(plain, plain_optimizer, *next_batch())
    _allreduce_sample(flat)
    _allreduce_sample(tiny)
    if contended:
        _overlapped_sample(plain, plain_optimizer, *next_batch(), alongside)

    probe = ContentionProbe(plain, plain_optimizer, flat) if job.probe_contention else None

    forwards: list[float] = []
    backwards: list[float] = []
    steps_s: list[float] = []
    allreduces: list[float] = []
    latencies: list[float] = []
    streams: list[float] = []
    overlapped: list[float] = []
    host_cpu: dict[str, list[float]] = {contender.name: [] for contender in contenders}
    # None: the reference measurements; the probe: its own block, timed like a strategy's.
    slots: list[Contender | ContentionProbe | None] = [*contenders, None]
    if probe is not None:
        slots.append(probe)
    for round_index, block in enumerate(split_blocks(job.iters, job.rounds)):
        # A new order every round, so no strategy always runs first or after the same one.
        for slot in (slots[index] for index in round_order(len(slots), round_index)):
            if isinstance(slot, ContentionProbe):
                slot.block(block, next_batch)
                continue
            if slot is None:
                for _ in range(block):
                    forward_s, backward_s, step_s = _compute_sample(
                        plain, plain_optimizer, *next_batch()
                    )
                    forwards.append(forward_s)
                    backwards.append(backward_s)
                    steps_s.append(step_s)
                    allreduces.append(_allreduce_sample(flat))
                    latencies.append(_allreduce_sample(tiny))
                    if stream:
                        streams.append(
                            hooked_stream_sample(plain, plain_optimizer, *next_batch(), stream)
                        )
                    if not contended:
                        continue
                    iteration_s, overlapped_backward_s, overlapped_done_s = _overlapped_sample(
                        plain, plain_optimizer, *next_batch(), alongside
                    )
                    overlapped.append(iteration_s)
                    if probe is not None:
                        probe.add_bulk(overlapped_backward_s, overlapped_done_s)
                continue
            dist.barrier()
            # One untimed step first: a strategy whose all-reduces run on into the next forward
            # is then timed in its steady state, each step waiting for the one before.
            train_step(slot, *next_batch())
            for _ in range(block):
                inputs, targets = next_batch()
                cpu_start = time.process_time()
                start = time.perf_counter()
                train_step(slot, inputs, targets)
                slot.times.append(time.perf_counter() - start)
                host_cpu[slot.name].append(time.process_time() - cpu_start)
            # The next contender starts on an idle network.
            settle(slot.wrapper)

    # One collective for every series: the maximum over ranks of each sample.
    iterations = [contender.times for contender in contenders]
    measured = [forwards, backwards, steps_s, allreduces, overlapped, latencies, streams]
    maxima = max_over_ranks_each([*iterations, *measured])
    cpu_sums = _sum_over_ranks([host_cpu[contender.name] for contender in contenders])
    samples = []
    for contender, slowest, cpu in zip(
        contenders, maxima[: len(contenders)], cpu_sums, strict=True
    ):
        plan = getattr(contender.wrapper, "plan", None)
        cost = getattr(contender.wrapper, "cost_model", None)
        samples.append(
            StrategySamples(
                strategy=contender.name,
                iteration_s=slowest,
                buckets=(_ddp_buckets(contender.wrapper) if plan is None else len(plan.buckets)),
                warmup_steps=contender.warmup_steps,
                predicted_s=None if plan is None else plan.predicted_s,
                cost_a=None if cost is None else cost.a,
                cost_b=None if cost is None else cost.b,
                plan=(
                    plan.describe()
                    if plan is not None
                    and parse_variant(contender.name)[0] in ("mgwfbp", "overlap")
                    else None
                ),
                chosen_channels=None if plan is None else plan.channels,
                channel_choice=getattr(contender.wrapper, "channel_choice", None) or None,
                bucket_tensors=(
                    None
                    if plan is None
                    else [[plan.tensors[i].name for i in bucket.indices] for bucket in plan.buckets]
                ),
                tuning=getattr(contender.wrapper, "tuning_summary", None) or None,
                host_cpu_s=cpu,
                bucket_parts=None if plan is None else _bucket_parts(plan),
            )
        )
    forwards, backwards, steps_s, allreduces, overlapped, latencies, streams = maxima[
        len(contenders) :
    ]
    layers = plain.emulated_layers() if isinstance(plain, EmulatedModel) else None
    return Measurement(
        model=job.model,
        batch=job.batch,
        ranks=dist.get_world_size(),
        gradient_bytes=flat.numel() * flat.element_size(),
        tensors=sum(1 for p in plain.parameters() if p.requires_grad),
        strategies=samples,
        forward_s=forwards,
        backward_s=backwards,
        step_s=steps_s,
        allreduce_s=allreduces,
        overlapped_s=overlapped,
        contention=None if probe is None else probe.finish(),
        latency_s=latencies,
        stream_s=streams,
        compute=job.compute.label(),
        dilation=job.compute.dilation,
        device_forward_s=None if layers is None else sum(layer.forward_s for layer in layers),
        device_backward_s=None if layers is None else sum(layer.backward_s for layer in layers),
        cores=len(os.sched_getaffinity(0)),
    )


def _bucket_parts(plan: Any) -> list[int]:
    """How many slices each of ``plan``'s buckets is sent in."""
    parts = [0] * len(plan.buckets)
    for launch in plan.launches:
        parts[launch.bucket] += 1
    return parts


def _sum_over_ranks(series: list[list[float]]) -> list[list[float]]:
    """Each sample of each series summed over ranks, in one collective (every rank calls it
    with series as long)."""
    flat = torch.tensor([value for values in series for value in values], dtype=torch.float64)
    dist.all_reduce(flat)
    sums, start = [], 0
    for values in series:
        sums.append(flat[start : start + len(values)].tolist())
        start += len(values)
    return sums
