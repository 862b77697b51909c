"""Replicated pipelines priced on flat and two-level networks, against timelines worked by hand."""

from __future__ import annotations

import pytest

from interlace.comm.cost import CostModel
from interlace.errors import UsageError
from interlace.pipeline.block import HEADER_BYTES
from interlace.sim.network import HierarchicalRing, Link, Ring, parse_network
from interlace.sim.pipeline import ACTIVATION_BYTES, simulate_pipeline, stage_costs
from interlace.sim.pipeline_price import PipelineConfig, price_pipeline, stage_reduce_s
from interlace.sim.trace import ActivationTrace, TensorTrace, Trace

#: Layer 0's output per sample: with the header, 500 bytes a micro-batch of one sample.
NUMEL = (500 - HEADER_BYTES) // ACTIVATION_BYTES
INTRA = Link(alpha=0.1, beta=0.001)  # a micro-batch's activation: 0.5 s on the wire + 0.1 s
INTER = Link(alpha=0.05, beta=0.001)
P0, P1 = 1000, 400  # the stages' gradient bytes


def two_layers() -> Trace:
    """Two layers, forward 1 s and backward 2 s each per sample, so a stage each."""
    tensors = (
        TensorTrace("l1.w", "l1", P1 // 4, P1, 1.0, 2.0),
        TensorTrace("l0.w", "l0", P0 // 4, P0, 1.0, 2.0),
    )
    return Trace(
        "two",
        tensors,
        forward_s=2.0,
        backward_s=4.0,
        activations=(ActivationTrace("l0", (NUMEL,)), ActivationTrace("l1", (1,))),
        batch_size=1,
    )


def hand_gpipe(allreduce0: float, allreduce1: float) -> dict[str, float]:
    """GPipe, 2 stages, 2 micro-batches of one sample, worked out by hand (one step from T).

    Stage 0: F0 [T, T+1], its activation on the wire [T+1, T+1.5], landing at T+1.6; F1
    [T+1, T+2], sent [T+2, T+2.5], landing T+2.6. Stage 1: F0 [T+1.6, T+2.6], F1 [T+2.6,
    T+3.6], B0 [T+3.6, T+5.6] whose gradient lands at T+6.2, B1 [T+5.6, T+7.6] (landing
    T+8.2); its all-reduce starts with B1 and ends 2 s + allreduce1 later. Stage 0 waits for
    the first gradient from T+2 to T+6.2 (3.6 s for stage 1's work, 0.6 s in flight), B0 [T+6.2,
    T+8.2], B1 [T+8.2, T+10.2]; its all-reduce, launched with B1, ends at T+10.2 + allreduce0,
    when it updates and the next step starts. Stage 0 never waits on stage 1 more than stage 1
    waits on it when allreduce0 >= allreduce1: its terms are the pipeline's.
    """
    return {
        "compute": 6.0,
        "pipeline bubble": 3.6,
        "p2p": 0.6,
        "all-reduce": allreduce0,
        "iteration": 10.2 + allreduce0,
        "stage 1 waits": allreduce1,
    }


def test_two_by_two_on_two_level_network_matches_the_hand_timeline() -> None:
    # Two GPUs per node: each pipeline inside a node (intra link), each stage's two replicas on
    # two nodes: a ring of 2 over the inter link, a = 2 alpha, b = beta (one per node).
    network = HierarchicalRing(2, INTER, INTRA)
    config = PipelineConfig(2, 2, "gpipe", batch=2, pieces=2, strategy="single")
    price = price_pipeline(two_layers(), config, network)
    allreduce0 = 2 * INTER.alpha + INTER.beta * P0
    allreduce1 = 2 * INTER.alpha + INTER.beta * P1
    hand = hand_gpipe(allreduce0, allreduce1)
    assert price.iteration_s == pytest.approx(hand["iteration"])
    assert price.terms() == pytest.approx({k: hand[k] for k in price.terms()})
    assert price.buckets == 1


def test_both_replicas_in_one_node_average_over_the_intra_link() -> None:
    network = HierarchicalRing(4, INTER, INTRA)
    config = PipelineConfig(2, 2, "gpipe", batch=2, pieces=2, strategy="single")
    price = price_pipeline(two_layers(), config, network)
    allreduce0 = 2 * INTRA.alpha + INTRA.beta * P0  # a ring of 2 inside the node
    assert price.iteration_s == pytest.approx(hand_gpipe(allreduce0, 0.0)["iteration"])


def test_one_replica_has_no_all_reduce_and_a_flat_network_uses_its_one_link() -> None:
    config = PipelineConfig(2, 1, "gpipe", batch=2, pieces=2)
    price = price_pipeline(two_layers(), config, Ring(INTRA))
    assert price.iteration_s == pytest.approx(10.2)
    assert price.allreduce_s == 0.0 and price.buckets == 0


def test_stage_all_reduce_starts_with_the_backward_and_follows_the_bucket_plan() -> None:
    cost = CostModel(0.1, 0.001)
    # One bucket after the whole backward: the backward, then a + b * bytes.
    assert stage_reduce_s(two_layers(), [(0, 1), (1, 2)], 0, 2.0, cost, "single") == (
        pytest.approx(2.0 + 0.1 + 0.001 * P0),
        1,
    )
    with pytest.raises(UsageError, match="overlaps the next forward"):
        stage_reduce_s(two_layers(), [(0, 1), (1, 2)], 0, 2.0, cost, "overlap")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "naive", "pipedream", "spectrain"])
def test_every_schedule_prices_and_more_replicas_never_speed_a_pipeline_up(schedule: str) -> None:
    trace = two_layers()
    network = parse_network("two-level:2:100gbit:10gbit")
    times = [
        price_pipeline(trace, PipelineConfig(2, r, schedule, 2, 2), network).iteration_s
        for r in (1, 2, 8)
    ]
    assert times == sorted(times)


def test_a_network_without_links_cannot_price_a_pipeline() -> None:
    config = PipelineConfig(2, 2, "gpipe", batch=2, pieces=2)
    with pytest.raises(UsageError, match="all-reduces only"):
        price_pipeline(two_layers(), config, parse_network("fitted:1e-4,1e-9"))
    with pytest.raises(UsageError, match="unknown schedule"):
        price_pipeline(two_layers(), PipelineConfig(2, 1, "zigzag", 2, 2), Ring(INTRA))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_flat_pipeline_walks_close_to_the_gloo_replay(schedule: str) -> None:
    # The gloo replay of one block (notices, shared links) against the walk's steady state:
    # a synchronous step flushes, so one block is one period give or take the link's latency.
    trace = two_layers()
    bounds = [(0, 1), (1, 2)]
    replayed = simulate_pipeline(
        stage_costs(trace, bounds, 4),
        schedule,
        CostModel(INTRA.alpha, INTRA.beta),
        microbatches=4,
        block=1,
    )
    walked = price_pipeline(trace, PipelineConfig(2, 1, schedule, 4, 4), Ring(INTRA))
    assert walked.iteration_s == pytest.approx(replayed.iteration_s, rel=0.05)
