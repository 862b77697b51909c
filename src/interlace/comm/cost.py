"""Cost models of all-reduce: ``T(M) = a + b*M`` seconds for an M-byte message.

From a formula (ring, double binary tree) or a least-squares fit of measured times (OSU logs
here, a live process group in :mod:`interlace.comm.calibrate`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CostModel:
    """``T(M) = a + b*M``: ``a`` seconds of start-up, ``b`` seconds per byte.

    Args:
        a: seconds of start-up per all-reduce.
        b: seconds per byte.
        concurrency: ``(a_j, c_j)`` for ``j = 2, 3, ...`` all-reduces at once (see below).

    Raises:
        ValueError: for negative or non-finite terms.
    """

    a: float
    b: float
    concurrency: tuple[tuple[float, float], ...] = ()
    """What running several all-reduces at once costs (several channels, AIACC-style).

    Entry ``j - 2`` is ``(a_j, c_j)``: ``j`` all-reduces of ``M`` bytes each, started together on
    ``j`` channels, all end after ``a_j + c_j * b * M``. ``c_j = j`` means the link is simply
    shared (no gain from concurrency); ``c_j < j`` means one stream left bandwidth idle, and
    ``a_j < j * a`` that start-ups overlap. Counts beyond the measured ones assume the link is
    shared from the last measured count on (see :meth:`concurrent_terms`).
    """

    def __post_init__(self) -> None:
        if not (math.isfinite(self.a) and math.isfinite(self.b)) or self.a < 0 or self.b < 0:
            raise ValueError(
                f"a cost model needs finite a >= 0 and b >= 0, got a={self.a}, b={self.b}"
            )
        for count, (a_j, c_j) in enumerate(self.concurrency, start=2):
            if not (math.isfinite(a_j) and math.isfinite(c_j)) or a_j < 0 or c_j <= 0:
                raise ValueError(
                    f"concurrency terms need finite a_j >= 0 and c_j > 0, got "
                    f"(a_{count}, c_{count}) = ({a_j}, {c_j})"
                )

    def time(self, nbytes: float, concurrent: int = 1) -> float:
        """Seconds to all-reduce ``nbytes`` while ``concurrent`` all-reduces (this one included)
        are in flight; nothing to send costs nothing.

        Args:
            nbytes: the message size.
            concurrent: all-reduces in flight, this one included.
        """
        if nbytes <= 0:
            return 0.0
        start_up, factor = self.concurrent_terms(concurrent)
        return start_up + factor * self.b * nbytes

    def concurrent_terms(self, count: int) -> tuple[float, float]:
        """``(a_j, c_j)`` for ``j = count`` concurrent all-reduces.

        Without a measurement, start-ups are assumed to overlap and bandwidth to be shared
        (``(a, j)``); past the last measured count ``m``, ``(a_m, c_m * j / m)``.

        Args:
            count: all-reduces in flight (>= 1).
        """
        if count < 1:
            raise ValueError(f"the number of concurrent all-reduces must be >= 1, got {count}")
        if count == 1:
            return self.a, 1.0
        if not self.concurrency:
            return self.a, float(count)
        if count - 2 < len(self.concurrency):
            return self.concurrency[count - 2]
        measured = len(self.concurrency) + 1
        a_m, c_m = self.concurrency[-1]
        return a_m, c_m * count / measured

    def with_concurrency(self, terms: Sequence[tuple[float, float]]) -> CostModel:
        """This model with the measured ``(a_j, c_j)`` for ``j = 2, 3, ...``.

        Args:
            terms: ``(a_j, c_j)`` for ``j = 2, 3, ...``.
        """
        return CostModel(self.a, self.b, tuple((float(a), float(c)) for a, c in terms))

    @classmethod
    def ring(cls, world_size: int, alpha: float, beta: float, gamma: float = 0.0) -> CostModel:
        """Ring all-reduce on ``world_size`` workers (reduce-scatter then all-gather).

        ``2(N-1)`` steps each pay ``alpha``; every worker sends ``2(N-1)/N * M`` bytes and reduces
        ``(N-1)/N * M`` of them: ``a = 2(N-1)alpha``, ``b = 2(N-1)/N beta + (N-1)/N gamma``.

        Args:
            world_size: workers.
            alpha: seconds of latency per step.
            beta: seconds per byte on the wire.
            gamma: seconds per byte of reduction arithmetic.
        """
        _check_link(world_size, alpha, beta, gamma)
        n = world_size
        if n == 1:
            return cls(0.0, 0.0)
        return cls(2 * (n - 1) * alpha, 2 * (n - 1) / n * beta + (n - 1) / n * gamma)

    @classmethod
    def double_binary_tree(
        cls, world_size: int, alpha: float, beta: float, gamma: float = 0.0
    ) -> CostModel:
        """Double binary tree all-reduce (NCCL's tree algorithm), pipelined over the message.

        A reduce up and a broadcast down a tree of depth ``ceil(log2 N)`` pay ``2 log2(N)``
        start-ups; with the message split between two complementary trees every worker sends and
        receives about ``2M`` bytes in all and reduces ``M``: ``a = 2 ceil(log2 N) alpha``,
        ``b = 2 beta + gamma``. It beats the ring on latency at large N and loses on bandwidth.

        Args:
            world_size: workers.
            alpha: seconds of latency per step.
            beta: seconds per byte on the wire.
            gamma: seconds per byte of reduction arithmetic.
        """
        _check_link(world_size, alpha, beta, gamma)
        if world_size == 1:
            return cls(0.0, 0.0)
        depth = math.ceil(math.log2(world_size))
        return cls(2 * depth * alpha, 2 * beta + gamma)

    @classmethod
    def fit_points(cls, sizes: Sequence[float], seconds: Sequence[float]) -> CostModel:
        """Least-squares ``a + b*M`` through measured (bytes, seconds) points.

        Negative coefficients (noise on a nearly flat or nearly proportional curve) are clamped
        to zero and the other refitted alone, so the model stays physical.

        Args:
            sizes: message sizes, in bytes (at least two distinct).
            seconds: their measured times.
        """
        import numpy as np  # noqa: PLC0415 - only fits need it; pricing imports stay light

        x = np.asarray(sizes, dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        if x.shape != y.shape or x.size < 2:
            raise ValueError("fitting a cost model needs at least two (size, time) points")
        if np.unique(x).size < 2:
            raise ValueError("fitting a cost model needs at least two distinct sizes")
        design = np.stack([np.ones_like(x), x], axis=1)
        (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
        if b < 0:
            return cls(max(float(np.mean(y)), 0.0), 0.0)
        if a < 0:
            return cls(0.0, max(float(np.dot(x, y) / np.dot(x, x)), 0.0))
        return cls(float(a), float(b))

    @classmethod
    def fit_slope(cls, a: float, sizes: Sequence[float], seconds: Sequence[float]) -> CostModel:
        """``b`` by least squares through ``(M, T - a)`` with the start-up ``a`` measured apart.

        Fitting both numbers lets a few noisy large messages decide the intercept, which then
        lands far from what a tiny message really costs (even below zero on a shaped link whose
        burst lets medium messages through early); the planners' merge decisions hinge on ``a``.

        Args:
            a: the start-up, measured apart.
            sizes: message sizes, in bytes.
            seconds: their measured times.
        """
        import numpy as np  # noqa: PLC0415 - only fits need it; pricing imports stay light

        x = np.asarray(sizes, dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64) - a
        if x.shape != y.shape or x.size < 1 or not np.any(x > 0):
            raise ValueError("fitting the per-byte cost needs at least one non-empty size")
        return cls(a, max(float(np.dot(x, y) / np.dot(x, x)), 0.0))

    def scaled_to(self, world_size: int, from_world_size: int) -> CostModel:
        """This ring model, fitted on ``from_world_size`` workers, extrapolated to ``world_size``.

        Recovers the per-link ``alpha`` and the per-byte term from the ring formulas and applies
        them at the new size (the reduction term is folded into ``beta``).

        Args:
            world_size: the workers to extrapolate to.
            from_world_size: the workers the model was fitted on (>= 2).
        """
        if from_world_size < 2 or world_size < 1:
            raise ValueError("extrapolating a ring model needs a fit on >= 2 workers")
        m = from_world_size
        alpha = self.a / (2 * (m - 1))
        beta = self.b / (2 * (m - 1) / m)
        return CostModel.ring(world_size, alpha, beta)


def ring_allreduce_time(
    nbytes: float, world_size: int, bandwidth_bps: float, latency_s: float = 0.0
) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` on ``world_size`` workers.

    Each worker sends and receives ``2(N-1)/N * M`` bytes over its link of ``bandwidth_bps`` bits
    per second, in ``2(N-1)`` steps that each pay ``latency_s``; reduction arithmetic is ignored.

    Args:
        nbytes: the message size.
        world_size: workers.
        bandwidth_bps: each link's bandwidth, in bits per second.
        latency_s: seconds per step.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bandwidth_bps <= 0:
        raise ValueError(f"bandwidth_bps must be > 0, got {bandwidth_bps}")
    return CostModel.ring(world_size, latency_s, 8.0 / bandwidth_bps).time(nbytes)


_OSU_LINE = re.compile(r"^\s*(?:(\d+)\s*,\s*)?(\d+)\s+([0-9.eE+-]+)\s*$")
_WORKERS_IN_NAME = re.compile(r"(\d+)\s*workers")


def read_osu_log(
    path: str | Path, workers: int | None = None
) -> dict[int, list[tuple[int, float]]]:
    """(bytes, seconds) points per worker count from an OSU all-reduce latency log.

    Data lines read ``workers,message_bytes  average_latency_us`` or, as OSU itself prints them,
    ``message_bytes  average_latency_us``; the worker count of the latter comes from ``workers``
    or else from the file name (``..._8workers_...``). Anything else is skipped.

    Args:
        path: the log.
        workers: the worker count of lines that give none (default: from the file name).

    Raises:
        ValueError: for a log without data lines, or lines whose worker count is unknown.
    """
    if workers is None:
        named = _WORKERS_IN_NAME.search(Path(path).name)
        workers = int(named[1]) if named else None
    points: dict[int, list[tuple[int, float]]] = {}
    for line in Path(path).read_text().splitlines():
        match = _OSU_LINE.match(line)
        if not match:
            continue
        count = int(match[1]) if match[1] else workers
        if count is None:
            raise ValueError(
                f"{path}: a line gives no worker count and the file name has none; "
                "pass workers= explicitly"
            )
        points.setdefault(count, []).append((int(match[2]), float(match[3]) * 1e-6))
    if not points:
        raise ValueError(f"{path} holds no 'workers,bytes latency_us' lines of an OSU log")
    return points


def fit_osu_log(
    path: str | Path, min_bytes: int = 0, workers: int | None = None
) -> dict[int, CostModel]:
    """A fitted cost model per worker count in an OSU log, from messages of >= ``min_bytes``.

    Args:
        path: the log.
        min_bytes: smaller messages are left out of the fit.
        workers: as for :func:`read_osu_log`.
    """
    return {
        count: CostModel.fit_points(*_unzip(p for p in pts if p[0] >= min_bytes))
        for count, pts in read_osu_log(path, workers).items()
    }


def _unzip(points: Iterable[tuple[int, float]]) -> tuple[list[float], list[float]]:
    pairs = list(points)
    return [float(size) for size, _ in pairs], [seconds for _, seconds in pairs]


def _check_link(world_size: int, alpha: float, beta: float, gamma: float) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if min(alpha, beta, gamma) < 0:
        raise ValueError("alpha, beta and gamma must be >= 0")
