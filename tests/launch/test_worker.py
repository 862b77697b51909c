"""Tests of callable jobs: each rank's return value, and a failing rank's traceback."""

from __future__ import annotations

import io
import os
import sys
import time

import pytest

from interlace import launch
from interlace.errors import RankFailedError
from interlace.launch.rank import SCRIPT_FLAG
from interlace.launch.worker import with_heartbeat

# -- rank targets (run in the worker processes) ---------------------------------------------------


def _rank() -> int:
    return int(os.environ["RANK"])


def times_rank(factor: int) -> int:
    return _rank() * factor


def fail_on_rank_one() -> None:
    if _rank() == 1:
        raise ValueError("rank one is unhappy")
    time.sleep(60)


# -- tests ----------------------------------------------------------------------------------------


def test_callable_returns_per_rank_values() -> None:
    result = launch.run(times_rank, 4, args=(10,), output=io.StringIO()).check()
    assert result.values == [0, 10, 20, 30]
    assert result.returncode == 0 and result.failed_rank is None


def test_failing_callable_surfaces_traceback() -> None:
    out = io.StringIO()
    result = launch.run(fail_on_rank_one, 3, output=out, timeout=30)
    assert result.failed_rank == 1
    assert result.returncode == 1
    assert "ValueError: rank one is unhappy" in result.tracebacks[1]
    with pytest.raises(RankFailedError) as info:
        result.check()
    assert info.value.rank == 1
    assert "rank 1" in str(info.value)
    assert "rank one is unhappy" in str(info.value)
    assert "interlace launch: rank 1 exited with status 1; stopping the other 2 ranks" in (
        out.getvalue()
    )


def test_python_commands_run_through_the_heartbeat_runner() -> None:
    py = sys.executable
    runner = [py, "-m", "interlace.launch", SCRIPT_FLAG]
    assert with_heartbeat([py, "train.py", "--epochs", "2"]) == [
        *runner,
        "train.py",
        "--epochs",
        "2",
    ]
    assert with_heartbeat([py, "-u", "-X", "dev", "t.py"]) == [
        py,
        "-u",
        "-X",
        "dev",
        "-m",
        "interlace.launch",
        SCRIPT_FLAG,
        "t.py",
    ]
    assert with_heartbeat([py, "-m", "pkg.train", "-x"]) == [*runner, "-m", "pkg.train", "-x"]
    # Left alone: code given inline, isolated mode (no PYTHONPATH), other programs.
    for command in ([py, "-c", "pass"], [py, "-I", "t.py"], [py], ["bash", "run.sh"]):
        assert with_heartbeat(command) == command
