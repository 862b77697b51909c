"""Two emulated hosts under torchrun's multi-node c10d rendezvous train as one 4-rank node does.

Each host is a network namespace of :class:`interlace.launch.netem.EmulatedCluster` running
``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d`` with the same small
DataParallel script as a single-node ``torchrun --nproc-per-node 4``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from interlace.launch import netem

SCRIPT = Path(__file__).with_name("multinode_script.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
RDZV_PORT = 29400
#: Per phase: generous, since starting 4 ranks that import torch is slow on a busy machine.
TIMEOUT_S = 600.0


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End a torchrun that is still running: SIGTERM, which it passes on to its ranks (each in
    a session of its own), then SIGKILL to its whole group if it does not exit."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _kill_inside(hosts: netem.EmulatedCluster) -> None:
    """Kill whatever still runs in the hosts' namespaces (ranks a stopped torchrun left)."""
    for host in range(hosts.nranks):
        listed = subprocess.run(
            ["ip", "netns", "pids", hosts.namespace(host)],
            check=False,
            capture_output=True,
            text=True,
        )
        for pid in listed.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _run_all(commands: list[tuple[list[str], dict[str, str]]], logs: Path, phase: str) -> None:
    """Run the commands at once; wait for all; stop what is left on failure or timeout."""
    procs: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for index, (argv, extra_env) in enumerate(commands):
            with open(logs / f"{phase}{index}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        argv,
                        env={**os.environ, **extra_env},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own group: torchrun and its ranks go together
                    )
                )
        for index, proc in enumerate(procs):
            code = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
            log_text = (logs / f"{phase}{index}.log").read_text(errors="replace")
            assert code == 0, f"{commands[index][0]} exited {code}:\n{log_text[-4000:]}"
    finally:
        for proc in procs:
            _stop(proc)


@pytest.mark.netns
@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_two_hosts_under_torchrun_match_one_four_rank_node(tmp_path: Path) -> None:
    single_out, multi_out = tmp_path / "single.pt", tmp_path / "multi.pt"
    single = [*TORCHRUN, "--standalone", "--nnodes", "1", "--nproc-per-node", "4"]
    _run_all([([*single, str(SCRIPT), str(single_out)], {})], tmp_path, "single")

    with netem.EmulatedCluster(2, "10gbit") as hosts:
        endpoint = f"{hosts.master_addr}:{RDZV_PORT}"
        node = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
        node += ["--rdzv-endpoint", endpoint, "--rdzv-id", "interlace-multinode"]
        # Both emulated hosts share this machine's hostname, which each resolves to its own
        # address: --local-addr makes each agent advertise its address instead (what a machine
        # with several interfaces needs too), and gloo is told which NIC to use.
        commands = [
            (
                hosts.wrap(
                    host,
                    [*node, "--local-addr", hosts.address(host), str(SCRIPT), str(multi_out)],
                ),
                {"GLOO_SOCKET_IFNAME": hosts.ifname(host)},
            )
            for host in range(2)
        ]
        try:
            _run_all(commands, tmp_path, "host")
        finally:
            _kill_inside(hosts)
        namespaces = list(hosts.created_namespaces)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert not any(name in listed.stdout for name in namespaces), "namespaces left behind"

    one_node = torch.load(single_out)
    two_nodes = torch.load(multi_out)
    assert len(two_nodes["losses"]) == 4
    assert len({tuple(losses) for losses in two_nodes["losses"]}) == 4  # each rank its own data
    assert two_nodes["losses"] == one_node["losses"]
    for name, weight in one_node["weights"].items():
        assert torch.equal(two_nodes["weights"][name], weight), name
