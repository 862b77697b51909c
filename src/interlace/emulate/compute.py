"""What a benchmark computes on: the real model, or an emulated one built from a trace.

``--compute real`` runs the model's own kernels; ``--compute emulated:TRACE`` replaces them by the
traced device time of a shipped trace name or a trace file (:mod:`interlace.emulate.model`).
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass
from pathlib import Path

from interlace.emulate.dilation import DEFAULT_DILATION, check_dilation
from interlace.errors import UsageError
from interlace.sim.traces import shipped_trace, trace_names


class ComputeKind(str, enum.Enum):
    """Where a benchmark's compute runs."""

    REAL = "real"
    EMULATED = "emulated"


@dataclass(frozen=True)
class Compute:
    """A parsed ``--compute`` value.

    Args:
        kind: Real kernels or emulated device time.
        trace: For emulated compute, the shipped trace name or the trace file's path.
        dilation: The time-dilation factor (1 for real compute).
    """

    kind: ComputeKind
    trace: str | None = None
    dilation: float = 1.0

    @property
    def emulated(self) -> bool:
        """Whether the compute is emulated device time."""
        return self.kind is ComputeKind.EMULATED

    @property
    def name(self) -> str:
        """How rows name what ran: ``real``, a shipped trace's name, or a trace file's stem."""
        if self.trace is None:
            return self.kind.value
        path = Path(self.trace)
        return path.stem if path.is_file() else self.trace

    def label(self) -> str:
        """How a result row names this compute, e.g. ``emulated:googlenet-k80 D=4``."""
        if not self.emulated:
            return "real"
        return f"emulated:{self.trace} D={self.dilation:g}"


def parse_compute(text: str, dilation: float | None = None) -> Compute:
    """Parse a ``--compute`` value: ``real`` or ``emulated:TRACE``.

    Args:
        text: The option's value. TRACE is a shipped trace name (``googlenet-k80``) or a file.
        dilation: The ``--dilation`` value; None takes the default for emulated compute.
            Real compute refuses a dilation other than 1 (its kernels cannot be slowed).

    Raises:
        UsageError: For an unknown kind, an unknown trace name, a missing file or a bad dilation.
    """
    kind, _, trace = text.strip().partition(":")
    kind = kind.lower()
    if kind == ComputeKind.REAL.value and not trace:
        if dilation is not None and check_dilation(dilation) != 1.0:
            raise UsageError(
                "--dilation applies to emulated compute only; "
                "use --compute emulated:TRACE or drop --dilation"
            )
        return Compute(ComputeKind.REAL)
    if kind != ComputeKind.EMULATED.value or not trace:
        raise UsageError(
            f"--compute must be 'real' or 'emulated:TRACE', got {text!r} "
            f"(shipped traces: {', '.join(trace_names())})"
        )
    if shipped_trace(trace) is None and not Path(trace).is_file():
        raise UsageError(
            f"--compute emulated:{trace}: no shipped trace has that name and no such file "
            f"(shipped traces: {', '.join(trace_names())})"
        )
    value = DEFAULT_DILATION if dilation is None else check_dilation(dilation)
    return Compute(ComputeKind.EMULATED, trace, value)


def add_compute_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--compute`` and ``--dilation`` to a benchmark's parser.

    Args:
        parser: The benchmark's argument parser; :func:`compute_from_args` reads the result.
    """
    parser.add_argument(
        "--compute",
        default="real",
        metavar="real|emulated:TRACE",
        help="run the model's kernels (real, the default) or a trace's device time "
        f"(emulated:TRACE, a shipped name such as {trace_names()[0]} or a trace file)",
    )
    parser.add_argument(
        "--dilation",
        type=float,
        default=None,
        metavar="D",
        help="emulated compute: multiply device time by D, divide link rates by D and report "
        f"times / D (default {DEFAULT_DILATION:g})",
    )


def compute_from_args(args: argparse.Namespace) -> Compute:
    """The :class:`Compute` that ``--compute`` and ``--dilation`` ask for.

    Args:
        args: Parsed flags from a parser given :func:`add_compute_arguments`.
    """
    return parse_compute(str(args.compute), args.dilation)
