"""``--preset mgwfbp-paper``: the MG-WFBP authors' simulation rebuilt from our pieces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from interlace.errors import UsageError
from interlace.sim.experiments import DEFAULT_WORKERS, ScalingRow
from interlace.sim.presets import check_preset, preset_named, preset_trace, simulate_preset


@pytest.fixture(scope="module")
def rows() -> dict[tuple[int, str], ScalingRow]:
    return {(row.workers, row.strategy): row for row in simulate_preset("mgwfbp-paper")}


def test_the_authors_model_at_64_workers_within_1_percent(
    rows: dict[tuple[int, str], ScalingRow],
) -> None:
    mine, wfbp, single = (rows[(64, s)] for s in ("pairwise", "wfbp", "single"))
    assert wfbp.iteration_s / mine.iteration_s == pytest.approx(1.73, rel=0.01)
    assert single.iteration_s / mine.iteration_s == pytest.approx(1.35, rel=0.01)
    # Speed-up as the paper measures it: 64 batches per iteration against one worker's batch
    # per forward + backward (103.4 + 206.8 ms).
    assert mine.speedup == pytest.approx(64 * 0.3102075 / mine.iteration_s, rel=1e-6)


def test_one_bucket_from_256_workers_on_and_every_size_printed(
    rows: dict[tuple[int, str], ScalingRow],
) -> None:
    assert {workers for workers, _ in rows} == set(DEFAULT_WORKERS)
    buckets = {w: rows[(w, "pairwise")].buckets for w in DEFAULT_WORKERS}
    assert all(buckets[w] == 1 for w in DEFAULT_WORKERS if w >= 256)
    assert all(buckets[w] > 1 for w in DEFAULT_WORKERS if w < 256)
    # The rows the paper did not have are there too.
    for strategy in ("mgwfbp", "optimal", "fixed", "overlap", "mgwfbp/k=2", "wfbp/k=4"):
        assert (64, strategy) in rows


def test_the_preset_checks_pass_on_its_own_model_and_only_note_another() -> None:
    preset = preset_named("mgwfbp-paper")
    notes = check_preset(simulate_preset("mgwfbp-paper"), preset)
    assert len(notes) == 2 and all(note.startswith("ok: ") for note in notes), notes
    other = check_preset(simulate_preset("mgwfbp-paper", "osu:10gbe"), preset, own=False)
    assert other and all(note.startswith("note: ") for note in other)


def test_the_preset_reads_the_trace_as_the_authors_did() -> None:
    trace = preset_trace(preset_named("mgwfbp-paper"))
    assert len(trace.ready_tensors()) == 65
    assert trace.forward_s == pytest.approx(0.5 * trace.backward_s)
    with pytest.raises(UsageError, match="unknown preset 'nope'; choose from mgwfbp-paper"):
        preset_named("nope")


def test_the_command_prints_the_table_and_plots(tmp_path: Path) -> None:
    png = tmp_path / "paper.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "interlace",
            "simulate",
            "--preset",
            "mgwfbp-paper",
            "--png",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "| 64 | 5.70 | 710.6 |" in done.stdout
    assert "ok: pairwise at 64 workers is 1.734x over WFBP and 1.347x over SyncEASGD" in done.stdout
    assert "| 2048 |" in done.stdout and "| 4 |" in done.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
