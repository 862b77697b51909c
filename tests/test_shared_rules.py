"""No rule priced twice: what the runtime runs and what the simulator prices come from one
object, and these tests fail if the two drift apart."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from interlace.comm.cost import CostModel
from interlace.comm.plan import Bucketing, ReadyTensor, plan_fixed, plan_merged, plan_per_tensor
from interlace.kfac.factor_bulk import all_reduce_mean
from interlace.kfac.factor_modes import Pipelined
from interlace.kfac.fusion import FUSION_BUCKETINGS, FUSIONS, make_groups
from interlace.pipeline.messages import header_of
from interlace.pipeline.runtime import PipelineStage
from interlace.pipeline.schedule import SCHEDULE_TYPES, Op, Schedule
from interlace.sim.kfac_link import bulk_messages
from interlace.sim.pipeline import StageCost, stage_programs
from interlace.sim.pipeline_events import Compute, Send
from interlace.sim.trace import load_trace
from interlace.testing import run_ranks

MIB = 2**20


#: The buckets each engine the runtime built was given.
_LAUNCHED: list[list[list[int]]] = []


class _RecordingEngine:
    """Stands in for the bucket engine: records the buckets the runtime launches."""

    def __init__(self, tensors: list[torch.Tensor], groups: list[list[int]], group: Any) -> None:
        self.tensors = tensors
        _LAUNCHED.append([list(members) for members in groups])

    def add(self, index: int, tensor: torch.Tensor) -> None:
        del index, tensor

    def finish(self) -> list[None]:
        return [None] * len(self.tensors)


def _runtime_bulk_bytes(
    monkeypatch: pytest.MonkeyPatch, dims: list[tuple[int, int]], cap_bytes: int
) -> list[int]:
    """The bytes per bucket of the runtime's bulk factor all-reduce, for whole float32 factors
    (meta tensors: sizes without memory), as it hands them to the bucket engine."""
    tensors = [
        torch.empty(dim, dim, device="meta") for pair in dims for dim in pair
    ]  # each layer's A, then G
    monkeypatch.setattr(sys.modules[all_reduce_mean.__module__], "BucketEngine", _RecordingEngine)
    _LAUNCHED.clear()
    all_reduce_mean(tensors, 2, None, cap_bytes)
    (groups,) = _LAUNCHED
    return [sum(tensors[i].numel() * tensors[i].element_size() for i in g) for g in groups]


@pytest.mark.parametrize(
    "trace", ["resnet32-h200", "resnet50-h200", "vgg16-h200", "bert-base-h200"]
)
@pytest.mark.parametrize("cap_mib", [0, 1, 25])
def test_the_simulator_prices_the_runtimes_bulk_factor_buckets(
    monkeypatch: pytest.MonkeyPatch, trace: str, cap_mib: int
) -> None:
    dims = [(factor.a_dim, factor.g_dim) for factor in load_trace(trace).factors]
    priced, _ = bulk_messages(dims, 4, 0.0, packed=False, cap_bytes=cap_mib * MIB)
    assert [m.nbytes for m in priced] == _runtime_bulk_bytes(monkeypatch, dims, cap_mib * MIB)


# ---------------------------------------------------------------------- the pipeline

#: ``(schedule, microbatches, block)``: each schedule's micro-batches (the asynchronous ones'
#: chunks, as ``interlace bench pipeline`` sets them) and the mini-batches of one block.
PIPELINE_CASES = [
    ("gpipe", 2, 2),
    ("1f1b", 3, 2),
    ("pipedream", 2, 3),
    ("spectrain", 2, 3),
    ("spectrain-reuse", 1, 2),
]
#: What each runtime action is called among the simulator's computations.
LABELS = {
    Op.FORWARD: "forward",
    Op.RECOMPUTE: "recompute",
    Op.BACKWARD: "backward",
    Op.SEND_ACT: "send",
    Op.SEND_GRAD: "send",
    Op.PREDICT: "predict",
    Op.STASH: "stash",
    Op.UPDATE: "update",
}


def _pipeline_rank() -> dict[str, list[str]]:
    """This rank's stage of a two-stage pipeline running each case's block: the actions of every
    program the runtime executed, as the simulator labels them."""
    ran: list[str] = []
    execute = PipelineStage._execute

    def recording(stage: PipelineStage, schedule: Schedule, *args: Any) -> None:
        program = schedule.program(stage.stage, stage._pieces_per_unit())
        ran.extend(LABELS[action.op] for action in program if action.op in LABELS)
        execute(stage, schedule, *args)

    PipelineStage._execute = recording  # type: ignore[method-assign]
    found: dict[str, list[str]] = {}
    rank = dist.get_rank()
    for name, microbatches, block in PIPELINE_CASES:
        torch.manual_seed(0)
        module = nn.Linear(4, 4)
        schedule, backward = name.split("-") if "-" in name else (name, "recompute")
        stage = PipelineStage(
            module,
            torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9),
            stage=rank,
            num_stages=2,
            schedule=schedule,
            loss_fn=nn.functional.mse_loss,
            microbatches=microbatches,
            chunks=1 if SCHEDULE_TYPES[name].synchronous else microbatches,
            spectrain_backward=backward,
        )
        batches = [(torch.randn(4, 4), torch.randn(4, 4)) for _ in range(block)]
        ran.clear()
        stage.run(batches, block)
        found[name] = list(ran)
    return found


def test_the_simulator_prices_the_programs_the_pipeline_runtime_runs() -> None:
    ran = run_ranks(_pipeline_rank, 2, timeout=120)
    stages = [StageCost(1.0, 2.0, 64.0), StageCost(1.0, 2.0, 0.0)]
    for name, microbatches, block in PIPELINE_CASES:
        programs = stage_programs(stages, name, microbatches=microbatches, block=block)
        priced = [
            [op.label for op in program if isinstance(op, Compute) and op.label in LABELS.values()]
            for program in programs
        ]
        assert priced == [ran[0][name], ran[1][name]], name


def test_the_simulator_prices_the_runtimes_header() -> None:
    programs = stage_programs(
        [StageCost(1.0, 2.0, 64.0), StageCost(1.0, 2.0, 0.0)], "gpipe", microbatches=2, block=1
    )
    headers = {
        op.message.nbytes
        for op in programs[0]
        if isinstance(op, Send) and str(op.message.key[0]).endswith("-header")
    }
    header = header_of(torch.zeros(2, 3))
    assert headers == {header.numel() * header.element_size()}


# ---------------------------------------------------------------------- K-FAC's fusion


def test_kfac_fusion_plans_as_dataparallels_bucketing_of_the_same_name() -> None:
    sizes = [40, 50, 20, 100, 30, 30, 30]
    tensors = [ReadyTensor(f"t{i}", size, 0.1 * i) for i, size in enumerate(sizes)]
    cost = CostModel(0.05, 1e-3)
    dataparallel = {
        Bucketing.PER_TENSOR: plan_per_tensor(tensors, cost).groups,
        Bucketing.FIXED: plan_fixed(tensors, cost, 100).groups,
        Bucketing.MERGED: plan_merged(tensors, cost).groups,
    }
    assert set(dataparallel) == set(FUSION_BUCKETINGS.values())
    ready = [t.ready_s for t in tensors]
    for name in FUSIONS:
        bucketing = Pipelined(fusion=name).fusion
        groups = make_groups(name, sizes, cap_bytes=100, ready_s=ready, cost=cost)
        assert groups == dataparallel[bucketing], name
