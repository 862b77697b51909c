"""What still waits for communication under ``overlap="forward"``, made safe to touch.

A gradient still being averaged is a :class:`PendingGrad` (:class:`PendingGrads` keeps them):
any read of it waits for every average first. A parameter whose update is deferred is marked by
:class:`DeferredMarks` until the next forward: any use of it outside that forward applies the
updates first. Neither leaves anything on torch's mode stack, and torch calls on other tensors
pay nothing.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["DeferredMarks", "PendingGrad", "PendingGrads", "PendingOwner"]


class PendingOwner(Protocol):
    """Who resolves pending gradients and updates (the forward overlap's runtime)."""

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


class PendingGrads:
    """The parameters' ``.grad`` from the end of backward until their buckets land.

    Args:
        params: The parameters, in the engine's numbering.
        owner: Who resolves a read of a pending gradient.
    """

    def __init__(self, params: Sequence[torch.Tensor], owner: PendingOwner) -> None:
        self._params = params
        self._owner = owner
        self._wrapped: list[PendingGrad] = []
        self._had_none: list[bool] = []

    def wrap(self) -> None:
        """Backward is over: each ``.grad`` becomes pending, a zero one where this rank made
        none (another rank may have produced one: a read must still wait for the average)."""
        self._wrapped = []
        self._had_none = []
        for number, param in enumerate(self._params):
            grad = param.grad
            self._had_none.append(grad is None)
            wrapped = PendingGrad.wrap(
                torch.zeros_like(param) if grad is None else grad, self._owner, number
            )
            param.grad = wrapped
            self._wrapped.append(wrapped)

    def discard(self, grad: PendingGrad) -> None:
        """The user zeroes ``grad``: its parameter's gradient is the plain tensor again.

        Args:
            grad: The pending gradient.
        """
        param = self._params[grad.param_index]
        if param.grad is grad:
            param.grad = grad.plain

    def land(
        self, members: Sequence[int], averages: Sequence[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Give ``members`` their averaged gradients for the deferred updates; return what each
        one's ``.grad`` is to be once the updates ran (:meth:`restore`).

        A gradient left as backward made it becomes the average (one no rank produced stays as
        it was: None, or what earlier passes accumulated); one the user zeroed or dropped since
        stays the user's, and the update still uses the average.

        Args:
            members: The parameters landing, by number.
            averages: Their averages (None: no rank produced a gradient).
        """
        after: list[torch.Tensor | None] = []
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for index, mean in zip(members, averages, strict=True):
            param = self._params[index]
            current = param.grad
            if current is not None and current is self._wrapped[index]:
                plain = (
                    None if mean is None and self._had_none[index] else self._wrapped[index].plain
                )
                if plain is not None and mean is not None:
                    targets.append(plain)
                    sources.append(mean)
                after.append(plain)
                param.grad = plain if mean is not None else None
            else:
                after.append(current)
                param.grad = mean
        if targets:
            # One batched copy: a copy per parameter costs more than the copying on models of
            # many small tensors.
            torch._foreach_copy_(targets, sources)
        return after

    def restore(self, members: Sequence[int], after: Sequence[torch.Tensor | None]) -> None:
        """Set the ``.grad`` of ``members`` to what :meth:`land` returned.

        Args:
            members: The parameters that landed, by number.
            after: Their gradients from now on.
        """
        for index, grad in zip(members, after, strict=True):
            self._params[index].grad = grad

    def clear(self) -> None:
        """Every bucket has landed: nothing is pending."""
        self._wrapped = []
        self._had_none = []


class DeferredMarks:
    """Marks parameters whose optimizer update is deferred: a use of one (an EMA update, a norm,
    a save) first has ``owner`` apply every deferred update.

    A marked parameter keeps its identity and storage; only its Python class is swapped for a
    subclass of its own whose ``__torch_function__`` completes first, so the check costs nothing
    on any other tensor and no mode is pushed. Metadata reads and setting ``.grad`` need no
    wait.

    Args:
        owner: Who applies the updates (held weakly).
    """

    def __init__(self, owner: PendingOwner) -> None:
        self._owner = weakref.ref(owner)
        self._classes: dict[type, type] = {}
        self._marked: dict[int, torch.Tensor] = {}

    @property
    def marked(self) -> bool:
        """Whether any parameter is marked."""
        return bool(self._marked)

    def mark(self, params: Iterable[torch.Tensor]) -> None:
        """Mark ``params`` (those marked already stay marked once).

        Args:
            params: Parameters whose update waits.
        """
        for param in params:
            kind = type(param)
            if getattr(kind, "_deferred_marks", None) is not None:
                continue
            marked = self._classes.get(kind)
            if marked is None:
                marked = _marked_class(kind, self)
                self._classes[kind] = marked
            param.__class__ = marked
            self._marked[id(param)] = param

    def unmark(self, params: Iterable[torch.Tensor]) -> None:
        """Give those of ``params`` that are marked their own class back.

        Args:
            params: Parameters whose update is being applied.
        """
        for param in params:
            if self._marked.pop(id(param), None) is not None:
                param.__class__ = type(param).__mro__[1]

    def keep_only(self, params: Iterable[torch.Tensor]) -> None:
        """Unmark every parameter but those of ``params`` (which stay marked if they are).

        Args:
            params: Parameters to leave marked.
        """
        kept = {id(param) for param in params}
        self.unmark([param for key, param in self._marked.items() if key not in kept])

    def clear(self) -> None:
        """Give every marked parameter its own class back."""
        for param in self._marked.values():
            param.__class__ = type(param).__mro__[1]
        self._marked = {}

    def complete(self) -> None:
        """A marked parameter is used: clear the marks and apply the updates."""
        self.clear()
        owner = self._owner()
        if owner is not None:
            owner.complete()


def _marked_class(kind: type, marks: DeferredMarks) -> type:
    """``kind``'s subclass for a parameter marked by ``marks``."""

    def __torch_function__(  # noqa: N807 - torch's protocol
        cls: type,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        for each in types:
            owner = getattr(each, "_deferred_marks", None)
            if owner is not None:
                owner.complete()
        # Every mark is cleared now: torch dispatches on the parameters' own classes.
        return func(*args, **kwargs)

    namespace = {
        "__torch_function__": classmethod(__torch_function__),
        "_deferred_marks": marks,
        "__module__": __name__,
    }
    return type(f"Deferred{kind.__name__}", (kind,), namespace)
