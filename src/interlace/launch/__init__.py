"""A torchrun-compatible local launcher, optionally on an emulated network (``--link RATE``).

:func:`run` starts N ranks of a callable, a script or a command with torchrun's environment,
prefixes their output, and stops them all when one fails; ``interlace launch`` is its command.
"""

from __future__ import annotations

from interlace.launch.command import PROG, build_parser, main
from interlace.launch.result import TIMEOUT_STATUS, LaunchResult
from interlace.launch.supervise import CAUSE_WINDOW_S, GRACE_S, run
from interlace.launch.worker import worker_main

__all__ = [
    "CAUSE_WINDOW_S",
    "GRACE_S",
    "PROG",
    "TIMEOUT_STATUS",
    "LaunchResult",
    "build_parser",
    "main",
    "run",
    "worker_main",
]
