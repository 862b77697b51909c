"""How a launched job ended: :class:`LaunchResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from interlace.errors import RankFailedError

__all__ = ["TIMEOUT_STATUS", "LaunchResult"]

#: Exit status of a job stopped by ``timeout`` (the convention of coreutils ``timeout``).
TIMEOUT_STATUS = 124


@dataclass
class LaunchResult:
    """How a launched job ended.

    Args:
        returncode: 0 on success, else the first failing rank's exit status (``128 + signal``
            when a signal killed it) or :data:`TIMEOUT_STATUS`.
        failed_rank: The rank reported as the cause of the failure, or None.
        values: Each rank's return value for a callable target (``None`` for ranks that
            returned none); empty for a command.
        tracebacks: A failing rank's formatted exception (or the tail of its stderr), by rank.
        elapsed_s: Seconds from the start of the launch to its end.
        timed_out: Whether ``timeout`` expired.
        hung_ranks: The ranks still running when ``timeout`` expired.
        stuck_ranks: The ranks that stopped making progress while a peer's collective timed
            out waiting for them (``failed_rank`` is the first of them).
        reason: The launcher's explanation of a collective timeout, or empty.
    """

    returncode: int
    failed_rank: int | None
    values: list[Any]
    tracebacks: dict[int, str]
    elapsed_s: float
    timed_out: bool
    hung_ranks: list[int] = field(default_factory=list)
    stuck_ranks: list[int] = field(default_factory=list)
    reason: str = ""

    @property
    def ok(self) -> bool:
        """Whether every rank exited with status 0."""
        return self.returncode == 0 and not self.timed_out

    def check(self) -> LaunchResult:
        """Return ``self`` if the job succeeded; otherwise raise what went wrong.

        Raises:
            TimeoutError: Naming the ranks that were still running.
            RankFailedError: Carrying the failing rank's traceback.
        """
        if self.timed_out:
            raise TimeoutError(
                f"job timed out after {self.elapsed_s:.1f} s; ranks still running: "
                f"{', '.join(map(str, self.hung_ranks)) or 'none'}"
            )
        if self.returncode != 0:
            rank = -1 if self.failed_rank is None else self.failed_rank
            # A stuck rank has no traceback; the rank that timed out waiting for it has one.
            detail = self.tracebacks.get(rank) or "\n".join(self.tracebacks.values())
            raise RankFailedError(rank, self.returncode, detail, reason=self.reason)
        return self
