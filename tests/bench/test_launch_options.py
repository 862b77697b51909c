"""A launch's options: counts that time nothing are refused in one line."""

from __future__ import annotations

import pytest

from interlace.bench.launch_options import LaunchOptions
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
