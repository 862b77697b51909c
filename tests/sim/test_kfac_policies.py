"""The simulator prices the runtime's own K-FAC policy objects (placements, decomposition methods,
factor-communication modes) and states none of their rules again."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from interlace.comm.cost import CostModel
from interlace.kfac import factor_modes, methods, placements
from interlace.kfac.costs import DecompositionCostModel
from interlace.kfac.placements import (
    Broadcast,
    CostSource,
    FactorPlacement,
    Greedy,
    LayerFactors,
    decomposition_program,
)
from interlace.sim.kfac import KFAC_STRATEGIES
from interlace.sim.kfac_costs import KfacCosts
from interlace.sim.kfac_runtime import runtime_strategy
from interlace.sim.kfac_stage import SimulatedCosts, decomposition_stage

SIM = Path(__file__).resolve().parents[2] / "src" / "interlace" / "sim"
#: The names the policies go by: a simulator module comparing a value with one of them would be
#: choosing behaviour by name, beside the object that has it.
POLICY_NAMES = {"greedy", "round-robin", "lbp", "eigen", "inverse", "bulk", "pipelined"}
#: The runtime's modules of policy objects, which the simulator imports.
POLICY_MODULES = {
    "interlace.kfac.placements",
    "interlace.kfac.methods",
    "interlace.kfac.factor_modes",
}


def _kfac_modules() -> dict[str, ast.Module]:
    return {path.name: ast.parse(path.read_text()) for path in sorted(SIM.glob("kfac*.py"))}


def _imported(tree: ast.Module) -> set[str]:
    return {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }


def test_the_simulator_imports_the_runtimes_policy_objects() -> None:
    imported = set().union(*(_imported(tree) for tree in _kfac_modules().values()))
    assert POLICY_MODULES - imported == set()
    # Built-in strategies hold the runtime's classes, not look-alikes.
    for strategy in KFAC_STRATEGIES.values():
        assert type(strategy.placement).__module__ == placements.__name__
    lbp = runtime_strategy("spd", "pipelined", "lbp")
    assert isinstance(lbp.placement, placements.LBP)
    assert KfacCosts(compute_method="inverse").method is methods.INVERSE
    assert factor_modes.factor_comm_from("pipelined") == factor_modes.Pipelined()


def test_no_simulator_module_chooses_by_a_policys_name() -> None:
    found = []
    for name, tree in _kfac_modules().items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            for operand in operands:
                if isinstance(operand, ast.Constant) and operand.value in POLICY_NAMES:
                    found.append(f"{name}:{node.lineno} compares with {operand.value!r}")
    assert found == []


def test_no_simulator_module_calls_a_placement_rule_past_its_object() -> None:
    # The rules behind the placements (greedy by n^3, LBP's balancing) are reached through
    # Placement.place only; the simulator calls none of them itself.
    rules = {"greedy_placement", "round_robin_placement", "lbp_placement", "decomposition_cost"}
    called = set()
    for tree in _kfac_modules().values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                called.add(node.func.id)
    assert called & rules == set()


def test_the_stage_runs_the_placement_it_is_given() -> None:
    calls: list[tuple[list[LayerFactors], int]] = []

    class Watched(Greedy):
        def place(
            self, layers: Sequence[LayerFactors], ranks: int, costs: CostSource
        ) -> FactorPlacement:
            calls.append((list(layers), ranks))
            return super().place(layers, ranks, costs)

    stage = decomposition_stage(
        [("a", 3, 4), ("b", 5, 2)],
        placement=Watched(),
        workers=2,
        costs=KfacCosts(),
        broadcast=CostModel(1e-4, 1e-9),
    )
    assert calls == [([LayerFactors(3, 4), LayerFactors(5, 2)], 2)]
    # Greedy by n^3: 27 + 64 = 91 before 125 + 8 = 133, so b on rank 0 and a on rank 1.
    assert stage.owners == [1, 0]


def test_a_placement_that_prices_asks_the_simulators_models() -> None:
    asked: list[Any] = []

    class Asking(placements.LBP):
        def place(
            self, layers: Sequence[LayerFactors], ranks: int, costs: CostSource
        ) -> FactorPlacement:
            asked.append(costs.priced())
            return super().place(layers, ranks, costs)

    costs = KfacCosts(compute_method="inverse")
    broadcast = CostModel(1e-4, 1e-9)
    decomposition_stage(
        [("a", 64, 32)],
        placement=Asking(),
        workers=2,
        costs=costs,
        broadcast=broadcast,
    )
    (priced,) = asked
    assert priced.decomposition == costs.decomposition_model() and priced.broadcast == broadcast
    # What a decomposition sends is the runtime method's count: the inverse, 64 x 64.
    assert priced.broadcast_s(64) == broadcast.time(64 * 64 * 4)


@dataclass(frozen=True)
class Given:
    """Places as it was built: the same owners, colocated or not."""

    owners: tuple[int | None, ...]
    colocated: bool
    name: ClassVar[str] = "given"

    def place(
        self, layers: Sequence[LayerFactors], ranks: int, costs: CostSource
    ) -> FactorPlacement:
        return FactorPlacement(self.owners, tuple(range(len(self.owners))))


def test_when_each_broadcast_starts_is_the_runtimes_program_for_the_object() -> None:
    # Layer a on rank 0, b on rank 1; 5 ms per decomposition, 1 ms + 0.25 ms per byte to send.
    # Colocated: one 16-byte message per layer (5 ms) on the shared group once both factors are
    # made: a's 10..15, b's 15..20. Not colocated: one 8-byte message per factor (3 ms) on its
    # owner's group once every rank has posted it (gloo sends nothing before the receiver
    # posts): a's at 5..8 and 10..13 (rank 1 posts both at once); rank 0 posts b's receives
    # after its own decompositions, at 10, so b's go at 10..13 and 13..16.
    costs = KfacCosts(decomposition=DecompositionCostModel(c3=0.0, c2=0.0, c0=5e-3))
    spans = {}
    for colocated in (True, False):
        placement = Given((0, 0, 1, 1), colocated)
        stage = decomposition_stage(
            [("a", 1, 1), ("b", 1, 1)],
            placement=placement,
            workers=2,
            costs=costs,
            broadcast=CostModel(1e-3, 0.25e-3),
        )
        placed = placement.place([], 2, SimulatedCosts(costs, CostModel(0.0, 0.0)))
        sent = [s for s in decomposition_program(placement, placed) if isinstance(s, Broadcast)]
        assert stage.broadcasts == len(sent)
        spans[colocated] = round(stage.makespan_s * 1e3, 9)
    assert spans == {True: 20.0, False: 16.0}
