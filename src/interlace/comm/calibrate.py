"""Fitting ``T(M) = a + b*M`` on the live process group, with a cache across restarts.

Every rank fits the identical model (per-size medians combined by a MAX all-reduce); rank 0
caches it by (backend, world size, link).
"""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from interlace.comm.cost import CostModel
from interlace.distenv import collective_device

DEFAULT_SIZES = (4 * 1024, 64 * 1024, 512 * 1024, 2 * 1024 * 1024, 8 * 1024 * 1024)
#: Message sizes of :func:`fit_stream_cost_model`: small ones for the start-up, larger ones for
#: the per-byte cost (the span of gradient buckets).
STREAM_SMALL_SIZES = (256, 1024, 4 * 1024, 16 * 1024, 64 * 1024)
STREAM_SIZES = (512 * 1024, 2 * 1024 * 1024)


def cache_path() -> Path:
    """Where fitted models are kept: ``$INTERLACE_CACHE_DIR`` or ``~/.cache/interlace``."""
    root = os.environ.get("INTERLACE_CACHE_DIR") or Path.home() / ".cache" / "interlace"
    return Path(root) / "cost_models.json"


def cache_key(group: dist.ProcessGroup | None = None) -> str:
    """``backend|world size|link``: what decides how fast an all-reduce is.

    Args:
        group: the group (default: the world).
    """
    backend = str(dist.get_backend(group))
    link = os.environ.get("INTERLACE_LINK", "loopback")
    return f"{backend}|{dist.get_world_size(group)}|{link}"


def time_allreduce(
    nbytes: int,
    group: dist.ProcessGroup | None = None,
    repeats: int = 5,
    warmup: int = 2,
    device: torch.device | None = None,
) -> float:
    """Median seconds of one all-reduce of ``nbytes`` (float32) on ``group``, on this rank.

    Args:
        nbytes: the message size.
        group: the group (default: the world).
        repeats: timed repetitions.
        warmup: untimed repetitions first.
        device: where the messages live (default: the CPU).
    """
    return _time_collective(
        lambda tensor: dist.all_reduce(tensor, group=group),
        nbytes,
        group,
        repeats=repeats,
        warmup=warmup,
        device=device,
    )


def time_broadcast(
    nbytes: int,
    source: int,
    group: dist.ProcessGroup | None = None,
    *,
    repeats: int = 5,
    warmup: int = 2,
    device: torch.device | None = None,
) -> float:
    """Median seconds of one broadcast of ``nbytes`` from global rank ``source``, on this rank.

    Args:
        nbytes: the message size.
        source: the global rank that sends.
        group: the group (default: the world).
        repeats: timed repetitions.
        warmup: untimed repetitions first.
        device: where the messages live (default: the CPU).
    """
    return _time_collective(
        lambda tensor: dist.broadcast(tensor, src=source, group=group),
        nbytes,
        group,
        repeats=repeats,
        warmup=warmup,
        device=device,
    )


def _time_collective(
    collective: Callable[[torch.Tensor], object],
    nbytes: int,
    group: dist.ProcessGroup | None,
    *,
    repeats: int,
    warmup: int,
    device: torch.device | None,
) -> float:
    """Median seconds of ``collective`` on ``nbytes`` of float32, all ranks started together."""
    device = device or torch.device("cpu")
    tensor = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    samples = []
    for index in range(warmup + repeats):
        dist.barrier(group)
        started = time.perf_counter()
        collective(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index >= warmup:
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def stream_sizes_up_to(total_bytes: int) -> tuple[int, ...]:
    """Message sizes for the streamed per-byte fit, from 512 KiB by fourfold steps up to
    ``total_bytes``: a shaped link lets a short message through at the wire's speed, so the
    slope is fitted over the sizes a job's buckets have.

    Args:
        total_bytes: The largest message the job sends (a model's gradients, say).
    """
    sizes = list(STREAM_SIZES)
    while sizes[-1] * 4 <= total_bytes:
        sizes.append(sizes[-1] * 4)
    if total_bytes > sizes[-1] * 1.5:
        sizes.append(total_bytes)
    return tuple(sizes)


def fit_stream_cost_model(
    group: dist.ProcessGroup | None = None,
    *,
    small_sizes: Sequence[int] = STREAM_SMALL_SIZES,
    sizes: Sequence[int] = STREAM_SIZES,
    count: int = 4,
    repeats: int = 3,
    device: torch.device | None = None,
) -> CostModel:
    """``a + b*M`` fitted on all-reduces issued back to back, as the bucket engine issues them.

    ``a`` is the median per-all-reduce time over streams of ``4 * count`` of each of
    ``small_sizes``; ``b`` is the least-squares slope through streams of ``count`` of each of
    ``sizes`` on top of it. All are maxima over ranks, so every rank gets the same model (why
    not one 4-byte all-reduce after a barrier, as :func:`fit_cost_model`: docs/notes/dp.md).

    Args:
        group: the group (default: the world).
        small_sizes: message sizes, in bytes, for the start-up.
        sizes: message sizes, in bytes, for the per-byte cost.
        count: all-reduces per stream (four times as many of the small sizes).
        repeats: timed streams per size.
        device: where the messages live (default: the CPU).
    """
    measured = torch.tensor(
        [
            time_allreduce_stream(4 * count, size, group=group, repeats=repeats, device=device)
            for size in small_sizes
        ]
        + [
            time_allreduce_stream(count, size, group=group, repeats=repeats, device=device)
            for size in sizes
        ],
        dtype=torch.float64,
        device=collective_device(group),
    )
    dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
    values = measured.tolist()
    start_up = statistics.median(values[: len(small_sizes)])
    return CostModel.fit_slope(
        start_up, [float(size) for size in sizes], values[len(small_sizes) :]
    )


def time_allreduce_stream(
    count: int,
    nbytes: int,
    *,
    group: dist.ProcessGroup | None = None,
    repeats: int = 3,
    warmup: int = 1,
    device: torch.device | None = None,
) -> float:
    """Median seconds per all-reduce when ``count`` of ``nbytes`` are issued back to back.

    The bucket engine launches its all-reduces asynchronously, one after another, without a
    barrier between them; where ranks outnumber cores each such all-reduce can cost several
    times what one after a barrier does (:func:`time_allreduce`).

    Args:
        count: all-reduces per stream.
        nbytes: the size of each.
        group: the group (default: the world).
        repeats: timed streams.
        warmup: untimed streams first.
        device: where the messages live (default: the CPU).
    """
    device = device or torch.device("cpu")
    tensors = [
        torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device) for _ in range(count)
    ]
    samples = []
    for index in range(warmup + repeats):
        dist.barrier(group)
        started = time.perf_counter()
        handles = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
        for handle in handles:
            if handle is not None:
                handle.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index >= warmup:
            samples.append((time.perf_counter() - started) / count)
    return statistics.median(samples)


def fit_cost_model(
    group: dist.ProcessGroup | None = None,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 5,
    warmup: int = 2,
    device: torch.device | None = None,
    use_cache: bool = True,
) -> CostModel:
    """Measure all-reduces on ``group`` and fit ``a + b*M``; identical on every rank.

    With ``use_cache`` a model fitted earlier for the same (backend, world size, link) is reused
    (rank 0 reads it and broadcasts it, so the ranks still agree).

    Args:
        group: the group (default: the world).
        sizes: message sizes, in bytes.
        repeats: timed repetitions.
        warmup: untimed repetitions first.
        device: where the messages live (default: the CPU).
        use_cache: reuse (and keep) the model fitted for this backend, world size and link.
    """
    key = cache_key(group)
    rank = dist.get_rank(group)
    cached: list[object] = [None]
    if use_cache and rank == 0:
        cached[0] = _read_cache().get(key)
    if use_cache:
        dist.broadcast_object_list(cached, src=_global_rank0(group), group=group)
    if cached[0] is not None:
        model = _cached_model(cached[0], key, warn=rank == 0)
        if model is not None:
            return model

    device = device or torch.device("cpu")
    # The start-up cost is what a 4-byte all-reduce takes; the per-byte cost is fitted on top.
    medians = torch.tensor(
        [time_allreduce(size, group, repeats, warmup, device) for size in (4, *sizes)],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=group)
    tiny, *rest = medians.cpu().tolist()
    model = CostModel.fit_slope(tiny, [float(size) for size in sizes], rest)
    if use_cache and rank == 0:
        _write_cache(key, model)
    return model


CONCURRENCY_BYTES = 2 * 1024 * 1024
"""Per-all-reduce size used to measure how concurrent all-reduces share the link."""


def time_concurrent_allreduce(
    nbytes: int,
    groups: Sequence[dist.ProcessGroup | None],
    repeats: int = 5,
    warmup: int = 2,
    device: torch.device | None = None,
) -> float:
    """Median seconds until ``len(groups)`` all-reduces of ``nbytes`` each, launched together one
    per group, have all finished.

    Args:
        nbytes: the size of each message.
        groups: one all-reduce on each.
        repeats: timed repetitions.
        warmup: untimed repetitions first.
        device: where the messages live (default: the CPU).
    """
    device = device or torch.device("cpu")
    tensors = [torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device) for _ in groups]
    samples = []
    for index in range(warmup + repeats):
        dist.barrier(groups[0])
        started = time.perf_counter()
        handles = [
            dist.all_reduce(tensor, group=group, async_op=True)
            for tensor, group in zip(tensors, groups, strict=True)
        ]
        for handle in handles:
            if handle is not None:
                handle.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index >= warmup:
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def fit_concurrency(
    groups: Sequence[dist.ProcessGroup | None],
    base: CostModel,
    *,
    nbytes: int = CONCURRENCY_BYTES,
    repeats: int = 5,
    warmup: int = 2,
    device: torch.device | None = None,
    use_cache: bool = True,
) -> CostModel:
    """``base`` with measured concurrency terms ``(a_j, c_j)`` for ``j = 2..len(groups)``.

    ``a_j`` is how long ``j`` concurrent 4-byte all-reduces take; ``c_j`` compares ``j``
    concurrent ``nbytes`` all-reduces with one alone, on the bandwidth part:
    ``c_j = (T_j - a_j) / (T_1 - a_1)``. Measured on the groups themselves (``groups[0]`` is the
    main group) and combined with MAX over ranks, so every rank gets the same model.

    Args:
        groups: the channels (``groups[0]`` is the main group).
        base: the one-channel model the terms are added to.
        nbytes: the message size for ``c_j``.
        repeats: timed repetitions.
        warmup: untimed repetitions first.
        device: where the messages live (default: the CPU).
        use_cache: reuse (and keep) the terms measured for this backend, world size and link.
    """
    first = groups[0]
    key = cache_key(first) + "|concurrency"
    rank = dist.get_rank(first)
    cached: list[object] = [None]
    if use_cache and rank == 0:
        cached[0] = _read_cache().get(key)
    if use_cache:
        dist.broadcast_object_list(cached, src=_global_rank0(first), group=first)
    if cached[0] is not None:
        with_terms = _cached_concurrency(cached[0], key, base, len(groups) - 1, warn=rank == 0)
        if with_terms is not None:
            return with_terms

    measured = []
    for count in range(1, len(groups) + 1):
        subset = groups[:count]
        measured.append(time_concurrent_allreduce(4, subset, repeats, warmup, device))
        measured.append(time_concurrent_allreduce(nbytes, subset, repeats, warmup, device))
    medians = torch.tensor(measured, dtype=torch.float64, device=collective_device(first))
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=first)
    values = medians.tolist()
    tiny_1, large_1 = values[0], values[1]
    alone = max(large_1 - tiny_1, 1e-12)
    terms = []
    for count in range(2, len(groups) + 1):
        tiny, large = values[2 * (count - 1)], values[2 * (count - 1) + 1]
        # Scale the start-up by what the fitted model says a lone one costs, so a_j and a agree
        # on their unit even if this measurement ran a little faster or slower.
        start_up = base.a * tiny / tiny_1 if tiny_1 > 0 else base.a
        terms.append((start_up, max(large - tiny, 1e-12) / alone))
    if use_cache and rank == 0:
        _write_entry(key, [list(term) for term in terms])
    return base.with_concurrency(terms)


def _global_rank0(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def _unusable(key: str, entry: object, why: str, warn: bool) -> None:
    """Say (on one rank) that a cached entry is ignored and measured again."""
    if warn:
        warnings.warn(
            f"cost cache {cache_path()}: entry {key!r} = {entry!r} is unusable ({why}); "
            "measuring again and replacing it",
            RuntimeWarning,
            stacklevel=3,
        )


def _cached_model(entry: object, key: str, *, warn: bool) -> CostModel | None:
    """The cached ``[a, b]`` as a model, or None (with a warning) when it is not a valid one.

    Every rank decides on the same broadcast entry, so they all measure again or none does.
    """
    if not isinstance(entry, list) or len(entry) != 2:
        _unusable(key, entry, "expected [a, b]", warn)
        return None
    try:
        return CostModel(float(entry[0]), float(entry[1]))
    except (TypeError, ValueError) as exc:  # NaN, infinity, a negative term, a string
        _unusable(key, entry, str(exc), warn)
        return None


def _cached_concurrency(
    entry: object, key: str, base: CostModel, count: int, *, warn: bool
) -> CostModel | None:
    """``base`` with the first ``count`` cached ``(a_j, c_j)``, or None when they are unusable.

    Too few terms (the cache was written for fewer channels) is not an error: measure again.
    """
    if not isinstance(entry, list):
        _unusable(key, entry, "expected a list of [a_j, c_j]", warn)
        return None
    if len(entry) < count:
        return None
    try:
        return base.with_concurrency([(float(a), float(c)) for a, c in entry[:count]])
    except (TypeError, ValueError) as exc:
        _unusable(key, entry, str(exc), warn)
        return None


def _read_cache() -> dict[str, object]:
    path = cache_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(key: str, model: CostModel) -> None:
    _write_entry(key, [model.a, model.b])


def _write_entry(key: str, value: object) -> None:
    path = cache_path()
    data = _read_cache()
    data[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(data, indent=1, sort_keys=True))
        temporary.replace(path)
    except OSError:
        # A read-only home only costs a re-measurement next time; never fail the job for it.
        pass
