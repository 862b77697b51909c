"""Where the next forward waits under ``overlap="forward"``: a pre-hook on each module that holds
parameters, which waits for those parameters' averages and updates only when the module runs.

A parameter waits at the modules that hold it, unless a checked forward saw it used outside
their forwards: then it waits at the start of the forward. One the checked forward did not use
at all (its modules did not run) waits at its modules too, and stays marked meanwhile (any other
use of it applies every update first, :mod:`interlace.dp.forward_overlap.pending`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from interlace.clock import Mark, StreamClock
from interlace.dp.forward_overlap.pending import METADATA

__all__ = ["ROOT", "Gates"]

#: The gate at the start of the forward (the wrapped module's own pre-hook).
ROOT = ""


class Gates:
    """Forward pre-hooks on ``module`` and every submodule holding one of ``params``.

    Args:
        module: The wrapped model.
        params: The parameters that may wait (DataParallel's, in registration order).
        on_gate: Called with a gate's name each time its module is about to run.
        clock: Times the gates during profiling (a GPU's stream: CUDA events, no host wait).
    """

    def __init__(
        self,
        module: nn.Module,
        params: Sequence[torch.Tensor],
        on_gate: Callable[[str], None],
        clock: StreamClock | None = None,
    ) -> None:
        index = {id(param): number for number, param in enumerate(params)}
        #: For each parameter, the modules that hold it directly, by name.
        self.owners: list[list[str]] = [[] for _ in params]
        modules: dict[str, nn.Module] = {}
        for name, child in module.named_modules():
            for param in child.parameters(recurse=False):
                number = index.get(id(param))
                if number is not None:
                    self.owners[number].append(name)
                    modules[name] = child
        modules[ROOT] = module
        self._modules = modules
        self._on_gate = on_gate
        #: Which parameters wait at each gate.
        self.waits: dict[str, list[int]] = {}
        #: Parameters the checked forward did not use: they wait at modules that did not run.
        self.idle: list[int] = []
        self.assign(escaped=set(), ran=set(modules))
        self._handles = [
            child.register_forward_pre_hook(self._hook(name)) for name, child in modules.items()
        ]
        self._params = list(params)
        self._clock = StreamClock("cpu") if clock is None else clock
        self._timing = False
        self._forward_start: Mark | None = None
        self._marks: list[tuple[Mark, dict[str, Mark]]] = []
        self._seen_this_pass: dict[str, Mark] = {}

    def assign(self, escaped: set[int], ran: set[str]) -> None:
        """Decide where each parameter waits.

        Args:
            escaped: Parameters used outside the forwards of the modules holding them.
            ran: Gates whose modules ran.
        """
        self.waits = {name: [] for name in self._modules}
        self.idle = []
        for number, owners in enumerate(self.owners):
            mine = [name for name in owners if name != ROOT]
            if number in escaped or not mine:
                self.waits[ROOT].append(number)
                continue
            running = [name for name in mine if name in ran]
            if not running:
                # Unused here (another path may use it): not a reason to wait before the forward.
                self.idle.append(number)
            for name in running or mine:
                self.waits[name].append(number)

    def remove(self) -> None:
        """Take the hooks off."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, name: str) -> Callable[..., None]:
        # Plain Python under torch.compile: a gate waits for collectives and runs optimizer
        # updates, which a compiled graph cannot hold (the graph breaks at each gate instead).
        @torch.compiler.disable  # type: ignore[untyped-decorator]
        def hook(_module: nn.Module, _inputs: Any) -> None:
            if self._timing and name not in self._seen_this_pass:
                self._seen_this_pass[name] = self._clock.mark()
            self._on_gate(name)

        return hook  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ profiling

    # Host clocks are no part of a compiled graph: under torch.compile these run as Python.
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def time_pass(self) -> None:
        """Time when each gate is first reached in the forward that starts now."""
        self._timing = True
        self._forward_start = self._clock.mark()
        self._seen_this_pass = {}

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def stop_timing(self) -> None:
        """The timed forward is over."""
        if self._timing and self._forward_start is not None:
            self._marks.append((self._forward_start, self._seen_this_pass))
        self._timing = False

    def offsets(self) -> list[tuple[str, float | None]]:
        """Every gate, in module registration order (the same list on every rank, whatever path
        each rank's forwards took), with its median offset in seconds from the forward's start
        over the timed passes that reached it, None if none did (on a GPU this waits for the
        timed passes' events: once, when planning)."""
        seconds: dict[str, list[float]] = {}
        for start, reached in self._marks:
            for name, mark in reached.items():
                seconds.setdefault(name, []).append(self._clock.seconds(start, mark))
        self._marks = []
        return [
            (name, statistics.median(seconds[name]) if name in seconds else None)
            for name in self._modules
        ]

    def check(self) -> UseCheck:
        """A context manager: the forward run inside it shows where each parameter is used;
        on exit, :meth:`assign` is called with what it saw."""
        return UseCheck(self, self._modules, self._params)

    # Eager even under torch.compile: the check watches every torch call, which a compiled
    # graph would fold away. One pass per wrapper.
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def checked_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``module(*args, **kwargs)`` inside :meth:`check`.

        Args:
            module: The wrapped model.
            args: Its positional inputs.
            kwargs: Its keyword inputs.
        """
        with self.check():
            return module(*args, **kwargs)


class UseCheck(TorchFunctionMode):
    """Records, during one forward, parameters used while none of their holders runs.

    Args:
        gates: The gates to reassign on exit.
        modules: The gates' modules, by name.
        params: The parameters.
    """

    def __init__(
        self, gates: Gates, modules: dict[str, nn.Module], params: Sequence[torch.Tensor]
    ) -> None:
        super().__init__()
        self._gates = gates
        self._modules = modules
        self._index = {id(param): number for number, param in enumerate(params)}
        self._running: list[str] = []
        self._ran: set[str] = {ROOT}
        self._escaped: set[int] = set()
        self._handles: list[Any] = []

    def __enter__(self) -> UseCheck:
        for name, module in self._modules.items():
            if name == ROOT:
                continue
            self._handles.append(module.register_forward_pre_hook(self._enter_module(name)))
            self._handles.append(module.register_forward_hook(self._leave_module(name)))
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        for handle in self._handles:
            handle.remove()
        if exc[0] is None:
            self._gates.assign(self._escaped, self._ran)

    def _enter_module(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any) -> None:
            self._running.append(name)
            self._ran.add(name)

        return hook

    def _leave_module(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any, _output: Any) -> None:
            if name in self._running:
                del self._running[len(self._running) - 1 - self._running[::-1].index(name)]

        return hook

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in METADATA:
            for leaf in tree_leaves((args, kwargs)):
                number = self._index.get(id(leaf))
                if number is not None and not any(
                    owner in self._running for owner in self._gates.owners[number]
                ):
                    self._escaped.add(number)
        return func(*args, **kwargs)
