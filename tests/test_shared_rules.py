"""No rule priced twice: what the runtime runs and what the simulator prices come from one
object, and these tests fail if the two drift apart."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from interlace.bench.validate_pipeline import PipelineSample
from interlace.comm.cost import CostModel
from interlace.comm.forward_plan import GateDues, GateTiming, gates_from_timings, plan_overlap
from interlace.comm.plan import Bucketing, Plan, ReadyTensor
from interlace.comm.planners import plan_fixed, plan_merged, plan_per_tensor
from interlace.dp import DataParallel
from interlace.dp.plan_state import plan_state_of
from interlace.emulate.pipeline import EmulatedPipelineModel
from interlace.kfac.factor_bulk import all_reduce_mean
from interlace.kfac.factor_modes import Pipelined
from interlace.kfac.fusion import FUSION_BUCKETINGS, FUSIONS, make_groups
from interlace.pipeline import partition
from interlace.pipeline.messages import header_of
from interlace.pipeline.partition import pipeline_blocks, plan_stages
from interlace.pipeline.runtime import PipelineStage
from interlace.pipeline.schedule import SCHEDULE_TYPES, Op, Schedule
from interlace.sim.kfac_link import bulk_messages
from interlace.sim.network import Link, Ring, parse_network
from interlace.sim.pipeline import HostCost, StageCost, stage_programs
from interlace.sim.pipeline_events import Compute, Send
from interlace.sim.pipeline_price import PipelineConfig, price_block, price_pipeline
from interlace.sim.replay import replay
from interlace.sim.trace import ActivationTrace, TensorTrace, Trace, load_trace
from interlace.sim.traces import shipped_trace
from interlace.testing import run_ranks

MIB = 2**20
MS = 1e-3


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


def _two_layer_trace() -> Trace:
    """Two layers of a sample each: forward 1 s, backward 2 s, 1000 bytes between them."""
    tensors = (
        TensorTrace("l1.w", "l1", 100, 400, 1.0, 2.0),
        TensorTrace("l0.w", "l0", 250, 1000, 1.0, 2.0),
    )
    return Trace(
        "two",
        tensors,
        forward_s=2.0,
        backward_s=4.0,
        activations=(ActivationTrace("l0", (230,)), ActivationTrace("l1", (1,))),
        batch_size=1,
    )


@pytest.mark.parametrize("schedule", ["gpipe", "spectrain"])
def test_the_planner_and_the_validation_price_one_pipeline_model(schedule: str) -> None:
    # The validation's prediction (its replay) and the planner's (its walk) start from the same
    # stage costs and the same programs (sim/pipeline.py's stage_programs): where no link is
    # shared they agree to rounding, so a rule changed in one and not the other fails here.
    trace = _two_layer_trace()
    bounds = ((0, 1), (1, 2))
    wire = Link(alpha=0.3, beta=0.001)
    sample = PipelineSample(
        bounds=bounds,
        cost=CostModel(wire.alpha, wire.beta),
        host=(HostCost(), HostCost()),
        measured_s={schedule: [1.0]},
        block=3,
        microbatches=1,
    )
    validated = sample.predict(trace, schedule, 1)
    config = PipelineConfig(2, 1, schedule, batch=1, pieces=1)
    planned = price_block(trace, config, Ring(wire), 3, bounds)
    assert planned == pytest.approx(validated.iteration_s, rel=1e-12)


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


# ---------------------------------------------------------------------- the gated forward

#: Buckets in ready order (the last layer's tensors first) that each hold tensors of two layers,
#: so a gate lands the updates of a later layer's parameters too.
GATED_BUCKETS = [[0, 1], [2, 3, 4], [5, 6, 7]]


class _Recording(torch.optim.SGD):
    """SGD that records the parameters each of its updates changes."""

    def __init__(self, params: Any, updated: list[int]) -> None:
        super().__init__(params, lr=0.1)
        self.updated = updated

    def step(self, closure: Any = None) -> Any:
        self.updated.extend(
            id(param)
            for group in self.param_groups
            for param in group["params"]
            if param.grad is not None
        )
        return super().step(closure)


def _gated_forward_rank() -> dict[str, Any]:
    """The plan of :data:`GATED_BUCKETS` run with ``overlap="forward"``: per layer of the next
    forward, the parameters updated (through the optimizer) and the buckets waited for when it
    is about to run."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6)]
    model = DataParallel(nn.Sequential(*layers, nn.Linear(6, 4)), overlap="forward")
    names = [name for name, _ in model.module.named_parameters()]
    params = list(model.module.parameters())
    order = list(reversed(range(len(params))))
    tensors = [
        ReadyTensor(names[i], params[i].numel() * 4, 0.1 * MS * (k + 1))
        for k, i in enumerate(order)
    ]
    timings = [
        GateTiming(gate.name, gate.tensors, 0.1 * MS * k)
        for k, gate in enumerate(model.gate_layout())
    ]
    plan = plan_overlap(
        tensors,
        gates_from_timings(timings, [order.index(i) for i in range(len(order))], 0.4 * MS),
        CostModel(1 * MS, 0.0),
        groups=GATED_BUCKETS,
        forward_s=0.4 * MS,
        step_s=1 * MS,
    )
    model.load_plan_state(plan_state_of(names, order, plan))
    updated: list[int] = []
    optimizer = _Recording(model.parameters(), updated)
    name_of = {id(param): name for name, param in model.module.named_parameters()}
    landed: dict[str, list[str]] = {}
    waited: dict[str, list[int]] = {}

    def record(layer: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any) -> None:
            landed[layer] = sorted(name_of[key] for key in updated)
            waited[layer] = model.waited_buckets

        return hook

    for layer, module in model.module.named_children():
        if any(True for _ in module.parameters()):
            module.register_forward_pre_hook(record(layer))
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        inputs, targets = (
            torch.randn(8, 6, generator=generator),
            torch.randn(8, 4, generator=generator),
        )
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        updated.clear()
        optimizer.step()
    model(inputs)  # the forward that lands the last step's updates, recorded
    return {"plan": model.plan, "buckets": model.buckets, "landed": landed, "waited": waited}


def _forward_end_of(plan: Plan, landed: list[set[int]]) -> float:
    """When the gated forward ends if gate ``k`` lands the tensors ``landed[k]`` (what the
    runtime did): it waits for their buckets, then updates them (the step by bytes)."""
    bucket_of = {i: n for n, bucket in enumerate(plan.buckets) for i in bucket.indices}
    total = sum(t.nbytes for t in plan.tensors)
    now = plan.backward_s + plan.forward_s - sum(gate.forward_s for gate in plan.gates)
    for gate, tensors in zip(plan.gates, landed, strict=True):
        now = max([now, *(plan.buckets[bucket_of[i]].end_s for i in tensors)])
        now += plan.step_s * sum(plan.tensors[i].nbytes for i in tensors) / total + gate.forward_s
    return now


def test_the_planner_and_the_simulator_price_the_updates_the_runtime_lands_at_each_gate() -> None:
    for report in run_ranks(_gated_forward_rank, 2, timeout=120):
        plan: Plan = report["plan"]
        names = [tensor.name for tensor in plan.tensors]
        assert report["buckets"] == [[names[i] for i in group] for group in GATED_BUCKETS]
        # What the runtime landed at each gate, from the updates seen so far at each layer.
        landed: list[set[int]] = []
        so_far: set[int] = set()
        for gate in plan.gates:
            seen = {names.index(name) for name in report["landed"][gate.name]}
            landed.append(seen - so_far)
            so_far = seen
        assert so_far == set(range(len(names)))  # every update landed inside the forward
        # The runtime's landings are those of the shared rule...
        dues = GateDues.of(plan.groups, (gate.tensors for gate in plan.gates)).in_order()
        assert landed == [set(landing.tensors) for landing in dues[:-1]]
        assert not dues[-1].buckets
        waited: set[int] = set()
        for gate, landing in zip(plan.gates, dues, strict=False):
            waited |= set(landing.buckets)
            # The engine starts over (nothing waited for) once every bucket has landed.
            expected = [] if len(waited) == len(plan.buckets) else sorted(waited)
            assert report["waited"][gate.name] == expected, gate.name
        # ...whole buckets, so a gate lands tensors that wait at a later gate...
        assert any(
            tensors - set(gate.tensors) for gate, tensors in zip(plan.gates, landed, strict=True)
        )
        # (a case that tells the rules apart: a gate's own tensors only would price it otherwise)
        own = [set(gate.tensors) - set().union(*landed[:k]) for k, gate in enumerate(plan.gates)]
        assert _forward_end_of(plan, own) != pytest.approx(plan.forward_end_s, rel=1e-6)
        # ...and both the planner and the simulator price exactly those landings.
        assert plan.forward_end_s == pytest.approx(_forward_end_of(plan, landed), rel=1e-12)
        assert replay(plan).forward_end_s == pytest.approx(plan.forward_end_s, rel=1e-12)


@pytest.mark.parametrize("trace_name", ["vgg11-h200", "resnet50-h200"])
def test_the_runtime_cuts_replicated_pipelines_where_the_pricer_does(
    trace_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """plan_stages' default cut (by time with one replica, time+allreduce with several) on the
    emulated model of a trace, its blocks measured at their traced times, is the pricer's."""
    trace = load_trace(shipped_trace(trace_name))
    model = EmulatedPipelineModel(trace, dilation=1.0)
    blocks = pipeline_blocks(model)
    emulated = model.emulated_blocks()

    def traced_times(_: nn.Sequential, sample: torch.Tensor, repeats: int = 3) -> list[float]:
        del repeats
        rows = sample.shape[0]
        return [(b.forward_s + b.backward_s) * rows / b.traced_batch for b in emulated]

    monkeypatch.setattr(partition, "profile_block_times", traced_times)
    network = parse_network("ring:10gbit")
    batch, pieces = 16, 4
    sample = torch.zeros(batch // pieces, 1)
    for stages, replicas in [(2, 1), (4, 1), (2, 2), (2, 4), (4, 2), (8, 2)]:
        config = PipelineConfig(stages, replicas, "spectrain", batch, pieces)
        priced = price_pipeline(trace, config, network).bounds
        cost = network.group_cost(replicas) if replicas > 1 else None
        plan = plan_stages(blocks, stages, sample=sample, replicas=replicas, cost=cost, batch=batch)
        assert plan.bounds == priced, (stages, replicas)
        assert plan.by == ("time" if replicas == 1 else "time+allreduce")
