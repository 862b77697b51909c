"""Which backend and device a rank joins with: NCCL only where every local rank has a GPU."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from interlace import distenv, launch
from interlace.errors import UsageError


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize(
    ("gpus", "local_rank", "local_world", "expected"),
    [
        (0, 0, 1, "gloo"),
        (1, 0, 1, "nccl"),
        (1, 0, 4, "gloo"),  # four ranks, one GPU: all on CPU, not a mix
        (1, 3, 4, "gloo"),
        (4, 3, 4, "nccl"),
        (8, 1, 2, "nccl"),
    ],
)
def test_nccl_only_when_every_local_rank_has_a_gpu(
    monkeypatch: pytest.MonkeyPatch, gpus: int, local_rank: int, local_world: int, expected: str
) -> None:
    _gpus(monkeypatch, gpus)
    monkeypatch.delenv(distenv.BACKEND_VARIABLE, raising=False)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    assert distenv.default_backend() == expected


def test_the_environment_variable_overrides_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1)
    monkeypatch.setenv(distenv.BACKEND_VARIABLE, "GLOO")
    assert distenv.default_backend(0) == "gloo"
    monkeypatch.setenv(distenv.BACKEND_VARIABLE, "mpi")
    with pytest.raises(ValueError, match=r"INTERLACE_BACKEND must be gloo or nccl, got 'mpi'"):
        distenv.default_backend(0)


def test_a_lone_process_on_cpu_gets_a_one_rank_gloo_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(distenv.BACKEND_VARIABLE, raising=False)
    _gpus(monkeypatch, 0)
    context = distenv.init_distributed(timeout_s=30)
    try:
        assert (context.rank, context.world_size, context.backend) == (0, 1, "gloo")
        assert context.device == torch.device("cpu") and context.is_main
        # Control messages of a gloo group stay on the host.
        assert distenv.collective_device() == torch.device("cpu")
    finally:
        torch.distributed.destroy_process_group()


def _group_timeout_s() -> float:
    backend = torch.distributed.group.WORLD._get_backend(torch.device("cpu"))  # type: ignore[union-attr]
    return float(backend.options._timeout.total_seconds())


def test_the_collective_timeout_comes_from_the_launchers_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(distenv.BACKEND_VARIABLE, raising=False)
    monkeypatch.setenv(distenv.COLLECTIVE_TIMEOUT_VARIABLE, "7")
    _gpus(monkeypatch, 0)
    distenv.init_distributed()
    try:
        assert _group_timeout_s() == 7.0
    finally:
        torch.distributed.destroy_process_group()
    monkeypatch.delenv(distenv.COLLECTIVE_TIMEOUT_VARIABLE)
    distenv.init_distributed()
    try:
        assert _group_timeout_s() == distenv.DEFAULT_COLLECTIVE_TIMEOUT_S == 300.0
    finally:
        torch.distributed.destroy_process_group()


def _leave_after_a_late_peer(marker: str) -> tuple[float, float]:
    """Rank 1 arrives late; rank 0 must not leave before it. Both then leave while failing."""
    rank = int(os.environ["RANK"])
    distenv.init_distributed(timeout_s=30)
    if rank == 1:
        time.sleep(1.0)
        Path(marker).write_text(str(time.time()))
    distenv.finish_distributed()
    left = time.time()
    assert not torch.distributed.is_initialized()
    # While an exception propagates: no barrier (rank 1 never joins one), only the teardown.
    # A second group on the first one's port can reach rank 0's old store while it closes
    # (connection reset), so the second group rendezvous on the next port.
    os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
    distenv.init_distributed(timeout_s=30)
    started = time.time()
    try:
        if rank == 0:
            raise KeyError("failing")
    except KeyError:
        pass
    else:
        time.sleep(3.0)  # rank 1 holds back; a barrier on rank 0 would wait for it
    try:
        raise RuntimeError("unwinding")
    except RuntimeError:
        distenv.finish_distributed()
    return left, time.time() - started


def test_finish_waits_for_every_rank_after_success_only(tmp_path: Path) -> None:
    marker = tmp_path / "rank1-arrived"
    result = launch.run(_leave_after_a_late_peer, 2, args=(str(marker),), timeout=120).check()
    (left_0, unwind_0), _ = result.values
    assert left_0 >= float(marker.read_text())  # rank 0 left only after rank 1 arrived
    assert unwind_0 < 3.0  # and did not wait for rank 1 while unwinding


def test_an_entry_points_flag_sets_the_timeout_its_ranks_inherit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Set, then removed: either way the variable is restored after the test.
    monkeypatch.setenv(distenv.COLLECTIVE_TIMEOUT_VARIABLE, "300")
    monkeypatch.delenv(distenv.COLLECTIVE_TIMEOUT_VARIABLE)
    distenv.set_collective_timeout(None)  # no flag: nothing changes
    assert distenv.COLLECTIVE_TIMEOUT_VARIABLE not in os.environ
    distenv.set_collective_timeout(45)
    assert distenv.collective_timeout_s() == 45.0
    assert os.environ[distenv.COLLECTIVE_TIMEOUT_VARIABLE] == "45"  # what launched ranks inherit
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(UsageError, match="--collective-timeout must be > 0 seconds"):
            distenv.set_collective_timeout(bad)
