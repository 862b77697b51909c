"""`interlace profile`: every rank's iteration as a Chrome trace and a Gantt chart."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from interlace.profile import layer_activations
from interlace.sim.trace import ActivationTrace
from interlace.timeline import Timeline


def test_profile_writes_a_trace_with_every_ranks_compute_and_buckets(tmp_path: Path) -> None:
    out = tmp_path / "profile"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "interlace",
            "profile",
            "--model",
            "mlp",
            "--data",
            "digits",
            "-n",
            "2",
            "--strategy",
            "wfbp",
            "--iters",
            "3",
            "--warmup",
            "2",
            "--batch-size",
            "16",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "per-tensor plan: 26 bucket(s)" in done.stdout
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    timeline = Timeline.from_chrome_trace(out / "timeline.json")
    assert timeline.processes() == ["rank 0", "rank 1"]
    for rank in ("rank 0", "rank 1"):
        events = [e for e in timeline.events if e.process == rank]
        comm = sorted((e for e in events if e.category == "comm"), key=lambda e: e.start_s)
        # WFBP on the 12-layer MLP: one all-reduce per parameter tensor (13 weights + 13 biases).
        assert len(comm) == 26
        assert sorted(int(e.name.split()[1]) for e in comm) == list(range(26))
        # All-reduces in flight at once are spread over lanes, so bars never overlap in a lane.
        for lane in {e.lane for e in comm}:
            bars = [e for e in comm if e.lane == lane]
            for before, after in itertools.pairwise(bars):
                assert after.start_s >= before.end_s - 1e-9
        backward = [e for e in events if e.category == "backward"]
        assert len(backward) >= 26
        assert sum(e.category == "forward" for e in events) == 1
        assert sum(e.category == "optimizer" for e in events) == 1
        # The first all-reduce starts during backward, not after it: communication overlaps.
        assert comm[0].start_s < max(e.end_s for e in backward)


def test_profile_with_kfac_draws_its_phases_after_backward(tmp_path: Path) -> None:
    out = tmp_path / "profile"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "interlace", "profile", "--model", "mlp", "--data"),
            *("digits", "-n", "2", "--iters", "2", "--warmup", "1", "--batch-size", "16"),
            *("--optimizer", "kfac", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "K-FAC (eigen, COMM-OPT) on 2 rank(s): 13 layers" in done.stdout
    timeline = Timeline.from_chrome_trace(out / "timeline.json")
    for rank in ("rank 0", "rank 1"):
        events = [e for e in timeline.events if e.process == rank]
        lanes = {e.lane for e in events}
        assert {"kfac", "kfac comm"} <= lanes
        names = {e.name for e in events}
        assert {"decompositions", "decomposition broadcast"} <= names
        # K-FAC's default pipelines the factor all-reduces: step() waits for what is in flight.
        assert any(name.startswith("factor all-reduce") for name in names)
        backward_end = max(e.end_s for e in events if e.category == "backward")
        (decompositions,) = [e for e in events if e.name == "decompositions"]
        (step,) = [e for e in events if e.category == "optimizer"]
        assert backward_end <= decompositions.start_s <= decompositions.end_s <= step.start_s
        # Factors of A are taken in forward hooks: during the pass, before backward ends.
        assert min(e.start_s for e in events if e.name.startswith("A ")) < backward_end


def test_layer_activations_gives_each_parameter_layers_output_shape_in_forward_order() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)
    )
    shapes = layer_activations(model, torch.randn(2, 3, 6, 6))
    assert shapes == (ActivationTrace("0", (4, 6, 6)), ActivationTrace("3", (5,)))
    assert model.training  # put back as it was
