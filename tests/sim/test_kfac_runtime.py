"""interlace's own K-FAC modes in the simulator: the mapping, hand-worked iterations, the bulk
buckets, the two queues of pipelined factors, measured gradient buckets and device costs.

The hand-worked cases use two layers whose factors are 1 x 1 (a factor is one float32, 4 bytes;
a decomposition two numbers, 8 bytes), so each message's time is read off the cost model.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from interlace.comm.cost import CostModel
from interlace.errors import UsageError
from interlace.kfac.costs import DecompositionCostModel
from interlace.kfac.factor_modes import Pipelined
from interlace.kfac.placements import LBP, Greedy
from interlace.sim.kfac import simulate_kfac
from interlace.sim.kfac_costs import KfacCosts
from interlace.sim.kfac_link import bulk_messages
from interlace.sim.kfac_runtime import RUNTIME_BULK_CAP_BYTES, runtime_strategy
from interlace.sim.kfac_stage import decomposition_stage
from interlace.sim.trace import FactorTrace, TensorTrace, Trace

MS = 1e-3
#: 1 ms per 4 bytes.
PER_BYTE = 0.25 * MS


def two_layers() -> Trace:
    """``l0`` (input side) and ``l1``: 2 ms forward, 4 ms backward each, 4-byte gradients, 1 ms
    step, 1 x 1 factors; tensors in backward order (l1 first)."""
    tensors = tuple(TensorTrace(f"l{i}.weight", f"l{i}", 1, 4, 2 * MS, 4 * MS) for i in (1, 0))
    return Trace(
        "two",
        tensors,
        4 * MS,
        8 * MS,
        1 * MS,
        (FactorTrace("l0", 1, 1), FactorTrace("l1", 1, 1)),
    )


def unit_costs(**changes: object) -> KfacCosts:
    """5 ms per decomposition, 0.5 ms to precondition a layer (its products are free)."""
    fields: dict[str, object] = {
        "decomposition": DecompositionCostModel(c3=0.0, c2=0.0, c0=5 * MS),
        "gemm_flops": 1e30,
        "precondition_overhead_s": 0.5 * MS,
    }
    fields.update(changes)
    return KfacCosts(**fields)  # type: ignore[arg-type]


def ms(phases: dict[str, float]) -> dict[str, float]:
    return {phase: round(seconds / MS, 9) for phase, seconds in phases.items()}


# ---------------------------------------------------------------------- the mapping


def test_each_ablation_mode_maps_to_what_the_runtime_does() -> None:
    dkfac = runtime_strategy("dkfac", "bulk", "greedy")
    assert (dkfac.pipelined, dkfac.placement, dkfac.computes_in_passes) == (False, Greedy(), True)
    assert (dkfac.bulk_packed, dkfac.bulk_cap_bytes) == (False, 25 * 2**20)
    assert not dkfac.factor_group
    spd = runtime_strategy("spd", "pipelined", "lbp")
    assert (spd.pipelined, spd.placement, spd.factor_group) == (True, LBP(), True)
    assert runtime_strategy("lbp", "bulk", "lbp").computes_in_passes
    assert runtime_strategy("p", "bulk", "greedy", symmetry_aware=True).bulk_packed
    assert RUNTIME_BULK_CAP_BYTES == 25 * 1024 * 1024


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ((Pipelined(fusion="none"), "greedy"), "merged buckets"),
        ((Pipelined(fusion="fixed"), "lbp"), "merged buckets"),
        (("hooks", "greedy"), "factor_comm must be one of"),
        (("bulk", "random"), "placement must be one of"),
    ],
)
def test_modes_without_a_model_are_refused_in_one_line(
    settings: tuple[Pipelined | str, str], message: str
) -> None:
    with pytest.raises(UsageError, match=message) as refused:
        runtime_strategy("m", *settings)
    assert "\n" not in str(refused.value)


# ---------------------------------------------------------------------- hand-worked


def test_bulk_greedy_by_hand() -> None:
    # Factors in the passes: forward l0 0..2, A0 2..4, l1 4..6, A1 6..8; backward G1 8..10,
    # l1 10..14, G0 14..16, l0 16..20. Gradients (a = 1 ms + 1 ms) 14..16 and 20..22: backward
    # returns at 22 (2 ms waiting). step() agrees which layers have factors (3 int32 flags per
    # layer, 24 B: 1 + 6 ms) 22..29; the bulk all-reduce of four whole 1 x 1 factors (16 B:
    # 1 + 4 ms) 29..34. Greedy: l0 on rank 0, l1 on rank 1, 10 ms each; then the broadcasts
    # (16 B each: 5 ms) one after the other: 10 + 5 + 5 = 20. Preconditioning 1, step 1: 56 ms.
    result = simulate_kfac(
        two_layers(),
        runtime_strategy("dkfac", "bulk", "greedy"),
        CostModel(1 * MS, PER_BYTE),
        2,
        costs=unit_costs(),
    )
    assert result.iteration_s == pytest.approx(56 * MS)
    assert ms(result.phases) == {
        "buffer_comm": 0.0,
        "forward_backward": 12.0,
        "factor_compute": 8.0,
        "gradient_comm": 2.0,
        "factor_comm": 12.0,
        "decomposition": 10.0,
        "decomposition_comm": 10.0,
        "precondition": 1.0,
        "step": 1.0,
        "host": 0.0,
    }
    assert result.owners == (0, 1)
    assert [round(c.start_s / MS, 9) for c in result.replay.comms] == [14, 20, 22, 29]


def test_link_timing_apart_from_planning() -> None:
    # As above, all-reduces taking a = 2 ms: gradients 14..17 and 20..23 (3 ms waiting), the
    # flags 23..31, the bulk 31..37; the broadcasts are priced by the planning model (5 ms
    # each): 37 + 20 + 2.
    result = simulate_kfac(
        two_layers(),
        runtime_strategy("dkfac", "bulk", "greedy"),
        CostModel(1 * MS, PER_BYTE),
        2,
        costs=unit_costs(),
        timing_cost=CostModel(2 * MS, PER_BYTE),
    )
    assert result.iteration_s == pytest.approx(59 * MS)
    assert ms(result.phases)["gradient_comm"] == 3.0


def test_each_layer_is_sent_as_soon_as_its_owner_has_made_it() -> None:
    # Three 1 x 1 layers, 10 ms to decompose each (two factors), 5 ms to send one (16 B). Greedy
    # (equal weights): l0 and l2 on rank 0, l1 on rank 1. On the shared group: l0 10..15 while
    # rank 0 decomposes l2 (10..20), l1 15..20 (made at 10, behind l0), l2 20..25. Every
    # decomposition first and then every broadcast would take 20 + 15 = 35 ms.
    stage = decomposition_stage(
        [(f"l{i}", 1, 1) for i in range(3)],
        placement=Greedy(),
        workers=2,
        costs=unit_costs(),
        broadcast=CostModel(1 * MS, PER_BYTE),
    )
    assert stage.owners == [0, 1, 0]
    assert (round(stage.makespan_s / MS, 9), round(stage.decomposition_s / MS, 9)) == (25, 20)
    assert stage.broadcasts == 3
    assert [
        (name, round(start / MS, 9), round(end / MS, 9)) for name, _, start, end in stage.events
    ] == [
        ("decompose l0.A", 0, 5),
        ("decompose l0.G", 5, 10),
        ("decompose l2.A", 10, 15),
        ("decompose l2.G", 15, 20),
        ("broadcast l0 (rank 0)", 10, 15),
        ("broadcast l1 (rank 1)", 15, 20),
        ("broadcast l2 (rank 0)", 20, 25),
    ]


def test_pipelined_factors_queue_apart_from_the_gradients() -> None:
    # No cost per byte, 5 ms per start-up: each queue runs its buckets one after another, each
    # when ready and its queue is free; the two queues overlap. The reference replays the
    # simulator's own buckets that way.
    cost = CostModel(5 * MS, 0.0)
    strategy = runtime_strategy("pipelined", "pipelined", "greedy")
    result = simulate_kfac(two_layers(), strategy, cost, 2, costs=unit_costs())
    one = simulate_kfac(
        two_layers(),
        replace(strategy, factor_group=False),
        cost,
        2,
        costs=unit_costs(),
    )
    free = {"gradient": 0.0, "factor": 0.0}
    shared = 0.0
    ready = [bucket.ready_s for bucket in result.plan.buckets]
    for kind, at in zip(result.kinds, ready, strict=True):
        free[kind] = max(free[kind], at) + 5 * MS
        shared = max(shared, at) + 5 * MS
    assert result.replay.comm_end_s == pytest.approx(max(free.values()))
    assert one.replay.comm_end_s == pytest.approx(shared)
    # G0 (ready at 16) runs beside l1's gradients (14..19) instead of after them.
    assert result.iteration_s < one.iteration_s - 3 * MS


def test_two_queues_share_the_wire() -> None:
    # Both queues busy with bytes at once: the newcomer's bytes take twice as long.
    cost = CostModel(0.0, PER_BYTE)
    strategy = runtime_strategy("pipelined", "pipelined", "greedy")
    trace = two_layers()
    big = Trace(
        "two",
        tuple(
            TensorTrace(t.name, t.layer, 10, 40, t.layer_forward_s, t.layer_backward_s)
            for t in trace.tensors
        ),
        trace.forward_s,
        trace.backward_s,
        trace.step_s,
        (FactorTrace("l0", 5, 5), FactorTrace("l1", 5, 5)),
    )
    result = simulate_kfac(big, strategy, cost, 2, costs=unit_costs())
    comms = result.replay.comms
    overlapping = [
        (a, b)
        for a, kind_a in zip(comms, result.kinds, strict=True)
        for b, kind_b in zip(comms, result.kinds, strict=True)
        if kind_a == "gradient"
        and kind_b == "factor"
        and a.start_s < b.end_s
        and b.start_s < a.end_s
    ]
    assert overlapping
    alone = [c.end_s - c.start_s for c in comms]
    assert max(alone) > cost.time(max(c.nbytes for c in comms)) * (1 + 1e-9)


def test_measured_gradient_buckets_replace_the_plan() -> None:
    strategy = runtime_strategy("dkfac", "bulk", "greedy")
    cost = CostModel(1 * MS, PER_BYTE)
    # One bucket of both gradients (8 B: 3 ms) once l0's is ready at 20: 20..23.
    result = simulate_kfac(
        two_layers(),
        strategy,
        cost,
        2,
        costs=unit_costs(),
        gradient_buckets=[["l1.weight", "l0.weight"]],
    )
    assert result.extra["gradient_buckets"] == 1
    assert ms(result.phases)["gradient_comm"] == 3.0
    with pytest.raises(ValueError, match="nope"):
        simulate_kfac(
            two_layers(), strategy, cost, 2, costs=unit_costs(), gradient_buckets=[["nope"]]
        )


def test_measured_factor_buckets_replace_the_merge_rule() -> None:
    # 5 ms start-ups: the merge rule sends A0, A1 and G1 (ready at 4, 8 and 10 ms) together
    # and G0 (16 ms) alone. The run's kept plan, one bucket of all four once G0 is ready, is
    # priced instead when given.
    cost = CostModel(5 * MS, 0.0)
    strategy = runtime_strategy("pipelined", "pipelined", "greedy")
    planned = simulate_kfac(two_layers(), strategy, cost, 2, costs=unit_costs())
    kept = [["l0.A", "l1.A", "l1.G", "l0.G"]]
    measured = simulate_kfac(
        two_layers(), strategy, cost, 2, costs=unit_costs(), factor_buckets=kept
    )
    names = [t.name for t in planned.plan.tensors]
    factor_groups = [
        [names[i] for i in b.indices]
        for b, kind in zip(planned.plan.buckets, planned.kinds, strict=True)
        if kind == "factor"
    ]
    assert factor_groups == [["l0.A", "l1.A", "l1.G"], ["l0.G"]]
    assert measured.extra["factor_buckets"] == 1
    (bucket,) = [
        b for b, kind in zip(measured.plan.buckets, measured.kinds, strict=True) if kind == "factor"
    ]
    assert bucket.ready_s == pytest.approx(16 * MS)
    starts = [
        c.start_s
        for c, kind in zip(measured.replay.comms, measured.kinds, strict=True)
        if kind == "factor"
    ]
    assert starts == [pytest.approx(16 * MS)]  # A0..G1 no longer go out at 10 ms
    with pytest.raises(ValueError, match="factor buckets name tensors the trace does not have"):
        simulate_kfac(
            two_layers(), strategy, cost, 2, costs=unit_costs(), factor_buckets=[["l9.A"]]
        )


# ---------------------------------------------------------------------- bulk buckets


def test_bulk_messages_are_whole_or_packed_factors_in_the_runtimes_buckets() -> None:
    # A 3 x 3 and a 2 x 2 factor: 36 and 16 bytes whole, 24 and 12 packed.
    (one,), groups = bulk_messages([(3, 2)], 4, 7.0, packed=False, cap_bytes=None)
    assert (one.nbytes, one.ready_s, groups) == (52, 7.0, [[0]])
    (packed,), _ = bulk_messages([(3, 2)], 4, 7.0, packed=True, cap_bytes=None)
    assert packed.nbytes == 36
    capped, groups = bulk_messages([(3, 2), (2, 3)], 4, 0.0, packed=False, cap_bytes=40)
    # 36 + 16 reaches 40 and closes the bucket; so do 16 + 36.
    assert [m.nbytes for m in capped] == [36 + 16, 16 + 36]
    assert groups == [[0], [1]]
    alone, _ = bulk_messages([(3, 2)], 4, 0.0, packed=False, cap_bytes=0)
    assert [m.nbytes for m in alone] == [36, 16]


# ---------------------------------------------------------------------- device costs


def test_measured_decompositions_price_the_stage_and_place_it() -> None:
    # The cubic alone says 0.1 ms, cheaper than a 3 ms broadcast (LBP would keep all four
    # local); the measured points say 5 ms for n = 1, and one model both places and prices.
    measured = DecompositionCostModel(
        c3=0.0, c2=0.0, c0=0.1 * MS, points=((1, 5 * MS), (4, 40 * MS))
    )
    costs = unit_costs(decomposition=measured)
    result = simulate_kfac(
        two_layers(),
        runtime_strategy("lbp", "bulk", "lbp"),
        CostModel(1 * MS, PER_BYTE),
        2,
        costs=costs,
    )
    # Each rank decomposes what it owns plus every local factor, at 5 ms each.
    local = sum(owner is None for owner in result.owners)
    per_rank = [sum(owner == r for owner in result.owners) + local for r in range(2)]
    assert ms(result.phases)["decomposition"] == pytest.approx(5.0 * max(per_rank))
    assert result.extra["single_worker_s"] == pytest.approx((12 + 8 + 20 + 1 + 1) * MS)


def test_decomposition_points_price_through_the_log_log_interpolation() -> None:
    points = ((10, 1.0), (100, 100.0))
    costs = KfacCosts(decomposition=DecompositionCostModel(0.0, 0.0, 1.0, points=points))
    assert costs.decomposition_s(32) == pytest.approx((32 / 10) ** 2)
    assert costs.decomposition_s(100) == pytest.approx(100.0)
    assert costs.decomposition_s(0) == 0.0


def test_listed_layers_take_their_factor_seconds() -> None:
    costs = unit_costs(layer_factor_s=(("l1", 1 * MS, 0.5 * MS),))
    assert costs.layer_factors_s("l1", 1, 1, 2 * MS, 4 * MS) == (1 * MS, 0.5 * MS)
    # l0 is not listed: a / g x its forward and g / (2 a) x its backward.
    assert costs.layer_factors_s("l0", 1, 1, 2 * MS, 4 * MS) == (2 * MS, 2 * MS)
    result = simulate_kfac(
        two_layers(),
        runtime_strategy("dkfac", "bulk", "greedy"),
        CostModel(1 * MS, PER_BYTE),
        2,
        costs=costs,
    )
    assert ms(result.phases)["factor_compute"] == 5.5
    with pytest.raises(ValueError, match="l1"):
        KfacCosts(layer_factor_s=(("l1", -1.0, 0.0),))


@pytest.mark.parametrize(("workers", "placement"), [(2, "lbp"), (65, "greedy")])
def test_auto_is_priced_as_the_placement_the_runtime_picks_on_that_many_ranks(
    workers: int, placement: str
) -> None:
    cost, costs = CostModel(1 * MS, PER_BYTE), unit_costs()
    auto = simulate_kfac(
        two_layers(), runtime_strategy("auto", "bulk", "auto"), cost, workers, costs=costs
    )
    named = simulate_kfac(
        two_layers(), runtime_strategy(placement, "bulk", placement), cost, workers, costs=costs
    )
    assert "placement='auto'" in runtime_strategy("auto", "bulk", "AUTO").description
    assert auto.iteration_s == named.iteration_s and auto.owners == named.owners
    # The two placements price apart here (LBP 42 / 37 ms, greedy 49), so the pick is seen.
    other = "greedy" if placement == "lbp" else "lbp"
    apart = simulate_kfac(
        two_layers(), runtime_strategy(other, "bulk", other), cost, workers, costs=costs
    )
    assert apart.iteration_s != auto.iteration_s
