"""Tests of reading the ranks' heartbeats after a collective timeout: who stopped, who waited."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from interlace.launch.diagnose import explain_timeout, finished_before_exit, is_collective_timeout
from interlace.launch.rank import RankState


def _write_state(folder: Path, rank: int, **fields: object) -> None:
    now = time.time()
    state = RankState(pid=100 + rank, beat=now, since=now - 10, **fields)  # type: ignore[arg-type]
    (folder / f"state-{rank}.json").write_text(json.dumps(asdict(state)))


def test_the_rank_outside_any_collective_is_named_stuck(tmp_path: Path) -> None:
    _write_state(tmp_path, 1, where="step (job.py:6)")
    _write_state(tmp_path, 2, where="step (job.py:7)", collective="all_reduce")
    stuck, message = explain_timeout(tmp_path, 0, {1, 2}, 5.0, 3)
    assert stuck == [1]
    assert message.startswith("rank 1 stopped making progress (in step (job.py:6) for 10 s); ")
    assert "rank 0 timed out waiting for it after the 5 s collective timeout" in message


def test_when_every_rank_waits_none_is_blamed_and_each_is_described(tmp_path: Path) -> None:
    _write_state(tmp_path, 1, where="sync (job.py:9)", collective="broadcast")
    stuck, message = explain_timeout(tmp_path, 0, {1}, 5.0, 2)
    assert stuck == []
    assert message.startswith("rank 0 timed out waiting in a collective after the 5 s")
    assert message.endswith("; rank 1 waiting in broadcast at sync (job.py:9) for 10 s")


def test_a_silent_rank_is_stuck_even_inside_a_collective(tmp_path: Path) -> None:
    now = time.time()
    state = RankState(pid=7, beat=now - 20, since=now - 25, where="f (x.py:1)", collective="wait")
    (tmp_path / "state-1.json").write_text(json.dumps(asdict(state)))
    stuck, message = explain_timeout(tmp_path, 0, {1}, 5.0, 2)
    assert stuck == [1]
    assert "last heartbeat 20 s ago" in message


def test_ranks_without_heartbeats_or_finished_are_not_blamed(tmp_path: Path) -> None:
    _write_state(tmp_path, 2, where="main (job.py:3)", state="returned")
    assert explain_timeout(tmp_path, 0, {1, 2}, 5.0, 3)[0] == []
    assert finished_before_exit(tmp_path, 2)
    assert not finished_before_exit(tmp_path, 1)


def test_timeouts_are_recognised_in_what_a_rank_reports() -> None:
    gloo = "RuntimeError: [unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"
    assert is_collective_timeout(gloo)
    assert is_collective_timeout("torch.distributed.DistStoreError: Socket Timeout")
    assert not is_collective_timeout("RuntimeError: Connection closed by peer")


def test_ranks_that_timed_out_in_different_collectives_are_said_to_disagree(
    tmp_path: Path,
) -> None:
    _write_state(tmp_path, 0, where="body (job.py:25)", collective="all_reduce", state="raised")
    _write_state(
        tmp_path,
        1,
        where="body (job.py:22)",
        collective="broadcast",
        state="raised",
        error="RuntimeError: Timed out waiting 5000ms for recv operation to complete",
    )
    stuck, message = explain_timeout(tmp_path, 0, set(), 5.0, 2)
    assert stuck == []
    assert message.startswith("rank 0 timed out waiting in all_reduce at body (job.py:25) after")
    assert message.endswith(
        "; rank 1 timed out too, waiting in broadcast at body (job.py:22)"
        "; the ranks called different collectives"
    )
