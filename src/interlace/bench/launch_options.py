"""How one validation launch runs: its counts of iterations, its time limits and where its
notes go, shared by the K-FAC and pipeline validations."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from interlace.errors import UsageError


@dataclass(frozen=True)
class LaunchOptions:
    """The counts and limits of one launch of ranks.

    Args:
        iters: Timed iterations per round (>= 1).
        warmup: Untimed iterations before the timed ones (>= 0).
        rounds: Rounds of timed iterations; the contenders take turns within each (>= 1).
        timeout_s: Seconds allowed for the whole launch.
        collective_timeout_s: Seconds any one collective may wait for its peers (None: the
            launcher's default).
        cache_dir: The ranks' cost-model cache folder (None: a fresh one for the launch).
        note: Where progress lines and the launcher's retry notice go.
    """

    iters: int = 5
    warmup: int = 2
    rounds: int = 4
    timeout_s: float = 600.0
    collective_timeout_s: float | None = None
    cache_dir: str | None = None
    note: Callable[[str], None] = print

    def check(self) -> None:
        """Refuse counts that time nothing, in one line.

        Raises:
            UsageError: For ``iters`` or ``rounds`` below 1 or a negative ``warmup``.
        """
        if self.iters < 1 or self.rounds < 1 or self.warmup < 0:
            raise UsageError(
                f"--iters ({self.iters}) and --rounds ({self.rounds}) must be >= 1 and "
                f"--warmup ({self.warmup}) >= 0"
            )
