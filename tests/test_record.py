"""Recording a trace on one device: per-layer forward, ready times, step, shapes and factors."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from interlace import record
from interlace.clock import StreamClock
from interlace.dp.iteration import DevicePass
from interlace.record import example_batch, record_trace
from interlace.sim.trace import load_trace
from interlace.zoo import build_model

SLEEP_S = 0.1  # long beside a loaded machine's scheduling delays, so the layers stay apart


class _SleepBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a layer of known backward time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return grad


class _Slow(nn.Linear):
    """A Linear whose forward and backward each take at least SLEEP_S."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEP_S)
        return _SleepBackward.apply(super().forward(x))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), _Slow(16, 16), nn.ReLU(), nn.Linear(16, 3))


def test_a_recorded_trace_times_each_layer_where_it_runs() -> None:
    model = _model()
    inputs, targets = example_batch(model, 4, (8,), 3)
    trace = record_trace(model, inputs, targets, name="toy", iters=3, warmup=1)
    # Backward order: the head first, then the slow layer, then the first Linear.
    assert [t.layer for t in trace.tensors] == ["4", "4", "2", "2", "0", "0"]
    by_layer = {t.layer: t for t in trace.tensors}
    # The slow layer's backward holds the sleep in its backward function; the head's does not.
    assert by_layer["2"].layer_backward_s >= SLEEP_S * 0.9
    assert by_layer["4"].layer_backward_s < SLEEP_S / 2
    assert by_layer["2"].layer_forward_s >= SLEEP_S * 0.9
    assert by_layer["0"].layer_forward_s < SLEEP_S / 2
    assert trace.forward_s >= SLEEP_S * 0.9
    assert trace.backward_s >= trace.layer_backward_total_s * 0.999
    assert trace.step_s > 0
    assert trace.batch_size == 4 and trace.input_shape == (8,)
    shapes = [(a.layer, a.shape) for a in trace.activations]
    assert shapes == [("0", (16,)), ("2", (16,)), ("4", (3,))]
    assert [(f.layer, f.a_dim, f.g_dim) for f in trace.factors] == [
        ("0", 9, 16),
        ("2", 17, 16),
        ("4", 17, 3),
    ]
    assert {t.numel for t in trace.tensors} == {16 * 8, 16, 16 * 16, 3 * 16, 3}
    assert "host clock" in trace.notes


def test_a_recorded_trace_round_trips_through_its_file(tmp_path: Path) -> None:
    model = _model()
    inputs, targets = example_batch(model, 2, (8,), 3)
    trace = record_trace(model, inputs, targets, name="toy", iters=1, warmup=0)
    assert load_trace(trace.save(tmp_path / "toy.json")) == trace


def test_example_batches_give_token_ids_to_an_embedding_first_model() -> None:
    model = nn.Sequential(nn.Embedding(50, 4), nn.Flatten(), nn.Linear(12, 2))
    inputs, targets = example_batch(model, 5, (3,), 2, seed=1)
    assert inputs.dtype == torch.int64 and inputs.shape == (5, 3)
    assert int(inputs.min()) >= 0 and int(inputs.max()) < 50
    assert targets.shape == (5,) and int(targets.max()) < 2
    dense, _ = example_batch(nn.Linear(3, 2), 5, (3,), 2)
    assert dense.dtype == torch.float32


def test_a_language_model_gets_a_target_per_position_and_a_trace(tmp_path: Path) -> None:
    model = build_model("gpt", (12,), 256)
    inputs, targets = example_batch(model, 3, (12,), 256)
    assert inputs.shape == (3, 12) and targets.shape == (3, 12)
    trace = record_trace(model, inputs, targets, name="gpt", iters=1, warmup=0)
    assert trace.forward_s > 0 and len(trace.save(tmp_path / "gpt.json").read_text()) > 0


def test_record_refuses_no_iterations() -> None:
    model = _model()
    inputs, targets = example_batch(model, 2, (8,), 3)
    with pytest.raises(ValueError, match="iters >= 1"):
        record_trace(model, inputs, targets, name="toy", iters=0)


def test_a_device_pass_on_the_cpu_reads_the_host_clock_in_order() -> None:
    clock = StreamClock("cpu")
    assert not clock.uses_events
    measured = DevicePass(clock, 3)
    time.sleep(0.01)
    measured.forward_ended()
    measured.backward_started()
    measured.tensor_ready(2)
    time.sleep(0.01)
    measured.tensor_ready(0)
    measured.backward_ended()
    forward_s, backward_s, ready = measured.seconds()
    assert forward_s >= 0.009
    assert ready[1] == backward_s  # never ready: counted at the end of backward
    assert 0 <= ready[2] < ready[0] <= backward_s
    assert ready[0] >= 0.009


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "interlace", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        check=False,
    )


def test_the_trace_command_writes_a_trace_the_simulator_reads(tmp_path: Path) -> None:
    result = _cli(
        "trace", "--model", "mlp", "--data", "digits", "--device", "cpu", "--iters", "2",
        "--warmup", "1", "--batch-size", "8", "--out", "mlp.json", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    trace = load_trace(tmp_path / "mlp.json")
    assert trace.model == "mlp" and trace.batch_size == 8 and trace.input_shape == (1, 8, 8)
    assert trace.factors and trace.activations
    assert "forward" in result.stdout and "CPU" in result.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "mps"], "--device mps: only cpu and cuda"),
        (["--device", "nonsense"], "is not a device"),
        (["--batch-size", "0"], "--batch-size must be >= 1"),
    ],
)
def test_the_trace_command_refuses_bad_settings_in_one_line(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    result = _cli("trace", "--model", "mlp", "--out", "x.json", *flags, cwd=tmp_path)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_the_trace_command_says_when_no_gpu_is_there(tmp_path: Path) -> None:
    result = _cli("trace", "--model", "mlp", "--out", "x.json", "--device", "cuda", cwd=tmp_path)
    assert result.returncode != 0
    assert "no CUDA GPU is visible" in result.stderr and "Traceback" not in result.stderr


def test_the_trace_command_records_the_language_model_on_its_corpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    record.add_arguments(parser)
    argv = ["--model", "gpt", "--data", "pydoc-topics", "--input-shape", "16", "--device"]
    argv += ["cpu", "--iters", "1", "--warmup", "0", "--batch-size", "2"]
    assert record.run(parser.parse_args([*argv, "--out", str(tmp_path / "gpt.json")])) == 0
    trace = load_trace(tmp_path / "gpt.json")
    gpt = build_model("gpt", (16,), 256)
    assert trace.batch_size == 2 and trace.input_shape == (16,)
    assert trace.total_numel == sum(p.numel() for p in gpt.parameters())
    # K-FAC factors for the Linear layers only (the blocks' four and the head), as
    # kfac-pytorch registers them; the embeddings are gradient tensors, not factor layers.
    linear = [name for name, m in gpt.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(f.layer for f in trace.factors) == sorted(linear)
    assert "--data pydoc-topics --batch-size 2" in trace.source
    assert "gpt.json" in capsys.readouterr().out
