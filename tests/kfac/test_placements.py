"""Placements as objects: the built-in ones, what an option names, and a new placement that is one
class, run by ``KFAC`` on two ranks and priced by the simulator with nothing else edited."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from interlace import KFAC
from interlace.comm.cost import CostModel
from interlace.errors import OptionError
from interlace.kfac.costs import DecompositionCostModel
from interlace.kfac.enums import AssignmentStrategy, PlacementChoice
from interlace.kfac.methods import EIGEN
from interlace.kfac.placements import (
    AUTO_LBP_MAX_RANKS,
    LBP,
    CostSource,
    FactorPlacement,
    Greedy,
    LayerFactors,
    Placement,
    PlacementCosts,
    RoundRobin,
    placement_from,
    placement_or_auto,
)
from interlace.sim.kfac import simulate_kfac
from interlace.sim.kfac_costs import KfacCosts
from interlace.sim.kfac_runtime import runtime_strategy
from interlace.sim.trace import FactorTrace, TensorTrace, Trace
from interlace.testing import average_gradients, run_ranks

MS = 1e-3


@dataclass(frozen=True)
class DealtFactors:
    """A toy placement, defined here only: every factor in turn onto the next rank, so that a
    layer's ``A`` and ``G`` land apart, each sent to every rank as soon as it is made."""

    name: ClassVar[str] = "dealt"
    colocated: ClassVar[bool] = False

    def place(
        self, layers: Sequence[LayerFactors], ranks: int, costs: CostSource
    ) -> FactorPlacement:
        count = 2 * len(layers)
        return FactorPlacement(tuple(k % ranks for k in range(count)), tuple(range(count)))


class _NoCosts:
    """A cost source for placements that must not ask for costs."""

    def priced(self, decomposition: Any = None, broadcast: Any = None) -> PlacementCosts:
        raise AssertionError("this placement should not price anything")


#: Three layers: A 7 / G 16, A 17 / G 3, and an embedding-like diagonal A 5 / G 2.
LAYERS = [LayerFactors(7, 16), LayerFactors(17, 3), LayerFactors(5, 2, a_diagonal=True)]


def test_an_option_names_a_placement_by_enum_string_or_object() -> None:
    assert placement_from("greedy") == Greedy()
    assert placement_from("ROUND_ROBIN") == RoundRobin()
    assert placement_from(PlacementChoice.LBP) == LBP()
    toy = DealtFactors()
    assert placement_from(toy) is toy and isinstance(toy, Placement)
    with pytest.raises(OptionError, match="placement must be one of 'auto', 'greedy'") as bad:
        placement_from("random")
    assert bad.value.option == "placement"


def test_auto_is_lbp_under_comm_opt_on_2_to_64_ranks_and_greedy_elsewhere() -> None:
    assert placement_from("auto", ranks=4) == LBP()
    assert placement_from(PlacementChoice.AUTO, ranks=2, comm_opt=True) == LBP()
    assert placement_from("auto", ranks=AUTO_LBP_MAX_RANKS) == LBP()
    # Greedy where LBP cannot run, costs more than it gains, or has nothing to send:
    assert placement_from("auto", ranks=4, comm_opt=False) == Greedy()
    assert placement_from("auto", ranks=AUTO_LBP_MAX_RANKS + 1) == Greedy()
    assert placement_from("auto", ranks=1) == Greedy()
    assert placement_from("auto") == Greedy()  # the world not known yet
    # Left for whoever knows the world (the simulator, per simulated world size):
    assert placement_or_auto("AUTO") is placement_or_auto(PlacementChoice.AUTO)
    assert placement_or_auto(PlacementChoice.AUTO) is PlacementChoice.AUTO
    assert placement_or_auto("lbp") == LBP() and placement_or_auto(toy := Greedy()) is toy
    with pytest.raises(OptionError, match="placement must be one of 'auto'"):
        placement_or_auto("random")


def test_greedy_places_layers_by_their_work_or_their_memory() -> None:
    # Work n^3: 7^3 + 16^3 = 4439 and 17^3 + 3^3 = 4940 (a diagonal A of 5 weighs 5, + 8):
    # the larger layer first on rank 0, the next on rank 1, the small one beside the lighter;
    # every rank decomposes them in that order, largest first.
    placed = Greedy().place(LAYERS, 2, _NoCosts())
    assert placed.owners == (1, 1, 0, 0, 1, 1) and placed.order == (2, 3, 0, 1, 4, 5)
    # Memory n^2: 49 + 256 = 305 beats 289 + 9 = 298, so the first layer goes first.
    by_memory = Greedy(balance=AssignmentStrategy.MEMORY).place(LAYERS, 2, _NoCosts())
    assert by_memory.owners == (0, 0, 1, 1, 1, 1)
    assert Greedy(balance="memory") == Greedy(balance=AssignmentStrategy.MEMORY)  # type: ignore[arg-type]


def test_round_robin_deals_layers_out_in_turn() -> None:
    assert RoundRobin().place(LAYERS, 2, _NoCosts()).owners == (0, 0, 1, 1, 0, 0)


def test_lbp_prices_with_the_models_given_and_asks_the_source_for_the_rest() -> None:
    asked: list[tuple[object, object]] = []

    class Source:
        def priced(self, decomposition: Any = None, broadcast: Any = None) -> PlacementCosts:
            asked.append((decomposition, broadcast))
            return PlacementCosts(
                decomposition or DecompositionCostModel(c3=1e-6, c2=0.0, c0=0.0),
                broadcast or CostModel(5e-4, 0.0),
                EIGEN,
            )

    given = DecompositionCostModel(c3=2e-6, c2=0.0, c0=0.0)
    placed = LBP(decomposition_cost=given).place(LAYERS, 2, Source())
    assert asked == [(given, None)]
    assert placed.costs is not None and placed.costs.decomposition == given
    # One rank sends nothing: every factor local, and nothing is priced.
    alone = LBP().place(LAYERS, 1, _NoCosts())
    assert alone.owners == (None,) * 6 and alone.costs is None


def test_an_impossible_answer_is_refused_naming_the_placement() -> None:
    with pytest.raises(ValueError, match="placement 'greedy' is colocated"):
        FactorPlacement((0, 1), (0, 1)).check(Greedy(), 2, 2)
    with pytest.raises(ValueError, match="owner 2, which is not a rank of 2"):
        FactorPlacement((0, 2), (0, 1)).check(DealtFactors(), 2, 2)
    with pytest.raises(ValueError, match="an order of 1 for 2 factors"):
        FactorPlacement((0, 1), (0,)).check(DealtFactors(), 2, 2)


def test_a_placement_that_is_not_colocated_needs_every_rank_as_a_gradient_worker() -> None:
    # The check reads the object's colocated, so a new placement is held to it too.
    with pytest.raises(OptionError, match=r"placement='dealt' needs grad_worker_fraction=1"):
        KFAC(_model(), placement=DealtFactors(), grad_worker_fraction="mem-opt")


# -- a new placement, run and priced ---------------------------------------------------------

GLOBAL_BATCH = 8


def _model() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3)
    ).double()


def _train(placement: Placement | str) -> dict[str, Any]:
    """Two K-FAC steps on this rank's share of each global batch; the preconditioned grads."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = _model()
    precond = KFAC(model, damping=0.01, kl_clip=None, inv_dtype=torch.float64, placement=placement)
    grads = []
    for step in range(2):
        generator = torch.Generator().manual_seed(300 + step)
        inputs = torch.randn(GLOBAL_BATCH, 6, generator=generator, dtype=torch.float64)
        targets = torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)
        share = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        model.zero_grad()
        functional.cross_entropy(model(inputs[share]), targets[share]).backward()
        average_gradients(model)
        precond.step()
        grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        with torch.no_grad():
            for param in model.parameters():
                param.sub_(0.1 * param.grad)  # type: ignore[operator]
    return {
        "grads": grads,
        "owners": precond.factor_owners,
        "describe": precond.describe(),
        "placement": precond.placement,
    }


def _dealt_on_two_ranks() -> dict[str, Any]:
    return _train(DealtFactors())


@pytest.mark.slow
def test_a_placement_class_defined_here_runs_on_two_ranks_as_greedy_would() -> None:
    reference = _train("greedy")  # one process, the whole batch
    for rank_result in run_ranks(_dealt_on_two_ranks, 2, timeout=120):
        # A and G of each layer apart: 0, 1 for every layer (two factors, two ranks).
        assert set(rank_result["owners"].values()) == {(0, 1)}
        assert "dealt placement" in rank_result["describe"].splitlines()[0]
        for ours, theirs in zip(rank_result["grads"], reference["grads"], strict=True):
            for got, expected in zip(ours, theirs, strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-12)


def _default_on_two_ranks() -> dict[str, Any]:
    return _train("auto")


@pytest.mark.slow
def test_kfacs_default_runs_lbp_on_two_ranks_as_one_process_would() -> None:
    reference = _train("greedy")
    for rank_result in run_ranks(_default_on_two_ranks, 2, timeout=120):
        assert isinstance(rank_result["placement"], LBP)
        for ours, theirs in zip(rank_result["grads"], reference["grads"], strict=True):
            for got, expected in zip(ours, theirs, strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-12)


def test_kfacs_default_placement_follows_the_world_and_the_gradient_workers() -> None:
    assert inspect.signature(KFAC).parameters["placement"].default is PlacementChoice.AUTO
    assert KFAC.check_options(world_size=4).placement == LBP()
    assert KFAC.check_options(world_size=4, grad_worker_fraction=0.25).placement == Greedy()
    assert KFAC.check_options(world_size=1).placement == Greedy()


def _two_layers() -> Trace:
    """``l0`` and ``l1``: 2 ms forward, 4 ms backward each, 4-byte gradients, 1 ms step, 1 x 1
    factors (tests/sim/test_kfac_runtime.py's hand-worked trace)."""
    tensors = tuple(TensorTrace(f"l{i}.weight", f"l{i}", 1, 4, 2 * MS, 4 * MS) for i in (1, 0))
    return Trace(
        "two", tensors, 4 * MS, 8 * MS, 1 * MS, (FactorTrace("l0", 1, 1), FactorTrace("l1", 1, 1))
    )


def test_the_simulator_prices_the_same_class_by_hand() -> None:
    # As tests/sim/test_kfac_runtime.py's bulk greedy case up to the decompositions (34 ms:
    # step()'s agreement on which layers have factors, 24 B at b = 0.25 ms/B, costs 1 + 6 ms,
    # then the bulk all-reduce), then A0, G0, A1, G1 dealt to ranks 0, 1, 0, 1: each rank
    # decomposes two factors (5 ms each) and sends each one (8 B: 1 + 2 ms) as soon as it is
    # made: 5..8 and 10..13. So 13 ms instead of greedy's 20, then preconditioning 1 and the
    # step 1: 49 ms.
    costs = KfacCosts(
        decomposition=DecompositionCostModel(c3=0.0, c2=0.0, c0=5 * MS),
        gemm_flops=1e30,
        precondition_overhead_s=0.5 * MS,
    )
    result = simulate_kfac(
        _two_layers(),
        runtime_strategy("dealt", "bulk", DealtFactors()),
        CostModel(1 * MS, 0.25 * MS),
        2,
        costs=costs,
    )
    assert result.owners == (0, 1, 0, 1)
    assert result.iteration_s == pytest.approx(49 * MS)
    assert result.phases["decomposition"] == pytest.approx(10 * MS)
    assert result.phases["decomposition_comm"] == pytest.approx(3 * MS)
