"""``decomposition_program``: each broadcast right after the decomposition that completes it, for
every placement; on two ranks the runtime walks it, to the bit as it did every broadcast last."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from interlace import KFAC
from interlace.kfac import work_assignment
from interlace.kfac.placements import (
    Broadcast,
    CostSource,
    Decompose,
    FactorPlacement,
    Greedy,
    LayerFactors,
    RoundRobin,
    decomposition_program,
)
from interlace.kfac.preconditioned_layer import KFACLayer
from interlace.testing import average_gradients, run_ranks

D, B = Decompose, Broadcast


@dataclass(frozen=True)
class Given:
    """A placement that answers what it was built with (colocated or not)."""

    owners: tuple[int | None, ...]
    order: tuple[int, ...]
    colocated: bool = False
    name: ClassVar[str] = "given"

    def place(
        self, layers: Sequence[LayerFactors], ranks: int, costs: CostSource
    ) -> FactorPlacement:
        return FactorPlacement(self.owners, self.order)


def _program(placement: Given, due: set[int] | None = None) -> tuple[Any, ...]:
    placed = placement.place([], 2, None)  # type: ignore[arg-type]
    return decomposition_program(placement, placed, due)


def test_a_colocated_layer_is_sent_once_both_its_factors_are_made() -> None:
    # Layers 0, 1, 2 on ranks 1, 0, 1, in layer order: each layer's one message right after its
    # G, on the shared group, before the next layer is decomposed.
    placement = Given((1, 1, 0, 0, 1, 1), tuple(range(6)), colocated=True)
    assert _program(placement) == (
        D(0), D(1), B((0, 1), 1, None),
        D(2), D(3), B((2, 3), 0, None),
        D(4), D(5), B((4, 5), 1, None),
    )  # fmt: skip
    # In another order, the message follows whichever of A and G comes last.
    reordered = Given((0, 0, 1, 1), (1, 2, 0, 3), colocated=True)
    assert _program(reordered) == (D(1), D(2), D(0), B((0, 1), 0, None), D(3), B((2, 3), 1, None))


def test_a_single_factor_is_sent_on_its_owners_group_as_soon_as_it_is_made() -> None:
    # LBP-like: factor 0 local (never sent), the others owned, walked in the given order.
    placement = Given((None, 1, 0, 1), (3, 2, 1, 0))
    assert _program(placement) == (
        D(3), B((3,), 1, 1), D(2), B((2,), 0, 0), D(1), B((1,), 1, 1), D(0),
    )  # fmt: skip


def test_only_the_factors_due_are_in_the_program() -> None:
    placement = Given((1, 1, 0, 0, 1, 1), tuple(range(6)), colocated=True)
    assert _program(placement, {0, 1, 4, 5}) == (
        D(0), D(1), B((0, 1), 1, None), D(4), D(5), B((4, 5), 1, None),
    )  # fmt: skip


def test_greedy_and_round_robin_run_through_the_same_rule() -> None:
    # n^3 work 4439, 6641, 2224: greedy walks its layers largest first (1, 0, 2) and sends
    # each as soon as it is made; round-robin walks them in layer order.
    layers = [LayerFactors(7, 16), LayerFactors(17, 12), LayerFactors(13, 3)]
    golden = {
        Greedy(): [((2, 3), 0), ((0, 1), 1), ((4, 5), 1)],
        RoundRobin(): [((0, 1), 0), ((2, 3), 1), ((4, 5), 0)],
    }
    for placement, expected in golden.items():
        placed = placement.place(layers, 2, None)  # type: ignore[arg-type]
        steps = decomposition_program(placement, placed)
        sent = [(step.factors, step.owner) for step in steps if isinstance(step, Broadcast)]
        assert sent == expected, placement.name


# -- two ranks -------------------------------------------------------------------------------

GLOBAL_BATCH = 8


def _train(placement: str) -> dict[str, Any]:
    """Two K-FAC steps on this rank's share of each global batch: the preconditioned gradients
    and, on two ranks, what this rank did at the first decomposition step, in order."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(5)
    # Factors (A / G) 7 / 16, 17 / 12, 13 / 3: greedy by n^3 puts layer 1 on rank 0, 0 and 2 on 1.
    model = nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3)
    ).double()
    precond = KFAC(model, damping=0.01, kl_clip=None, inv_dtype=torch.float64, placement=placement)
    log: list[str] = []
    decompose, send = KFACLayer.decompose, KFACLayer.broadcast_decompositions

    def logged_decompose(layer: KFACLayer, which: str, damping: float) -> Any:
        log.append(f"decompose {layer.name}.{which}")
        return decompose(layer, which, damping)

    def logged_send(layer: KFACLayer, *args: Any, **kwargs: Any) -> Any:
        log.append(f"broadcast {layer.name}")
        return send(layer, *args, **kwargs)

    grads = []
    for step in range(2):
        generator = torch.Generator().manual_seed(300 + step)
        inputs = torch.randn(GLOBAL_BATCH, 6, generator=generator, dtype=torch.float64)
        targets = torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)
        share = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        model.zero_grad()
        functional.cross_entropy(model(inputs[share]), targets[share]).backward()
        average_gradients(model)
        if step == 0:
            KFACLayer.decompose = logged_decompose  # type: ignore[method-assign]
            KFACLayer.broadcast_decompositions = logged_send  # type: ignore[method-assign]
        try:
            precond.step()
        finally:
            KFACLayer.decompose = decompose  # type: ignore[method-assign]
            KFACLayer.broadcast_decompositions = send  # type: ignore[method-assign]
        grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        with torch.no_grad():
            for param in model.parameters():
                param.sub_(0.1 * param.grad)  # type: ignore[operator]
    precond.remove_hooks()
    return {"grads": grads, "log": log, "layers": precond.layers}


def _sent_last(*args: Any) -> tuple[Any, ...]:
    """The order before broadcasts started early: every decomposition, then every broadcast."""
    steps = decomposition_program(*args)
    return tuple(s for s in steps if isinstance(s, Decompose)) + tuple(
        s for s in steps if isinstance(s, Broadcast)
    )


def _both_placements() -> dict[str, Any]:
    records = {placement: _train(placement) for placement in ("greedy", "round-robin")}
    work_assignment.decomposition_program = _sent_last  # type: ignore[assignment]
    try:
        for placement in ("greedy", "round-robin"):
            records[f"{placement} sent last"] = _train(placement)
    finally:
        work_assignment.decomposition_program = decomposition_program
    return records


@pytest.mark.slow
def test_two_ranks_send_each_layer_as_soon_as_it_is_made_and_precondition_as_one_process() -> None:
    per_rank = run_ranks(_both_placements, 2, timeout=120)
    # Greedy walks its layers largest first (module 2, then 0, then 4), round-robin in order.
    walks = {
        "greedy": (("2", 0), ("0", 1), ("4", 1)),
        "round-robin": (("0", 0), ("2", 1), ("4", 0)),
    }
    for placement, walk in walks.items():
        reference = _train(placement)  # one process, the whole batch
        records = [rank_records[placement] for rank_records in per_rank]
        assert records[0]["layers"] == {name: owner for name, owner in walk}
        for rank, record in enumerate(records):
            # Each rank decomposes its own layers; every layer's broadcast is posted right after
            # its owner's turn, so it overlaps the decompositions of the layers after it.
            expected = []
            for name, owner in walk:
                if owner == rank:
                    expected += [f"decompose {name}.A", f"decompose {name}.G"]
                expected.append(f"broadcast {name}")
            assert record["log"] == expected, (placement, rank)
        for rank, record in enumerate(records):
            before = per_rank[rank][f"{placement} sent last"]
            assert before["log"][-3:] == [f"broadcast {name}" for name, _ in walk]
            for step, grads in enumerate(record["grads"]):
                for got, old, expected in zip(
                    grads, before["grads"][step], reference["grads"][step], strict=True
                ):
                    # The same numbers as when every broadcast came last, to the bit.
                    assert torch.equal(got, old), (placement, rank, step)
                    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-12)
