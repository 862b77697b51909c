"""The shipped traces and OSU logs, by name."""

from __future__ import annotations

import pytest

from interlace.errors import UsageError
from interlace.sim.network import Ring, parse_network
from interlace.sim.trace import load_trace
from interlace.sim.traces import (
    data_path,
    osu_set_names,
    shipped_osu_set,
    shipped_trace,
    trace_names,
)
from interlace.zoo import build_model


def test_every_shipped_trace_loads_by_name() -> None:
    assert "googlenet-k80" in trace_names()
    for name in trace_names():
        trace = load_trace(name)
        assert trace.tensors
    googlenet = load_trace("googlenet-k80")
    # The seed's GoogLeNet: 128 tensors in 64 layers, 13.38 M parameters, 8 workers.
    assert len(googlenet.tensors) == 128
    assert len(googlenet.layers) == 64
    assert googlenet.total_numel == pytest.approx(13.38e6, rel=1e-3)
    assert googlenet.model == "googlenet" and googlenet.workers == 8


def test_a_name_and_its_file_give_the_same_trace() -> None:
    path = shipped_trace("googlenet-k80")
    assert path is not None and path.exists()
    assert load_trace("googlenet-k80") == load_trace(path)
    assert load_trace("GoogLeNet-K80") == load_trace(path)


def test_an_unknown_trace_name_is_one_line_naming_the_shipped_ones() -> None:
    with pytest.raises(UsageError, match="googlenet-k80") as caught:
        load_trace("resnet-nosuch")
    assert "\n" not in str(caught.value)
    assert shipped_trace("resnet-nosuch") is None


def test_osu_by_name_fits_as_the_folder_does() -> None:
    assert "10gbe" in osu_set_names()
    files = shipped_osu_set("10gbe")
    assert files is not None and len(files) == 3 and all(f.exists() for f in files)
    folder = data_path("osu_allreduce_2workers_10gbe.log").parent
    by_name, by_folder = parse_network("osu:10gbe"), parse_network(f"osu:{folder}")
    assert isinstance(by_name, Ring) and isinstance(by_folder, Ring)
    assert by_name.link == by_folder.link
    for workers in (2, 4, 8, 64):
        assert by_name.cost(workers) == by_folder.cost(workers)


def test_an_unknown_osu_set_names_the_shipped_ones() -> None:
    with pytest.raises(UsageError, match="10gbe") as caught:
        parse_network("osu:40gbe")
    assert "\n" not in str(caught.value)


def test_the_language_model_trace_is_the_zoo_gpt_at_one_sequence() -> None:
    trace = load_trace("gpt-cpu")
    gpt = build_model("gpt", (128,), 256)
    params = {name: p.numel() for name, p in gpt.named_parameters()}
    assert {t.name: t.numel for t in trace.tensors} == params
    assert trace.batch_size == 1 and trace.input_shape == (128,)
    assert "CPU" in trace.source and "--data pydoc-topics" in trace.source
    # Backward ends at the embeddings: their gradients are the last ones ready.
    assert {t.layer for t in trace.tensors[-2:]} == {"token", "position"}
