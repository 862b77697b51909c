"""The data-parallel strategies by name: one table for DataParallel, training and the simulator.

A name (``mgwfbp``, ``fixed``, ``overlap``, ...) stands for a bucket planner and its arguments;
``ddp``, ``ddp-50mb``, ``ddp-100mb`` and ``fsdp2`` are torch's own wrappers, which the runtime
runs but does not plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import Overlap, overlap_candidates
from interlace.comm.plan import MIB, Bucketing, Gate, Plan, ReadyTensor
from interlace.comm.planners import make_plan
from interlace.errors import UsageError

#: Other names DataParallel accepts for a bucketing: the strategies' names and the papers'.
BUCKETING_ALIASES: dict[str, Bucketing] = {
    "mgwfbp": Bucketing.MERGED,
    "wfbp": Bucketing.PER_TENSOR,
    "syncesgd": Bucketing.SINGLE,
    "synceasgd": Bucketing.SINGLE,
}


def bucketing_named(name: Bucketing | str) -> Bucketing:
    """The bucketing ``name`` stands for: a :class:`Bucketing`, its string or an alias.

    Args:
        name: a member of :class:`Bucketing`, its value, or a key of :data:`BUCKETING_ALIASES`.

    Raises:
        UsageError: naming the choices, for an unknown name.
    """
    if isinstance(name, Bucketing):
        return name
    if name in BUCKETING_ALIASES:
        return BUCKETING_ALIASES[name]
    try:
        return Bucketing(name)
    except ValueError:
        raise UsageError(
            f"unknown bucketing '{name}'; choose one of "
            f"{', '.join(member.value for member in Bucketing)} "
            f"(or the aliases {', '.join(BUCKETING_ALIASES)})"
        ) from None


@dataclass(frozen=True)
class Strategy:
    """A data-parallel strategy: a planner and its arguments, under the name rows and flags use.

    Args:
        name: the name ``--strategy``, ``--strategies`` and the JSON rows use.
        bucketing: the planner (a :class:`Bucketing` or its string); None for torch's own
            wrappers (``torch_wrapper``), which bucket by themselves.
        description: one line saying what the strategy is.
        cap_bytes: the cap of ``fixed`` buckets (and of torch DDP's, for ``ddp-100mb``).
        first_cap_bytes: the first ``fixed`` bucket's cap (None: ``cap_bytes``).
        channels: process groups the buckets travel on.
        partition_bytes: buckets above this are split across channels (None: never).
        runtime: whether the training job and ``interlace bench dp`` run it by this name.
        overlap: what its all-reduces may overlap (``forward``: on into the next forward).
        torch_wrapper: ``"ddp"`` or ``"fsdp2"`` for torch's own wrappers, None for interlace's.
    """

    name: str
    bucketing: Bucketing | None
    description: str
    cap_bytes: float = 25 * MIB
    first_cap_bytes: float | None = None
    channels: int = 1
    partition_bytes: float | None = None
    runtime: bool = False
    overlap: Overlap = Overlap.BACKWARD
    torch_wrapper: str | None = None

    def __post_init__(self) -> None:
        if self.bucketing is not None:
            # A planner's string is accepted too; the field always holds the member.
            object.__setattr__(self, "bucketing", Bucketing(self.bucketing))

    def plan(
        self,
        tensors: Sequence[ReadyTensor],
        cost: CostModel,
        *,
        backward_s: float,
        forward_s: float,
        gates: Sequence[Gate] = (),
        step_s: float = 0.0,
    ) -> Plan:
        """This strategy's plan for ``tensors`` (in ready order) under ``cost``.

        Args:
            tensors: the tensors in ready order.
            cost: the price of an all-reduce.
            backward_s: when backward ends.
            forward_s: the forward pass, added to the predicted iteration time.
            gates: the next forward's gates (``overlap="forward"``: the fastest predicted
                overlap plan, as DataParallel's planner makes it, is returned).
            step_s: the optimizer step.

        Raises:
            ValueError: for torch's own wrappers, which interlace does not plan, or an overlap
                strategy without gates.
        """
        if self.bucketing is None:
            raise ValueError(f"{self.name!r} buckets by itself; interlace has no plan for it")
        if self.overlap is Overlap.FORWARD:
            if not gates:
                raise ValueError(f"{self.name!r} overlaps the next forward: it needs its gates")
            _, best = overlap_candidates(
                tensors,
                gates,
                cost,
                forward_s=forward_s,
                backward_s=backward_s,
                step_s=step_s,
                channels=self.channels,
            )[0]
            return best
        return make_plan(
            self.bucketing,
            tensors,
            cost,
            cap_bytes=self.cap_bytes,
            first_cap_bytes=self.first_cap_bytes,
            backward_s=backward_s,
            forward_s=forward_s,
            channels=self.channels,
            partition_bytes=self.partition_bytes,
        )


#: Every strategy by name. ``fixed`` is DDP's rule as :class:`interlace.DataParallel` runs it
#: (25 MiB, the first bucket 1 MiB); ``horovod`` is Horovod's 128 MiB fusion buffer (its 1 ms fusion
#: cycle is not modelled: a bucket is sent when full or at the end of backward).
STRATEGIES: dict[str, Strategy] = {
    strategy.name: strategy
    for strategy in (
        Strategy(
            "ddp",
            None,
            "torch DistributedDataParallel, 25 MiB buckets (1 MiB first)",
            first_cap_bytes=MIB,
            runtime=True,
            torch_wrapper="ddp",
        ),
        Strategy(
            "ddp-50mb",
            None,
            "torch DistributedDataParallel with bucket_cap_mb=50",
            cap_bytes=50 * MIB,
            runtime=True,
            torch_wrapper="ddp",
        ),
        Strategy(
            "ddp-100mb",
            None,
            "torch DistributedDataParallel with bucket_cap_mb=100",
            cap_bytes=100 * MIB,
            runtime=True,
            torch_wrapper="ddp",
        ),
        Strategy(
            "fsdp2",
            None,
            "torch FSDP2 (fully_shard per layer, reshard_after_forward=False)",
            torch_wrapper="fsdp2",
        ),
        Strategy(
            "single",
            Bucketing.SINGLE,
            "SyncEASGD: one all-reduce after backward",
            runtime=True,
        ),
        Strategy(
            "wfbp",
            Bucketing.PER_TENSOR,
            "WFBP: one all-reduce per tensor once it is ready",
            runtime=True,
        ),
        Strategy(
            "fixed",
            Bucketing.FIXED,
            "DDP: 25 MiB buckets, the first 1 MiB",
            first_cap_bytes=MIB,
            runtime=True,
        ),
        Strategy(
            "horovod", Bucketing.FIXED, "Horovod: 128 MiB fusion buckets", cap_bytes=128 * MIB
        ),
        Strategy(
            "mgwfbp",
            Bucketing.MERGED,
            "MG-WFBP: Theorem 1's optimal merge",
            runtime=True,
        ),
        Strategy(
            "optimal",
            Bucketing.OPTIMAL,
            "exact best contiguous bucketing (dynamic programming)",
            runtime=True,
        ),
        Strategy(
            "pairwise",
            Bucketing.PAIRWISE,
            "MG-WFBP's published simulator: greedy pairwise merge (not Theorem 1)",
        ),
        Strategy(
            "overlap",
            Bucketing.MERGED,
            "all-reduces on into the next forward, most urgent first (overlap='forward')",
            runtime=True,
            overlap=Overlap.FORWARD,
        ),
        Strategy("mgwfbp/k=2", Bucketing.MERGED, "MG-WFBP on 2 channels (AIACC)", channels=2),
        Strategy("wfbp/k=4", Bucketing.PER_TENSOR, "WFBP on 4 channels (AIACC)", channels=4),
    )
}

#: The names the training job, ``interlace profile`` and ``interlace bench dp`` run.
RUNTIME_STRATEGIES: tuple[str, ...] = tuple(
    name for name, strategy in STRATEGIES.items() if strategy.runtime
)

#: What ``interlace bench dp`` runs: the runtime strategies and torch's FSDP2, a peer measured
#: beside them (its sharded parameters and checkpoints are not the training job's).
BENCH_STRATEGIES: tuple[str, ...] = (
    *RUNTIME_STRATEGIES,
    *(
        name
        for name, strategy in STRATEGIES.items()
        if strategy.torch_wrapper is not None and not strategy.runtime
    ),
)

#: The strategies interlace plans, hence the ones the simulator can replay.
PLANNED_STRATEGIES: dict[str, Strategy] = {
    name: strategy for name, strategy in STRATEGIES.items() if strategy.bucketing is not None
}


def planned_strategy(name: str) -> Strategy | None:
    """The planned strategy ``name``, also as ``<name>/k=K`` on ``K`` channels; None if unknown.

    Args:
        name: a key of :data:`PLANNED_STRATEGIES`, optionally with a ``/k=K`` suffix.

    Raises:
        UsageError: for the optimal planner on more than one channel.
    """
    if name in PLANNED_STRATEGIES:
        return PLANNED_STRATEGIES[name]
    base, _, suffix = name.partition("/k=")
    if base not in PLANNED_STRATEGIES or not suffix.isdigit() or int(suffix) < 1:
        return None
    channels = int(suffix)
    chosen = PLANNED_STRATEGIES[base]
    if channels > 1 and chosen.bucketing is Bucketing.OPTIMAL:
        raise UsageError(f"{name!r}: the optimal planner is exact on one channel only")
    return replace(
        chosen,
        name=name,
        channels=channels,
        description=f"{chosen.description}, on {channels} channels",
        runtime=False,
    )
