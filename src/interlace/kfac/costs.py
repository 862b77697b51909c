"""Measured cost models for SPD-KFAC's load-balancing placement (see docs/notes/kfac.md).

:class:`DecompositionCostModel` prices decomposing a factor; broadcasts are priced by the
all-reduce model :class:`interlace.comm.cost.CostModel` (:func:`broadcast_time`).
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from interlace.comm.cost import CostModel
from interlace.kfac.methods import DecompositionMethod, method_from

if TYPE_CHECKING:
    import torch

__all__ = [
    "MEASURED_SIZES",
    "BroadcastCostModel",
    "DecompositionCostModel",
    "broadcast_time",
    "decomposition_numel",
    "log_log_interpolate",
    "random_spd",
    "time_decomposition",
]

#: Broadcasts are priced by the all-reduce cost model: a broadcast moves no more data.
BroadcastCostModel = CostModel

#: The sides :meth:`DecompositionCostModel.measure` times by default.
MEASURED_SIZES: tuple[int, ...] = (32, 64, 128, 256, 512)


def log_log_interpolate(points: Sequence[tuple[int, float]], n: int) -> float:
    """Seconds at size ``n`` from measured ``(size, seconds)`` points: piecewise linear in
    ``log(size), log(seconds)``, extended along the end segments.

    Args:
        points: At least two points of increasing size >= 1 and seconds > 0.
        n: The size (>= 1).
    """
    sizes = [p[0] for p in points]
    index = min(max(bisect.bisect_left(sizes, n), 1), len(points) - 1)
    (n0, t0), (n1, t1) = points[index - 1], points[index]
    slope = math.log(t1 / t0) / math.log(n1 / n0)
    return t0 * math.exp(slope * math.log(n / n0))


@dataclass(frozen=True)
class DecompositionCostModel:
    """Seconds to decompose one dense ``n x n`` factor: through measured ``points`` when it has
    them, else ``c0 + c2 n^2 + c3 n^3``.

    A device's solver is far from cubic over the sizes a model has (on an H200 ``eigh`` of
    64 x 64 takes a fifth of 256 x 256's time, not a sixty-fourth), and a placement balanced by
    a cubic that misses the small sizes by 10x is off by a decomposition or two per rank; so a
    measured model keeps its points and interpolates them (:func:`log_log_interpolate`). The
    coefficients are the cubic fitted to the same points, for reports and for a model given
    by hand.

    Args:
        c3: Seconds per ``n^3``.
        c2: Seconds per ``n^2``.
        c0: Seconds per decomposition.
        points: Measured ``(n, seconds)``, increasing in ``n`` and non-decreasing in seconds
            (empty: the cubic alone).
    """

    c3: float
    c2: float
    c0: float
    points: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name, value in (("c3", self.c3), ("c2", self.c2), ("c0", self.c0)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if self.points:
            sizes = [n for n, _ in self.points]
            times = [t for _, t in self.points]
            if len(sizes) < 2 or sizes != sorted(set(sizes)) or sizes[0] < 1:
                raise ValueError("points need >= 2 sizes, increasing and >= 1")
            if any(not (math.isfinite(t) and t > 0) for t in times) or times != sorted(times):
                raise ValueError("points need finite times > 0, non-decreasing in size")

    def time(self, n: int, diagonal: bool = False) -> float:
        """Seconds to decompose an ``n x n`` factor.

        A diagonal factor needs no decomposition (its inverse is elementwise), and an empty one
        nothing at all: both cost zero. Non-negative coefficients, or non-decreasing points,
        make the time non-decreasing in ``n``.

        Args:
            n: The factor's side.
            diagonal: Whether the factor is a diagonal (free).
        """
        if diagonal or n <= 0:
            return 0.0
        if self.points:
            return log_log_interpolate(self.points, n)
        return self.c0 + self.c2 * n**2 + self.c3 * n**3

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> DecompositionCostModel:
        """The measured model of ``(n, seconds)`` samples: their median per size as its points
        (made non-decreasing), and the cubic fitted to them by non-negative least squares.

        Residuals are relative (each row is divided by its time), so a 32 x 32 factor's fraction
        of a millisecond counts as much as a 512 x 512 factor's tens: the local-or-broadcast
        decision is made among the small factors. With three unknowns, exact NNLS is cheap:
        the solution is the unconstrained least-squares fit on its own support, so every subset
        of the coefficients is fitted and the best fit with no negative coefficient is kept.

        Args:
            samples: ``(n, seconds)`` measurements of at least three distinct sizes.
        """
        if not samples:
            raise ValueError("fitting a decomposition cost model needs (size, seconds) samples")
        import numpy as np  # noqa: PLC0415 - only fits need it; pricing imports stay light

        sizes = np.asarray([float(n) for n, _ in samples])
        seconds = np.asarray([float(t) for _, t in samples])
        if not (np.all(np.isfinite(sizes)) and np.all(np.isfinite(seconds))):
            raise ValueError("decomposition timings must be finite")
        if np.any(sizes <= 0) or np.any(seconds < 0):
            raise ValueError("decomposition samples need sizes > 0 and times >= 0")
        if np.unique(sizes).size < 3:
            raise ValueError(
                "fitting c0 + c2 n^2 + c3 n^3 needs samples of at least three distinct sizes"
            )
        # A zero time (below the clock's resolution) is weighted as the smallest positive one.
        positive = seconds[seconds > 0]
        floor = float(positive.min()) if positive.size else 1.0
        weights = 1.0 / np.maximum(seconds, floor)
        columns = np.stack([sizes**3, sizes**2, np.ones_like(sizes)], axis=1) * weights[:, None]
        target = seconds * weights
        # Columns differ by up to ~1e8 in scale; normalising them keeps lstsq well conditioned.
        scale = np.linalg.norm(columns, axis=0)
        columns = columns / scale
        best: tuple[float, np.ndarray] | None = None
        for support_size in range(1, 4):
            for support in itertools.combinations(range(3), support_size):
                chosen = list(support)
                solution, *_ = np.linalg.lstsq(columns[:, chosen], target, rcond=None)
                if np.any(solution < 0):
                    continue
                coefficients = np.zeros(3)
                coefficients[chosen] = solution
                residual = float(np.sum((columns @ coefficients - target) ** 2))
                # Strictly better only: equal residuals keep the smaller support (found first).
                if best is None or residual < best[0]:
                    best = (residual, coefficients)
        # A single column always fits with a non-negative coefficient (targets are >= 0).
        assert best is not None
        c3, c2, c0 = (float(value) for value in best[1] / scale)
        return cls(c3=c3, c2=c2, c0=c0, points=_measured_points(samples))

    @classmethod
    def measure(
        cls,
        method: DecompositionMethod | str,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        sizes: Sequence[int] = MEASURED_SIZES,
        repeats: int = 3,
    ) -> DecompositionCostModel:
        """Time ``method``'s kernel (``eigh``, ``inv``) on this device, then fit.

        Each size is decomposed once untimed (the first call loads solver kernels and
        workspaces) and then ``repeats`` times on fresh random SPD matrices; the median time
        per size goes to :meth:`fit`. CUDA work is synchronised around each timing.

        Args:
            method: The decomposition method (or its name, ``"eigen"`` or ``"inverse"``).
            device: Where to time.
            dtype: The dtype of the timed matrices (default float32).
            sizes: The sides timed.
            repeats: Timed decompositions per size (after one untimed).
        """
        chosen = method_from(method, "method")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        import torch  # noqa: PLC0415 - only measuring needs torch; the simulator prices without it

        dtype = torch.float32 if dtype is None else dtype
        device = torch.device(device)
        generator = torch.Generator().manual_seed(0)
        samples = []
        for n in sizes:
            matrices = [random_spd(n, dtype, device, generator) for _ in range(repeats + 1)]
            timings = [time_decomposition(chosen, matrix) for matrix in matrices]
            samples.append((n, statistics.median(timings[1:])))
        return cls.fit(samples)


def _measured_points(samples: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """Each size's median time, raised where needed so that a larger size never costs less
    (noise can invert two close sizes); none if a time is 0 (below the clock's resolution)."""
    by_size: dict[int, list[float]] = {}
    for n, seconds in samples:
        by_size.setdefault(int(n), []).append(float(seconds))
    points = []
    highest = 0.0
    for n in sorted(by_size):
        highest = max(highest, statistics.median(by_size[n]))
        points.append((n, highest))
    if highest <= 0 or points[0][1] <= 0:
        return ()
    return tuple(points)


def random_spd(
    n: int, dtype: torch.dtype, device: torch.device, generator: torch.Generator
) -> torch.Tensor:
    """A well-conditioned SPD matrix like a damped factor: ``X X^T / n + I``.

    Args:
        n: The side.
        dtype: The result's dtype (drawn in float64).
        device: The result's device.
        generator: The CPU generator ``X`` is drawn from.
    """
    import torch  # noqa: PLC0415 - only measuring needs torch; the simulator prices without it

    x = torch.randn(n, n, generator=generator, dtype=torch.float64)
    return (x @ x.T / n + torch.eye(n, dtype=torch.float64)).to(device=device, dtype=dtype)


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        import torch  # noqa: PLC0415 - only measuring needs torch; the simulator prices without it

        torch.cuda.synchronize(device)


def time_decomposition(method: DecompositionMethod | str, matrix: torch.Tensor) -> float:
    """Seconds for one decomposition of ``matrix``, with the device drained before and after.

    Args:
        method: The decomposition method (or its name), whose kernel is timed.
        matrix: A square matrix.
    """
    chosen = method_from(method, "method")
    _synchronise(matrix.device)
    start = time.perf_counter()
    chosen.run(matrix)
    _synchronise(matrix.device)
    return time.perf_counter() - start


def decomposition_numel(method: DecompositionMethod | str, dim: int, diagonal: bool = False) -> int:
    """Numbers broadcast for one factor's decomposition, as the preconditioner sends them.

    ``eigen``: eigenvectors and eigenvalues, ``n^2 + n``; ``inverse``: the ``n x n`` inverse;
    a diagonal factor: its ``n`` values either way (:meth:`DecompositionMethod.numel`).

    Args:
        method: The decomposition method (or its name).
        dim: The factor's side.
        diagonal: Whether the factor is a diagonal.
    """
    return method_from(method, "method").numel(dim, diagonal)


def broadcast_time(
    model: CostModel,
    method: DecompositionMethod | str,
    dim: int,
    diagonal: bool = False,
    element_size: int = 4,
) -> float:
    """Seconds to broadcast one factor's decomposition, priced by ``model`` (``a + b M``).

    Args:
        model: The ``a + b M`` cost model.
        method: The decomposition method (or its name).
        dim: The factor's side.
        diagonal: Whether the factor is a diagonal.
        element_size: Bytes per number sent.
    """
    return model.time(decomposition_numel(method, dim, diagonal) * element_size)
