"""The bucket engine against a plain per-tensor all-reduce average, on two ranks."""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from interlace.comm.channels import Channels
from interlace.comm.engine import BucketEngine
from interlace.comm.hooks import HookSpec
from interlace.comm.plan import Launch
from interlace.testing import run_ranks, run_scenarios

#: Shapes and dtypes of the test's gradients: a float64 tensor inside a float32 bucket makes the
#: engine split that bucket by dtype.
SHAPES: list[tuple[tuple[int, ...], torch.dtype]] = [
    ((3, 4), torch.float32),
    ((5,), torch.float32),
    ((2, 2, 2), torch.float64),
    ((7,), torch.float32),
    ((1,), torch.float32),
]


def _gradients(step: int) -> list[torch.Tensor]:
    """This rank's gradients for ``step``: different on every rank and every step."""
    generator = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return [torch.randn(shape, generator=generator).to(dtype) for shape, dtype in SHAPES]


def _reference(grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The average over ranks, one all-reduce per tensor; a tensor no rank sent stays None.

    A tensor this rank did not send counts as zeros, as long as some rank sent it."""
    world = dist.get_world_size()
    sent = torch.tensor([0.0 if grad is None else 1.0 for grad in grads])
    dist.all_reduce(sent)
    averaged: list[torch.Tensor | None] = []
    for (shape, dtype), grad, count in zip(SHAPES, grads, sent.tolist(), strict=True):
        if count == 0:
            averaged.append(None)
            continue
        value = torch.zeros(shape, dtype=dtype) if grad is None else grad / world
        dist.all_reduce(value)
        averaged.append(value)
    return averaged


def _worst(
    got: list[torch.Tensor | None], expected: list[torch.Tensor | None]
) -> tuple[float, bool]:
    """The largest relative difference, and whether None appears exactly where expected."""
    worst = 0.0
    same_none = True
    for mine, theirs in zip(got, expected, strict=True):
        if mine is None or theirs is None:
            same_none = same_none and mine is None and theirs is None
            continue
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
        difference = (mine.double() - theirs.double()).norm() / theirs.double().norm()
        worst = max(worst, float(difference))
    return worst, same_none


def _run(
    engine: BucketEngine, grads: list[torch.Tensor | None], *, in_place: bool = False
) -> list[torch.Tensor | None]:
    """One iteration: gradients in reverse registration order (as backward visits them); with
    ``in_place`` each is written into its slot first and handed over as that view."""
    engine.begin()
    for index in reversed(range(len(grads))):
        grad = grads[index]
        if grad is not None:
            engine.add(index, engine.slot(index).copy_(grad) if in_place else grad)
    return [None if value is None else value.clone() for value in engine.finish()]


def _plain_buckets(_: None) -> dict[str, Any]:
    tensors = [torch.zeros(shape, dtype=dtype) for shape, dtype in SHAPES]
    engine = BucketEngine(tensors, [[4, 3], [2, 1, 0]])
    report: dict[str, Any] = {"groups": engine.groups, "worst": [], "none_ok": []}
    for step in range(4):
        grads: list[torch.Tensor | None] = list(_gradients(step))
        if step == 2:
            grads[1] = None  # on every rank: no gradient at all for tensor 1
            if dist.get_rank() == 0:
                grads[3] = None  # on rank 0 only: rank 1's gradient, averaged with zeros
        # The last step writes each gradient straight into its slot.
        got = _run(engine, grads, in_place=step == 3)
        worst, none_ok = _worst(got, _reference(grads))
        report["worst"].append(worst)
        report["none_ok"].append(none_ok)
    return report


def test_buckets_average_like_one_all_reduce_per_tensor(two_ranks: dict[str, list[Any]]) -> None:
    for report in two_ranks["plain"]:
        # The float64 tensor split the second bucket: [2] alone, then [1, 0].
        assert report["groups"] == [[4, 3], [2], [1, 0]]
        assert report["worst"] == [0.0, 0.0, 0.0, 0.0]
        assert all(report["none_ok"])


def _marks_per_bucket(_: None) -> dict[str, Any]:
    tensors = [torch.zeros(shape, dtype=dtype) for shape, dtype in SHAPES]
    engine = BucketEngine(tensors, [[4, 3], [2], [1, 0]])
    grads: list[torch.Tensor | None] = list(_gradients(0))
    grads[4] = None  # on every rank
    if dist.get_rank() == 0:
        grads[3] = None  # rank 1's only
    engine.begin()
    for index in reversed(range(len(grads))):
        grad = grads[index]
        if grad is not None:
            engine.add(index, grad)
    engine.close()
    engine.wait([0])
    first = engine.averaged([3, 4])
    waited_first = engine.waited_buckets()
    expected = _reference(grads)
    worst, none_ok = _worst([None if v is None else v.clone() for v in first], expected[3:])
    engine.wait([1, 2])
    return {"worst": worst, "none_ok": none_ok, "waited_first": waited_first}


def test_a_bucket_with_unused_tensors_is_usable_without_the_others(
    two_ranks: dict[str, list[Any]],
) -> None:
    for report in two_ranks["marks"]:
        # Bucket 0 carries its own usage marks: reading which of its tensors some rank used
        # waits for it alone, though it is not the bucket sent last.
        assert report["waited_first"] == [0]
        assert report["worst"] == 0.0 and report["none_ok"]


def _compressed(compression: str) -> dict[str, Any]:
    tensors = [torch.zeros(shape, dtype=dtype) for shape, dtype in SHAPES]
    engine = BucketEngine(tensors, [[4, 3, 2, 1, 0]], compression=compression)
    grads: list[torch.Tensor | None] = list(_gradients(0))
    got = _run(engine, grads)
    expected = _reference(grads)
    float32 = [i for i, (_, dtype) in enumerate(SHAPES) if dtype == torch.float32]
    return {
        "float32": _worst([got[i] for i in float32], [expected[i] for i in float32])[0],
        "float64": _worst([got[2]], [expected[2]])[0],
    }


@pytest.mark.parametrize(("compression", "precision"), [("fp16", 1e-3), ("bf16", 8e-3)])
def test_compressed_buckets_round_trip_at_the_wire_types_precision(
    compression: str, precision: float, two_ranks: dict[str, list[Any]]
) -> None:
    for report in two_ranks[compression]:
        # Rounded to the wire type (not bit-identical), within its precision.
        assert 0 < report["float32"] < precision, report
        # Only float32 buckets are compressed.
        assert report["float64"] == 0.0


def _on_channels(_: None) -> dict[str, Any]:
    channels = Channels(2)
    tensors = [torch.zeros(shape, dtype=dtype) for shape, dtype in SHAPES]
    events: list[tuple[int, int, int, float, float]] = []
    engine = BucketEngine(
        tensors,
        [[0, 1], [3, 4], [2]],
        channels=channels.groups,
        # The first bucket cut in two slices, one per channel; the others on one channel each.
        launches=[_send(0, 0, 2, 0), _send(0, 1, 2, 1), _send(1, 0, 1, 1), _send(2, 0, 1, 0)],
        recorder=lambda *event: events.append(event),
    )
    grads: list[torch.Tensor | None] = list(_gradients(0))
    worst, none_ok = _worst(_run(engine, grads), _reference(grads))
    # The recorder runs on the backend's thread as each all-reduce completes: let all 4 land.
    deadline = time.monotonic() + 10.0
    while len(events) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    return {
        "worst": worst,
        "none_ok": none_ok,
        "assignment": engine.assignment,
        "slices": sorted((bucket, channel) for bucket, channel, *_ in events),
        "bytes": sorted((bucket, channel, nbytes) for bucket, channel, nbytes, *_ in events),
        "launch_order": [bucket for bucket, *_ in sorted(events, key=lambda event: event[3])],
    }


def test_partitioned_buckets_on_two_channels_average_like_one_all_reduce_per_tensor(
    two_ranks: dict[str, list[Any]],
) -> None:
    for report in two_ranks["channels"]:
        assert report["worst"] == 0.0 and report["none_ok"]
        assert report["assignment"] == [[0, 1], [1], [0]]
        assert report["slices"] == [(0, 0), (0, 1), (1, 1), (2, 0)]
        # Bucket 0's 17 float32 elements and its 2 usage marks cut 10 + 9: 10 + 7 elements of
        # gradients (the marks are not counted).
        assert report["bytes"] == [(0, 0, 40), (0, 1, 28), (1, 1, 32), (2, 0, 64)]
        # Gradients arrived last-first, yet buckets are launched in plan order.
        assert report["launch_order"] == sorted(report["launch_order"])


def _send(bucket: int, part: int, parts: int, channel: int) -> Launch:
    return Launch(bucket, part, parts, 0, channel, 0.0, 0.0)


def _out_of_order(_: None) -> dict[str, Any]:
    tensors = [torch.zeros(shape, dtype=dtype) for shape, dtype in SHAPES]
    events: list[tuple[int, int, int, float, float]] = []
    # Bucket [0, 1] (ready last) is sent before the rest of bucket [3, 4], whose first slice
    # went out as soon as it was complete: the order the plan says, not the order of arrival.
    engine = BucketEngine(
        tensors,
        [[3, 4], [2], [0, 1]],
        launches=[_send(0, 0, 2, 0), _send(2, 0, 1, 0), _send(1, 0, 1, 0), _send(0, 1, 2, 0)],
        recorder=lambda *event: events.append(event),
    )
    grads: list[torch.Tensor | None] = list(_gradients(0))
    engine.begin()
    sent_after: list[int] = []
    stamped_after: list[list[bool]] = []
    for index in reversed(range(len(grads))):
        grad = grads[index]
        assert grad is not None
        engine.add(index, grad)
        sent_after.append(engine.launcher.launched)
        stamped_after.append([launched is not None for launched in engine.launched_s])
    launched_s = list(engine.launched_s)
    engine.close()
    engine.wait([2])
    first = [None if value is None else value.clone() for value in engine.averaged([0, 1])]
    got = [None if value is None else value.clone() for value in engine.finish()]
    expected = _reference(grads)
    deadline = time.monotonic() + 10.0
    while len(events) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.begin()
    return {
        "worst": _worst(got, expected)[0],
        "first": _worst(first, expected[:2])[0],
        "sent_after": sent_after,
        "stamped_after": stamped_after,
        "launched_s": launched_s,
        "stamped_after_begin": engine.launched_s,
    }


def test_slices_go_out_in_the_plans_launch_order_and_average_like_one_all_reduce(
    two_ranks: dict[str, list[Any]],
) -> None:
    for report in two_ranks["out of order"]:
        # Tensors arrive 4, 3 (bucket 0 complete: its first slice goes), 2 (bucket 1 waits
        # behind bucket 2), 1, 0 (bucket 2 complete: it, bucket 1 and the last slice go).
        assert report["sent_after"] == [0, 1, 1, 1, 4]
        assert report["worst"] == 0.0
        assert report["first"] == 0.0
        # Each bucket's launch time is stamped when its first slice goes, and cleared by begin().
        assert report["stamped_after"] == [
            [False, False, False],
            [True, False, False],
            [True, False, False],
            [True, False, False],
            [True, True, True],
        ]
        first, second, third = report["launched_s"]
        assert first <= third <= second  # plan order: bucket 0, bucket 2, bucket 1
        assert report["stamped_after_begin"] == [None, None, None]


def _bad_launches(kind: str) -> str:
    """The message of the error the engine raises on this rank."""
    tensors = [torch.zeros(2), torch.zeros(3)]
    try:
        if kind == "missing":
            BucketEngine(tensors, [[0], [1]], launches=[_send(0, 0, 1, 0)])
        elif kind == "slice":
            BucketEngine(tensors, [[0, 1]], launches=[_send(0, 0, 2, 0)])
        else:
            BucketEngine(tensors, [[0, 1]], launches=[_send(0, 0, 1, 1)])
    except Exception as error:  # what a user would see, whatever its class
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ("missing", "bucket 1 is not launched"),
        ("slice", "bucket 0 is not launched as a whole set of slices"),
        ("range", "outside 0..0"),
    ],
)
def test_bad_launches_are_refused(kind: str, needle: str, two_ranks: dict[str, list[Any]]) -> None:
    for message in two_ranks[f"bad {kind}"]:
        assert needle in message, message


def test_bad_engines_are_refused_before_any_collective() -> None:
    with pytest.raises(ValueError, match="at least one tensor"):
        BucketEngine([], [])
    with pytest.raises(ValueError, match="unknown compression 'int8'"):
        BucketEngine([torch.zeros(1)], [[0]], compression="int8")


#: The 2-rank scenarios above, by name; the refusals last.
TWO_RANK_SCENARIOS: dict[str, Callable[[], Any]] = {
    "plain": lambda: _plain_buckets(None),
    "marks": lambda: _marks_per_bucket(None),
    "fp16": lambda: _compressed("fp16"),
    "bf16": lambda: _compressed("bf16"),
    "channels": lambda: _on_channels(None),
    "out of order": lambda: _out_of_order(None),
    "bad missing": lambda: _bad_launches("missing"),
    "bad slice": lambda: _bad_launches("slice"),
    "bad range": lambda: _bad_launches("range"),
}


def _every_two_rank_scenario(_: None) -> dict[str, Any]:
    """Each scenario's result on this rank; a failure names its scenario."""
    return run_scenarios(TWO_RANK_SCENARIOS)


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list[Any]]:
    """Every 2-rank scenario's results by rank, from one launch: starting ranks costs more
    than the scenarios do."""
    per_rank = run_ranks(_every_two_rank_scenario, 2, None, timeout=240)
    return {name: [results[name] for results in per_rank] for name in TWO_RANK_SCENARIOS}


def _all_reduce_hook(state: Any, bucket: Any) -> Any:
    """A DDP-style hook: the bucket's sum over ranks, through the future's value."""
    return (
        dist.all_reduce(bucket.buffer(), async_op=True)
        .get_future()
        .then(lambda future: future.value()[0])
    )


def _exit_waits_registered(_: None) -> list[int]:
    """atexit callbacks after building no hooked engine, one, and a second one."""
    BucketEngine([torch.zeros(3)], [[0]])
    counts = [atexit._ncallbacks()]
    for _second in range(2):
        BucketEngine([torch.zeros(3)], [[0]], hook=HookSpec(None, _all_reduce_hook))
        counts.append(atexit._ncallbacks())
    return counts


def test_a_hooked_engine_makes_the_exit_wait_for_gloo_once() -> None:
    # gloo frees a hook's finished work on its own thread; the exit gives it time, once.
    (counts,) = run_ranks(_exit_waits_registered, 1, None)
    assert counts[1] == counts[0] + 1 and counts[2] == counts[1]
