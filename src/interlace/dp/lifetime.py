"""The end of a DataParallel's life: what it put on the module and the process, taken off once
(by ``close()``, the ``with`` block's end or a finalizer), and the rule that a parameter belongs
to one live wrapper at a time (docs/data-parallel.md, "Closing a wrapper").
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from interlace.comm.channels import Channels
from interlace.dp.forward_overlap import ForwardOverlap
from interlace.errors import UsageError

__all__ = ["Holdings", "claim", "ensure_unclaimed", "unclaim", "weak_method"]

logger = logging.getLogger("interlace")

#: The live wrapper of each wrapped parameter, by ``id``; an entry goes with its wrapper.
_owners: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def ensure_unclaimed(params: Sequence[torch.Tensor]) -> None:
    """Raise if a live wrapper holds one of ``params``.

    Args:
        params: The parameters about to be wrapped.

    Raises:
        UsageError: naming what to do.
    """
    if not any(id(param) in _owners for param in params):
        return
    gc.collect()  # a dropped wrapper kept only by a reference cycle of the user's is not live
    if any(id(param) in _owners for param in params):
        raise UsageError(
            "this module's parameters are already wrapped by a live DataParallel; close that "
            "wrapper first (model.close(), or wrap with `with DataParallel(...) as model:`)"
        )


def claim(params: Sequence[torch.Tensor], wrapper: Any) -> None:
    """Record ``wrapper`` as the live wrapper of ``params``.

    Args:
        params: Its parameters.
        wrapper: The DataParallel (held weakly).
    """
    for param in params:
        _owners[id(param)] = wrapper


def unclaim(params: Sequence[torch.Tensor], wrapper: Any) -> None:
    """Forget ``wrapper`` as the wrapper of ``params``.

    Args:
        params: Its parameters.
        wrapper: The DataParallel.
    """
    for param in params:
        if _owners.get(id(param)) is wrapper:
            del _owners[id(param)]


def weak_method(owner: Any, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of ``owner`` called through a weak reference, so that whatever holds the
    result (a tensor, the bucket engine) does not keep ``owner`` alive.

    Args:
        owner: The object.
        method: An unbound method of its class.
    """
    reference = weakref.ref(owner)

    def call(*args: Any) -> Any:
        target = reference()
        return None if target is None else method(target, *args)

    return call


class Holdings:
    """What one wrapper registered outside itself: hooks on its parameters, the forward
    overlap's hooks and step listener, the channels' process groups. It holds no reference to
    the wrapper, so a finalizer may keep it.

    Args:
        channels: The channels (the groups beyond the first were created by the wrapper).
        forward_overlap: The forward overlap's runtime, or None.
    """

    def __init__(self, channels: Channels, forward_overlap: ForwardOverlap | None) -> None:
        self.channels = channels
        self.forward_overlap = forward_overlap
        #: Removable handles of the hooks put on the parameters.
        self.handles: list[Any] = []

    def release(self) -> None:
        """Apply what is pending, take every hook off, destroy the created process groups."""
        try:
            if self.forward_overlap is not None:
                self.forward_overlap.close()
        finally:
            for handle in self.handles:
                handle.remove()
            self.handles = []
            self.forward_overlap = None
            self.channels.close()

    def release_quietly(self) -> None:
        """:meth:`release` from a finalizer: a failure is logged (the wrapper is gone)."""
        try:
            self.release()
        except Exception:  # nothing can be raised to from a finalizer
            logger.warning(
                "interlace.DataParallel: closing a dropped wrapper failed", exc_info=True
            )
