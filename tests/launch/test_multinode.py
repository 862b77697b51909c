"""Two emulated hosts under torchrun's multi-node c10d rendezvous train as one 4-rank node does.

Each host is a network namespace of :class:`interlace.launch.netem.EmulatedCluster` running
``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d`` with the same small
DataParallel script as a single-node ``torchrun --nproc-per-node 4``.
"""

from __future__ import annotations

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
TIMEOUT_S = 400.0


def _run_all(commands: list[tuple[list[str], dict[str, str]]], logs: Path) -> None:
    """Run the commands at once; wait for all; kill what is left on failure or timeout."""
    procs: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for index, (argv, extra_env) in enumerate(commands):
            with open(logs / f"cmd{index}.log", "wb") as log:
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
            log_text = (logs / f"cmd{index}.log").read_text(errors="replace")
            assert code == 0, f"{commands[index][0]} exited {code}:\n{log_text[-4000:]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.netns
def test_two_hosts_under_torchrun_match_one_four_rank_node(tmp_path: Path) -> None:
    single_out, multi_out = tmp_path / "single.pt", tmp_path / "multi.pt"
    single = [*TORCHRUN, "--standalone", "--nnodes", "1", "--nproc-per-node", "4"]
    _run_all([([*single, str(SCRIPT), str(single_out)], {})], tmp_path)

    with netem.EmulatedCluster(2, "10gbit") as hosts:
        endpoint = f"{hosts.master_addr}:{RDZV_PORT}"
        node = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
        node += ["--rdzv-endpoint", endpoint, "--rdzv-id", "interlace-multinode"]
        commands = [
            # gloo would pick an interface by resolving the hostname: name the host's NIC.
            (
                hosts.wrap(host, [*node, str(SCRIPT), str(multi_out)]),
                {"GLOO_SOCKET_IFNAME": hosts.ifname(host)},
            )
            for host in range(2)
        ]
        _run_all(commands, tmp_path)
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
