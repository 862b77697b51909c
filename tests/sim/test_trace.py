"""Simulator traces: the MG-WFBP Caffe log, our JSON format, and errors that point at the line."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from interlace.sim.profiled import from_ready
from interlace.sim.trace import (
    ActivationTrace,
    FactorTrace,
    TensorTrace,
    Trace,
    TraceFormatError,
    load_trace,
)
from interlace.sim.traces import data_path

#: The shipped GoogLeNet K80 trace, and the folder that holds it beside the 10 GbE OSU logs.
GOOGLENET = data_path("googlenet_k80_8workers.log")
TRACES = GOOGLENET.parent

LINE = "I0219 13:29:33.944887 66221 distributed.cpp:112] [{}, {}, {}, 0, 0]"


def caffe_log(records: list[tuple[int, int, float]]) -> str:
    return "\n".join(LINE.format(*record) for record in records) + "\n"


def test_googlenet_log_parses_to_its_documented_counts_and_sizes() -> None:
    trace = load_trace(GOOGLENET)
    # README: 128 parameter tensors in 64 layers, 13.38 M parameters, float32.
    assert len(trace.tensors) == 128
    assert len(trace.layers) == 64
    assert trace.total_numel == 13_379_136
    assert trace.total_bytes == 4 * 13_379_136
    assert trace.workers == 8
    # Backward order: the classifier (index 126/127) first, the first convolution last.
    first, last = trace.tensors[0], trace.tensors[-1]
    assert (first.name, first.numel, first.layer_backward_s) == (
        "layer63.weight",
        1_024_000,
        pytest.approx(461.088e-6),
    )
    assert (last.name, last.numel) == ("layer0.bias", 64)
    assert last.layer_backward_s == pytest.approx(15143.7e-6)
    # A layer's time is counted once: weight and bias are ready together.
    ready = trace.ready_times()
    assert ready[0] == ready[1] == pytest.approx(461.088e-6)
    assert ready[-1] == pytest.approx(trace.backward_s)
    assert trace.forward_s == pytest.approx(trace.backward_s / 2)
    assert len(trace.factors) == 64


def test_the_last_complete_iteration_is_used_and_layers_pair_up(tmp_path: Path) -> None:
    path = tmp_path / "tiny_2workers.log"
    first = [(0, 10, 5.0), (1, 2, 5.0), (2, 30, 1.0), (3, 3, 1.0)]
    second = [(0, 10, 50.0), (1, 2, 50.0), (2, 30, 10.0), (3, 3, 10.0)]
    path.write_text(caffe_log(first + second))
    trace = load_trace(path)
    assert [t.name for t in trace.tensors] == [
        "layer1.weight",
        "layer1.bias",
        "layer0.weight",
        "layer0.bias",
    ]
    assert trace.ready_times() == pytest.approx([10e-6, 10e-6, 60e-6, 60e-6])
    assert trace.backward_s == pytest.approx(60e-6)
    assert trace.factors[0] == FactorTrace("layer1", 11, 3)
    assert trace.workers == 2


def test_the_authors_reading_keeps_one_message_per_logged_all_reduce() -> None:
    # Their simulator drops the lines with no backward or no all-reduce time: 63 biases go,
    # while one bias (index 37, 64 elements) logged an all-reduce of its own and stays, its
    # layer's 1.47 ms of backward counted a second time.
    trace = load_trace("googlenet-k80", messages="logged", iteration=2)
    assert len(trace.tensors) == len(trace.layers) == len(trace.ready_tensors()) == 65
    assert trace.total_numel == 13_365_760  # 13.37 M
    assert trace.backward_s == pytest.approx(0.206805002)
    assert trace.forward_s == pytest.approx(trace.backward_s / 2)
    assert trace.tensors[0].name == "layer63.weight"
    assert "layer18.bias" in [t.name for t in trace.tensors]
    assert trace.factors == ()
    assert "iteration 2 of 2" in trace.notes
    # The two logged iterations time backward alike; the first lacks the merged column only.
    first = load_trace("googlenet-k80", messages="logged", iteration=1)
    assert [t.layer_backward_s for t in first.tensors] == [
        t.layer_backward_s for t in trace.tensors
    ]


def test_an_iteration_is_chosen_by_its_number(tmp_path: Path) -> None:
    path = tmp_path / "tiny_2workers.log"
    first = [(0, 10, 5.0), (1, 2, 5.0), (2, 30, 1.0), (3, 3, 1.0)]
    second = [(0, 10, 50.0), (1, 2, 50.0), (2, 30, 10.0), (3, 3, 10.0)]
    path.write_text(caffe_log(first + second + [(0, 10, 7.0)]))
    assert load_trace(path, iteration=1).backward_s == pytest.approx(6e-6)
    assert load_trace(path).backward_s == pytest.approx(60e-6)  # the last complete one
    with pytest.raises(TraceFormatError, match=r":9: iteration 3 is incomplete \(1 of 4"):
        load_trace(path, iteration=3)
    with pytest.raises(TraceFormatError, match="no iteration 4; the log has 3"):
        load_trace(path, iteration=4)
    # No all-reduce time is logged in this log: the authors' reading has nothing to keep.
    with pytest.raises(TraceFormatError, match="no line of the iteration logged both"):
        load_trace(path, messages="logged")


def test_choosing_how_to_read_a_log_is_refused_for_a_json_trace(tmp_path: Path) -> None:
    path = small_trace().save(tmp_path / "toy.json")
    with pytest.raises(TraceFormatError, match="reads Caffe logs only"):
        load_trace(path, iteration=1)
    with pytest.raises(TraceFormatError, match="reads Caffe logs only"):
        load_trace(path, messages="logged")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("I0219 distributed.cpp:112] [2, 30, oops, 0, 0]", "expected a line ending in"),
        ("I0219 distributed.cpp:112] [7, 30, 1.0, 0, 0]", "tensor index 7 out of sequence"),
        ("garbage", "expected a line ending in"),
    ],
)
def test_a_malformed_log_line_is_reported_with_file_and_line(
    tmp_path: Path, bad: str, message: str
) -> None:
    path = tmp_path / "broken.log"
    path.write_text(caffe_log([(0, 10, 5.0), (1, 2, 5.0)]) + bad + "\n")
    with pytest.raises(TraceFormatError, match=f"^{path}:3: {message}"):
        load_trace(path)


def small_trace() -> Trace:
    return from_ready(
        "toy",
        names=["fc.weight", "fc.bias", "conv.weight"],
        layers=["fc", "fc", "conv"],
        numels=[100, 10, 50],
        element_bytes=[4, 4, 4],
        ready_s=[0.001, 0.0012, 0.004],
        forward_s=0.002,
        backward_s=0.005,
        step_s=0.0005,
        layer_forward_s={"conv": 0.0015},
        factors=[FactorTrace("fc", 11, 10)],
        broadcast_bytes=[64],
    )


def test_json_round_trip(tmp_path: Path) -> None:
    trace = small_trace()
    path = trace.save(tmp_path / "toy.json")
    assert load_trace(path) == trace
    # One tensor per line, so a malformed tensor can be pointed at.
    lines = path.read_text().splitlines()
    number = next(i for i, line in enumerate(lines, 1) if '"conv.weight"' in line)
    lines[number - 1] = lines[number - 1].replace('"numel": 50', '"numel": "many"')
    path.write_text("\n".join(lines))
    with pytest.raises(TraceFormatError, match=rf"^{path}:{number}: tensor 2 is malformed"):
        load_trace(path)


def test_broken_json_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n "format": "interlace-trace",\n "version": 1,\n oops\n}\n')
    with pytest.raises(TraceFormatError, match=rf"^{path}:4: not valid JSON"):
        load_trace(path)
    path.write_text('{"format": "something-else"}')
    with pytest.raises(TraceFormatError, match="not an interlace-trace file"):
        load_trace(path)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read the trace"):
        load_trace(tmp_path / "nope.log")


def test_a_backward_shorter_than_its_layers_is_refused() -> None:
    tensor = TensorTrace("w", "l", 1, 4, 0.0, 0.01)
    with pytest.raises(ValueError, match="shorter than its layers"):
        Trace("m", (tensor,), forward_s=0.0, backward_s=0.005)


def test_activations_batch_and_input_shape_round_trip(tmp_path: Path) -> None:
    base = small_trace()
    trace = Trace(
        model=base.model,
        tensors=base.tensors,
        forward_s=base.forward_s,
        backward_s=base.backward_s,
        factors=base.factors,
        activations=(ActivationTrace("conv", (4, 8, 8)), ActivationTrace("fc", (10,))),
        batch_size=32,
        input_shape=(3, 8, 8),
    )
    loaded = load_trace(trace.save(tmp_path / "with_activations.json"))
    assert loaded == trace
    assert loaded.activations[0].shape == (4, 8, 8)
    assert loaded.activation("conv") == ActivationTrace("conv", (4, 8, 8))
    assert loaded.activation("conv").numel == 4 * 8 * 8  # type: ignore[union-attr]
    assert loaded.activation("bn") is None
    assert loaded.factor("fc") == FactorTrace("fc", 11, 10)
    assert (loaded.batch_size, loaded.input_shape) == (32, (3, 8, 8))


def test_a_trace_written_before_activations_still_loads(tmp_path: Path) -> None:
    path = small_trace().save(tmp_path / "old.json")
    text = path.read_text()
    # The format as it was: no activations list, no batch size, no input shape.
    start = text.index(' ],\n "activations"')
    old = text[:start] + " ]\n}\n"
    old = old.replace(' "batch_size": 0,\n', "").replace(' "input_shape": [],\n', "")
    assert "activations" not in old and "batch_size" not in old
    path.write_text(old)
    loaded = load_trace(path)
    assert loaded == small_trace()
    assert (loaded.activations, loaded.batch_size, loaded.input_shape) == ((), 0, ())


def test_a_malformed_activation_names_its_line(tmp_path: Path) -> None:
    trace = Trace(
        model="m",
        tensors=small_trace().tensors,
        forward_s=0.002,
        backward_s=0.005,
        activations=(ActivationTrace("conv", (4, 8, 8)),),
    )
    path = trace.save(tmp_path / "bad.json")
    lines = path.read_text().splitlines()
    number = next(i for i, line in enumerate(lines, 1) if '"shape"' in line)
    lines[number - 1] = lines[number - 1].replace("[4, 8, 8]", '"big"')
    path.write_text("\n".join(lines))
    with pytest.raises(TraceFormatError, match=rf"^{path}:{number}: activation 0 is malformed"):
        load_trace(path)


def test_an_empty_activation_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="every dimension must be >= 1"):
        Trace(
            "m",
            small_trace().tensors,
            forward_s=0.002,
            backward_s=0.005,
            activations=(ActivationTrace("conv", (4, 0)),),
        )


def test_a_diagonal_factor_is_saved_and_loaded_and_others_read_as_before(tmp_path: Path) -> None:
    trace = Trace(
        "embedded",
        (TensorTrace("embed.weight", "embed", 400, 1600, 1e-3, 1e-3),),
        1e-3,
        1e-3,
        factors=(FactorTrace("embed", 50, 8, a_diagonal=True),),
    )
    path = trace.save(tmp_path / "embedded.json")
    assert load_trace(path).factors == trace.factors
    dense = replace(trace, factors=(FactorTrace("embed", 50, 8),))
    assert "a_diagonal" not in dense.save(tmp_path / "dense.json").read_text()
    assert load_trace(tmp_path / "dense.json").factors == dense.factors
