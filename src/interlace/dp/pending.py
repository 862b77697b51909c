"""What still waits for communication under ``overlap="forward"``, made safe to touch.

A gradient still being averaged is a :class:`PendingGrad`: any read of it waits for every average
first. A parameter whose update is deferred is watched by :class:`ParamGuard` until the next
forward: any use of it outside that forward applies the updates first.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["ParamGuard", "PendingGrad", "PendingOwner"]


class PendingOwner(Protocol):
    """Who resolves pending gradients and updates (:class:`interlace.dp.overlap.ForwardOverlap`)."""

    def complete(self) -> None:
        """Wait for every average in flight and apply every deferred update."""

    def discard(self, grad: PendingGrad) -> None:
        """The user zeroes ``grad``: its parameter's gradient is the user's plain tensor now.

        Args:
            grad: The pending gradient being zeroed.
        """


def _getters(*names: str) -> set[Any]:
    found = set()
    for name in names:
        descriptor = inspect.getattr_static(torch.Tensor, name, None)
        if hasattr(descriptor, "__get__"):
            found.add(descriptor.__get__)
    return found


_GRAD = inspect.getattr_static(torch.Tensor, "grad")


#: Reading these says nothing about a tensor's values: no need to wait for them.
METADATA: frozenset[Any] = frozenset(
    _getters(
        "grad",
        "grad_fn",
        "requires_grad",
        "is_leaf",
        "is_sparse",
        "is_cuda",
        "device",
        "dtype",
        "shape",
        "ndim",
        "layout",
        "names",
        "_base",
    )
    | {_GRAD.__set__, _GRAD.__delete__}
    | {
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.element_size,
        torch.Tensor.requires_grad_,
        torch.Tensor.detach_,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.get_device,
        torch.Tensor.__len__,
        torch.Tensor.__hash__,
    }
)
#: What ``Optimizer.zero_grad(set_to_none=False)`` calls to discard a gradient.
DISCARDS: frozenset[Any] = frozenset({torch.Tensor.zero_, torch._foreach_zero_})


class PendingGrad(torch.Tensor):
    """A parameter's ``.grad`` while the ranks' average is still in flight.

    It holds this rank's own gradient. Any operation that reads its values (a norm, a clip, a
    copy, an optimizer that is not deferred) first waits for every average of the iteration and
    writes it in, then runs on plain tensors; metadata (shape, dtype, ``requires_grad``) needs no
    wait, and zeroing it (``zero_grad(set_to_none=False)``) discards it without waiting.
    """

    _owner: PendingOwner
    param_index: int
    plain: torch.Tensor

    @staticmethod
    def wrap(grad: torch.Tensor, owner: PendingOwner, index: int) -> PendingGrad:
        """``grad`` (sharing its storage) marked as pending under ``owner``.

        Args:
            grad: This rank's gradient.
            owner: Who resolves it.
            index: Its parameter's index in the owner.
        """
        pending: PendingGrad = torch.Tensor._make_subclass(PendingGrad, grad, False)
        pending._owner = owner
        pending.param_index = index
        pending.plain = grad
        return pending

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in METADATA:
            pending = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, cls)]
            if func in DISCARDS:
                for grad in pending:
                    grad._owner.discard(grad)
            else:
                for owner in {id(grad._owner): grad._owner for grad in pending}.values():
                    owner.complete()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


class ParamGuard(TorchFunctionMode):
    """Between a deferred optimizer step and the next forward: an operation on one of
    ``params`` (an EMA update, a norm, a save) first applies the deferred updates.

    Args:
        owner: Who applies them.
        params: The parameters whose updates are deferred.
    """

    def __init__(self, owner: PendingOwner, params: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self._owner = owner
        self._ids = {id(param) for param in params}
        self.active = True

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if (
            self.active
            and func not in METADATA
            and any(id(leaf) in self._ids for leaf in tree_leaves((args, kwargs)))
        ):
            self.active = False
            self._owner.complete()
        return func(*args, **kwargs)

    def watch(self) -> None:
        """Start watching (on this thread)."""
        self.__enter__()  # type: ignore[no-untyped-call]

    def release(self) -> bool:
        """Stop watching; False when another mode was pushed above this one since (it is then
        left in place, inert, for a later :meth:`release`)."""
        self.active = False
        stack = torch.overrides._get_current_function_mode_stack()
        if not stack or stack[-1] is not self:
            return False
        self.__exit__(None, None, None)
        return True
