"""Pipeline schedules in the simulator: torch's orders and the stage programs against golden
lists, iteration times against timelines worked out by hand, and links shared as TCP shares
them.

Times are whole units (forward 1, backward 2 per piece unless said) so that every answer is a
short sum.
"""

from __future__ import annotations

import math

import pytest

from interlace.comm.cost import CostModel
from interlace.errors import UsageError
from interlace.pipeline.partition import balance_stages
from interlace.pipeline.schedule import Op, gpipe_order, one_f_one_b_order
from interlace.sim.pipeline import (
    INTERLACE_PIPELINE_SCHEDULES,
    PIPELINE_SCHEDULES,
    HostCost,
    StageCost,
    simulate_pipeline,
    stage_costs,
    stage_programs,
    trace_bounds,
    with_measured_compute,
)
from interlace.sim.pipeline_events import (
    Compute,
    Message,
    Post,
    Send,
    Wait,
    fair_rates,
    replay_programs,
)
from interlace.sim.trace import ActivationTrace, TensorTrace, Trace

FREE = CostModel(0.0, 0.0)
SYNCHRONOUS = ("gpipe", "1f1b", "torch-gpipe", "torch-1f1b")


def equal_stages(
    count: int, microbatches: int, tf: float = 1.0, tb: float = 2.0, nbytes: float = 100.0
) -> list[StageCost]:
    """``count`` stages of ``tf`` forward and ``tb`` backward per piece of ``microbatches``."""
    return [
        StageCost(tf * microbatches, tb * microbatches, 0.0 if k == count - 1 else nbytes)
        for k in range(count)
    ]


def _order_text(order: list[tuple[Op, int]]) -> str:
    return " ".join(("F" if op is Op.FORWARD else "B") + str(i) for op, i in order)


def test_torch_gpipe_order_4_stages_4_microbatches_golden() -> None:
    # torch's ScheduleGPipe walks the order interlace's GPipe does: one rule, priced for both.
    assert [_order_text(o) for o in gpipe_order(4, 4)] == ["F0 F1 F2 F3 B0 B1 B2 B3"] * 4


def test_torch_1f1b_order_4_stages_4_microbatches_golden() -> None:
    # Stage k: min(M, N - k) forwards, then one backward and one forward in turn.
    assert [_order_text(o) for o in one_f_one_b_order(4, 4)] == [
        "F0 F1 F2 F3 B0 B1 B2 B3",
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def _text(op: object) -> str:
    if isinstance(op, Compute):
        return op.label
    if isinstance(op, Send | Post):
        m = op.message
        return f"{type(op).__name__.lower()} {m.key[0]}{m.key[2]}"
    assert isinstance(op, Wait)
    return "wait " + ",".join(f"{m.key[0]}{m.key[2]}" for m in op.messages)


def test_torch_1f1b_program_golden() -> None:
    """Schedule1F1B on 2 stages, 2 micro-batches: what each rank fires, posts and waits on."""
    programs = stage_programs(equal_stages(2, 2), "torch-1f1b", microbatches=2, block=1)
    assert [_text(op) for op in programs[0]] == [
        # warm-up: two forwards, the first sent at once, the second left for the first backward
        "wait ",
        "forward",
        "wait ",
        "send",  # the host call
        "send act0",
        "wait ",
        "forward",
        "wait act0",
        # 1B1F: the held send goes out with the first gradient's receive
        "send",
        "send act1",
        "post grad0",
        "wait act1,grad0",
        "backward",
        # cool-down
        "post grad1",
        "wait grad1",
        "backward",
        "wait ",
        "wait ",
        "scale",
        "update",
    ]
    assert [_text(op) for op in programs[1]] == [
        "post act0",
        "wait act0",
        "forward",
        "wait ",
        "wait ",
        "backward",
        "send",
        "send grad0",
        "post act1",
        "wait grad0,act1",
        "forward",
        "wait ",
        "backward",
        "send",
        "send grad1",
        "wait grad1",
        "scale",
        "update",
    ]


def test_interlace_gpipe_program_posts_every_header_first_and_waits_sends_last() -> None:
    programs = stage_programs(equal_stages(2, 2), "gpipe", microbatches=2, block=1)
    assert [_text(op) for op in programs[1]] == [
        "post act-header0",
        "post act-header1",
        "wait act0",
        "forward",
        "wait act1",
        "forward",
        "backward",
        "send",  # the host call, then the header and the payload
        "send grad-header0",
        "send grad0",
        "backward",
        "send",
        "send grad-header1",
        "send grad1",
        "update",
        "wait grad-header0,grad0,grad-header1,grad1",
    ]
    payload = next(op.message for op in programs[1] if isinstance(op, Send) and op.message.after)
    assert payload.after is not None and payload.after.key == ("grad-header", 0, 0, 0, 0)


@pytest.mark.parametrize("schedule", SYNCHRONOUS)
@pytest.mark.parametrize("block", [1, 3])
def test_synchronous_schedules_take_m_plus_s_minus_1_slots(schedule: str, block: int) -> None:
    # Equal stages, free messages: (M + S - 1) * (tf + tb) per mini-batch, each step flushed.
    stages, micro = 4, 4
    result = simulate_pipeline(
        equal_stages(stages, micro), schedule, FREE, microbatches=micro, block=block
    )
    assert result.iteration_s == pytest.approx((micro + stages - 1) * (1 + 2))
    assert result.block_s == pytest.approx(block * (micro + stages - 1) * 3)


@pytest.mark.parametrize("stages, block", [(2, 2), (4, 4), (4, 8)])
def test_asynchronous_1f1b_fills_and_drains_once_per_block(stages: int, block: int) -> None:
    # Whole mini-batches (one chunk), forward = backward = 1, free messages: the unit-time
    # schedule of 2K + 2(S - 1) ticks (S = 2, K = 2: F0 F1 on stage 0, F0 B0 F1 B1 on stage 1
    # one tick later, stage 0's B0 at tick 3 and B1 at tick 5).
    result = simulate_pipeline(
        equal_stages(stages, 1, tf=1.0, tb=1.0), "pipedream", FREE, microbatches=1, block=block
    )
    assert result.block_s == pytest.approx(2 * block + 2 * (stages - 1))
    assert result.iteration_s == pytest.approx((2 * block + 2 * (stages - 1)) / block)


def test_a_recomputation_hides_behind_the_gradients_wait() -> None:
    # 2 stages, one mini-batch: SpecTrain's stage 0 computes again (1) while stage 1 runs its
    # forward and backward (1 + 2), so it ends with PipeDream: 1 + 1 + 2 + 2 = 6. (Naive's one
    # mini-batch meets no update between its passes and keeps its forward's graph.)
    stages = equal_stages(2, 1)
    times = {
        s: simulate_pipeline(stages, s, FREE, microbatches=1).block_s
        for s in ("naive", "spectrain", "pipedream", "spectrain-reuse")
    }
    assert times == pytest.approx(dict.fromkeys(times, 6.0))


def test_messages_cost_a_plus_b_bytes_each_way() -> None:
    """2 stages, 1 micro-batch: F, activation, F, B, gradient, B.

    interlace's tensor is a header (80 bytes, then one crossing of a / 3), the ready notice for
    its payload (a / 3) and the payload (b bytes + a / 3): a + b (bytes + 80) each way. torch's
    receive is posted before the tensor is sent, so its notice is back already: b bytes + a / 3.
    """
    a, b = 0.3, 0.001
    cost = CostModel(a, b)
    stages = [StageCost(1.0, 2.0, 1000.0), StageCost(1.0, 2.0, 0.0)]
    for schedule in INTERLACE_PIPELINE_SCHEDULES:
        result = simulate_pipeline(stages, schedule, cost, microbatches=1)
        assert result.block_s == pytest.approx(6 + 2 * (a + b * 1080)), schedule
    torch_gpipe = simulate_pipeline(stages, "torch-gpipe", cost, microbatches=1)
    assert torch_gpipe.block_s == pytest.approx(6 + 2 * (b * 1000 + a / 3))


def test_torch_posts_a_receive_late_so_its_transfer_waits() -> None:
    """2 stages, 2 micro-batches, forward 1 and backward 2 each, 0.5 per message.

    interlace (receives posted ahead): activations move at [1, 1.5] and [2, 2.5]; stage 1 runs
    F0 [1.5, 2.5], F1 [2.5, 3.5], B0 [3.5, 5.5], B1 [5.5, 7.5]; the gradients move at
    [5.5, 6] and [7.5, 8]; stage 0 runs B0 [6, 8], B1 [8, 10]: 10.

    torch (each receive posted just before its computation): activation 1 waits for stage 1's
    F0 to end and moves at [2.5, 3]; F1 [3, 4], B0 [4, 6], B1 [6, 8]; stage 0 posted gradient
    0's receive long before (its forward sends had arrived at 3): [6, 6.5], B0 [6.5, 8.5];
    gradient 1's receive is posted only then: [8.5, 9], B1 [9, 11]: 11.
    """
    cost = CostModel(0.0, 1e-7)  # 0.5 per piece of 5e6 bytes; interlace's header is 8e-6
    stages = [StageCost(2.0, 4.0, 1e7), StageCost(2.0, 4.0, 0.0)]
    interlace = simulate_pipeline(stages, "gpipe", cost, microbatches=2)
    torch_gpipe = simulate_pipeline(stages, "torch-gpipe", cost, microbatches=2)
    assert interlace.block_s == pytest.approx(10.0, abs=1e-4)
    assert torch_gpipe.block_s == pytest.approx(11.0)


def _message(name: str, src: int, dst: int, nbytes: float = 1000.0) -> Message:
    return Message((name,), src, dst, nbytes)


def test_two_pairs_share_a_sending_link_fairly() -> None:
    # 1000 bytes to each of two ranks at 1 ms/byte: half the link each, both done at 2 s.
    one, two = _message("x", 0, 1), _message("y", 0, 2)
    replay = replay_programs(
        [
            [Send(one), Send(two), Wait((one, two))],
            [Post(one), Wait((one,))],
            [Post(two), Wait((two,))],
        ],
        CostModel(0.0, 0.001),
        buffer_bytes=0,
    )
    assert replay.finish_s == pytest.approx((2.0, 2.0, 2.0))


def test_two_senders_share_a_receiving_link_fairly() -> None:
    one, two = _message("x", 1, 0), _message("y", 2, 0)
    replay = replay_programs(
        [
            [Post(one), Post(two), Wait((one,)), Compute(0.0, "f"), Wait((two,))],
            [Send(one), Wait((one,))],
            [Send(two), Wait((two,))],
        ],
        CostModel(0.0, 0.001),
        buffer_bytes=0,
    )
    assert replay.finish_s == pytest.approx((2.0, 2.0, 2.0))


def test_messages_of_one_pair_go_one_after_the_other() -> None:
    """One stream per pair: the second message's bytes follow the first's last byte.

    a = 0.25: every crossing takes 1/12. Both receives are posted at 0, their notices are back
    at 1/12; the first payload moves [1/12, 13/12] and lands at 14/12, the second moves
    [13/12, 25/12] and lands at 26/12. With no socket buffer the sender's handles complete as
    the last byte goes on the wire, at 25/12."""
    one, two = _message("x", 0, 1), _message("y", 0, 1)
    replay = replay_programs(
        [
            [Send(one), Send(two), Wait((one, two))],
            [Post(one), Post(two), Wait((one,)), Compute(0.5, "f"), Wait((two,))],
        ],
        CostModel(0.25, 0.001),
        buffer_bytes=0,
    )
    spans = [t for s in replay.transfers for t in (s.start_s, s.end_s)]
    assert spans == pytest.approx([1 / 12, 14 / 12, 13 / 12, 26 / 12])
    assert replay.finish_s == pytest.approx((25 / 12, 26 / 12))


def test_a_ready_notice_waits_behind_the_bytes_of_its_stream() -> None:
    """Rank 0 streams 1000 bytes to rank 1 from 0 to 1 s; at 0.1 s it posts the receive of 10
    bytes from rank 1, whose ready notice goes out on the same stream after them: rank 1 learns
    of it at 1 s and its 10 bytes land at 1.01 s."""
    big, small = _message("x", 0, 1), _message("y", 1, 0, 10.0)
    replay = replay_programs(
        [
            [Send(big), Compute(0.1, "f"), Post(small), Wait((small, big))],
            [Post(big), Send(small), Wait((big, small))],
        ],
        CostModel(0.0, 0.001),
        buffer_bytes=0,
    )
    assert replay.finish_s == pytest.approx((1.01, 1.01))
    assert [s.start_s for s in replay.transfers if s.label.startswith("y")] == pytest.approx([1.0])


def test_a_payload_is_posted_when_its_header_lands() -> None:
    header = _message("h", 0, 1, 0.0)
    payload = Message(("p",), 0, 1, 1000.0, after=header)
    replay = replay_programs(
        [[Send(header), Send(payload), Wait((header, payload))], [Post(header), Wait((payload,))]],
        CostModel(0.0, 0.001),
        buffer_bytes=0,
    )
    assert replay.finish_s == pytest.approx((1.0, 1.0))


@pytest.mark.parametrize(("buffer", "done"), [(0.0, 1.0), (400.0, 0.6), (4096.0, 0.0)])
def test_a_send_is_complete_once_its_socket_buffer_holds_the_rest(
    buffer: float, done: float
) -> None:
    # 1000 bytes at 1 ms a byte: the sender's handle completes when no more than the buffer is
    # left to go, the receiver still waits for the last byte.
    message = _message("x", 0, 1)
    replay = replay_programs(
        [[Send(message), Wait((message,))], [Post(message), Wait((message,))]],
        CostModel(0.0, 0.001),
        buffer_bytes=buffer,
    )
    assert replay.finish_s == pytest.approx((done, 1.0))


def test_a_flow_gets_what_its_busier_link_leaves() -> None:
    # Max-min: pairs (0,1) and (0,2) share rank 0's sending link; (3,2) shares rank 2's
    # receiving link with (0,2). Capacity 1: every pair gets a half.
    rates = fair_rates(
        [_message("a", 0, 1), _message("b", 0, 2), _message("c", 3, 2), _message("d", 4, 5)], 1.0
    )
    assert rates == {(0, 1): 0.5, (0, 2): 0.5, (3, 2): 0.5, (4, 5): 1.0}
    # (0,1) alone with (0,2), which also shares rank 2's link with two more: 1/3 for those
    # three, 2/3 left to (0,1).
    rates = fair_rates(
        [_message("a", 0, 1), _message("b", 0, 2), _message("c", 3, 2), _message("d", 4, 2)], 1.0
    )
    assert rates[(0, 1)] == pytest.approx(2 / 3)
    assert rates[(0, 2)] == rates[(3, 2)] == rates[(4, 2)] == pytest.approx(1 / 3)


def test_a_program_waiting_on_a_message_never_sent_is_a_deadlock() -> None:
    lost = _message("x", 0, 1)
    with pytest.raises(ValueError, match="deadlock"):
        replay_programs([[Compute(1.0, "f")], [Post(lost), Wait((lost,))]], FREE)


def _count(program: list[object], label: str) -> int:
    return sum(1 for op in program if isinstance(op, Compute) and op.label == label)


def test_host_work_lands_where_the_runtime_does_it() -> None:
    host = HostCost(update_s=1.0, predict_s=1.0, copy_s=1.0, scale_s=1.0)
    stages = [StageCost(4.0, 8.0, 0.0 if k == 3 else 10.0, host) for k in range(4)]
    block = 3

    def counts(schedule: str, label: str) -> list[int]:
        programs = stage_programs(stages, schedule, microbatches=4, block=block)
        return [_count(p, label) for p in programs]

    # SpecTrain predicts every forward (s_fwd = 3, 2, 2, 1) and, computing again before its
    # backward, stage 2's (s_bwd = 0, 0, 1; the last stage keeps the forward's graph).
    assert counts("spectrain", "predict") == [3, 3, 6, 3]
    assert counts("spectrain-reuse", "predict") == [3, 3, 3, 3]
    assert counts("spectrain", "recompute") == [12, 12, 12, 0]  # every chunk but the last's
    assert counts("naive", "recompute") == [12, 12, 12, 0]
    assert counts("naive", "predict") == [0, 0, 0, 0]
    assert counts("pipedream", "stash") == [3, 3, 3, 0]  # no update between on the last
    assert counts("pipedream", "recompute") == [0, 0, 0, 0]
    for schedule in PIPELINE_SCHEDULES:
        assert counts(schedule, "update") == [block] * 4, schedule
        torch = schedule.startswith("torch")
        assert counts(schedule, "scale") == [block if torch else 0] * 4, schedule
        assert counts(schedule, "forward") == [4 * block] * 4, schedule
        # One sending call per piece each way: activations on, gradients back.
        assert counts(schedule, "send") == [4 * block, 8 * block, 8 * block, 4 * block], schedule


def test_host_work_adds_to_a_stage_alone() -> None:
    # 2 stages, 1 micro-batch, free messages: 1 + 1 + 2 + 2, plus stage 0's host forward and
    # backward (0.5 each) and the update that ends its block (0.25).
    host = HostCost(forward_s=0.5, backward_s=0.5, update_s=0.25)
    stages = [StageCost(1.0, 2.0, 10.0, host), StageCost(1.0, 2.0, 0.0)]
    assert simulate_pipeline(stages, "gpipe", FREE, microbatches=1).block_s == pytest.approx(7.25)


def three_layer_trace() -> Trace:
    """Layers l0 -> l1 -> l2 (forward order), in backward order as traces keep them; traced at
    a batch of 8."""
    ms = 1e-3
    times = {"l0": (1, 2), "l1": (3, 4), "l2": (5, 6)}
    tensors = tuple(
        TensorTrace(f"{name}.w", name, 10, 40, f * ms, b * ms)
        for name, (f, b) in reversed(times.items())
    )
    return Trace(
        "three",
        tensors,
        forward_s=9 * ms,
        backward_s=12 * ms,
        activations=(
            ActivationTrace("l0", (4, 2)),
            ActivationTrace("l1", (3,)),
            ActivationTrace("l2", (10,)),
        ),
        batch_size=8,
    )


def test_stage_costs_scale_the_traced_layers_to_the_batch() -> None:
    costs = stage_costs(three_layer_trace(), [(0, 1), (1, 3)], 16)
    ms = 1e-3
    assert costs[0].forward_s == pytest.approx(2 * ms)  # 1 ms traced at 8, twice the samples
    assert costs[0].backward_s == pytest.approx(4 * ms)
    assert costs[1].forward_s == pytest.approx(16 * ms)
    assert costs[1].backward_s == pytest.approx(20 * ms)
    assert costs[0].output_bytes == 4 * 2 * 4 * 16  # l0's (4, 2) float32 output, 16 samples
    assert costs[1].output_bytes == 0


def test_stage_costs_spread_the_passes_outside_the_layers_over_them() -> None:
    ms = 1e-3
    trace = three_layer_trace()
    rest = Trace(  # the layers own 9 of 18 ms forward and 12 of 15 ms backward
        trace.model, trace.tensors, 18 * ms, 15 * ms, activations=trace.activations, batch_size=8
    )
    costs = stage_costs(rest, [(0, 1), (1, 3)], 8)
    assert costs[0].forward_s == pytest.approx(2 * ms)  # l0's 1 ms, doubled
    assert costs[0].backward_s == pytest.approx(2.5 * ms)  # l0's 2 ms, times 15 / 12
    assert sum(c.forward_s for c in costs) == pytest.approx(18 * ms)
    assert sum(c.backward_s for c in costs) == pytest.approx(15 * ms)


def test_trace_bounds_balance_the_traced_times() -> None:
    trace = three_layer_trace()
    assert trace_bounds(trace, 2) == balance_stages([3, 7, 11], 2) == [(0, 2), (2, 3)]


@pytest.mark.parametrize(
    ("bounds", "needle"),
    [
        ([(0, 1), (2, 3)], "contiguous"),
        ([(0, 2)], "cover"),
        ([(0, 1), (1, 1), (1, 3)], "non-empty"),
    ],
)
def test_bad_stage_bounds_are_usage_errors(bounds: list[tuple[int, int]], needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        stage_costs(three_layer_trace(), bounds, 8)


def test_a_trace_without_activation_sizes_is_refused() -> None:
    trace = three_layer_trace()
    bare = Trace(trace.model, trace.tensors, trace.forward_s, trace.backward_s, batch_size=8)
    with pytest.raises(UsageError, match="activation size"):
        stage_costs(bare, [(0, 3)], 8)


def test_unknown_schedule_and_too_few_microbatches_are_usage_errors() -> None:
    stages = equal_stages(4, 2)
    with pytest.raises(UsageError, match="unknown pipeline schedule"):
        simulate_pipeline(stages, "dp", FREE, microbatches=2)
    with pytest.raises(UsageError, match="Schedule1F1B"):
        simulate_pipeline(stages, "torch-1f1b", FREE, microbatches=2)


def test_every_schedule_ends_and_keeps_each_stage_busy_for_its_work() -> None:
    stages = equal_stages(4, 4, nbytes=1e6)
    cost = CostModel(1e-4, 1e-6)
    for schedule in PIPELINE_SCHEDULES:
        result = simulate_pipeline(stages, schedule, cost, microbatches=4, block=2)
        recompute = schedule in ("naive", "spectrain")
        for k in range(4):
            work = 2 * (4 + 8) + (2 * 4 if recompute and k < 3 else 0)
            assert result.replay.busy_s(k) == pytest.approx(work), (schedule, k)
        assert math.isfinite(result.block_s) and result.block_s >= 2 * 12


def test_measured_compute_scales_the_device_time_around_the_host_work() -> None:
    # Two pieces of 0.1 + 0.2 s host work, a 0.05 s division and a 0.15 s update: 0.8 s of host
    # work, so a 4.8 s mini-batch leaves 4 s of device time for the trace's 2 + 6: half of each.
    host = HostCost(forward_s=0.1, backward_s=0.2, scale_s=0.05, update_s=0.15)
    stages = [StageCost(2.0, 6.0, 100.0, host), StageCost(1.0, 1.0, 0.0)]
    first, second = with_measured_compute(stages, [4.8, 3.0], 2)
    assert (first.forward_s, first.backward_s) == (pytest.approx(1.0), pytest.approx(3.0))
    assert (second.forward_s, second.backward_s) == (pytest.approx(1.5), pytest.approx(1.5))
    assert first.host == host and first.output_bytes == 100.0
    with pytest.raises(UsageError, match="1 measured stage times for 2 stages"):
        with_measured_compute(stages, [1.0], 2)
