"""The emulated model: traced structure, device time, gradients equal to torch DDP's."""

from __future__ import annotations

import copy
import itertools
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from interlace.bench.harness import NUM_CLASSES, RankJob
from interlace.comm.cost import CostModel
from interlace.comm.plan import Bucketing
from interlace.dp import DataParallel
from interlace.emulate import EmulatedModel, gradient_factor, measure_cost, parse_compute
from interlace.emulate.device import MAX_CREDIT_S
from interlace.errors import UsageError
from interlace.sim.trace import TensorTrace, Trace, load_trace
from interlace.testing import run_ranks

MS = 1e-3
# A cost model that makes "merged" form several buckets on the small trace.
COST = CostModel(a=2e-4, b=1e-9)


def small_trace(backward_ms: tuple[float, ...] = (1.0, 2.0, 1.5, 0.5)) -> Trace:
    """Layers of a weight and a bias each, in backward order (the last layer first)."""
    tensors = []
    for index, ms in enumerate(backward_ms):
        layer = f"block{len(backward_ms) - 1 - index}"
        for name, numel in (("bias", 3 + index), ("weight", 40 * (index + 1))):
            tensors.append(
                TensorTrace(f"{layer}.{name}", layer, numel, 4 * numel, ms / 2 * MS, ms * MS)
            )
    total = sum(backward_ms) * MS
    return Trace("toy", tuple(tensors), forward_s=total / 2, backward_s=total)


# ---------------------------------------------------------------------- structure


def test_the_googlenet_model_has_the_traced_parameters_in_forward_order() -> None:
    trace = load_trace("googlenet-k80")
    model = EmulatedModel("googlenet-k80")
    params = list(model.parameters())
    assert len(params) == 128
    assert sum(p.numel() for p in params) == 13_379_136
    assert [p.numel() for p in params] == [t.numel for t in reversed(trace.tensors)]
    assert len(model.emulated_layers()) == 64
    assert [layer.name for layer in model.emulated_layers()] == [
        name for name, _ in reversed(trace.layers)
    ]
    # Named as traced: layer 0's tensors, in the trace's order reversed.
    assert [name for name, _ in model.named_parameters()][:2] == [
        f"layers.0.{t.name.partition('.')[2]}" for t in reversed(trace.tensors[-2:])
    ]


def test_device_time_is_the_traced_time_times_the_dilation() -> None:
    trace = small_trace()
    model = EmulatedModel(trace, dilation=3.0)
    for layer in model.emulated_layers():
        tensor = next(t for t in trace.tensors if t.layer == layer.name)
        assert layer.forward_s == pytest.approx(3.0 * tensor.layer_forward_s)
        assert layer.backward_s == pytest.approx(3.0 * tensor.layer_backward_s)
    assert model.device_s == pytest.approx(3.0 * (trace.forward_s + trace.backward_s))


# ---------------------------------------------------------------------- device time


def _one_layer(forward_ms: float, backward_ms: float) -> Trace:
    return Trace(
        "one",
        (TensorTrace("only.weight", "only", 10, 40, forward_ms * MS, backward_ms * MS),),
        forward_s=forward_ms * MS,
        backward_s=backward_ms * MS,
    )


@pytest.mark.parametrize("dilation", [1.0, 4.0])
def test_a_layer_of_t_seconds_takes_t_times_the_dilation(dilation: float) -> None:
    forward_ms, backward_ms = 5.0, 10.0
    model = EmulatedModel(_one_layer(forward_ms, backward_ms), dilation=dilation)
    (layer,) = model.emulated_layers()
    x = torch.ones(2, 1)
    for call in (layer, model):  # the layer on its own, and inside the model's forward
        start = time.perf_counter()
        out = call(x)
        forward_took = time.perf_counter() - start
        start = time.perf_counter()
        out.sum().backward()
        backward_took = time.perf_counter() - start
        # The forward's spend repays an earlier sleep's overshoot (the device's credit, at most
        # MAX_CREDIT_S), so it may end that much early; the scheduler's overshoot makes the
        # upper bound loose. Backward sleeps to deadlines and never ends early.
        assert forward_took >= forward_ms * MS * dilation - MAX_CREDIT_S
        assert backward_took >= backward_ms * MS * dilation
        assert forward_took < forward_ms * MS * dilation + 0.5
        assert backward_took < backward_ms * MS * dilation + 0.5


def test_parameter_free_time_comes_after_the_layers_in_each_pass() -> None:
    # Layers own 5 ms of forward and 10 ms of backward; the trace's passes take 30 and 40 ms.
    only = TensorTrace("only.weight", "only", 10, 40, 5 * MS, 10 * MS)
    trace = Trace("rest", (only,), forward_s=30 * MS, backward_s=40 * MS)
    model = EmulatedModel(trace, dilation=2.0)
    assert model.device_s == pytest.approx(2 * 70 * MS)
    x = torch.ones(2, 1)
    start = time.perf_counter()
    out = model(x)
    assert time.perf_counter() - start >= 60 * MS
    ready: list[float] = []
    (param,) = model.parameters()
    param.register_post_accumulate_grad_hook(lambda _: ready.append(time.perf_counter()))
    start = time.perf_counter()
    out.sum().backward()
    took = time.perf_counter() - start
    # The gradient is ready after the layer's 20 ms, the pass ends after the trace's 80 ms.
    assert 20 * MS <= ready[0] - start < 60 * MS
    assert took >= 80 * MS
    assert model.emulation_cost().device_s == pytest.approx(model.device_s)
    assert not x.requires_grad


def test_the_model_counts_its_device_time_and_its_own_cpu_time() -> None:
    model = EmulatedModel(small_trace(), dilation=0.5)
    model(torch.ones(4, 1)).sum().backward()
    cost = model.emulation_cost()
    assert cost.iterations == 1
    assert cost.device_s == pytest.approx(model.device_s)
    assert cost.cpu_s >= 0 and "ms per iteration" in cost.describe()
    model.reset_emulation_cost()
    assert model.emulation_cost().iterations == 0
    measured = measure_cost(model, torch.ones(4, 1), iterations=2)
    assert measured.iterations == 2
    assert measured.device_s == pytest.approx(2 * model.device_s)


# ---------------------------------------------------------------------- gradients


def test_gradients_follow_the_inputs_and_a_fixed_factor_per_parameter() -> None:
    model = EmulatedModel(small_trace(), dilation=0.01)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(3))
    model(x).sum().backward()
    position = 0
    for index, layer in enumerate(model.emulated_layers()):
        for param in layer.parameters():
            # The layer's scalar (upstream gradient of ones x input, / (index + 1)) x factor.
            expected = float(x.sum()) / (index + 1) * gradient_factor(position)
            assert param.grad is not None
            assert torch.allclose(param.grad, torch.full_like(param, expected), rtol=1e-5)
            position += 1
    other = EmulatedModel(small_trace(), dilation=0.01)
    other(x + 1).sum().backward()
    first = next(iter(model.parameters())).grad
    assert first is not None and not torch.equal(first, next(iter(other.parameters())).grad)


def test_each_layer_s_gradients_are_ready_before_the_next_layer_s_backward() -> None:
    model = EmulatedModel(small_trace(backward_ms=(20.0, 20.0, 20.0, 20.0)), dilation=1.0)
    fired: list[tuple[str, float]] = []
    for layer in model.emulated_layers():
        for param in layer.parameters():
            param.register_post_accumulate_grad_hook(
                lambda _, name=layer.name: fired.append((name, time.perf_counter()))
            )
    out = model(torch.ones(2, 1))
    began: list[float] = []
    # Fires as backward reaches the model's output, before any emulated layer's backward.
    out.register_hook(lambda grad: began.append(time.perf_counter()))
    out.sum().backward()
    names = [layer.name for layer in model.emulated_layers()]
    assert [name for name, _ in fired][::2] == names[::-1]
    # Layer k's hooks (in backward order) come no sooner than k + 1 whole backwards (20 ms each)
    # after backward began: the device runs the layers back to back.
    times = [stamp for _, stamp in fired[::2]]
    assert all(later >= earlier for earlier, later in itertools.pairwise(times))
    assert all(stamp - began[0] >= 0.02 * (k + 1) for k, stamp in enumerate(times))


def _compare_with_ddp(steps: int) -> dict[str, Any]:
    """DDP and DataParallel (each bucketing) on one emulated model; worst gradient gaps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict[str, Any] = {}
    for bucketing in Bucketing:
        reference = EmulatedModel(small_trace(), dilation=0.01)
        ours_model = copy.deepcopy(reference)
        ddp = DistributedDataParallel(reference)
        ours = DataParallel(ours_model, bucketing=bucketing, profile_steps=2, cost_model=COST)
        worst, worst_reference, locals_differ = 0.0, 0.0, False
        for step in range(steps):
            batches = [
                torch.randn(4, 3, generator=torch.Generator().manual_seed(100 * step + r))
                for r in range(world)
            ]
            for model in (ddp, ours):
                model.zero_grad(set_to_none=True)
                model(batches[rank]).sum().backward()
            sums = [float(b.sum()) for b in batches]
            locals_differ |= len(set(sums)) > 1
            position = 0
            for index, layer in enumerate(reference.emulated_layers()):
                for p_ddp in layer.parameters():
                    # The average of every rank's local gradient, written out independently.
                    mean = sum(sums) / world / (index + 1) * gradient_factor(position)
                    assert p_ddp.grad is not None
                    worst_reference = max(
                        worst_reference, float((p_ddp.grad - mean).abs().max()) / abs(mean)
                    )
                    position += 1
            for p_ddp, p_ours in zip(reference.parameters(), ours_model.parameters(), strict=True):
                assert p_ddp.grad is not None and p_ours.grad is not None
                worst = max(worst, float((p_ddp.grad - p_ours.grad).abs().max()))
        report[str(bucketing)] = {
            "worst": worst,
            "worst_reference": worst_reference,
            "locals_differ": locals_differ,
            "buckets": len(ours.plan.buckets) if ours.plan else None,
        }
    return report


def test_every_bucketing_gives_ddp_s_gradients_on_the_emulated_model() -> None:
    report = run_ranks(_compare_with_ddp, 2, 5, timeout=240)[0]
    assert set(report) == {str(b) for b in Bucketing}
    for bucketing, result in report.items():
        assert result["buckets"] is not None, f"{bucketing}: never planned"
        assert result["locals_differ"], bucketing
        assert result["worst"] < 1e-6, (bucketing, result["worst"])
        assert result["worst_reference"] < 1e-5, (bucketing, result["worst_reference"])
    assert report["single"]["buckets"] == 1
    assert report["per-tensor"]["buckets"] == 8


# ---------------------------------------------------------------------- bad inputs


def test_an_unknown_trace_name_names_the_shipped_ones() -> None:
    with pytest.raises(UsageError, match="googlenet-k80") as caught:
        EmulatedModel("nosuch-trace")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("dilation", [0.0, -2.0, float("nan"), float("inf")])
def test_a_bad_dilation_is_a_clear_error(dilation: float) -> None:
    with pytest.raises(UsageError, match="dilation must be a finite number > 0"):
        EmulatedModel(small_trace(), dilation=dilation)


def test_each_layer_spends_its_own_share_of_the_forward_so_a_pre_hook_waits_between_layers() -> (
    None
):
    # Layers own 5 + 15 ms of a 40 ms forward: the rest is spread in proportion, 10 and 30 ms.
    first = TensorTrace("first.weight", "first", 10, 40, 5 * MS, 1 * MS)
    second = TensorTrace("second.weight", "second", 10, 40, 15 * MS, 1 * MS)
    trace = Trace("spread", (second, first), forward_s=40 * MS, backward_s=2 * MS)
    model = EmulatedModel(trace, dilation=1.0)
    assert [layer.forward_s for layer in model.emulated_layers()] == pytest.approx(
        [gate.forward_s for gate in trace.forward_gates()]
    )
    assert [layer.forward_s for layer in model.emulated_layers()] == pytest.approx(
        [10 * MS, 30 * MS]
    )
    reached: list[float] = []
    for layer in model.emulated_layers():
        layer.register_forward_pre_hook(lambda *_: reached.append(time.perf_counter()))
    start = time.perf_counter()
    model(torch.ones(2, 1))
    took = time.perf_counter() - start
    assert reached[0] - start < 10 * MS  # the first layer is reached at once
    assert reached[1] - start >= 10 * MS  # the second after the first layer's share
    assert took >= 40 * MS


def test_the_language_model_trace_emulates_on_the_bench_s_float_batches() -> None:
    """An Embedding-first model's trace: the emulated layers pass their input through, so the
    bench's batches stay float logits (never token ids) and every traced tensor gets a gradient."""
    job = RankJob(
        model="gpt-cpu",
        batch=4,
        input_shape=(128,),
        iters=1,
        warmup=0,
        num_classes=256,
        compute=parse_compute("emulated:gpt-cpu", 0.01),
    )
    model = job.module()
    assert isinstance(model, EmulatedModel)
    inputs, targets = job.batches(stream=0)[0]
    assert inputs.dtype == torch.float32 and inputs.shape == (4, NUM_CLASSES)
    torch.nn.functional.cross_entropy(model(inputs), targets).backward()
    trace = load_trace("gpt-cpu")
    assert sum(p.numel() for p in model.parameters()) == trace.total_numel == 875_264
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    # The embeddings come first in forward order, as in the traced model.
    assert [layer.name for layer in model.emulated_layers()][:2] in (
        ["token", "position"],
        ["position", "token"],
    )
