"""The simulator prices the runtime's own K-FAC policy objects (placements, decomposition methods,
factor-communication modes) and states none of their rules again."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from interlace.comm.cost import CostModel
from interlace.kfac import factor_modes, methods, placements
from interlace.kfac.placements import CostSource, FactorPlacement, Greedy, LayerFactors
from interlace.sim.kfac import KFAC_STRATEGIES
from interlace.sim.kfac_costs import KfacCosts
from interlace.sim.kfac_runtime import runtime_strategy
from interlace.sim.kfac_stage import decomposition_stage

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
        broadcasts_after=True,
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
        broadcasts_after=False,
        workers=2,
        costs=costs,
        broadcast=broadcast,
    )
    (priced,) = asked
    assert priced.decomposition == costs.decomposition_model() and priced.broadcast == broadcast
    # What a decomposition sends is the runtime method's count: the inverse, 64 x 64.
    assert priced.broadcast_s(64) == broadcast.time(64 * 64 * 4)
