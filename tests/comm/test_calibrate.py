"""Fitting the all-reduce cost on a live group: every rank agrees, and the cache is used."""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from interlace.comm.calibrate import (
    cache_path,
    fit_concurrency,
    fit_cost_model,
    fit_stream_cost_model,
    stream_sizes_up_to,
)
from interlace.comm.cost import CostModel
from interlace.testing import run_ranks, run_scenarios


def _fit_twice(_: None) -> tuple[CostModel, CostModel]:
    first = fit_cost_model(sizes=(4096, 65536, 1 << 20), repeats=3, warmup=1)
    # Rank 0 replaces the cached entry; a second fit must read it rather than measure.
    dist.barrier()
    if dist.get_rank() == 0:
        path = cache_path()
        entries = json.loads(path.read_text())
        (key,) = entries
        entries[key] = [0.125, 2.5e-9]
        path.write_text(json.dumps(entries))
    dist.barrier()
    second = fit_cost_model(sizes=(4096, 65536, 1 << 20))
    return first, second


def test_ranks_fit_one_model_and_reuse_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INTERLACE_CACHE_DIR", str(tmp_path))
    results = run_ranks(_fit_twice, 3, None, timeout=120)
    firsts = {first for first, _ in results}
    assert len(firsts) == 1, firsts  # bit-identical on every rank
    (fitted,) = firsts
    # Loopback noise can hide the per-byte term, never make it negative.
    assert fitted.a >= 0 and fitted.b >= 0
    assert all(second == CostModel(0.125, 2.5e-9) for _, second in results)
    cached = json.loads((tmp_path / "cost_models.json").read_text())
    assert list(cached) == ["gloo|3|loopback"]


def _fit_stream() -> CostModel:
    return fit_stream_cost_model(
        small_sizes=(256, 4096), sizes=(65536, 1 << 18), count=2, repeats=2
    )


def test_streamed_all_reduces_fit_one_model_everywhere(two_ranks: dict[str, list[Any]]) -> None:
    results = two_ranks["stream"]
    assert len(set(results)) == 1, results  # maxima over ranks: bit-identical
    assert results[0].a > 0 and results[0].b >= 0


def _fit_over_bad_entries(cache_dir: str) -> tuple[CostModel, list[str]]:
    os.environ["INTERLACE_CACHE_DIR"] = cache_dir
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fit_cost_model(sizes=(4096, 65536), repeats=2, warmup=1)
        groups = [None, dist.new_group()]
        with_terms = fit_concurrency(groups, model, nbytes=65536, repeats=2, warmup=1)
    return with_terms, [str(w.message) for w in caught]


#: Unusable cached entries, by kind: (the cost model's, the concurrency terms').
BAD_ENTRIES = {
    "non-finite": ([float("nan"), 1e-9], [[1e-4, float("inf")]]),
    "negative": ([-1.0, 1e-9], [[-1e-4, 1.5]]),
}
KEY = "gloo|2|loopback"


@pytest.mark.parametrize("kind", list(BAD_ENTRIES))
def test_unusable_cache_entries_are_measured_again_with_a_warning(
    kind: str, two_ranks: dict[str, list[Any]], cache_dirs: dict[str, Path]
) -> None:
    tmp_path, key = cache_dirs[kind], KEY
    (model, messages), (other, other_messages) = two_ranks[kind]
    assert model == other
    assert all(math.isfinite(v) and v >= 0 for v in (model.a, model.b, *model.concurrency[0]))
    assert len(messages) == 2 and all("measuring again" in m for m in messages), messages
    assert other_messages == []  # one warning per job, from rank 0
    cached = json.loads((tmp_path / "cost_models.json").read_text())
    assert cached[key] == [model.a, model.b]
    assert cached[f"{key}|concurrency"] == [list(model.concurrency[0])]


def test_the_streamed_fit_spans_the_sizes_up_to_the_job_s_largest_message() -> None:
    mib = 1024 * 1024
    assert stream_sizes_up_to(mib) == (mib // 2, 2 * mib)
    # Fourfold steps from 2 MiB, then the total itself when it is well past the last step.
    assert stream_sizes_up_to(39 * mib) == (mib // 2, 2 * mib, 8 * mib, 32 * mib)
    assert stream_sizes_up_to(100 * mib) == (mib // 2, 2 * mib, 8 * mib, 32 * mib, 100 * mib)


@pytest.fixture(scope="module")
def cache_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A cache folder per kind of unusable entry, holding those entries."""
    folders = {}
    for kind, (model_entry, terms_entry) in BAD_ENTRIES.items():
        folders[kind] = tmp_path_factory.mktemp(kind)
        entries = {KEY: model_entry, f"{KEY}|concurrency": terms_entry}
        (folders[kind] / "cost_models.json").write_text(json.dumps(entries))
    return folders


def _every_two_rank_scenario(cache_dirs: dict[str, str]) -> dict[str, Any]:
    """Each 2-rank scenario's result on this rank; a failure names its scenario."""
    scenarios: dict[str, Callable[[], Any]] = {"stream": _fit_stream}
    for kind, folder in cache_dirs.items():
        scenarios[kind] = lambda folder=folder: _fit_over_bad_entries(folder)
    return run_scenarios(scenarios)


@pytest.fixture(scope="module")
def two_ranks(cache_dirs: dict[str, Path]) -> dict[str, list[Any]]:
    """Every 2-rank scenario's results by rank, from one launch: starting ranks costs more than
    the fits do."""
    folders = {kind: str(folder) for kind, folder in cache_dirs.items()}
    per_rank = run_ranks(_every_two_rank_scenario, 2, folders, timeout=240)
    return {name: [results[name] for results in per_rank] for name in per_rank[0]}
