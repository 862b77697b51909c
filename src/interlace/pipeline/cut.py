"""Where a pipeline is cut: the rule the runtime's ``plan_stages`` and the simulator share.

Pure arithmetic (no torch): block compute times and gradient bytes in, stage ranges out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum

from interlace.comm.cost import CostModel
from interlace.pipeline.balance import (
    balance_spans,
    balance_stages,
    balance_table,
    check_num_stages,
)

__all__ = ["StageCut", "cut_stages", "stage_cut", "stage_step_s"]


class StageCut(str, Enum):
    """What a pipeline's stages are balanced by.

    ``TIME``: each block's measured forward+backward seconds. ``PARAMS``: parameter counts.
    ``TIME_ALLREDUCE``: a stage costs its compute per mini-batch plus the all-reduce of its
    gradients over its replicas (:func:`stage_step_s`). ``AUTO``: ``TIME`` with one replica,
    ``TIME_ALLREDUCE`` with several.
    """

    TIME = "time"
    PARAMS = "params"
    TIME_ALLREDUCE = "time+allreduce"
    AUTO = "auto"

    def resolved(self, replicas: int) -> StageCut:
        """The rule ``AUTO`` stands for at ``replicas`` replicas; any other rule itself.

        Args:
            replicas: Pipelines whose stages average their gradients (>= 1).
        """
        if self is StageCut.AUTO:
            return StageCut.TIME if replicas <= 1 else StageCut.TIME_ALLREDUCE
        return self


def stage_cut(value: StageCut | str) -> StageCut:
    """``value`` as a :class:`StageCut`; a one-line error naming the choices otherwise.

    Args:
        value: A rule or its name.

    Raises:
        ValueError: For an unknown name.
    """
    try:
        return StageCut(value)
    except ValueError:
        choices = ", ".join(rule.value for rule in StageCut)
        raise ValueError(f"unknown stage cost {value!r}; choose one of {choices}") from None


def stage_step_s(compute_s: float, grad_bytes: float, cost: CostModel | None) -> float:
    """A replicated stage's mini-batch as :attr:`StageCut.TIME_ALLREDUCE` prices it.

    Its compute plus one all-reduce of its gradients on ``cost`` (the stage group's price,
    ring factor ``2(R-1)/R`` included when fitted on that group). The two add rather than
    overlap: a stage's average starts in its last backward before the update and the update
    waits for it, so almost all of it is exposed.

    Args:
        compute_s: The stage's forward and backward seconds per mini-batch.
        grad_bytes: The bytes its all-reduce sends.
        cost: The all-reduce's price (None: one replica, nothing to average).
    """
    return compute_s + (cost.time(grad_bytes) if cost is not None else 0.0)


def cut_stages(
    compute_s: Sequence[float],
    grad_bytes: Sequence[float],
    num_stages: int,
    *,
    replicas: int = 1,
    cost: CostModel | None = None,
) -> list[tuple[int, int]]:
    """Cut blocks into ``num_stages`` contiguous stages minimising the slowest stage's step.

    With one replica (or no cost model) this is :func:`balance_stages` of ``compute_s``, exactly
    the by-time cut. With ``replicas > 1`` a stage ``[i, j)`` costs
    :func:`stage_step_s` of its compute and gradient bytes, and the cut minimises the largest
    such cost (:func:`balance_spans`, the same tie-breaking).

    Args:
        compute_s: Each block's forward+backward seconds per mini-batch (one replica's share).
        grad_bytes: Each block's gradient bytes (what its stage's all-reduce sends for it).
        num_stages: Stages (1 to the number of blocks).
        replicas: Pipelines whose stages average their gradients.
        cost: The all-reduce price of a stage's replica group (required for replicas > 1).

    Raises:
        ValueError: For lengths that differ, negative or non-finite values, a bad stage count,
            or replicas > 1 without a cost model.
    """
    if len(compute_s) != len(grad_bytes):
        raise ValueError(
            f"{len(compute_s)} block times but {len(grad_bytes)} block gradient sizes; give one "
            "of each per block"
        )
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if replicas == 1:
        return balance_stages(compute_s, num_stages)
    if cost is None:
        raise ValueError(
            f"cutting {replicas} replicas by time+allreduce needs the stage group's cost model"
        )
    check_num_stages(num_stages, len(compute_s))
    times = _checked(compute_s, "block times")
    sizes = _checked(grad_bytes, "block gradient bytes")
    time_prefix, byte_prefix = _prefix(times), _prefix(sizes)
    n = len(times)
    if type(cost) is not CostModel:

        def step(start: int, end: int) -> float:
            return stage_step_s(
                time_prefix[end] - time_prefix[start], byte_prefix[end] - byte_prefix[start], cost
            )

        return balance_spans(step, n, num_stages)
    # stage_step_s row by row, CostModel.time's arithmetic spelt out (one all-reduce alone).
    start_up, factor = cost.concurrent_terms(1)
    per_byte = factor * cost.b
    inf = math.inf
    table = []
    for i in range(n):
        t0, b0 = time_prefix[i], byte_prefix[i]
        row = [inf] * (i + 1)
        for t, b in zip(time_prefix[i + 1 :], byte_prefix[i + 1 :], strict=True):
            nbytes = b - b0
            row.append((t - t0) + (start_up + per_byte * nbytes if nbytes > 0 else 0.0))
        table.append(row)
    # Block times and bytes are >= 0: a stage's cost never falls as it gains blocks.
    return balance_table(table, num_stages, monotone=True)


def _checked(values: Sequence[float], what: str) -> list[float]:
    result = [float(v) for v in values]
    for index, value in enumerate(result):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{what} must be finite and >= 0, got {value} at index {index}")
    return result


def _prefix(values: Sequence[float]) -> list[float]:
    prefix = [0.0]
    for value in values:
        prefix.append(prefix[-1] + value)
    return prefix
