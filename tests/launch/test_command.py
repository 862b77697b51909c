"""Tests of the ``interlace launch`` command: bad input, a script's status, and signals."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from interlace import launch
from interlace.launch import netem


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


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
        (["-n", "2", "--", "nosuchprogram"], "command not found: nosuchprogram"),
        (["-n", "2", "--", "/nonexistent/tool"], "command not found: /nonexistent/tool"),
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


def _sigint_at(disposition: signal.Handlers) -> Callable[[], None]:
    """A ``preexec_fn`` that starts the child with SIGINT at ``disposition`` (whatever the
    test's own is: a shell starts background commands with SIGINT ignored)."""

    def start() -> None:
        signal.signal(signal.SIGINT, disposition)

    return start


@pytest.mark.parametrize(
    ("signo", "status", "started_ignoring"),
    [(signal.SIGTERM, 143, False), (signal.SIGINT, 130, False), (signal.SIGINT, 130, True)],
)
def test_launcher_signal_stops_ranks(
    tmp_path: Path, signo: int, status: int, started_ignoring: bool
) -> None:
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
        # The launcher must stop on SIGINT even when it starts with SIGINT ignored.
        preexec_fn=_sigint_at(signal.SIG_IGN if started_ignoring else signal.SIG_DFL),  # noqa: PLW1509
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


def test_launch_with_link_when_unavailable_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # what check_available consults
    status = launch.main(["-n", "2", "--link", "1gbit", "--", sys.executable, "-c", "pass"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and "drop --link" in err[0]


def _start_and_kill_launcher(tmp_path: Path, *launch_args: str) -> tuple[int, list[int]]:
    """Start ``interlace launch`` with two sleeping ranks, SIGKILL it; its PID and the ranks'."""
    script = _write(
        tmp_path / "pidfile.py",
        "import os, sys, time\n"
        "path = os.path.join(sys.argv[1], os.environ['RANK'] + '.pid')\n"
        "open(path, 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n",
    )
    command = [sys.executable, "-m", "interlace.launch", "-n", "2", *launch_args, "--"]
    launcher = subprocess.Popen(
        [*command, "python", script, str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        pidfiles = [tmp_path / "0.pid", tmp_path / "1.pid"]
        while not all(p.exists() and p.read_text() for p in pidfiles):
            assert time.monotonic() < deadline, "ranks never started"
            assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in pidfiles]
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=15)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    return launcher.pid, pids


def test_ranks_die_with_a_launcher_killed_by_sigkill(tmp_path: Path) -> None:
    _, pids = _start_and_kill_launcher(tmp_path)
    assert _wait_gone(pids, 5.0) == []


def _our_namespaces(pid: int) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    prefix = f"{netem.NAME_PREFIX}{pid}c"
    return [line.split()[0] for line in listed.stdout.splitlines() if line.startswith(prefix)]


@pytest.mark.netns
def test_a_killed_launchers_network_is_swept_at_the_next_start(tmp_path: Path) -> None:
    launcher_pid, pids = _start_and_kill_launcher(tmp_path, "--link", "1gbit")
    assert _wait_gone(pids, 5.0) == []
    left = _our_namespaces(launcher_pid)
    assert len(left) == 3  # the switch and two ranks: nothing could remove them
    try:
        out = io.StringIO()
        launch.run([sys.executable, "-c", "pass"], 1, output=out, timeout=30).check()
        assert _our_namespaces(launcher_pid) == []
        assert "left by a launcher that was killed" in out.getvalue()
    finally:
        for name in left:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
