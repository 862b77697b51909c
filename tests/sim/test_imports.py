"""What ``interlace simulate``, ``interlace plan`` and ``interlace --help`` import: no torch, no
sympy, and matplotlib only when a plot is written (importing them was most of the command's
time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "sympy", "matplotlib")

#: The scaling run of docs/simulate.md: the GoogLeNet trace at eleven worker counts.
SIMULATE = [
    "simulate",
    "--trace",
    "googlenet-k80",
    "--workers",
    "4,8,16,32,64,128,256,512,1024,2048,4",
    "--network",
    "ring:10gbit",
]

#: Generous: the run takes about half a second here, and took over four when it imported torch;
#: the import check below is the exact guard, this one catches a slow simulation.
WALL_LIMIT_S = 5.0

#: The planner's sweep of docs/plan.md: ResNet-50 (the largest trace), every family, 4..2048.
PLAN = ["plan", "--trace", "resnet50-h200", "--workers", "4..2048", "--gpus-per-node", "8"]
#: Generous against the 2 s the planner aims at: CPU seconds of the child (wall time on a
#: shared machine measures the neighbours).
PLAN_CPU_LIMIT_S = 8.0


def _run_in_child(argv: list[str], cwd: Path) -> dict[str, object]:
    """Run ``interlace ARGV`` in a fresh interpreter; what it imported and how long it took."""
    code = (
        "import json, sys, time\n"
        "started = time.perf_counter()\n"
        "from interlace import cli\n"
        "try:\n"
        f"    status = cli.main({argv!r})\n"
        "except SystemExit as exit:\n"
        "    status = exit.code\n"
        "elapsed = time.perf_counter() - started\n"
        "cpu = time.process_time()\n"
        f"heavy = sorted({{m.split('.')[0] for m in sys.modules if m.startswith({HEAVY!r})}})\n"
        "print(json.dumps({'status': status, 'heavy': heavy, 'elapsed': elapsed, 'cpu': cpu}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return report


def test_a_simulation_without_a_plot_imports_no_torch_sympy_or_matplotlib(tmp_path: Path) -> None:
    rows = tmp_path / "rows.json"
    report = _run_in_child([*SIMULATE, "--png", "none", "--json", str(rows)], tmp_path)
    assert report["status"] == 0
    assert report["heavy"] == []
    assert {row["workers"] for row in json.loads(rows.read_text())} == {2**k for k in range(2, 12)}
    assert isinstance(report["elapsed"], float) and report["elapsed"] < WALL_LIMIT_S


def test_the_default_plot_imports_matplotlib_and_still_no_torch(tmp_path: Path) -> None:
    report = _run_in_child(SIMULATE, tmp_path)
    assert report["status"] == 0
    assert report["heavy"] == ["matplotlib"]
    assert (tmp_path / "simulate" / "scaling.png").stat().st_size > 0


def test_the_planner_imports_none_of_them_and_answers_the_sweep_fast(tmp_path: Path) -> None:
    rows = tmp_path / "rows.json"
    report = _run_in_child([*PLAN, "--json", str(rows)], tmp_path)
    assert report["status"] == 0
    assert report["heavy"] == []
    assert {row["family"] for row in json.loads(rows.read_text())} == {"data", "kfac", "pipeline"}
    assert isinstance(report["cpu"], float) and report["cpu"] < PLAN_CPU_LIMIT_S


@pytest.mark.parametrize(
    "argv", [["--help"], ["simulate", "--help"], ["plan", "--help"]], ids=" ".join
)
def test_help_imports_none_of_them(argv: list[str], tmp_path: Path) -> None:
    report = _run_in_child(argv, tmp_path)
    assert report["status"] == 0
    assert report["heavy"] == []


def test_every_simulator_module_imports_without_them() -> None:
    code = (
        "import importlib, pkgutil, sys\n"
        "import interlace.sim as sim\n"
        "for info in pkgutil.iter_modules(sim.__path__):\n"
        "    importlib.import_module(f'interlace.sim.{info.name}')\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules if m.startswith({HEAVY!r})}}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
