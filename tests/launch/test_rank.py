"""Tests of what runs inside a rank: the heartbeat, the collective timeout, running a script."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from interlace.errors import UsageError
from interlace.launch import rank as rank_module
from interlace.launch.rank import (
    COLLECTIVE_TIMEOUT_VARIABLE,
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    SCRIPT_FLAG,
    STATE_DIR_VARIABLE,
    UNREADABLE_WHERE,
    Heartbeat,
    RankState,
    collective_timeout_s,
    read_state,
    report_phase,
)


def test_collective_timeout_defaults_and_reads_the_variable() -> None:
    assert collective_timeout_s({}) == DEFAULT_COLLECTIVE_TIMEOUT_S == 300.0
    assert collective_timeout_s({COLLECTIVE_TIMEOUT_VARIABLE: "12.5"}) == 12.5
    for bad in ("0", "-3", "soon", "inf"):
        with pytest.raises(UsageError, match=COLLECTIVE_TIMEOUT_VARIABLE):
            collective_timeout_s({COLLECTIVE_TIMEOUT_VARIABLE: bad})


def _sleep_here(seconds: float) -> None:
    time.sleep(seconds)


def test_heartbeat_says_where_the_main_thread_is_and_its_phase(tmp_path: Path) -> None:
    heartbeat = Heartbeat(tmp_path / "state-0.json", interval_s=0.05).start()
    report_phase("step 3: backward")
    _sleep_here(0.5)
    state = read_state(tmp_path, 0)
    assert state is not None and state.state == "running"
    assert state.where.startswith("_sleep_here (test_rank.py:")
    assert state.collective is None
    assert state.phase == "step 3: backward"
    heartbeat.finish("returned")
    finished = read_state(tmp_path, 0)
    assert finished is not None and finished.state == "returned"


class _Code:
    def __init__(self, name: str, filename: str) -> None:
        self.co_name = name
        self.co_filename = filename


class _LinelessFrame:
    """A frame as Python 3.11 can show it mid-instruction: ``f_lineno`` is None."""

    def __init__(self, code: _Code, back: object = None) -> None:
        self.f_code = code
        self.f_back = back
        self.f_lineno = None


class _TornDownFrame:
    """A frame whose code can no longer be read (torn down while the heartbeat looked)."""

    f_back = None
    f_lineno = 7

    @property
    def f_code(self) -> _Code:
        raise RuntimeError("frame torn down")


def _main_thread_shows(frame: object, monkeypatch: pytest.MonkeyPatch) -> None:
    main = threading.main_thread().ident
    monkeypatch.setattr(sys, "_current_frames", lambda: {main: frame})


def _beat_after(directory: Path, after: float) -> RankState:
    """The first heartbeat written after ``after``; the bound is only reached if beating stopped."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = read_state(directory, 0)
        if state is not None and state.beat > after:
            return state
        time.sleep(0.01)
    raise AssertionError(f"no heartbeat after {after}")


def test_a_frame_without_a_line_number_is_shown_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _LinelessFrame(_Code("train_step", "/home/u/job.py"))
    c10d = f"/site-packages/torch{os.sep}distributed{os.sep}distributed_c10d.py"
    _main_thread_shows(_LinelessFrame(_Code("all_reduce", c10d), back=job), monkeypatch)
    heartbeat = Heartbeat(tmp_path / "state-0.json", interval_s=60).start()
    state = read_state(tmp_path, 0)
    heartbeat.finish("returned")
    assert state is not None and state.state == "running"
    assert (state.where, state.collective) == ("train_step (job.py:?)", "all_reduce")


@pytest.mark.parametrize("failing", ["frame", "inspection"])
def test_the_heartbeat_keeps_beating_when_its_inspection_fails(
    failing: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if failing == "frame":
        _main_thread_shows(_TornDownFrame(), monkeypatch)
    else:

        def broken(frame: object) -> tuple[str, str | None]:
            raise ValueError("inspection failed")

        monkeypatch.setattr(rank_module, "_where", broken)
    heartbeat = Heartbeat(tmp_path / "state-0.json", interval_s=0.01).start()
    first = read_state(tmp_path, 0)
    assert first is not None and first.where == UNREADABLE_WHERE
    later = _beat_after(tmp_path, first.beat)
    heartbeat.finish("returned")
    assert later.state == "running" and later.where == UNREADABLE_WHERE


def test_a_beat_that_fails_outright_does_not_end_the_heartbeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = Heartbeat._write
    calls = []

    def fails_once_beating(self: Heartbeat, state: RankState) -> None:
        calls.append(state.beat)
        if len(calls) == 2:  # the thread's first beat (the first is written by start())
            raise ValueError("cannot serialise")
        write(self, state)

    monkeypatch.setattr(Heartbeat, "_write", fails_once_beating)
    heartbeat = Heartbeat(tmp_path / "state-0.json", interval_s=0.01).start()
    first = read_state(tmp_path, 0)
    assert first is not None
    later = _beat_after(tmp_path, first.beat)
    heartbeat.finish("returned")
    assert len(calls) >= 3 and later.state == "running"


def test_a_state_describes_where_and_how_long() -> None:
    now = 1000.0
    waiting = RankState(
        pid=1, beat=now, where="f (x.py:3)", since=now - 38, collective="all_reduce"
    )
    assert waiting.describe(now) == "waiting in all_reduce at f (x.py:3) for 38 s"
    silent = RankState(pid=1, beat=now - 38, where="f (x.py:3)", since=now - 40)
    assert silent.describe(now) == "in f (x.py:3) for 40 s; last heartbeat 38 s ago"
    phased = RankState(pid=1, beat=now, phase="step 12: backward", phase_since=now - 5)
    assert phased.describe(now) == "last phase 'step 12: backward', 5 s ago"


def test_the_default_process_group_timeout_is_set_on_import(tmp_path: Path) -> None:
    # A fresh interpreter: the hook must act when torch.distributed is imported after it.
    code = (
        "from interlace.launch.rank import limit_default_timeout\n"
        "limit_default_timeout(7.0)\n"
        "import torch.distributed.distributed_c10d as c10d\n"
        "print(c10d._get_default_timeout('gloo').total_seconds())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == str(datetime.timedelta(seconds=7.0).total_seconds())


def _run_script(
    tmp_path: Path, body: str, *args: str
) -> tuple[subprocess.CompletedProcess[str], RankState | None]:
    script = tmp_path / "job.py"
    script.write_text(body)
    env = {STATE_DIR_VARIABLE: str(tmp_path), "RANK": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "interlace.launch", SCRIPT_FLAG, str(script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
        check=False,
    )
    return proc, read_state(tmp_path, 0)


def test_a_script_runs_as_python_would_and_is_recorded_as_returned(tmp_path: Path) -> None:
    body = (
        "import os, sys\n"
        "print(__name__, sys.argv[1:], os.path.basename(sys.argv[0]), sys.path[0] == "
        f"{str(tmp_path)!r})\n"
    )
    proc, state = _run_script(tmp_path, body, "--flag", "v")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "__main__ ['--flag', 'v'] job.py True"
    assert state is not None and state.state == "returned"


def test_a_failing_script_keeps_its_status_and_traceback(tmp_path: Path) -> None:
    proc, state = _run_script(tmp_path, "def f():\n    raise KeyError('k')\nf()\n")
    assert proc.returncode == 1
    assert proc.stderr.startswith("Traceback")
    assert "runpy" not in proc.stderr and 'job.py", line 3' in proc.stderr
    assert state is not None and state.state == "raised" and state.error == "KeyError: 'k'"
    proc, state = _run_script(tmp_path, "import sys\nsys.exit(5)\n")
    assert proc.returncode == 5
    assert state is not None and state.state == "raised"


def test_report_phase_without_a_heartbeat_is_harmless() -> None:
    report_phase("alone")
    assert rank_module.start_heartbeat({}) is None
