"""DDP communication hooks on interlace's buckets: a bucket with ``dist.GradBucket``'s interface.

Torch's hooks (``default_hooks.allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
``powerSGD_hook.powerSGD_hook`` ...) take ``(state, bucket)`` and return a future of the
averaged flat buffer; :class:`HookBucket` is what they are given (recipe: docs/integrations.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

CommHook = Callable[..., "torch.futures.Future[torch.Tensor]"]
"""A DDP communication hook: ``hook(state, bucket) -> Future[Tensor]``, the future's value
being the bucket's averaged flat buffer."""


@dataclass(frozen=True)
class HookSpec:
    """A registered hook and the state it is called with.

    Args:
        state: the hook's first argument (a process group or None for the default hooks, a
            ``PowerSGDState`` for PowerSGD).
        hook: the hook.
    """

    state: Any
    hook: CommHook


class HookBucket:
    """One interlace bucket as a hook sees it: the methods of ``torch.distributed.GradBucket``.

    Args:
        index: the bucket's position in launch order (0 is launched first).
        buffer: the flat gradient buffer (only gradient data; the hook may change it in place).
        gradients: each tensor's gradient, a view of ``buffer`` shaped like the tensor.
        parameters: the tensors whose gradients these are, in the same order.
        is_last: whether this bucket is launched last in an iteration.
    """

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        gradients: Sequence[torch.Tensor],
        parameters: Sequence[torch.Tensor],
        is_last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._gradients = list(gradients)
        self._parameters = list(parameters)
        self._is_last = is_last

    def index(self) -> int:
        """The bucket's index (stable while the bucket layout is)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat buffer: the bucket's gradients, one after another."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient, a view of :meth:`buffer` shaped like the parameter."""
        return list(self._gradients)

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in the order of :meth:`gradients`."""
        return list(self._parameters)

    def is_last(self) -> bool:
        """Whether this is the last bucket of the iteration (hooks count iterations by it)."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the buffer the hook works on (as ``fp16_compress_wrapper`` does); the
        future's value is still copied back into the bucket's own buffer.

        Args:
            buffer: the new flat buffer, as many elements as the old one.
        """
        self._buffer = buffer


def layout_changed(state: Any) -> None:
    """Tell a hook's state that the bucket layout changed, so per-bucket memories go stale.

    PowerSGD keeps its error feedback and warm-start matrices per bucket index; they are
    dropped (the next compressed step starts them afresh) instead of being applied to a bucket
    of another size. Other states keep nothing per bucket that interlace knows of.

    Args:
        state: the registered hook's state.
    """
    if isinstance(state, PowerSGDState):
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
