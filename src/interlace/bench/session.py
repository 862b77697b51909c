"""How a benchmark's or a validation's launches run: one launch of ranks on the target link
(:class:`LaunchOptions`) and a run's launches with its progress bar, its cost-model cache and
its failures (:class:`Session`)."""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from tqdm import tqdm

from interlace.bench import harness
from interlace.bench.harness import PROG, REAL_COMPUTE, LaunchFailedError
from interlace.emulate import Compute, dilate_rate
from interlace.emulate.device import dilate_link
from interlace.errors import UsageError
from interlace.launch import netem

_T = TypeVar("_T")

#: Why a validation, which has no loopback fallback, refuses to run without the emulated cluster.
VALIDATION_NEEDS_ROOT = "validation measures on the emulated cluster and needs root"


def run_link(link: str | None, compute: Compute) -> str | None:
    """The link the ranks run at for a target ``link``: on emulated compute its rate divided by
    the dilation (compute runs D times slower, and so must the links).

    Args:
        link: The target cluster's link, or None for loopback.
        compute: What the ranks compute on.
    """
    if link is None or not compute.emulated:
        return link
    return dilate_link(link, compute.dilation)


def shown_link(link: str, compute: Compute) -> str:
    """``link`` as rows show it: on emulated compute with the rate the ranks ran at
    (``10gbit (emulated at 2.5gbit)``).

    Args:
        link: The target cluster's link.
        compute: What the ranks computed on.
    """
    if not compute.emulated:
        return link
    return f"{link} (emulated at {format_rate(dilate_rate(link, compute.dilation))})"


def format_rate(rate_bps: float) -> str:
    """``rate_bps`` as a ``tc``/``--link`` rate with 3 significant digits (``87.5mbit``).

    Args:
        rate_bps: A finite rate > 0, bits per second.
    """
    if not rate_bps > 0 or not math.isfinite(rate_bps):
        raise ValueError(f"a rate must be a finite number > 0, got {rate_bps}")
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate_bps >= scale or unit == "kbit":
            value = rate_bps / scale
            text = f"{value:.3g}" if value < 1000 else f"{value:.0f}"
            return f"{text}{unit}"
    raise AssertionError("unreachable")


def check_netem(reason: str = "run as root, or pass --no-netem to measure on loopback") -> None:
    """Make sure the emulated cluster can be built here.

    Args:
        reason: What the refusal suggests.

    Raises:
        UsageError: It cannot (not root, or no iproute2).
    """
    netem.require(reason)


@dataclass(frozen=True)
class LaunchOptions:
    """How a launch of ranks runs: its counts of iterations, its limits and where its notes go.

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

    def launch(
        self,
        fn: Callable[[_T], Any],
        job: _T,
        *,
        nprocs: int,
        link: str | None,
        compute: Compute = REAL_COMPUTE,
        prog: str = PROG,
    ) -> Any:
        """Rank 0's value of ``fn(job)`` on ``nprocs`` ranks on the target ``link``
        (:func:`run_link`), with these limits; every benchmark and validation launches here.

        Args:
            fn: The rank code.
            job: Its argument.
            nprocs: Ranks to start.
            link: The target link, or None for loopback.
            compute: What the ranks compute on (emulated: the links run at rate / dilation).
            prog: What the launcher's notices start with.

        Raises:
            LaunchFailedError: When the launch fails.
        """

        def run(cache_dir: str) -> Any:
            return harness.launch_on_ranks(
                fn,
                job,
                nprocs=nprocs,
                link=run_link(link, compute),
                timeout_s=self.timeout_s,
                collective_timeout_s=self.collective_timeout_s,
                cache_dir=cache_dir,
                note=self.note,
                prog=prog,
            )

        if self.cache_dir is not None:
            return run(self.cache_dir)
        # A fitted cost model must never stand in for a measurement of this launch.
        with tempfile.TemporaryDirectory(prefix="interlace-launch-") as fresh:
            return run(fresh)


class Session:
    """One run's launches: its progress bar, one cost-model cache folder for all of them (fresh
    for the run), what failed, and the files it wrote. Use it as a context manager.

    Args:
        prog: What its messages start with.
        total: Launches the run makes (the bar's length).
        timeout_s: Seconds allowed per launch.
        collective_timeout_s: Seconds any one collective may wait for its peers.
        nprocs: Ranks of :meth:`launch`'s launches (None: launches through :meth:`options`).
        compute: What the ranks of :meth:`launch`'s launches compute on.
    """

    def __init__(
        self,
        prog: str,
        total: int,
        *,
        timeout_s: float,
        collective_timeout_s: float | None,
        nprocs: int | None = None,
        compute: Compute = REAL_COMPUTE,
    ) -> None:
        self.prog = prog
        self.nprocs = nprocs
        self.timeout_s = timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.compute = compute
        self.failures: list[str] = []
        self.written: list[str] = []
        self._total = total
        self._bar: Any = None
        self._cache_dir = ""

    def __enter__(self) -> Session:
        self._cache_dir = tempfile.mkdtemp(prefix="interlace-bench-")
        self._bar = tqdm(total=self._total, unit="launch", desc=self.prog, dynamic_ncols=True)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._bar.close()
        shutil.rmtree(self._cache_dir, ignore_errors=True)

    def note(self, line: str) -> None:
        """Print ``line`` above the progress bar.

        Args:
            line: One or more lines.
        """
        self._bar.write(line)

    def options(self, **counts: int) -> LaunchOptions:
        """The session's limits, cache folder and notes as launch options.

        Args:
            **counts: ``iters``, ``warmup`` and ``rounds`` of the launch.
        """
        return LaunchOptions(
            timeout_s=self.timeout_s,
            collective_timeout_s=self.collective_timeout_s,
            cache_dir=self._cache_dir,
            note=self.note,
            **counts,
        )

    def attempt(self, what: str, measure: Callable[[], _T]) -> _T | None:
        """``measure()``, counted on the bar; a launch that fails in it is recorded, noted and
        None.

        Args:
            what: The launch, for the bar and for the failure's message.
            measure: Launches and returns what was measured.
        """
        self._bar.set_postfix_str(what)
        try:
            return measure()
        except LaunchFailedError as exc:
            self.failures.append(f"{what}: {exc}")
            self.note(f"{self.prog}: launch failed: {self.failures[-1]}")
            return None
        finally:
            self._bar.update(1)

    def launch(
        self,
        fn: Callable[[Any], _T],
        job: Any,
        *,
        what: str,
        link: str | None,
    ) -> _T | None:
        """Rank 0's value of ``fn(job)`` on the session's ranks and compute, or None when the
        launch failed (:meth:`attempt`).

        Args:
            fn: The rank code.
            job: Its argument.
            what: The launch, for the bar and for a failure's message.
            link: The target link, or None for loopback.
        """
        if self.nprocs is None:
            raise ValueError("a session without ranks launches through options().launch()")
        nprocs = self.nprocs
        return self.attempt(
            what,
            lambda: self.options().launch(
                fn, job, nprocs=nprocs, link=link, compute=self.compute, prog=self.prog
            ),
        )

    def wrote(self, line: str) -> None:
        """Say at the end that a file was written.

        Args:
            line: What was written where.
        """
        self.written.append(line)

    def finish(self) -> int:
        """The files written, then every failed launch on stderr; the exit status (1 when a
        launch failed)."""
        for line in self.written:
            print(line)
        if not self.failures:
            return 0
        print(f"\n{self.prog}: {len(self.failures)} launch(es) failed:", file=sys.stderr)
        for message in self.failures:
            print(f"  {message.splitlines()[0]}", file=sys.stderr)
        return 1
