"""The MG-WFBP authors' Caffe logs, line by line: their records, iterations and messages.

:func:`interlace.sim.trace.read_caffe_log` turns one iteration into a trace; docs/traces.md
describes the format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from interlace.errors import UsageError


class TraceFormatError(UsageError):
    """A trace file that cannot be read; the message starts with ``FILE:LINE:`` where known."""


class CaffeMessages(str, Enum):
    """Which lines of a Caffe log iteration become messages; a member or its string works."""

    #: Every line: a layer's weight and bias as two tensors of one layer (PyTorch's unit).
    TENSORS = "tensors"
    #: The lines with both a backward and an all-reduce time logged, each one message with its
    #: own backward time; the others dropped (how the authors' simulator read the logs).
    LOGGED = "logged"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class CaffeRecord:
    """One log line's ``[index, numel, backward_us, comm_us, merged_comm_us]``, in seconds.

    Args:
        line: The line's number in the file.
        index: The tensor's index, from the input side.
        numel: Its elements.
        backward_s: Its layer's backward time.
        comm_s: Its logged all-reduce time (0: none logged).
    """

    line: int
    index: int
    numel: int
    backward_s: float
    comm_s: float


#: ``... distributed.cpp:112] [i, numel, backward_us, comm_us, merged_comm_us]``
_RECORD = re.compile(r"\[([^\[\]]*)\]\s*$")
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_FIELDS = re.compile(
    rf"^\s*(\d+)\s*,\s*(\d+)\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*$"
)


def parse_caffe_log(path: Path, text: str) -> list[list[CaffeRecord]]:
    """Every iteration of the log: runs of records ``i = 0, 1, ...``.

    Blank lines and ``#`` comments are skipped; any other line that does not end in a record,
    or a record out of sequence, is an error naming the file and line.

    Args:
        path: The log (for messages).
        text: Its text.

    Raises:
        TraceFormatError: ``FILE:LINE: what is wrong``.
    """
    iterations: list[list[CaffeRecord]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        record = _RECORD.search(stripped)
        fields = _FIELDS.match(record[1]) if record else None
        if fields is None:
            raise TraceFormatError(
                f"{path}:{number}: expected a line ending in "
                f"'[index, numel, backward_us, comm_us, merged_comm_us]', got {stripped[-80:]!r}"
            )
        index, numel = int(fields[1]), int(fields[2])
        backward_us, comm_us = float(fields[3]), float(fields[4])
        if numel < 1 or backward_us < 0 or comm_us < 0:
            raise TraceFormatError(
                f"{path}:{number}: numel must be >= 1 and times >= 0, got {record and record[0]}"
            )
        if index == 0:
            iterations.append([])
        elif not iterations or index != len(iterations[-1]):
            expected = len(iterations[-1]) if iterations else 0
            raise TraceFormatError(
                f"{path}:{number}: tensor index {index} out of sequence (expected {expected}, "
                "or 0 to start an iteration)"
            )
        iterations[-1].append(CaffeRecord(number, index, numel, backward_us * 1e-6, comm_us * 1e-6))
    if not iterations:
        raise TraceFormatError(f"{path}:1: no '[index, numel, backward_us, ...]' records")
    return iterations


def choose_iteration(
    path: Path, iterations: list[list[CaffeRecord]], number: int | None = None
) -> tuple[int, list[CaffeRecord]]:
    """The iteration to read, as ``(its number from 1, its records)``.

    Args:
        path: The log (for messages).
        iterations: :func:`parse_caffe_log`'s iterations.
        number: Which one, counting from 1 (None: the last complete one, i.e. as long as the
            first).

    Raises:
        TraceFormatError: For a number outside the log or an incomplete iteration.
    """
    complete = len(iterations[0])
    if number is None:
        number = max(k for k, it in enumerate(iterations, start=1) if len(it) == complete)
    if not 1 <= number <= len(iterations):
        raise TraceFormatError(
            f"{path}: no iteration {number}; the log has {len(iterations)} (count from 1)"
        )
    chosen = iterations[number - 1]
    if len(chosen) != complete:
        raise TraceFormatError(
            f"{path}:{chosen[-1].line}: iteration {number} is incomplete ({len(chosen)} of "
            f"{complete} tensors); choose another"
        )
    return number, chosen


def logged_messages(records: list[CaffeRecord]) -> list[CaffeRecord]:
    """The records :attr:`CaffeMessages.LOGGED` keeps: a backward and an all-reduce time logged.

    Args:
        records: One iteration's records.
    """
    return [r for r in records if r.backward_s > 0 and r.comm_s > 0]
