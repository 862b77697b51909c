"""Tests of supervising ranks: output, failures, the first failing rank, signals, timeouts.

Rank targets are module-level functions here (the workers import this module by name) or small
scripts written to ``tmp_path``.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from interlace import launch
from interlace.errors import RankFailedError

# -- rank targets (run in the worker processes) ---------------------------------------------------


def _rank() -> int:
    return int(os.environ["RANK"])


def say_hello(greeting: str) -> str:
    rank = _rank()
    print(f"{greeting} from {rank}")
    print(f"warning from {rank}", file=sys.stderr)
    return f"{greeting}-{rank}"


def crash_while_others_sleep() -> None:
    rank = _rank()
    if rank == 1:
        time.sleep(0.3)
        os._exit(7)
    if rank == 2:
        # A rank that ignores SIGTERM: the launcher must escalate to SIGKILL after its grace.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)


def sleep_forever() -> None:
    time.sleep(60)


def kill_self_on_rank_zero() -> None:
    if _rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# -- output ---------------------------------------------------------------------------------------


def test_output_prefixes_other_ranks_not_rank0() -> None:
    out = io.StringIO()
    result = launch.run(say_hello, 2, args=("hi",), output=out).check()
    lines = out.getvalue().splitlines()
    assert "hi from 0" in lines
    assert "warning from 0" in lines
    assert "[rank 1] hi from 1" in lines
    assert "[rank 1] warning from 1" in lines
    assert result.values == ["hi-0", "hi-1"]


def test_prefix_rank0() -> None:
    out = io.StringIO()
    launch.run(say_hello, 2, args=("yo",), output=out, prefix_rank0=True).check()
    lines = out.getvalue().splitlines()
    assert "[rank 0] yo from 0" in lines
    assert "yo from 0" not in lines


# -- failures -------------------------------------------------------------------------------------


def test_first_failing_rank_status_is_the_jobs(tmp_path: Path) -> None:
    script = _write(
        tmp_path / "exits.py",
        "import os, sys, time\n"
        "rank = int(os.environ['RANK'])\n"
        "if rank == 2: sys.exit(3)\n"
        "if rank == 1: time.sleep(1.0); sys.exit(5)\n"
        "time.sleep(30)\n",
    )
    result = launch.run(script, 3, output=io.StringIO(), timeout=30)
    assert (result.failed_rank, result.returncode) == (2, 3)
    with pytest.raises(RankFailedError, match="rank 2 failed with exit status 3"):
        result.check()


def test_crash_while_others_block_ends_job_quickly() -> None:
    out = io.StringIO()
    start = time.monotonic()
    result = launch.run(crash_while_others_sleep, 4, output=out, timeout=60)
    elapsed = time.monotonic() - start
    assert elapsed < 10.0
    assert not result.timed_out
    assert (result.failed_rank, result.returncode) == (1, 7)
    assert "rank 1 exited with status 7; stopping the other 3 ranks" in out.getvalue()


def test_signal_death_maps_to_128_plus_signal() -> None:
    out = io.StringIO()
    result = launch.run(kill_self_on_rank_zero, 2, output=out, timeout=30)
    assert (result.failed_rank, result.returncode) == (0, 128 + signal.SIGKILL)
    assert "rank 0 was killed by SIGKILL" in out.getvalue()


def test_timeout_kills_hung_ranks() -> None:
    out = io.StringIO()
    result = launch.run(sleep_forever, 2, output=out, timeout=1.0)
    assert result.timed_out
    assert result.hung_ranks == [0, 1]
    assert result.returncode == launch.TIMEOUT_STATUS
    assert result.elapsed_s < 8.0
    with pytest.raises(TimeoutError, match="ranks still running: 0, 1"):
        result.check()


# -- hangs: the rank that stopped is named, not the one that gave up waiting ----------------------


def step_with_a_stall(x: Any, step: int) -> None:
    import torch.distributed as dist  # noqa: PLC0415 - torch only inside the ranks

    if _rank() == 1 and step == 1:
        time.sleep(60)  # stops making progress; rank 0 waits for it in the all-reduce
    dist.all_reduce(x)


def train_with_a_stalled_rank(folder: str) -> None:
    import torch  # noqa: PLC0415 - torch only inside the ranks
    import torch.distributed as dist  # noqa: PLC0415 - torch only inside the ranks

    # Join together: on a loaded machine one rank may import torch seconds after the other, and
    # the short timeout also bounds the rendezvous.
    Path(folder, f"{_rank()}.ready").touch()
    while len(list(Path(folder).glob("*.ready"))) < 2:
        time.sleep(0.01)
    # No timeout given: the launcher's collective timeout must bound it, not gloo's 30 minutes.
    dist.init_process_group("gloo")
    x = torch.ones(2)
    for step in range(3):
        step_with_a_stall(x, step)


def test_a_collective_timeout_names_the_stalled_rank_not_the_waiting_one(tmp_path: Path) -> None:
    out = io.StringIO()
    result = launch.run(
        train_with_a_stalled_rank,
        2,
        args=(str(tmp_path),),
        output=out,
        timeout=240,  # only a backstop: the collective timeout ends the job
        collective_timeout=3,
    )
    assert not result.timed_out, out.getvalue()
    assert (result.failed_rank, result.stuck_ranks) == (1, [1]), out.getvalue()
    assert result.returncode == 1  # rank 0's status: it raised the timeout
    message = out.getvalue()
    assert "rank 1 stopped making progress (in step_with_a_stall (test_supervise.py:" in message
    assert "rank 0 timed out waiting for it after the 3 s collective timeout" in message
    assert "--collective-timeout" in message  # says how to change it
    with pytest.raises(RankFailedError, match="rank 1 stopped making progress") as caught:
        result.check()
    assert "Timed out" in str(caught.value)  # rank 0's traceback comes along


# -- a crash after the rank's code returned ---------------------------------------------------


@pytest.mark.parametrize(("returned", "status"), [(True, 0), (False, 128 + signal.SIGABRT)])
def test_an_abort_at_shutdown_after_success_counts_as_finished(
    tmp_path: Path, returned: bool, status: int
) -> None:
    # What gloo's teardown does to some finished ranks: SIGABRT after the script's code is done.
    abort = "os.kill(os.getpid(), signal.SIGABRT)"
    body = "import atexit, os, signal\n" + (
        f"atexit.register(lambda: {abort})\nprint('done')\n" if returned else f"{abort}\n"
    )
    script = _write(tmp_path / "aborts.py", body)
    out = io.StringIO()
    result = launch.run(script, 2, output=out, timeout=30)
    assert result.returncode == status, out.getvalue()
    finished = "had finished (its code returned) but then was killed by SIGABRT"
    assert (finished in out.getvalue()) == returned, out.getvalue()
