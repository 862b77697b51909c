"""Tests of the emulated network: its life cycle, its cleanup, and that it runs at its rate.

Tests marked ``netns`` need root and iproute2 and are skipped elsewhere (see conftest.py); the
messages of :func:`interlace.launch.netem.check_available` are checked everywhere with a faked euid.
"""

from __future__ import annotations

import io
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from interlace import launch
from interlace.comm.cost import ring_allreduce_time
from interlace.comm.links import parse_link
from interlace.errors import UsageError
from interlace.launch import netem
from interlace.testing import run_ranks

# -- rank targets (run in the worker processes) ---------------------------------------------------


def _our_namespaces(pid: int) -> list[str]:
    """Namespaces named for launcher ``pid`` in ``ip netns list``."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    return [name for name in names if name.startswith(f"{netem.NAME_PREFIX}{pid}c")]


def report_then_crash_rank_two(launcher_pid: int) -> None:
    """Every rank prints what it sees of the network; rank 2 then dies, the others block."""
    rank = int(os.environ["RANK"])
    # `ip netns exec` mounts the namespace's own /sys, so this lists the rank's interfaces.
    interfaces = sorted(os.listdir("/sys/class/net"))
    print(f"IFACES {rank} {' '.join(interfaces)}", flush=True)
    if rank == 2:
        print(f"NETNS {' '.join(_our_namespaces(launcher_pid))}", flush=True)
        time.sleep(0.5)
        sys.exit(3)
    time.sleep(60)


def timed_allreduce(nbytes: int, iters: int) -> dict[str, object]:
    """Median seconds of an all-reduce of ``nbytes`` (slowest rank per round), plus the env."""
    import torch  # noqa: PLC0415 - a spawned rank's entry point
    import torch.distributed as dist  # noqa: PLC0415 - a spawned rank's entry point

    tensor = torch.ones(nbytes // 4)
    dist.all_reduce(tensor)  # warm-up: connections, first-touch allocation
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    rounds = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(rounds, op=dist.ReduceOp.MAX)
    return {
        "median_s": statistics.median(rounds.tolist()),
        "sum_ok": bool(torch.all(tensor == dist.get_world_size() ** (iters + 1)).item()),
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME"),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR"),
        "INTERLACE_LINK": os.environ.get("INTERLACE_LINK"),
        "interfaces": sorted(os.listdir("/sys/class/net")),
    }


# -- everywhere -----------------------------------------------------------------------------------


def test_check_available_says_why_and_what_to_do() -> None:
    with pytest.raises(netem.NetemUnavailableError) as info:
        netem.check_available(geteuid=lambda: 1000, probe=False)
    message = str(info.value)
    assert "root" in message and "uid 1000" in message
    assert "run as root, or drop --link to run on plain loopback" in message
    assert isinstance(info.value, UsageError)  # so the CLI answers with one line and status 2

    with pytest.raises(netem.NetemUnavailableError, match="tc not found"):
        netem.check_available(
            geteuid=lambda: 0, which=lambda tool: None if tool == "tc" else "/x", probe=False
        )


def test_require_names_the_reason_then_the_command_s_purpose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unavailable() -> None:
        raise netem.NetemUnavailableError("needs root (running as uid 1000)")

    monkeypatch.setattr(netem, "check_available", unavailable)
    with pytest.raises(UsageError) as info:
        netem.require("validation needs it")
    assert str(info.value) == "needs root (running as uid 1000); validation needs it"


# -- with namespaces ------------------------------------------------------------------------------


@pytest.mark.netns
def test_cluster_builds_and_removes_everything() -> None:
    with netem.EmulatedCluster(3, "100mbit") as cluster:
        names = cluster.created_namespaces
        assert len(names) == 4  # the switch and three ranks
        assert set(names) <= set(_our_namespaces(os.getpid()))
        assert cluster.master_addr == cluster.address(0) != cluster.address(1)
        assert len(cluster.ifname(2)) <= 15
        assert cluster.wrap(1, ["true"]) == ["ip", "netns", "exec", cluster.namespace(1), "true"]
        qdisc = subprocess.run(
            ["tc", "-n", cluster.namespace(1), "qdisc", "show", "dev", cluster.ifname(1)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        ping = subprocess.run(
            cluster.wrap(1, [sys.executable, "-c", _CONNECT_SNIPPET, cluster.address(2)]),
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        assert "refused" in ping.stdout, ping.stderr  # rank 2 is reachable (nothing listens)
    assert not set(names) & set(_our_namespaces(os.getpid()))
    assert not any(Path(folder).exists() for folder in cluster.created_etc_dirs)
    cluster.close()  # idempotent


# Connect to port 9 of the given address: "refused" proves the packet got there and back.
_CONNECT_SNIPPET = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=5)
except ConnectionRefusedError:
    print("refused")
except OSError as exc:
    print("error", exc)
"""


@pytest.mark.netns
def test_failed_setup_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    real_run = netem.run_tool
    calls = {"n": 0}

    def failing_run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        if argv[:1] == ["tc"]:
            calls["n"] += 1
            if calls["n"] == 3:  # fail part way through the second rank
                raise RuntimeError("injected tc failure")
        return real_run(argv, check)

    monkeypatch.setattr(netem, "run_tool", failing_run)
    before = set(_our_namespaces(os.getpid()))
    with pytest.raises(RuntimeError, match="injected"):
        netem.EmulatedCluster(3, "1gbit")
    assert set(_our_namespaces(os.getpid())) == before


@pytest.mark.netns
def test_cleanup_stale_removes_only_dead_launchers() -> None:
    # A PID above the kernel's pid_max never belongs to a live process (a dead child's PID
    # could be reused by the time the sweep runs).
    dead_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    stale = f"{netem.NAME_PREFIX}{dead_pid}c0r0"
    live = f"{netem.NAME_PREFIX}{os.getpid()}c999r0"
    try:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "add", name], check=True)
        removed = netem.cleanup_stale()
        listed = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, check=True
        ).stdout
        # Another test's launcher sweeping at the same moment may be the one that removed it.
        assert stale not in listed
        assert live not in removed and live in listed
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


@pytest.mark.netns
def test_rank_crash_on_emulated_cluster_cleans_up() -> None:
    out = io.StringIO()
    start = time.monotonic()
    result = launch.run(
        report_then_crash_rank_two, 4, "1gbit", args=(os.getpid(),), output=out, timeout=60
    )
    elapsed = time.monotonic() - start
    text = out.getvalue()
    assert elapsed < 15.0
    assert (result.failed_rank, result.returncode) == (2, 3)
    assert "rank 2 exited with status 3; stopping the other 3 ranks" in text
    # During the job: five namespaces (switch + 4 ranks), each rank seeing lo and its own veth.
    during = next(line for line in text.splitlines() if "NETNS " in line).split("NETNS ")[1]
    assert len(during.split()) == 5
    for rank in range(4):
        line = next(line for line in text.splitlines() if f"IFACES {rank} " in line)
        assert line.split(f"IFACES {rank} ")[1].split() == sorted(
            ["lo", f"{netem.NAME_PREFIX}{os.getpid()}r{rank}"]
        )
    # After it: none of ours.
    assert _our_namespaces(os.getpid()) == []


@pytest.mark.netns
def test_allreduce_runs_at_the_link_rate() -> None:
    nbytes, world, link = 2_000_000, 2, "100mbit"
    values = run_ranks(timed_allreduce, world, nbytes, 4, link=link, timeout=60)
    for rank, value in enumerate(values):
        assert value["sum_ok"]
        assert value["GLOO_SOCKET_IFNAME"] == f"{netem.NAME_PREFIX}{os.getpid()}r{rank}"
        assert value["MASTER_ADDR"] == f"{netem.SUBNET}.1"
        assert value["INTERLACE_LINK"] == link
        assert value["GLOO_SOCKET_IFNAME"] in value["interfaces"]
    model = ring_allreduce_time(nbytes, world, parse_link(link))
    measured = values[0]["median_s"]
    # 0.16 s on the model; headers alone make the wire 4.6% slower than the payload rate.
    assert 0.75 * model <= measured <= 1.25 * model, (measured, model)
    assert _our_namespaces(os.getpid()) == []


@pytest.mark.netns
def test_ctrl_c_removes_the_emulated_network(tmp_path: Path) -> None:
    script = tmp_path / "wait.py"
    script.write_text(
        "import os, sys, time\n"
        "flag = open('/proc/sys/net/ipv4/tcp_slow_start_after_idle').read().strip()\n"
        "open(os.path.join(sys.argv[1], os.environ['RANK'] + '.up'), 'w').write(flag)\n"
        "time.sleep(60)\n"
    )
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "interlace.launch",
            "-n",
            "2",
            "--link",
            "1gbit",
            "--",
            "python",
            str(script),
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        marks = [tmp_path / "0.up", tmp_path / "1.up"]
        while not all(mark.exists() and mark.read_text() for mark in marks):
            assert time.monotonic() < deadline, "ranks never started"
            assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.05)
        # Each rank's namespace keeps TCP out of slow start after idle periods.
        assert [mark.read_text() for mark in marks] == ["0", "0"]
        assert len(_our_namespaces(launcher.pid)) == 3
        launcher.send_signal(signal.SIGINT)
        launcher.communicate(timeout=15)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130
    assert _our_namespaces(launcher.pid) == []
