"""The GPU path: CUDA tensors, NCCL (one rank), K-FAC decompositions on the GPU.

Every test here needs a CUDA device and is skipped without one (CI has none). They check that
the same code gives the same numbers on the GPU as on the CPU paths the rest of the suite
verifies against independent references: DataParallel against torch DDP over NCCL, K-FAC on
CUDA against K-FAC on CPU in float64, every SPD-KFAC mode against D-KFAC, and the training job
end to end. TF32 is switched off inside the ranks so float32 products are exact to rounding.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional
from torch.nn.parallel import DistributedDataParallel

from interlace import KFAC, launch
from interlace.comm.calibrate import fit_cost_model
from interlace.comm.cost import CostModel
from interlace.distenv import DistContext, default_backend
from interlace.dp import DataParallel
from interlace.kfac.costs import DecompositionCostModel
from interlace.kfac.factor_modes import Pipelined
from interlace.record import record_trace
from interlace.runlog import read_metrics
from interlace.testing import run_ranks
from interlace.train import TrainConfig, TrainResult, train_rank
from interlace.zoo import build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: A cost model that makes "merged" form several buckets on resnet20.
COST = CostModel(a=2e-4, b=1e-9)


def _exact_float32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True


def _relative(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    assert a is not None and b is not None
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# -- DataParallel over NCCL ------------------------------------------------------------------


def _data_parallel_against_ddp(settings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One NCCL rank: each DataParallel setting trained beside torch DDP for a few steps."""
    _exact_float32()
    device = torch.device("cuda", torch.cuda.current_device())
    reports = []
    for setting in settings:
        torch.manual_seed(1234)
        reference = build_model("resnet20", (1, 8, 8), 10).to(device)
        ours_model = copy.deepcopy(reference)
        ddp = DistributedDataParallel(reference, device_ids=[device.index])
        # One GPU: the whole machinery, which the one-rank shortcut would skip.
        ours = DataParallel(
            ours_model, profile_steps=2, cost_model=COST, single_rank_shortcut=False, **setting
        )
        # Compressed runs keep the weights (lr 0): rounding is then the only difference, not
        # rounding amplified through training by a deep network.
        lr = 0.0 if setting.get("compression") else 0.05
        opt_ddp = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
        opt_ours = torch.optim.SGD(ours.parameters(), lr=lr, momentum=0.9)
        generator = torch.Generator().manual_seed(7)
        worst_grad, losses_ddp, losses_ours = 0.0, [], []
        for _ in range(6):
            inputs = torch.randn(16, 1, 8, 8, generator=generator).to(device)
            targets = torch.randint(0, 10, (16,), generator=generator).to(device)
            for model, optimizer, losses in (
                (ddp, opt_ddp, losses_ddp),
                (ours, opt_ours, losses_ours),
            ):
                optimizer.zero_grad(set_to_none=True)
                loss = functional.cross_entropy(model(inputs), targets)
                loss.backward()
                losses.append(float(loss.detach()))
            for p_ddp, p_ours in zip(reference.parameters(), ours_model.parameters(), strict=True):
                worst_grad = max(worst_grad, _relative(p_ours.grad, p_ddp.grad))
            opt_ddp.step()
            opt_ours.step()
        devices = {str(p.grad.device) for p in ours_model.parameters() if p.grad is not None}
        reports.append(
            {
                "setting": setting,
                "worst_grad": worst_grad,
                "losses_ddp": losses_ddp,
                "losses_ours": losses_ours,
                "buckets": len(ours.plan.buckets) if ours.plan else None,
                "grad_devices": devices,
                "channels": ours.plan.channels if ours.plan else None,
            }
        )
    return reports


def test_data_parallel_on_cuda_over_nccl_matches_ddp() -> None:
    settings: list[dict[str, Any]] = [
        {"bucketing": "merged"},
        {"bucketing": "per-tensor"},
        {"bucketing": "fixed", "bucket_cap_mb": 0.05},
        {"bucketing": "optimal"},
        {"bucketing": "merged", "channels": 2, "partition_mb": 0.01},
    ]
    compressed: list[dict[str, Any]] = [
        {"bucketing": "merged", "compression": "fp16"},
        {"bucketing": "merged", "compression": "bf16"},
    ]
    reports = run_ranks(
        _data_parallel_against_ddp, 1, [*settings, *compressed], backend="nccl", timeout=300
    )[0]
    for report in reports:
        setting = report["setting"]
        assert report["buckets"] is not None, f"{setting}: never planned"
        assert report["grad_devices"] == {"cuda:0"}, setting
        compression = setting.get("compression")
        if compression is None:
            assert report["worst_grad"] < 1e-6, (setting, report["worst_grad"])
            assert report["losses_ours"] == pytest.approx(report["losses_ddp"], rel=1e-6), setting
        else:
            # One rank sends its own gradients: the only change is rounding to 16 bits.
            bound = 2.0**-8 if compression == "fp16" else 2.0**-5
            assert 0 < report["worst_grad"] < bound, (setting, report["worst_grad"])
    assert reports[0]["buckets"] > 1  # the cost model above splits resnet20's gradients
    assert reports[4]["channels"] == 2


def _calibrate_on_cuda() -> dict[str, float]:
    device = torch.device("cuda", torch.cuda.current_device())
    model = fit_cost_model(None, device=device, sizes=(1 << 12, 1 << 16, 1 << 20), use_cache=False)
    return {"a": model.a, "b": model.b}


def test_the_cost_model_is_fitted_with_nccl_all_reduces_of_cuda_tensors() -> None:
    fitted = run_ranks(_calibrate_on_cuda, 1, backend="nccl", timeout=120)[0]
    assert fitted["a"] >= 0 and fitted["b"] >= 0
    # A one-rank NCCL all-reduce of up to 4 MB is a device copy: well under a millisecond each.
    assert fitted["a"] + fitted["b"] * (1 << 20) < 1e-2, fitted


# -- K-FAC on the GPU ------------------------------------------------------------------------


def _kfac_model() -> nn.Module:
    torch.manual_seed(4321)
    return nn.Sequential(
        nn.Conv2d(2, 4, kernel_size=3, stride=2, padding=1, dilation=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 16),
        nn.ReLU(),
        nn.Linear(16, 5),
    )


def _kfac_grads(device: str, options: dict[str, Any], steps: int = 3) -> list[dict[str, Any]]:
    """``steps`` preconditioned gradients of the same model and batches on ``device``."""
    _exact_float32()
    model = _kfac_model().to(device=device, dtype=torch.float64)
    precond = KFAC(
        model, damping=0.01, factor_decay=0.5, kl_clip=None, inv_dtype=torch.float64, **options
    )
    generator = torch.Generator().manual_seed(99)
    grads = []
    for _ in range(steps):
        inputs = torch.randn(12, 2, 9, 9, generator=generator, dtype=torch.float64).to(device)
        targets = torch.randint(0, 5, (12,), generator=generator).to(device)
        model.zero_grad(set_to_none=True)
        functional.cross_entropy(model(inputs), targets).backward()
        precond.step()
        grads.append({n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()})  # type: ignore[union-attr]
        with torch.no_grad():
            for param in model.parameters():
                param.sub_(0.1 * param.grad)  # type: ignore[operator]
    precond.remove_hooks()
    return grads


def _assert_same_grads(
    ours: list[dict[str, Any]], reference: list[dict[str, Any]], what: str
) -> None:
    for step, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        for name, value in theirs.items():
            where = f"{what} step {step} {name}"
            torch.testing.assert_close(
                mine[name], value, rtol=1e-7, atol=1e-10, msg=lambda m, where=where: f"{where}: {m}"
            )


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_kfac_on_cuda_preconditions_like_kfac_on_cpu(method: str) -> None:
    cpu = _kfac_grads("cpu", {"compute_method": method})
    cuda = _kfac_grads("cuda", {"compute_method": method})
    _assert_same_grads(cuda, cpu, f"{method} cuda vs cpu")


def _spd_modes_on_cuda() -> dict[str, list[dict[str, Any]]]:
    modes: dict[str, dict[str, Any]] = {
        "dkfac": {"factor_comm": "bulk", "placement": "greedy"},
        "pipelined": {"factor_comm": Pipelined(fusion="merged"), "placement": "greedy"},
        "lbp": {"factor_comm": "bulk", "placement": "lbp"},
        "spd": {"factor_comm": Pipelined(fusion="merged"), "placement": "lbp"},
    }
    return {mode: _kfac_grads("cuda", options, steps=5) for mode, options in modes.items()}


def test_every_spd_kfac_mode_preconditions_alike_over_nccl() -> None:
    records = run_ranks(_spd_modes_on_cuda, 1, backend="nccl", timeout=300)[0]
    for mode in ("pipelined", "lbp", "spd"):
        _assert_same_grads(records[mode], records["dkfac"], f"{mode} vs dkfac")


def test_decomposition_costs_are_measured_on_the_gpu() -> None:
    fitted = DecompositionCostModel.measure("eigen", "cuda", torch.float32, sizes=(64, 256, 1024))
    predicted = [fitted.time(n) for n in (64, 256, 1024)]
    assert all(value > 0 for value in predicted), fitted
    assert predicted == sorted(predicted), fitted


# -- the training job ------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd", "kfac"])
def test_the_training_job_runs_on_the_gpu(tmp_path: Path, optimizer: str) -> None:
    config = TrainConfig(
        model="resnet20",
        data="digits",
        epochs=2,
        batch_size=64,
        optimizer=optimizer,
        progress=False,
    )
    run_dir = tmp_path / "run"
    result = launch.run(train_rank, 1, args=(config, str(run_dir)), timeout=300).check()
    (only,) = result.values
    assert isinstance(only, TrainResult)
    assert json.loads((run_dir / "config.json").read_text())["device"] == "cuda:0"
    rows = read_metrics(run_dir / "metrics.csv")
    assert [row["epoch"] for row in rows] == [1, 2]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert only.final_test_accuracy > 0.5  # ten classes: chance is 0.1


def _rank_devices() -> tuple[str, str]:
    context = DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=0,
        device=torch.device("cpu"),
        backend=default_backend(),
    )
    return context.backend, dist.get_backend()


def test_more_ranks_than_gpus_fall_back_to_gloo() -> None:
    count = torch.cuda.device_count()
    backends = run_ranks(_rank_devices, count + 1, timeout=120)
    assert {chosen for chosen, _ in backends} == {"gloo"}


# -- device time, not host time ----------------------------------------------------------------


class _HeavyForward(nn.Module):
    """Linear layers around parameter-free matrix products that cost device time in forward
    only: the host queues them in microseconds, the GPU takes milliseconds."""

    def __init__(self, width: int = 2048, products: int = 40) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.last = nn.Linear(width, 10)
        self.register_buffer("mixer", torch.randn(width, width) / width**0.5)
        self.products = products

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        side = x.detach()
        for _ in range(self.products):
            side = side @ self.mixer
        return self.last(x + 0.0 * side)


def _device_forward_s(model: nn.Module, inputs: torch.Tensor) -> float:
    """The forward's device time, read with CUDA events around it (median of 5)."""
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(inputs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[2]


def _profiled_forward_on_cuda() -> dict[str, float]:
    _exact_float32()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = _HeavyForward().to(device)
    inputs = torch.randn(2048, 2048, device=device)
    targets = torch.randint(0, 10, (2048,), device=device)
    ours = DataParallel(model, profile_steps=3, cost_model=COST, single_rank_shortcut=False)
    for _ in range(6):
        functional.cross_entropy(ours(inputs), targets).backward()
    assert ours.plan is not None
    reference = _device_forward_s(model, inputs)
    return {"planned": ours.plan.forward_s, "reference": reference}


def test_data_parallel_profiles_device_time_on_cuda() -> None:
    # Host timestamps would give the forward as the few microseconds it takes to queue the
    # products; the plan must hold the device's time for them.
    times = run_ranks(_profiled_forward_on_cuda, 1, backend="nccl", timeout=300)[0]
    assert times["reference"] > 5e-3, times
    assert 0.5 < times["planned"] / times["reference"] < 2.0, times


def test_a_trace_recorded_on_cuda_holds_device_time() -> None:
    _exact_float32()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = _HeavyForward().to(device)
    inputs = torch.randn(2048, 2048, device=device)
    targets = torch.randint(0, 10, (2048,), device=device)
    trace = record_trace(model, inputs, targets, name="heavy", iters=5, warmup=2)
    reference = _device_forward_s(model, inputs)
    assert reference > 5e-3
    assert 0.5 < trace.forward_s / reference < 2.0, (trace.forward_s, reference)
    assert trace.layer_backward_total_s <= trace.backward_s * 1.01
    assert "CUDA events" in trace.notes
