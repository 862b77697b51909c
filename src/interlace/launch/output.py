"""The ranks' output on the launcher's streams: one line at a time, each prefixed ``[rank K]``."""

from __future__ import annotations

import sys
import threading
from collections import deque
from typing import IO, TextIO

__all__ = ["Output", "pump"]


class Output:
    """Serialises prefixed lines from many reader threads onto the launcher's streams.

    Args:
        output: The stream that receives every line; None for this process's stdout (and
            stderr, for the ranks' stderr and the launcher's own messages).
    """

    def __init__(self, output: TextIO | None) -> None:
        self._output = output
        self._lock = threading.Lock()

    def write(self, text: str, *, stderr: bool) -> None:
        """Write ``text`` whole, to stderr when ``stderr`` (unless a stream was given).

        Args:
            text: One or more complete lines.
            stderr: Whether the text came from a rank's stderr (or the launcher itself).
        """
        stream = self._output or (sys.stderr if stderr else sys.stdout)
        with self._lock:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):
                pass  # a closed or broken launcher stream must not take the job down with it

    @property
    def captured(self) -> bool:
        """Whether output goes to a caller's stream (then rank 0 must be piped into it too)."""
        return self._output is not None

    def message(self, text: str) -> None:
        """One line from the launcher itself (always to stderr, or to ``output`` if given).

        Args:
            text: The line, without the ``interlace launch:`` prefix and newline.
        """
        self.write(f"interlace launch: {text}\n", stderr=True)


def pump(pipe: IO[bytes], prefix: str, sink: Output, stderr: bool, tail: deque[str] | None) -> None:
    """Copy ``pipe`` to ``sink`` line by line, each line prefixed; keep a tail if asked.

    Args:
        pipe: A rank's stdout or stderr; closed when it ends.
        prefix: Put before every line (``[rank K] `` or nothing).
        sink: Where the lines go.
        stderr: Whether ``pipe`` is the rank's stderr.
        tail: Receives every line too (a bounded deque keeps the last ones), or None.
    """
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            if not line.endswith("\n"):
                line += "\n"
            sink.write(prefix + line, stderr=stderr)
            if tail is not None:
                tail.append(line)
