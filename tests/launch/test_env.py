"""Tests of the rank environment: torchrun's env:// contract and the rendezvous port."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from interlace import launch


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
