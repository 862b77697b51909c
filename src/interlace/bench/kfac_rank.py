"""``interlace bench kfac``, rank side: the jobs, and the rank code that times a distributed
K-FAC iteration phase by phase (the breakdown) or the ablation's modes side by side."""

from __future__ import annotations

import copy
import resource
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional

from interlace.bench.harness import (
    Contender,
    RankJob,
    event_record,
    make_optimizer,
    max_over_ranks,
    max_over_ranks_each,
    rotated,
    steps_until,
)
from interlace.bench.kfac_peer import KfacPytorchPeer
from interlace.comm.cost import CostModel
from interlace.dp import DataParallel
from interlace.emulate.kfac import EmulatedKFACModel
from interlace.emulate.model import EmulatedLayer
from interlace.kfac import KFAC, PHASES, FactorSync
from interlace.kfac.factor_modes import FactorCommMode, Pipelined, factor_comm_from
from interlace.kfac.placements import LBP, Placement, placement_from
from interlace.timeline import Event

#: Steps every contender of a memory launch takes at least. A process's peak RSS creeps up over
#: its first steps (the allocator's pools grow), so contenders whose plans settle at once would
#: otherwise be measured earlier in that climb than those that profile first.
MEMORY_STEPS = 30

#: SPD-KFAC's ablation (``--ablation``): each mode's ``(factor_comm, fusion, placement)``, all
#: from the one :class:`interlace.KFAC`. ``dkfac`` is the baseline every speed-up is against.
ABLATION_MODES: dict[str, tuple[str, str, str]] = {
    "dkfac": ("bulk", "none", "greedy"),
    "pipelined": ("pipelined", "merged", "greedy"),
    "lbp": ("bulk", "none", "lbp"),
    "spd": ("pipelined", "merged", "lbp"),
}
BASELINE_MODE = "dkfac"
#: The mode :class:`interlace.KFAC`'s defaults select on the ablation's ranks (COMM-OPT, 2 to
#: 64 ranks): factors pipelined in merged buckets, LBP placement.
DEFAULT_MODE = "spd"
#: ``--compare kfac-pytorch`` adds this contender: kfac-pytorch's ``KFACPreconditioner`` with its
#: defaults (COMM-OPT, factors all-reduced from its hooks) and the run's update intervals.
KFAC_PYTORCH_MODE = "kfac-pytorch"


def mode_settings(mode: str) -> tuple[str, str, str]:
    """``(factor_comm, fusion, placement)`` of an ablation mode or of the compared peer.

    Args:
        mode: A key of :data:`ABLATION_MODES`, or :data:`KFAC_PYTORCH_MODE`.
    """
    if mode == KFAC_PYTORCH_MODE:
        return ("kfac-pytorch", "kfac-pytorch", "kaisa")
    return ABLATION_MODES[mode]


#: The ablation's extra column: the K-FAC model's own forward + backward (DataParallel's gradient
#: all-reduces, the factor hooks and, when pipelined, the factor all-reduces they launch).
KFAC_PASSES = ("kfac_passes", "fwd+bwd+hooks")
#: Host (this thread's CPU) seconds of a K-FAC iteration's passes, of its ``step()``, and of
#: DataParallel's passes alone (the ablation's keys).
HOST_PASSES, HOST_STEP, HOST_DATA_PARALLEL = "host_passes", "host_step", "host_data_parallel"


@dataclass(frozen=True, kw_only=True)
class KfacJob(RankJob):
    """What every rank of a K-FAC launch is told; on emulated compute the trace's K-FAC model
    trains.

    Args:
        compute_method: ``"eigen"`` or ``"inverse"``.
        factor_update_steps: Steps between factor updates.
        inv_update_steps: Steps between decompositions.
        factor_sync: When interlace's K-FAC averages factors (``KFAC(factor_sync=)``).
    """

    compute_method: str
    factor_update_steps: int = 1
    inv_update_steps: int = 1
    factor_sync: str = FactorSync.AT_DECOMPOSITION.value

    def emulated_module(self, trace: str, dilation: float) -> torch.nn.Module:
        """The trace's emulated K-FAC model (its factors' device work included).

        Args:
            trace: A shipped trace's name or a trace file.
            dilation: The time-dilation factor.
        """
        return EmulatedKFACModel(trace, dilation)


@dataclass(frozen=True, kw_only=True)
class BreakdownJob(KfacJob):
    """One configuration timed phase by phase.

    Args:
        grad_worker_fraction: 1 = COMM-OPT, 1/N = MEM-OPT, between = HYBRID.
        placement: Where decompositions are computed.
        timeline: Whether to record the last iteration's events.
    """

    grad_worker_fraction: float = 1.0
    placement: str = "greedy"
    timeline: bool = False


@dataclass(frozen=True, kw_only=True)
class AblationJob(KfacJob):
    """``modes`` side by side (an ``--ablation`` launch), or one mode alone (a memory launch).

    Args:
        modes: Keys of :data:`ABLATION_MODES`, or :data:`KFAC_PYTORCH_MODE`.
        broadcast_cost: LBP's broadcast cost model for every LBP mode (None: the first LBP
            mode measures one).
        memory_steps: Steps a memory launch takes at least (:func:`measure_memory_rank`).
    """

    modes: tuple[str, ...] = tuple(ABLATION_MODES)
    broadcast_cost: CostModel | None = None
    memory_steps: int = MEMORY_STEPS


def lbp_costs_for(model: torch.nn.Module, compute_method: str) -> dict[str, Any]:
    """LBP's decomposition cost model for an emulated model: its device's, dilated; else none
    (the preconditioner measures one).

    Args:
        model: The job's model.
        compute_method: ``"eigen"`` or ``"inverse"``.
    """
    if isinstance(model, EmulatedKFACModel):
        return {
            "decomposition_cost": model.costs.decomposition_model(compute_method, model.dilation)
        }
    return {}


def mode_policies(
    factor_comm: str, fusion: str, placement: str, lbp_costs: dict[str, Any]
) -> tuple[FactorCommMode, Placement]:
    """``KFAC``'s ``factor_comm`` and ``placement`` objects for a mode's names.

    Args:
        factor_comm: ``"bulk"`` or ``"pipelined"``.
        fusion: The pipelined buckets (ignored for bulk).
        placement: ``"greedy"``, ``"round-robin"`` or ``"lbp"``.
        lbp_costs: LBP's cost models by keyword (empty: measured at start-up).
    """
    mode = factor_comm_from(factor_comm)
    if isinstance(mode, Pipelined):
        mode = replace(mode, fusion=fusion)
    chosen = placement_from(placement)
    if isinstance(chosen, LBP):
        chosen = replace(chosen, **lbp_costs)
    return mode, chosen


def _kfac_iteration(
    contender: KfacContender, batch: tuple[torch.Tensor, torch.Tensor], passes_key: str
) -> dict[str, float]:
    """One timed K-FAC iteration behind a barrier: the preconditioner's phases, the passes
    (forward + backward, under ``passes_key``), the optimizer step, the whole iteration, and
    the host (CPU) seconds of the passes and of ``step()``."""
    inputs, targets = batch
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.thread_time()
    contender.optimizer.zero_grad()
    loss = functional.cross_entropy(contender.wrapper(inputs), targets)
    loss.backward()
    backward_end, cpu_backward_end = time.perf_counter(), time.thread_time()
    contender.precond.step()
    precond_end, cpu_precond_end = time.perf_counter(), time.thread_time()
    contender.optimizer.step()
    optimizer_end = time.perf_counter()
    # A peer that leaves collectives pending past its step waits for them here, in its time.
    finish = getattr(contender.precond, "finish", None)
    if finish is not None:
        finish()
    end = time.perf_counter()
    sample = dict(contender.precond.last_phase_s)
    sample[passes_key] = backward_end - start
    # This thread's CPU time: host work, which an emulated device (sleeping on the same
    # thread) does not overlap; collectives' own threads are left out.
    sample[HOST_PASSES] = cpu_backward_end - cpu_start
    sample[HOST_STEP] = cpu_precond_end - cpu_backward_end
    sample["optimizer"] = optimizer_end - precond_end
    sample["iteration"] = end - start
    return sample


def _passes(module: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Seconds of ``module``'s forward and backward behind a barrier (no optimizer step)."""
    return _timed_passes(module, batch)[0]


def _timed_passes(module: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """Wall and host (this thread's CPU) seconds of ``module``'s forward and backward behind
    a barrier."""
    inputs, targets = batch
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.thread_time()
    module.zero_grad()
    functional.cross_entropy(module(inputs), targets).backward()
    return time.perf_counter() - start, time.thread_time() - cpu_start


def measure_rank(job: BreakdownJob) -> dict[str, Any]:
    """One rank of a launch: warm up, time ``job.iters`` iterations, return the medians.

    Args:
        job: The model and K-FAC settings to time.
    """
    rank = dist.get_rank()
    torch.manual_seed(job.seed)
    plain = job.module()
    model = copy.deepcopy(plain)
    wrapped = DataParallel(model)
    data_parallel_only = DataParallel(copy.deepcopy(plain))
    optimizer = make_optimizer(model)
    precond = KFAC(
        wrapped,
        lr=0.01,
        compute_method=job.compute_method,
        grad_worker_fraction=job.grad_worker_fraction,
        factor_update_steps=job.factor_update_steps,
        inv_update_steps=job.inv_update_steps,
        factor_sync=job.factor_sync,
        placement=mode_policies(
            "bulk", "none", job.placement, lbp_costs_for(model, job.compute_method)
        )[1],
        # D-KFAC's phases, each after backward: the breakdown SPD-KFAC's pipelining attacks.
        factor_comm="bulk",
    )
    batches = job.batches(rank)

    contender = KfacContender("kfac", wrapped, optimizer, precond=precond)

    def kfac_iteration(step: int) -> dict[str, float]:
        return _kfac_iteration(contender, batches[step % len(batches)], "passes")

    def passes(module: Any, step: int) -> float:
        return _passes(module, batches[step % len(batches)])

    def warm_up(step: int) -> None:
        kfac_iteration(step)
        passes(data_parallel_only, step)

    step = steps_until(
        lambda taken: (
            taken >= job.warmup and wrapped.planning_done and data_parallel_only.planning_done
        ),
        warm_up,
        job.model,
    )
    precond.take_events()

    keys = [*PHASES, "passes", "optimizer", "iteration", "plain", "data_parallel"]
    samples: dict[str, list[float]] = {key: [] for key in keys}
    events: list[dict[str, Any]] = []
    for index in range(job.iters):
        last = index == job.iters - 1
        if last and job.timeline:
            wrapped.record_timeline(True)
            precond.take_events()
        sample = kfac_iteration(step + index)
        if last and job.timeline:
            events = _iteration_events(wrapped, precond, rank, sample)
        sample["plain"] = passes(plain, step + index)
        sample["data_parallel"] = passes(data_parallel_only, step + index)
        for key in keys:
            samples[key].append(sample[key])
    maxima = dict(zip(samples, max_over_ranks_each(list(samples.values())), strict=True))
    medians = {key: statistics.median(values) for key, values in maxima.items()}
    # Data parallelism's share of forward + backward: the wrapped passes beyond the plain ones.
    exposed = [
        max(0.0, wrapped_s - plain_s)
        for wrapped_s, plain_s in zip(maxima["data_parallel"], maxima["plain"], strict=True)
    ]
    medians["gradient_comm"] = statistics.median(exposed)
    medians["forward_backward"] = medians["plain"]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, events)
    return {
        "medians": medians,
        "layers": len(precond.layers),
        "events": [event for rank_events in gathered for event in rank_events],
    }


@dataclass(kw_only=True)
class KfacContender(Contender):
    """One K-FAC contender on one rank: its own copy of the model, wrapper, optimizer and
    preconditioner (an ablation mode, or the compared peer).

    Args:
        precond: Its preconditioner (:class:`interlace.KFAC` or the peer's stand-in).
    """

    precond: Any

    def settled(self) -> bool:
        """Whether every plan is final: DataParallel's buckets, and for pipelined factors the
        merged buckets (one bulk factor step, ``profile_steps`` profiled ones, then the
        bucket trials)."""
        if not getattr(self.wrapper, "planning_done", True):
            return False
        precond = self.precond
        mode = precond.factor_comm
        if not isinstance(mode, Pipelined):
            return True
        return bool(precond.factor_plan_settled)


def _contender(
    mode: str, plain: torch.nn.Module, job: AblationJob, lbp_costs: dict[str, Any]
) -> KfacContender:
    """One mode's contender on its own copy of ``plain``: interlace's ``DataParallel`` and
    ``KFAC`` in that mode, or kfac-pytorch at its defaults under torch's DDP (its users' set-up).

    Args:
        mode: A key of :data:`ABLATION_MODES`, or :data:`KFAC_PYTORCH_MODE`.
        plain: The model every contender copies.
        job: The launch's settings.
        lbp_costs: LBP's cost models, shared by the LBP modes (empty: measured anew).
    """
    model = copy.deepcopy(plain)
    if mode == KFAC_PYTORCH_MODE:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        peer = KfacPytorchPeer(
            ddp,
            factor_update_steps=job.factor_update_steps,
            inv_update_steps=job.inv_update_steps,
            compute_method=job.compute_method,
            lr=0.01,
        )
        return KfacContender(mode, ddp, make_optimizer(model), precond=peer)
    wrapped = DataParallel(model)
    factor_comm, placement = mode_policies(*ABLATION_MODES[mode], lbp_costs)
    precond = KFAC(
        wrapped,
        lr=0.01,
        compute_method=job.compute_method,
        grad_worker_fraction=1.0,
        factor_update_steps=job.factor_update_steps,
        inv_update_steps=job.inv_update_steps,
        placement=placement,
        factor_comm=factor_comm,
        factor_sync=job.factor_sync,
    )
    return KfacContender(mode, wrapped, make_optimizer(model), precond=precond)


def factor_bucket_names(precond: KFAC, model: torch.nn.Module) -> list[list[str]] | None:
    """The pipelined factor buckets ``precond`` kept, as the simulator's trace names them:
    ``"LAYER.A"`` / ``"LAYER.G"``, an emulated layer by its traced name, any other by its
    module's path (None: no pipelined buckets).

    Args:
        precond: A contender's preconditioner.
        model: The model it preconditions a copy of (the same module paths).
    """
    plan = precond.factor_plan
    if plan is None:
        return None
    modules = dict(model.named_modules())

    def traced(path: str) -> str:
        module = modules.get(path, modules.get(path.removeprefix("module.")))
        return module.name if isinstance(module, EmulatedLayer) else path

    order = precond.factor_order
    return [[f"{traced(order[i][0])}.{order[i][1]}" for i in bucket] for bucket in plan]


def peak_rss_mb() -> float:
    """This process's peak resident set so far, in MiB (``getrusage``'s ``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def measure_memory_rank(job: AblationJob) -> dict[str, Any]:
    """One rank of a memory launch: ``job.modes``' single contender alone in fresh processes,
    trained until its plans are final and then ``job.warmup`` more steps (step 0 decomposes),
    and for at least ``job.memory_steps`` steps in all, so that contenders are measured after
    as many steps.

    Peak RSS is a process's high-water mark, so each contender gets processes of its own:
    measured in the ablation's shared ones, a mode's peak would hold the others' memory.

    Args:
        job: The model and the one mode to measure.

    Returns:
        ``peak_rss_mb``: the largest peak RSS over ranks; ``base_rss_mb``: the largest peak
        over ranks before the contender was built (interpreter, torch, model, batches);
        ``added_rss_mb``: the largest per-rank difference of the two.
    """
    if len(job.modes) != 1:
        raise ValueError(f"a memory launch measures one mode, got {list(job.modes)}")
    torch.manual_seed(job.seed)
    plain = job.module()
    batches = job.batches(dist.get_rank())
    dist.barrier()
    base = peak_rss_mb()
    contender = _contender(job.modes[0], plain, job, lbp_costs_for(plain, job.compute_method))

    def step_of(step: int) -> None:
        _kfac_iteration(contender, batches[step % len(batches)], KFAC_PASSES[0])

    settled = steps_until(lambda taken: taken > 0 and contender.settled(), step_of, job.model)
    steps = max(settled + max(job.warmup, 1), job.memory_steps)
    for step in range(settled, steps):
        step_of(step)
    peak = peak_rss_mb()
    base_max, peak_max, added_max = max_over_ranks([base, peak, peak - base])
    return {
        "peak_rss_mb": peak_max,
        "base_rss_mb": base_max,
        "added_rss_mb": added_max,
        "steps": steps,
    }


def measure_ablation_rank(job: AblationJob) -> dict[str, Any]:
    """One rank of an ablation launch: every mode on its own copy of the model, interleaved.

    Every round runs one iteration of each mode (the first mode rotating from round to round),
    then the plain module's passes and DataParallel's alone, each behind a barrier.

    Args:
        job: The model and the modes to time side by side.
    """
    torch.manual_seed(job.seed)
    plain = job.module()
    data_parallel_only = DataParallel(copy.deepcopy(plain))
    contenders: list[KfacContender] = []
    lbp_costs: dict[str, Any] = lbp_costs_for(plain, job.compute_method)
    if job.broadcast_cost is not None:
        lbp_costs["broadcast_cost"] = job.broadcast_cost
    # The same order on every rank: KFAC creates process groups and measures LBP's costs with
    # collectives. The LBP modes share one measurement, so they share one placement.
    for mode in job.modes:
        contenders.append(_contender(mode, plain, job, lbp_costs))
        precond = contenders[-1].precond
        priced = isinstance(precond, KFAC) and precond.broadcast_cost is not None
        if priced and "broadcast_cost" not in lbp_costs:
            lbp_costs = {
                "decomposition_cost": precond.decomposition_cost,
                "broadcast_cost": precond.broadcast_cost,
            }
    batches = job.batches(dist.get_rank())

    def kfac_iteration(contender: KfacContender, step: int) -> dict[str, float]:
        return _kfac_iteration(contender, batches[step % len(batches)], KFAC_PASSES[0])

    def passes(module: Any, step: int) -> float:
        return _passes(module, batches[step % len(batches)])

    data_parallel_host: list[float] = []

    def one_round(step: int) -> tuple[dict[str, dict[str, float]], float, float]:
        samples = {
            contender.name: kfac_iteration(contender, step)
            for contender in rotated(contenders, step)
        }
        wall, host = _timed_passes(data_parallel_only, batches[step % len(batches)])
        data_parallel_host.append(host)
        return samples, passes(plain, step), wall

    def settled(taken: int) -> bool:
        return (
            taken > 0
            and data_parallel_only.planning_done
            and all(contender.settled() for contender in contenders)
        )

    # Warm up until every plan is final, then one more round on the final plans.
    settled_at = steps_until(settled, one_round, job.model)
    step = max(settled_at + 1, job.warmup)
    for extra in range(settled_at, step):
        one_round(extra)

    keys = [*PHASES, KFAC_PASSES[0], "optimizer", HOST_PASSES, HOST_STEP, "iteration"]
    samples: dict[str, dict[str, list[float]]] = {
        mode: {key: [] for key in keys} for mode in job.modes
    }
    plain_s: list[float] = []
    data_parallel_s: list[float] = []
    data_parallel_host.clear()
    for index in range(job.iters):
        round_samples, plain_sample, data_parallel_sample = one_round(step + index)
        for mode, sample in round_samples.items():
            for key in keys:
                samples[mode][key].append(sample[key])
        plain_s.append(plain_sample)
        data_parallel_s.append(data_parallel_sample)
    # One collective for every series: the maximum over ranks of each sample.
    series = [samples[mode][key] for mode in job.modes for key in keys]
    maxima = max_over_ranks_each([*series, plain_s, data_parallel_s, data_parallel_host])
    plain_max, data_parallel_max = maxima[-3], maxima[-2]
    data_parallel_host_s = statistics.median(maxima[-1])
    forward_backward = statistics.median(plain_max)
    # Data parallelism's share of forward + backward: the wrapped passes beyond the plain ones.
    gradient_comm = statistics.median(
        max(0.0, wrapped_s - plain_s)
        for wrapped_s, plain_s in zip(data_parallel_max, plain_max, strict=True)
    )
    medians: dict[str, dict[str, float]] = {}
    # Whole cycles of decompositions: every inv_update_steps consecutive iterations hold one.
    cycle = max(job.inv_update_steps, 1)
    whole = job.iters // cycle * cycle
    for m, mode in enumerate(job.modes):
        medians[mode] = {
            key: statistics.median(maxima[m * len(keys) + k]) for k, key in enumerate(keys)
        }
        iterations = maxima[m * len(keys) + keys.index("iteration")]
        medians[mode]["cycle_iteration"] = (
            statistics.fmean(iterations[:whole]) if whole else medians[mode]["iteration"]
        )
        # Each phase's mean over the same whole cycles (its slowest rank in each iteration).
        for k, key in enumerate(keys[:-1]):
            values = maxima[m * len(keys) + k]
            medians[mode][f"cycle_{key}"] = (
                statistics.fmean(values[:whole]) if whole else medians[mode][key]
            )
        medians[mode]["forward_backward"] = forward_backward
        medians[mode]["gradient_comm"] = gradient_comm
        medians[mode][HOST_DATA_PARALLEL] = data_parallel_host_s
    return {
        "medians": medians,
        "layers": len(contenders[0].precond.layers),
        "factor_buckets": {
            c.name: len(c.precond.factor_plan) if c.precond.factor_plan is not None else None
            for c in contenders
        },
        "local_factors": {
            c.name: sum(
                owner is None for pair in c.precond.factor_owners.values() for owner in pair
            )
            if isinstance(c.precond, KFAC) and not c.precond.placement.colocated
            else None
            for c in contenders
        },
        "factor_owners": {
            c.name: [list(pair) for pair in c.precond.factor_owners.values()]
            for c in contenders
            if c.name != KFAC_PYTORCH_MODE
        },
        "factor_tuning": {
            c.name: c.precond.factor_tuning for c in contenders if isinstance(c.precond, KFAC)
        },
        "factor_sync": {
            c.name: c.precond.factor_sync.value for c in contenders if isinstance(c.precond, KFAC)
        },
        "factor_bucket_names": {
            c.name: names
            for c in contenders
            if isinstance(c.precond, KFAC)
            and (names := factor_bucket_names(c.precond, plain)) is not None
        },
        # DataParallel's final buckets as parameter names, in launch order.
        "gradient_buckets": {
            c.name: [[plan.tensors[i].name for i in bucket.indices] for bucket in plan.buckets]
            for c in contenders
            if (plan := getattr(c.wrapper, "plan", None)) is not None
        },
    }


def _iteration_events(
    wrapped: Any, precond: Any, rank: int, sample: dict[str, float]
) -> list[dict[str, Any]]:
    """The last iteration as plain dicts (picklable): the data-parallel timeline of forward,
    backward and gradient all-reduces, then K-FAC's spans, on one time origin."""
    process = f"rank {rank}"
    timeline = wrapped.last_timeline
    events = [
        event_record(event, process=process)
        for event in (timeline.events if timeline is not None else ())
    ]
    events += [
        event_record(event, lane="kfac comm" if event.category == "comm" else "kfac")
        for event in precond.take_events(process=process, origin_s=wrapped.last_forward_start)
    ]
    end = sample["iteration"]
    step = Event("SGD step", "optimizer", end - sample["optimizer"], end, "kfac", process)
    return [*events, event_record(step)]
