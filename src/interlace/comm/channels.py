"""Communication channels: several process groups over the same ranks (AIACC-Training).

Which bucket goes on which channel is decided by the plan, never locally (docs/notes/dp.md).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from interlace.errors import UsageError

#: ``channels="auto"`` tries 1..4 channels.
MAX_AUTO_CHANNELS = 4


class Channels:
    """``count`` process groups over the ranks of ``process_group`` (default: the world).

    Creating a group is collective: with the default group every rank of the job must build the
    same ``Channels``; with a subgroup, every member of it.

    Args:
        count: how many channels (channel 0 is ``process_group`` itself).
        process_group: the ranks the channels span (default: the world).

    Raises:
        UsageError: for ``count < 1``.
    """

    def __init__(self, count: int, process_group: dist.ProcessGroup | None = None) -> None:
        if count < 1:
            raise UsageError(f"channels must be >= 1, got {count}")
        self.process_group = process_group
        groups: list[dist.ProcessGroup | None] = [process_group]
        if count > 1:
            if process_group is None:
                ranks = list(range(dist.get_world_size()))
                groups += [dist.new_group(ranks) for _ in range(count - 1)]
            else:
                ranks = dist.get_process_group_ranks(process_group)
                groups += [
                    dist.new_group(ranks, use_local_synchronization=True) for _ in range(count - 1)
                ]
        self.groups = groups

    def __len__(self) -> int:
        return len(self.groups)

    def close(self) -> None:
        """Destroy the process groups created here (channel 0 is the caller's); a second call,
        or one after the default group was destroyed, does nothing."""
        created, self.groups = self.groups[1:], self.groups[:1]
        if not dist.is_initialized():
            return
        for group in created:
            if group is not None and group in dist.distributed_c10d._world.pg_map:
                dist.destroy_process_group(group)

    def __getitem__(self, channel: int) -> dist.ProcessGroup | None:
        return self.groups[channel]


def check_same_everywhere(
    value: Any, what: str, process_group: dist.ProcessGroup | None = None
) -> None:
    """Raise on every rank if ``value`` differs between ranks, naming the first rank that differs.

    Used before anything is launched on the channels: a mismatch found here is an error message;
    found later, it would be a hang.

    Args:
        value: this rank's value (compared by its ``repr``).
        what: what the value is, for the message.
        process_group: the ranks to compare (default: the world).

    Raises:
        UsageError: naming the first rank whose value differs from rank 0's.
    """
    digest = zlib.crc32(repr(value).encode())
    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, (digest, repr(value)), group=process_group)
    for rank, (theirs, text) in enumerate(gathered):
        if theirs != gathered[0][0]:
            raise UsageError(
                f"{what} differs across ranks: rank {rank} has {_shorten(text)} but rank 0 has "
                f"{_shorten(gathered[0][1])}; every rank must use the same settings"
            )


def layout_of(groups: Sequence[Sequence[int]], launches: Sequence[Any]) -> str:
    """A compact description of the buckets and of which slice goes out when on which channel,
    for cross-rank checks.

    Args:
        groups: the buckets, as tensor indices.
        launches: the launches in order (``bucket``, ``part``, ``parts`` and ``channel``).
    """
    buckets = ";".join(",".join(map(str, group)) for group in groups)
    order = " ".join(f"{x.bucket}.{x.part}/{x.parts}@{x.channel}" for x in launches)
    return f"{buckets} | {order}"


def _shorten(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
