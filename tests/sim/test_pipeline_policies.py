"""The simulator prices what the pipeline runtime runs: the schedule classes of
``interlace.pipeline.schedule``, their lowered programs and their graph-reuse rule, with no rule
of its own; and a schedule defined here as one class runs in both the runtime and the simulator.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import interlace.pipeline.schedule as schedule_module
import interlace.sim.pipeline as sim_pipeline
from interlace.comm.cost import CostModel
from interlace.pipeline.runtime import PipelineStage
from interlace.pipeline.schedule import SCHEDULE_TYPES, Op, Schedule
from interlace.sim.pipeline import HostCost, StageCost, simulate_pipeline, stage_programs
from interlace.sim.pipeline_events import Compute, Instruction, Post, Send, Wait
from interlace.testing import run_ranks

FREE = CostModel(0.0, 0.0)
HOST = HostCost(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)

#: What the simulator does for each action of a lowered program, as :func:`_tokens` names it.
PRICED = {
    Op.POST_ACT: ["post"],
    Op.POST_GRAD: ["post"],
    Op.RECV_ACT: ["wait"],
    Op.RECV_GRAD: ["wait"],
    Op.SEND_ACT: ["send", "Send", "Send"],  # the host call, then header and payload
    Op.SEND_GRAD: ["send", "Send", "Send"],
    Op.WAIT_SENDS: ["wait"],
    Op.FORWARD: ["forward"],
    Op.RECOMPUTE: ["recompute"],
    Op.BACKWARD: ["backward"],
    Op.PREDICT: ["predict"],
    Op.STASH: ["stash"],
    Op.UPDATE: ["update"],
}


def _stages(count: int) -> list[StageCost]:
    return [StageCost(2.0, 4.0, 0.0 if k == count - 1 else 100.0, HOST) for k in range(count)]


def _tokens(program: list[Instruction]) -> list[str]:
    tokens = []
    for op in program:
        if isinstance(op, Compute):
            tokens.append(op.label)
        elif isinstance(op, Send):
            tokens.append("Send")
        else:
            tokens.append("post" if isinstance(op, Post) else "wait")
    return tokens


@pytest.mark.parametrize("name", list(SCHEDULE_TYPES))
@pytest.mark.parametrize(("stages", "pieces", "block"), [(2, 1, 1), (3, 2, 3), (4, 3, 2)])
def test_the_simulator_prices_every_action_of_the_runtimes_program(
    name: str, stages: int, pieces: int, block: int
) -> None:
    """Action for action, in order: the simulator's program of each stage is the lowered
    program the runtime runs (one per mini-batch for a flush, one stream otherwise)."""
    kind = SCHEDULE_TYPES[name]
    programs = stage_programs(_stages(stages), name, microbatches=pieces, block=block)
    for stage, program in enumerate(programs):
        if kind.synchronous:
            lowered = kind(stages, pieces).program(stage) * block
        else:
            lowered = kind(stages, block).program(stage, pieces)
        assert _tokens(program) == [t for action in lowered for t in PRICED[action.op]]


def test_the_simulator_follows_the_runtimes_graph_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Change the one rule in interlace.pipeline.schedule: the simulator's recomputations and
    the runtime's follow it."""

    def recomputes(name: str) -> list[int]:
        programs = stage_programs(_stages(3), name, microbatches=2, block=4)
        return [
            sum(isinstance(op, Compute) and op.label == "recompute" for op in p) for p in programs
        ]

    def runtime_recomputes() -> int:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        stage = PipelineStage(
            module,
            torch.optim.SGD(module.parameters(), lr=0.1),
            stage=0,
            num_stages=1,  # the whole pipeline: no process group needed
            schedule="gpipe",
            loss_fn=nn.functional.cross_entropy,
            microbatches=2,
        )
        stage.run([(torch.randn(8, 4), torch.randint(0, 3, (8,)))], 1)
        return sum(event.name == "recompute" for event in stage.take_events())

    assert recomputes("spectrain") == [8, 8, 0]
    assert recomputes("gpipe") == [0, 0, 0]
    assert runtime_recomputes() == 0
    monkeypatch.setattr(schedule_module, "reuses_forward_graph", lambda actions: False)
    assert recomputes("gpipe") == [8, 8, 8]
    assert runtime_recomputes() == 2
    monkeypatch.setattr(schedule_module, "reuses_forward_graph", lambda actions: True)
    assert recomputes("spectrain") == [0, 0, 0]


def test_the_simulator_states_no_weight_or_graph_rule_of_its_own() -> None:
    """It takes the schedules from interlace.pipeline and reads their programs: it names no
    weight policy, no schedule of interlace's and none of the rules."""
    tree = ast.parse(Path(sim_pipeline.__file__).read_text())
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    rules = {"Weights", "ASYNCHRONOUS", "SYNCHRONOUS", "version_difference", "same_weights"}
    rules |= {"reuses_forward_graph", "stashes_weights", "predicted", "weights", "ahead"}
    assert names & rules == set()
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert strings & set(SCHEDULE_TYPES) == set()
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "interlace.pipeline.schedule"
        for alias in node.names
    }
    assert {"SCHEDULE_TYPES", "Schedule"} <= imported


class LastInFirstOut(Schedule):
    """A toy schedule: GPipe whose backwards run the last micro-batch first."""

    name = "lifo"

    def orders(self) -> list[list[tuple[Op, int]]]:
        forwards = [(Op.FORWARD, b) for b in range(self.num_batches)]
        backwards = [(Op.BACKWARD, b) for b in reversed(range(self.num_batches))]
        return [forwards + backwards for _ in range(self.num_stages)]


def test_a_new_schedule_class_is_priced_by_the_simulator() -> None:
    """2 stages, 2 micro-batches of forward 1 and backward 2, free messages: stage 1 runs F0
    [1, 2], F1 [2, 3], B1 [3, 5], B0 [5, 7]; stage 0 B1 [5, 7], B0 [7, 9]: 9 per mini-batch,
    GPipe's, with gradient 1 taken before gradient 0."""
    stages = [StageCost(2.0, 4.0, 100.0), StageCost(2.0, 4.0, 0.0)]
    result = simulate_pipeline(stages, LastInFirstOut, FREE, microbatches=2, block=3)
    assert result.schedule == "lifo"
    assert result.block_s == pytest.approx(3 * 9.0)
    program = stage_programs(stages, LastInFirstOut, microbatches=2, block=1)[0]
    taken = [m.key[2] for op in program if isinstance(op, Wait) for m in op.messages[:1]]
    assert taken[:2] == [1, 0]


BATCH = 8


def _model() -> list[nn.Module]:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(5, 7), nn.Tanh()), nn.Linear(7, 3)]
    return [b.double() for b in blocks]


def _batches(count: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, 5, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (BATCH,), generator=generator),
        )
        for _ in range(count)
    ]


def _lifo_rank(steps: int) -> list[Tensor]:
    rank = dist.get_rank()
    module = _model()[rank]
    stage = PipelineStage(
        module,
        torch.optim.SGD(module.parameters(), lr=0.1),
        stage=rank,
        num_stages=2,
        schedule=LastInFirstOut,
        loss_fn=nn.functional.cross_entropy,
        microbatches=4,
    )
    result = stage.run(_batches(steps) if rank in (0, 1) else None, steps)
    assert result.updates == steps
    return [p.detach().clone() for p in module.parameters()]


def test_a_new_schedule_class_runs_on_the_runtime() -> None:
    """3 steps on 2 stages: a flush whose backwards run out of order still gives the
    unpipelined model's updates."""
    steps = 3
    per_stage = run_ranks(_lifo_rank, 2, steps, timeout=60)
    model = nn.Sequential(*_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, targets in _batches(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    got = [t for stage in per_stage for t in stage]
    expected = [p.detach() for p in model.parameters()]
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
