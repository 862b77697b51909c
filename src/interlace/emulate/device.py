"""A device clock: spends emulated device time as sleep, carrying each sleep's overshoot.

Many K-FAC and pipeline costs are tens of microseconds, below what a sleep can resolve; the clock
counts the time a sleep overran as device time already spent, so totals stay right.
"""

from __future__ import annotations

import threading
import time

from interlace.emulate.dilation import dilate_rate

#: Overshoot carried to later spends is capped here: a sleep delayed by a busy machine for
#: longer than this does not cancel the next costs.
MAX_CREDIT_S = 0.002


class DeviceClock:
    """Spends device time as sleep, one clock per emulated device (thread safe).

    A spend of ``t`` seconds sleeps ``t`` minus the credit left from earlier overshoots (up to
    :data:`MAX_CREDIT_S`), and records this sleep's own overshoot as new credit. So a run of
    short costs takes their sum within one sleep's resolution, not one resolution each.

    Args:
        dilation: Multiplies every spend (1: the given times are already dilated).
    """

    def __init__(self, dilation: float = 1.0) -> None:
        self.dilation = float(dilation)
        self._credit = 0.0
        self._lock = threading.Lock()
        #: Device seconds spent so far (dilated), for accounting.
        self.spent_s = 0.0

    def __getstate__(self) -> dict[str, float]:
        # Copies (a model deep-copied per contender) and pickles get a lock of their own.
        return {"dilation": self.dilation, "credit": self._credit, "spent_s": self.spent_s}

    def __setstate__(self, state: dict[str, float]) -> None:
        self.dilation = state["dilation"]
        self._credit = state["credit"]
        self.spent_s = state["spent_s"]
        self._lock = threading.Lock()

    @property
    def paid_s(self) -> float:
        """Device seconds paid for in wall time so far: those spent plus the overshoot carried
        as credit (paid already, owed to later spends)."""
        with self._lock:
            return self.spent_s + self._credit

    def spend(self, seconds: float) -> None:
        """Take ``seconds`` x the dilation of device time, sleeping on this thread.

        Args:
            seconds: Undilated device seconds (>= 0; negative values count as 0).
        """
        due = max(seconds, 0.0) * self.dilation
        if due <= 0.0:
            return
        with self._lock:
            self.spent_s += due
            wait = due - self._credit
            if wait <= 0.0:
                self._credit -= due
                return
            self._credit = 0.0
        start = time.perf_counter()
        time.sleep(wait)
        overshoot = time.perf_counter() - start - wait
        with self._lock:
            self._credit = min(self._credit + max(overshoot, 0.0), MAX_CREDIT_S)


def dilate_link(link: str, dilation: float) -> str:
    """The ``--link`` rate the emulated cluster runs at: ``link``'s rate divided by ``dilation``.

    Args:
        link: The target link, as ``--link`` takes it (``10gbit``, ``300mbit``).
        dilation: The dilation factor.

    Raises:
        UsageError: For a bad link or dilation.
    """
    # Fixed-point: the link parser takes digits and a unit, not an exponent (1.5625e+06).
    return f"{dilate_rate(link, dilation) / 1e3:.3f}kbit"
