"""A run's launches: the launch options, the links the ranks run at, and a session's failures."""

from __future__ import annotations

import os

import pytest

from interlace.bench.harness import REAL_COMPUTE, LaunchFailedError
from interlace.bench.session import LaunchOptions, Session, format_rate, run_link, shown_link
from interlace.comm.links import parse_link
from interlace.emulate import parse_compute
from interlace.errors import UsageError


@pytest.mark.parametrize(
    "options",
    [LaunchOptions(iters=0), LaunchOptions(rounds=0), LaunchOptions(warmup=-1)],
)
def test_counts_that_time_nothing_are_refused_in_one_line(options: LaunchOptions) -> None:
    with pytest.raises(UsageError, match=r"--iters \(\d+\) and --rounds \(\d+\)") as refused:
        options.check()
    assert "\n" not in str(refused.value)


def test_the_defaults_and_a_single_timed_iteration_are_accepted() -> None:
    LaunchOptions().check()
    LaunchOptions(iters=1, warmup=0, rounds=1).check()


def _cache_dir(job: None) -> str:
    return os.environ["INTERLACE_CACHE_DIR"]


def test_a_launch_without_a_cache_folder_gets_a_fresh_one() -> None:
    folder = LaunchOptions(timeout_s=120).launch(_cache_dir, None, nprocs=2, link=None)
    assert "interlace-launch-" in folder and not os.path.exists(folder)


@pytest.mark.parametrize(
    ("rate", "text"),
    [(5e8, "500mbit"), (2.5e9, "2.5gbit"), (1e9, "1gbit"), (43.63e6, "43.6mbit"), (2e4, "20kbit")],
)
def test_rates_are_written_as_links_the_launcher_accepts(rate: float, text: str) -> None:
    assert format_rate(rate) == text
    assert parse_link(text) == pytest.approx(rate, rel=5e-3)


def test_emulated_compute_runs_the_target_link_at_its_rate_over_the_dilation() -> None:
    emulated = parse_compute("emulated:googlenet-k80", 4.0)
    assert parse_link(str(run_link("10gbit", emulated))) == pytest.approx(2.5e9)
    assert run_link("10gbit", REAL_COMPUTE) == "10gbit" and run_link(None, emulated) is None
    assert shown_link("10gbit", emulated) == "10gbit (emulated at 2.5gbit)"
    assert shown_link("10gbit", REAL_COMPUTE) == "10gbit"


def _fails() -> int:
    raise LaunchFailedError("rank 1 failed with status 1\nTraceback")


def test_a_session_records_a_failed_launch_and_ends_with_status_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with Session("interlace bench x", 2, nprocs=2, timeout_s=10, collective_timeout_s=None) as s:
        assert s.attempt("m1", lambda: 3) == 3
        assert s.attempt("m2", _fails) is None
        s.wrote("timeline written to t.png")
    assert s.failures == ["m2: rank 1 failed with status 1\nTraceback"]
    assert s.finish() == 1
    out, err = capsys.readouterr()
    assert "launch failed: m2: rank 1 failed" in out and "timeline written to t.png" in out
    assert "1 launch(es) failed:\n  m2: rank 1 failed with status 1\n" in err
