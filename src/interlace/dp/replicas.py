"""Keeping the replicas alike: rank 0's parameters and buffers, at wrap time and every forward.

That the ranks built the same model is checked by :func:`interlace.comm.agree.check_agreement`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn


def broadcast_from_first(
    tensors: Sequence[torch.Tensor],
    process_group: dist.ProcessGroup | None = None,
    src: int | None = None,
) -> None:
    """Copy the group's rank 0's values into ``tensors``, now, in one broadcast.

    One broadcast of all their bytes whatever their dtypes, since every collective pays a
    start-up.

    Args:
        tensors: the same tensors (shapes and dtypes) on every rank.
        process_group: the group (default: the world).
        src: the global rank to copy from instead of the group's rank 0.
    """
    if not tensors:
        return
    ordered, flat = _pack_bytes(tensors)
    source = _first_rank(process_group) if src is None else src
    dist.broadcast(flat, src=source, group=process_group)
    _unpack_bytes(ordered, flat)


class BufferBroadcast:
    """Rank 0's module buffers (BatchNorm statistics) for every training forward, as DDP does.

    DDP re-sends the buffers before every forward and waits for them. Nothing changes them
    between the end of one training forward and the start of the next (evaluation passes read
    them), so :meth:`send` starts a snapshot travelling at the end of a forward, during backward,
    and :meth:`receive` waits for it at the start of the next.

    Args:
        module: the module whose buffers are kept alike.
        process_group: the group (default: the world).
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        self.module = module
        self.process_group = process_group
        # The modules that hold buffers, found once as DDP does (walking every module each
        # forward cost more than the rest of the step on small layers); a buffer a module
        # reassigns (``.to()``, a new tensor) is still read from its module each time.
        self._holders = [m for m in module.modules() if m._buffers]
        self._src = _first_rank(process_group)
        self._rank = dist.get_rank(process_group)
        self._in_flight: tuple[dist.Work | None, list[torch.Tensor], torch.Tensor] | None = None

    def _buffers(self) -> list[torch.Tensor]:
        """The module's buffers now, in ``module.buffers()``'s order, each once."""
        found = {id(b): b for m in self._holders for b in m._buffers.values() if b is not None}
        return list(found.values())

    @property
    def in_flight(self) -> bool:
        """Whether a snapshot sent by :meth:`send` is still to be received."""
        return self._in_flight is not None

    def send(self) -> None:
        """Start broadcasting rank 0's buffers as they are now, for the next forward.

        A snapshot travels, so the next forward may update the buffers while it is in flight.
        """
        buffers = self._buffers()
        if not buffers:
            return
        ordered, flat = _pack_bytes(buffers)
        handle = dist.broadcast(flat, src=self._src, group=self.process_group, async_op=True)
        self._in_flight = (handle, ordered, flat)

    def receive(self) -> None:
        """Rank 0's buffers into this rank's: the snapshot in flight, or a broadcast now."""
        if self._in_flight is None:
            broadcast_from_first(self._buffers(), self.process_group)
            return
        handle, ordered, flat = self._in_flight
        self._in_flight = None
        if handle is not None:
            handle.wait()
        if self._rank != 0:
            _unpack_bytes(ordered, flat)

    def discard(self) -> None:
        """Complete and drop the snapshot in flight, if any: the buffers changed since it left
        (a training-mode pass without gradients), so the next forward broadcasts afresh."""
        if self._in_flight is None:
            return
        handle = self._in_flight[0]
        if handle is not None:
            handle.wait()
        self._in_flight = None


def _first_rank(process_group: dist.ProcessGroup | None) -> int:
    """The global rank of the group's rank 0 (collectives name their source globally)."""
    return 0 if process_group is None else dist.get_global_rank(process_group, 0)


def _pack_bytes(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``tensors``, widest elements first (so each starts at an offset its dtype can be viewed
    at), and a copy of all their bytes in one flat tensor."""
    ordered = sorted(tensors, key=lambda t: -t.element_size())
    with torch.no_grad():
        flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in ordered])
    return ordered, flat


def _unpack_bytes(ordered: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat``'s bytes back into ``ordered`` (as :func:`_pack_bytes` laid them out)."""
    pieces = torch.split(flat, [t.numel() * t.element_size() for t in ordered])
    with torch.no_grad():
        torch._foreach_copy_(
            ordered,
            [piece.view(t.dtype).view_as(t) for piece, t in zip(pieces, ordered, strict=True)],
        )
