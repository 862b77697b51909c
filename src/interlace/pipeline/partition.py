"""Cutting a model into contiguous pipeline stages of balanced cost.

:func:`plan_stages` sees the model as blocks (:func:`pipeline_blocks`), costs each block by
measured time or parameter count and cuts them to minimise the largest stage's cost.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from interlace.comm.cost import CostModel
from interlace.errors import UsageError
from interlace.pipeline.balance import balance_stages, check_num_stages
from interlace.pipeline.cut import StageCut, cut_stages, stage_cut

__all__ = [
    "PLAN_BY",
    "StagePlan",
    "balance_stages",
    "gradient_bytes",
    "pipeline_blocks",
    "plan_stages",
    "profile_block_times",
    "stage_module",
]

#: The costs :func:`plan_stages` can balance (:class:`~interlace.pipeline.cut.StageCut`):
#: measured seconds, parameter counts, seconds plus the stage all-reduce, or ``auto``.
PLAN_BY: tuple[str, ...] = tuple(rule.value for rule in StageCut)


def pipeline_blocks(model: nn.Module) -> nn.Sequential:
    """``model`` as a sequence of blocks whose composition is ``model(x)``.

    An :class:`torch.nn.Sequential` is its own block sequence and is returned as is. Any other
    model must say where it can be cut by defining ``pipeline_blocks()``, returning a list of
    modules that share the model's parameters (all the zoo models do): a generic module's
    ``forward`` can do anything with its children, so the cut points cannot be guessed.

    Args:
        model: an nn.Sequential, or a model with a pipeline_blocks() method.

    Raises :class:`~interlace.errors.UsageError` otherwise.
    """
    if isinstance(model, nn.Sequential):
        return model
    method = getattr(model, "pipeline_blocks", None)
    if not callable(method):
        raise UsageError(
            f"cannot cut a {type(model).__name__} into pipeline stages: the model must be an "
            "nn.Sequential or define pipeline_blocks() returning the list of modules whose "
            "composition is its forward()"
        )
    blocks = list(method())
    if not blocks or not all(isinstance(block, nn.Module) for block in blocks):
        raise UsageError(
            f"{type(model).__name__}.pipeline_blocks() must return a non-empty list of "
            "nn.Module blocks whose composition is the model's forward()"
        )
    return nn.Sequential(*blocks)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_block(block: nn.Module, leaf: Tensor, params: list[nn.Parameter]) -> Tensor:
    """One forward and backward of ``block`` on ``leaf``; returns the output."""
    inputs: list[Tensor] = [leaf] if leaf.requires_grad else []
    inputs += params
    # clone() makes a non-leaf copy: in-place ops on it are allowed and the stored input (or the
    # caller's sample) stays intact; it costs one copy of the activations, small next to a block.
    out: Tensor = block(leaf.clone())
    if inputs and out.requires_grad:
        torch.autograd.grad(out, inputs, grad_outputs=torch.ones_like(out), allow_unused=True)
    return out


def profile_block_times(blocks: nn.Sequential, sample: Tensor, repeats: int = 3) -> list[float]:
    """Seconds of forward plus backward of each block on ``sample``: the median of ``repeats``.

    Each block runs alone on the previous block's output (detached, requiring grad when floating
    point, as a stage receives its input from the one before), and a ones-like gradient is
    backpropagated through it to its input and its parameters, which is the work a pipeline stage
    does per micro-batch. One untimed warm-up precedes the ``repeats`` timed runs, so one-off costs
    (allocator growth, kernel selection) do not count.

    Profiling leaves the model as it found it: gradients are taken with
    :func:`torch.autograd.grad` so no ``.grad`` is written, and buffers (BatchNorm running
    statistics) are restored afterwards. Each run feeds the block a fresh copy of its input, so a
    block that starts with an in-place operation neither fails on a leaf nor corrupts the input of
    the next run. Blocks run in whatever mode (train or eval) they are in.

    Args:
        blocks: the block sequence to time.
        sample: a representative input batch of the first block.
        repeats: timed runs per block (>= 1).

    Raises :class:`ValueError` for ``repeats < 1``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = sample.device
    saved_buffers = [(buffer, buffer.detach().clone()) for buffer in blocks.buffers()]
    times: list[float] = []
    try:
        with torch.enable_grad():
            current = sample.detach()
            for block in blocks:
                params = [p for p in block.parameters() if p.requires_grad]
                floating = current.is_floating_point() or current.is_complex()
                leaf = current.detach().requires_grad_(floating)
                current = _run_block(block, leaf, params).detach()  # warm-up; next input
                samples = []
                for _ in range(repeats):
                    _synchronize(device)
                    begin = time.perf_counter()
                    _run_block(block, leaf, params)
                    _synchronize(device)
                    samples.append(time.perf_counter() - begin)
                times.append(statistics.median(samples))
    finally:
        with torch.no_grad():
            for buffer, saved in saved_buffers:
                buffer.copy_(saved)
    return times


@dataclass(frozen=True)
class StagePlan:
    """Where a block sequence is cut into pipeline stages, and what each block costs.

    ``bounds`` are the half-open block ranges of the stages, in order; ``costs`` is the cost of
    every block (seconds when ``by`` is ``"time"`` or ``"time+allreduce"``, parameter counts
    when ``by == "params"``).

    Args:
        bounds: the half-open block ranges of the stages, in order.
        costs: the cost of every block.
        by: what the costs are: "time" (seconds), "params" (parameter counts) or
            "time+allreduce" (seconds per mini-batch; the stages also pay ``reduce_s``).
        reduce_s: with "time+allreduce", each stage's all-reduce as the cut priced it.
    """

    bounds: tuple[tuple[int, int], ...]
    costs: tuple[float, ...]
    by: str
    reduce_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        expected = 0
        for start, end in self.bounds:
            if start != expected or end <= start:
                raise ValueError(
                    f"stage bounds must be contiguous non-empty ranges starting at 0, "
                    f"got {self.bounds}"
                )
            expected = end
        if not self.bounds or expected != len(self.costs):
            raise ValueError(
                f"stage bounds {self.bounds} do not cover the {len(self.costs)} block costs"
            )

    @property
    def num_stages(self) -> int:
        """How many stages the plan has."""
        return len(self.bounds)

    @property
    def stage_costs(self) -> tuple[float, ...]:
        """The total cost of each stage."""
        return tuple(math.fsum(self.costs[start:end]) for start, end in self.bounds)

    @property
    def imbalance(self) -> float:
        """Largest stage cost over the mean: 1.0 is perfect, 2.0 means the pipeline runs at half.

        A plan whose costs are all zero counts as perfectly balanced. With ``reduce_s`` a
        stage's cost is its compute plus its all-reduce, what the cut balanced.
        """
        stage_costs = self.stage_costs
        if self.reduce_s:
            stage_costs = tuple(c + r for c, r in zip(stage_costs, self.reduce_s, strict=True))
        mean = math.fsum(stage_costs) / len(stage_costs)
        return max(stage_costs) / mean if mean > 0 else 1.0

    def describe(self) -> str:
        """A table of the stages: block range, block count, cost and share of the total."""
        seconds = self.by != StageCut.PARAMS
        unit = "ms" if seconds else self.by
        scale = 1e3 if seconds else 1.0
        # Milliseconds to two decimals; parameter counts as whole numbers with separators.
        spec = ".2f" if seconds else ",.0f"
        total = math.fsum(self.costs)
        rows = [f"{'stage':>5}  {'blocks':>9}  {'n':>3}  {'cost (' + unit + ')':>14}  {'share':>6}"]
        for stage, ((start, end), cost) in enumerate(
            zip(self.bounds, self.stage_costs, strict=True)
        ):
            share = cost / total if total > 0 else 1.0 / self.num_stages
            span = f"{start}" if end - start == 1 else f"{start}-{end - 1}"
            row = (
                f"{stage:>5}  {span:>9}  {end - start:>3}  {cost * scale:>14{spec}}  {share:>6.1%}"
            )
            if self.reduce_s:
                row += f"  + all-reduce {self.reduce_s[stage] * 1e3:.2f} ms"
            rows.append(row)
        what = "compute + all-reduce" if self.reduce_s else "cost"
        rows.append(f"imbalance (max / mean stage {what}): {self.imbalance:.3f}")
        return "\n".join(rows)


def plan_stages(
    blocks: nn.Sequential,
    num_stages: int,
    *,
    by: StageCut | str = StageCut.AUTO,
    sample: Tensor | None = None,
    replicas: int = 1,
    cost: CostModel | None = None,
    batch: int | None = None,
) -> StagePlan:
    """Cut ``blocks`` into ``num_stages`` stages of balanced cost.

    ``by="time"`` balances forward+backward seconds measured on ``sample`` (a representative
    micro-batch, required) with :func:`profile_block_times`: the right measure for throughput
    with one replica. ``by="time+allreduce"`` is for ``replicas > 1`` pipelines whose stages
    average their gradients: each stage costs its measured compute per mini-batch plus the
    all-reduce of its gradient bytes on ``cost`` (:func:`interlace.pipeline.cut.cut_stages`,
    the rule the simulator prices with); with one replica it is the by-time cut. ``by="auto"``
    (the default) is "time" with one replica and "time+allreduce" with several.
    ``by="params"`` balances parameter counts, which needs no sample and is deterministic: the
    right measure when memory for weights and optimizer state is the constraint.

    Args:
        blocks: the block sequence to cut.
        num_stages: how many stages (1 to len(blocks)).
        by: a :class:`~interlace.pipeline.cut.StageCut` or its name (one of PLAN_BY).
        sample: a representative micro-batch; required unless by="params".
        replicas: pipelines whose stages average their gradients (>= 1).
        cost: the all-reduce price of a stage's replica group; required for
            "time+allreduce" with replicas > 1.
        batch: samples per mini-batch through one replica (default: the sample's): the
            measured times are scaled to it, since a stage averages once per mini-batch.

    Raises :class:`ValueError` for an unknown ``by``, a missing sample or cost model, or a
    stage count that is < 1 or larger than the number of blocks.
    """
    rule = stage_cut(by).resolved(replicas)
    check_num_stages(num_stages, len(blocks))
    if rule is StageCut.PARAMS:
        counts = [float(sum(p.numel() for p in block.parameters())) for block in blocks]
        return StagePlan(tuple(balance_stages(counts, num_stages)), tuple(counts), rule.value)
    if sample is None:
        raise ValueError(
            f"plan_stages(by={rule.value!r}) measures each block, so it needs sample=, a "
            "representative input batch; or use by='params'"
        )
    costs = profile_block_times(blocks, sample)
    if rule is StageCut.TIME:
        return StagePlan(tuple(balance_stages(costs, num_stages)), tuple(costs), rule.value)
    if replicas > 1 and cost is None:
        raise ValueError(
            "plan_stages(by='time+allreduce') with replicas > 1 needs cost=, the stage "
            "group's all-reduce CostModel (interlace.comm.calibrate.fit_cost_model)"
        )
    scale = batch / len(sample) if batch else 1.0
    costs = [c * scale for c in costs]
    sizes = [float(gradient_bytes(block)) for block in blocks]
    bounds = tuple(cut_stages(costs, sizes, num_stages, replicas=replicas, cost=cost))
    reduce_s = tuple(
        cost.time(math.fsum(sizes[start:end])) if cost is not None and replicas > 1 else 0.0
        for start, end in bounds
    )
    return StagePlan(bounds, tuple(costs), rule.value, reduce_s)


def gradient_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s trainable parameters: what averaging its gradients sends.

    Args:
        module: a block or stage.
    """
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def stage_module(blocks: nn.Sequential, plan: StagePlan, stage: int) -> nn.Sequential:
    """The blocks of stage ``stage`` as an :class:`torch.nn.Sequential` sharing their modules.

    The blocks keep their names from ``blocks`` (``"3"``, ``"4"``, ...), so a stage's state dict
    keys match those of the whole block sequence.

    Args:
        blocks: the block sequence the plan was made from.
        plan: where the sequence is cut.
        stage: which stage to return, from 0.

    Raises :class:`ValueError` when ``plan`` was made for a different number of blocks or
    ``stage`` is out of range.
    """
    if len(blocks) != len(plan.costs):
        raise ValueError(
            f"the plan covers {len(plan.costs)} blocks but the sequence has {len(blocks)}; "
            "make the plan from these blocks"
        )
    if not 0 <= stage < plan.num_stages:
        raise ValueError(f"stage must be in [0, {plan.num_stages}), got {stage}")
    start, end = plan.bounds[stage]
    part = blocks[start:end]
    if not isinstance(part, nn.Sequential):  # a subclass that indexes differently
        part = nn.Sequential(*(blocks[i] for i in range(start, end)))
    return part
