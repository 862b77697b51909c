"""Scaling runs: worker counts, and MG-WFBP's properties across worker counts."""

from __future__ import annotations

import pytest

from interlace.errors import UsageError
from interlace.sim.experiments import check_claims, parse_workers, scaling_rows, simulate_scaling
from interlace.sim.network import (
    parse_network,
)
from interlace.sim.trace import load_trace
from interlace.sim.traces import data_path

#: The shipped GoogLeNet K80 trace, and the folder that holds it beside the 10 GbE OSU logs.
GOOGLENET = data_path("googlenet_k80_8workers.log")
TRACES = GOOGLENET.parent
WORKERS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def test_parse_workers() -> None:
    assert parse_workers("4..2048") == WORKERS
    assert parse_workers("4,8, 8,16") == (4, 8, 16)
    for bad in ("4,x", "0", "8..4"):
        with pytest.raises(UsageError, match="--workers"):
            parse_workers(bad)


# ---------------------------------------------------------------------- MG-WFBP's properties


@pytest.mark.parametrize("spec", [f"osu:{TRACES}", "ring:10gbit", "tree:10gbit", "hier:8:10gbit"])
def test_mgwfbp_never_loses_to_wfbp_or_syncesgd_and_its_buckets_shrink(spec: str) -> None:
    trace = load_trace(GOOGLENET)
    network = parse_network(spec)
    results = simulate_scaling(trace, network, WORKERS, ("single", "wfbp", "mgwfbp"))
    by_key = {(r.workers, r.strategy): r for r in results}
    counts = []
    for workers in WORKERS:
        mg = by_key[(workers, "mgwfbp")].iteration_s
        assert mg <= min(by_key[(workers, s)].iteration_s for s in ("single", "wfbp")) * (1 + 1e-9)
        counts.append(by_key[(workers, "mgwfbp")].buckets)
    assert counts == sorted(counts, reverse=True)
    notes = check_claims(scaling_rows(trace, results))
    assert all(note.startswith("ok") for note in notes[:1])


def test_on_the_osu_ring_mgwfbp_becomes_syncesgd_at_large_scale() -> None:
    trace = load_trace(GOOGLENET)
    results = simulate_scaling(trace, parse_network(f"osu:{TRACES}"), (2048,), ("mgwfbp",))
    assert results[0].buckets == 1
