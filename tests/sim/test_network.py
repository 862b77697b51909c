"""Network models against the papers' formulas, fits and OSU logs; --network specs."""

from __future__ import annotations

import pytest

from interlace.comm.cost import CostModel
from interlace.errors import UsageError
from interlace.sim.network import (
    Fitted,
    HierarchicalRing,
    Link,
    Ring,
    Tree,
    fit_ring_link,
    parse_network,
)
from interlace.sim.traces import data_path

#: The shipped GoogLeNet K80 trace, and the folder that holds it beside the 10 GbE OSU logs.
GOOGLENET = data_path("googlenet_k80_8workers.log")
TRACES = GOOGLENET.parent


def test_ring_and_tree_follow_the_papers_formulas() -> None:
    link = Link(alpha=10e-6, beta=1e-9, gamma=0.5e-9)
    ring = Ring(link).cost(8)
    assert ring.a == pytest.approx(2 * 7 * 10e-6)
    assert ring.b == pytest.approx(2 * 7 / 8 * 1e-9 + 7 / 8 * 0.5e-9)
    tree = Tree(link).cost(8)
    assert tree.a == pytest.approx(2 * 3 * 10e-6)
    assert tree.b == pytest.approx(2e-9 + 0.5e-9)


def test_hierarchical_ring_is_rings_inside_and_across_nodes() -> None:
    inter, intra = Link(50e-6, 1e-9), Link(5e-6, 0.1e-9)
    model = HierarchicalRing(8, inter, intra).cost(64)
    inside, across = CostModel.ring(8, 5e-6, 0.1e-9), CostModel.ring(8, 50e-6, 1e-9)
    assert model.a == pytest.approx(inside.a + across.a)
    assert model.b == pytest.approx(inside.b + across.b / 8)
    # Fewer workers than a node: one node, the intra-node ring only.
    assert HierarchicalRing(8, inter, intra).cost(4) == CostModel.ring(4, 5e-6, 0.1e-9)


def test_ring_link_recovered_from_fits_at_several_sizes() -> None:
    link = Link(40e-6, 2e-9)
    fits = {n: CostModel.ring(n, link.alpha, link.beta) for n in (2, 4, 8)}
    found = fit_ring_link(fits)
    assert found.alpha == pytest.approx(link.alpha)
    assert found.beta == pytest.approx(link.beta)


def test_fitted_models_are_fixed_or_extrapolated() -> None:
    model = CostModel(9.72e-4, 1.97e-9)
    assert Fitted(model).cost(1024) == model
    assert Fitted(model, 8).cost(8).a == pytest.approx(model.a)
    assert Fitted(model, 8).cost(64).a == pytest.approx(model.a / 14 * 126)


def test_network_specs() -> None:
    ring = parse_network("ring:10gbit:50us")
    assert isinstance(ring, Ring)
    assert ring.link.alpha == pytest.approx(50e-6)
    assert ring.link.beta == pytest.approx(8 / 10e9)
    assert isinstance(parse_network("tree:1gbit"), Tree)
    hier = parse_network("hier:8:10gbit")
    assert isinstance(hier, HierarchicalRing)
    assert hier.gpus_per_node == 8
    fitted = parse_network("fitted:1e-3,2e-9@8")
    assert isinstance(fitted, Fitted)
    assert fitted.fitted_on == 8
    for bad in ("ring", "ring:fast", "hier:x:1gbit", "fitted:1", "mesh:1gbit", "osu:/no/such"):
        with pytest.raises(UsageError, match="--network"):
            parse_network(bad)


def test_osu_logs_give_a_ring_close_to_each_fit() -> None:
    network = parse_network(f"osu:{TRACES}")
    assert isinstance(network, Ring)
    # The paper's fit for 8 workers: a = 0.97 ms, b = 1.97 ns/byte; our OSU fit is the same order.
    eight = network.cost(8)
    assert 0.3e-3 < eight.a < 1.5e-3
    assert 1e-9 < eight.b < 5e-9


def test_the_mgwfbp_authors_ring_prices_an_all_reduce_as_their_formula() -> None:
    # Their simulator's constants, written out: 45.25 us per step, 1.2 s per 9 GiB-bits of
    # payload on 10 GbE, 160 operations per 16 GFLOP/s per 4-byte element of reduction.
    alpha = 45.25e-6
    beta = 1.2 / (9 * 2**30 / 8)
    gamma = 2.5e-9
    network = parse_network("paper:10gbe")
    for n, numel in ((2, 64), (64, 1_024_000), (2048, 13_365_760)):
        nbytes = 4 * numel
        by_hand = (
            2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta + (n - 1) / n * nbytes * gamma
        )
        assert network.cost(n).time(nbytes) == pytest.approx(by_hand, rel=1e-12)
    # 64 workers, the classifier's 4.096 MB: 5.7015 ms of start-ups, 18.09 ms of bytes and sums.
    assert network.cost(64).time(4_096_000) == pytest.approx(0.02379236, rel=1e-6)
    assert network.cost(1).time(4_096_000) == 0.0
    assert "MG-WFBP's simulator" in network.describe()


def test_a_ring_spec_takes_a_reduction_cost_per_byte() -> None:
    ring = parse_network("ring:10gbit:45us:2.5ns").cost(4)
    assert ring.a == pytest.approx(2 * 3 * 45e-6)
    assert ring.b == pytest.approx(2 * 3 / 4 * 8 / 10e9 + 3 / 4 * 2.5e-9)
    with pytest.raises(UsageError, match="paper takes one of 10gbe"):
        parse_network("paper:56gbib")
    with pytest.raises(UsageError, match=r"ring takes RATE\[:LATENCY\[:GAMMA\]\]"):
        parse_network("ring:10gbit:1us:1ns:1ns")


def test_two_level_spec_names_both_links_and_prices_groups_hierarchically() -> None:
    network = parse_network("two-level:8:100gbit:10gbit:2us:30us")
    assert isinstance(network, HierarchicalRing) and network.node_size == 8
    intra, inter = network.point_to_point(same_node=True), network.point_to_point(same_node=False)
    assert intra is not None and inter is not None
    assert (intra.alpha, intra.beta) == (pytest.approx(2e-6), pytest.approx(8 / 100e9))
    assert (inter.alpha, inter.beta) == (pytest.approx(30e-6), pytest.approx(8 / 10e9))
    # A group of 16, 4 on each of 4 nodes: a ring of 4 inside (2 x 3 steps of 2 us), then a
    # ring of 4 nodes (2 x 3 steps of 30 us) carrying a quarter of the message each.
    group = network.group_cost(16, per_node=4)
    assert group.a == pytest.approx(6 * 2e-6 + 6 * 30e-6)
    assert group.b == pytest.approx(2 * 3 / 4 * 8 / 100e9 + 2 * 3 / 4 * 8 / 10e9 / 4)
    # One member per node: a plain ring over the links between nodes.
    ring = CostModel.ring(4, inter.alpha, inter.beta)
    assert network.group_cost(4, per_node=1) == ring
    assert network.cost(64) == network.group_cost(64, per_node=8)
    with pytest.raises(UsageError, match="two-level takes G:INTRA_RATE:INTER_RATE"):
        parse_network("two-level:8:100gbit")
    with pytest.raises(UsageError, match="workers per node must be an integer"):
        parse_network("two-level:eight:100gbit:10gbit")


def test_flat_networks_have_one_link_and_fits_theirs_when_they_know_their_size() -> None:
    ring = parse_network("ring:10gbit:50us")
    assert ring.node_size is None
    link = ring.point_to_point(True)
    assert link is not None and link == ring.point_to_point(False)
    assert (link.alpha, link.beta) == (pytest.approx(50e-6), pytest.approx(8 / 10e9))
    assert ring.group_cost(8, per_node=4) == ring.cost(8)
    # A fit on 4 workers, a = 6 alpha and b = 1.5 beta: the link behind it.
    fitted = parse_network("fitted:6e-4,1.5e-9@4").point_to_point()
    assert fitted is not None
    assert (fitted.alpha, fitted.beta) == (pytest.approx(1e-4), pytest.approx(1e-9))
    assert parse_network("fitted:6e-4,1.5e-9").point_to_point() is None
