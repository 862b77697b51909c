"""Tests of the local launcher: torchrun's env contract, output, failure handling, the CLI.

Rank targets are module-level functions here (the workers import this module by name) or small
scripts written to ``tmp_path``; only the gloo tests import torch, so the rest stay fast.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from interlace import launch
from interlace.errors import RankFailedError
from interlace.testing import run_ranks

# -- rank targets (run in the worker processes) ---------------------------------------------------


def _rank() -> int:
    return int(os.environ["RANK"])


def say_hello(greeting: str) -> str:
    rank = _rank()
    print(f"{greeting} from {rank}")
    print(f"warning from {rank}", file=sys.stderr)
    return f"{greeting}-{rank}"


def times_rank(factor: int) -> int:
    return _rank() * factor


def fail_on_rank_one() -> None:
    if _rank() == 1:
        raise ValueError("rank one is unhappy")
    time.sleep(60)


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


def allreduce_sum(n: int) -> list[float]:
    import torch
    import torch.distributed as dist

    tensor = torch.full((n,), float(dist.get_rank() + 1))
    dist.all_reduce(tensor)
    return tensor.tolist()


def raise_in_group() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("deliberate failure inside the process group")
    dist.barrier()


# -- helpers --------------------------------------------------------------------------------------


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


ENV_SCRIPT = """
import json, os
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS",
        "GLOO_SOCKET_IFNAME", "INTERLACE_LINK", "EXTRA"]
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}))
"""


def _env_lines(text: str) -> list[dict[str, str | None]]:
    found = []
    for line in text.splitlines():
        _, sep, payload = line.partition("ENV ")
        if sep:
            found.append(json.loads(payload))
    return found


# -- the env:// contract --------------------------------------------------------------------------


def test_env_contract_for_three_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _write(tmp_path / "env.py", ENV_SCRIPT)
    for name in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "INTERLACE_LINK"):
        monkeypatch.delenv(name, raising=False)
    out = io.StringIO()
    result = launch.run(script, 3, env={"EXTRA": "yes"}, output=out, master_port=29999)
    assert result.ok, out.getvalue()
    envs = sorted(_env_lines(out.getvalue()), key=lambda e: int(e["RANK"] or -1))
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    for rank, e in enumerate(envs):
        assert e["LOCAL_RANK"] == e["ROLE_RANK"] == str(rank)
        assert e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == e["ROLE_WORLD_SIZE"] == "3"
        assert e["GROUP_RANK"] == "0"
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert e["MASTER_PORT"] == "29999"
        assert e["OMP_NUM_THREADS"] == "1"
        assert e["GLOO_SOCKET_IFNAME"] is None
        assert e["INTERLACE_LINK"] is None
        assert e["EXTRA"] == "yes"
    assert len({e["TORCHELASTIC_RUN_ID"] for e in envs}) == 1
    assert result.values == []


def test_free_master_port_is_chosen(tmp_path: Path) -> None:
    script = _write(tmp_path / "env.py", ENV_SCRIPT)
    out = io.StringIO()
    launch.run(script, 2, output=out).check()
    ports = {e["MASTER_PORT"] for e in _env_lines(out.getvalue())}
    assert len(ports) == 1
    assert 0 < int(ports.pop() or 0) < 65536


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


# -- callables and failures -----------------------------------------------------------------------


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


# -- through the test harness: real gloo process groups -------------------------------------------


def test_run_ranks_gloo_allreduce() -> None:
    values = run_ranks(allreduce_sum, 3, 5, timeout=60)
    assert values == [[6.0] * 5] * 3


def test_run_ranks_reports_failing_rank_traceback() -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(raise_in_group, 2, timeout=60)
    assert info.value.rank == 1
    assert "deliberate failure inside the process group" in str(info.value)


# -- the command line -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-n", "0", "--", "python", "x.py"], "-n must be >= 1"),
        (["-n", "2", "--link", "fast", "--", "python", "x.py"], "accepted rates: 100mbit, 1gbit"),
        (["-n", "2", "--", "python", "/nonexistent/train.py"], "script not found"),
        (["-n", "2", "/nonexistent/train.py"], "script not found: /nonexistent/train.py"),
        (["-n", "2"], "no command to launch"),
        (["-n", "2", "--"], "no command to launch"),
        (["--", "python", "x.py"], "required: -n"),
    ],
)
def test_cli_bad_input(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert launch.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("interlace launch: error:")
    assert expected in lines[0]


def test_cli_runs_script_and_returns_its_status(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # Rank 1 fails only once rank 0 has printed: otherwise the launcher may stop rank 0 (as it
    # should) before a loaded machine has even started it.
    printed = tmp_path / "rank0-printed"
    script = _write(
        tmp_path / "job.py",
        "import os, sys, time\nprint('rank', os.environ['RANK'], sys.argv[1:], flush=True)\n"
        f"marker = {str(printed)!r}\n"
        "if os.environ['RANK'] == '0':\n    open(marker, 'w').close()\n    sys.exit(0)\n"
        "end = time.monotonic() + 30\n"
        "while not os.path.exists(marker) and time.monotonic() < end:\n    time.sleep(0.01)\n"
        "sys.exit(4)\n",
    )
    status = launch.main(["-n", "2", "--", "python", script, "--flag", "v"])
    out = capfd.readouterr()
    assert status == 4
    assert "rank 0 ['--flag', 'v']" in out.out
    assert "[rank 1] rank 1 ['--flag', 'v']" in out.out
    assert "interlace launch: rank 1 exited with status 4" in out.err
    # The command without a leading `--` works too.
    printed.unlink()
    assert launch.main(["-n", "1", script, "x"]) == 0


def _wait_gone(pids: list[int], deadline_s: float) -> list[int]:
    """PIDs still alive (and not zombies) after waiting up to ``deadline_s``."""
    end = time.monotonic() + deadline_s
    alive = pids
    while time.monotonic() < end:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError):
                continue
            if state != "Z":
                alive.append(pid)
        if not alive:
            return []
        time.sleep(0.05)
    return alive


@pytest.mark.parametrize(("signo", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_launcher_signal_stops_ranks(tmp_path: Path, signo: int, status: int) -> None:
    script = _write(
        tmp_path / "pidfile.py",
        "import os, sys, time\n"
        "path = os.path.join(sys.argv[1], os.environ['RANK'] + '.pid')\n"
        "open(path, 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n",
    )
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "interlace.launch",
            "-n",
            "2",
            "--",
            "python",
            script,
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        pidfiles = [tmp_path / "0.pid", tmp_path / "1.pid"]
        while not all(p.exists() and p.read_text() for p in pidfiles):
            assert time.monotonic() < deadline, "ranks never started"
            assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in pidfiles]
        launcher.send_signal(signo)
        _, err = launcher.communicate(timeout=15)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == status, err
    assert "stopping all ranks" in err
    assert _wait_gone(pids, 5.0) == []
