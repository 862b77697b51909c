"""``interlace bench kfac --compare kfac-pytorch``: kfac-pytorch's ``KFACPreconditioner`` at its
defaults, seen through what a contender needs, its phases timed from outside (kfac-pytorch keeps
no timings; its methods are wrapped on the instances, its code is unchanged). On an emulated model
its factors, decompositions and preconditioning take the same device time as interlace's."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

from interlace.emulate.kfac import EmulatedFactorHelper, EmulatedFactorLayer
from interlace.kfac import PHASES
from interlace.kfac.decomp import FactorDecomposition
from interlace.kfac.methods import method_from

#: What a pending collective's result is: ``Work.get_future()`` and ``then()`` give the C++
#: future, which is not an instance of its Python subclass.
FUTURE_TYPES: tuple[type, ...] = (torch._C.Future, torch.futures.Future)

#: Where each wrapped kfac-pytorch layer method's time goes. ``save_layer_*`` cut the factors'
#: batch products in the module hooks; ``update_*_factor`` fold them into the running averages.
LAYER_PHASES: dict[str, str] = {
    "save_layer_input": "factor_compute",
    "save_layer_grad_output": "factor_compute",
    "update_a_factor": "factor_compute",
    "update_g_factor": "factor_compute",
    "reduce_a_factor": "factor_comm",
    "reduce_g_factor": "factor_comm",
    "compute_a_inv": "decomposition",
    "compute_g_inv": "decomposition",
    "broadcast_a_inv": "decomposition_comm",
    "broadcast_g_inv": "decomposition_comm",
    "preconditioned_grad": "precondition",
    "broadcast_grad": "precondition_comm",
    "update_grad": "precondition",
}
#: A layer's attributes that may hold a pending collective's future, by the phase that sent it.
#: kfac-pytorch waits on one where it next reads the attribute; the wrappers wait just before
#: the method that would, so the wait is counted as that communication phase.
FUTURE_PHASES: dict[str, str] = {
    "_a_factor": "factor_comm",
    "_g_factor": "factor_comm",
    "_qa": "decomposition_comm",
    "_qg": "decomposition_comm",
    "_da": "decomposition_comm",
    "_dg": "decomposition_comm",
    "_dgda": "decomposition_comm",
    "_a_inv": "decomposition_comm",
    "_g_inv": "decomposition_comm",
    "_grad": "precondition_comm",
}
#: Which futures each method reads (and so would wait on) first.
WAITS_BEFORE: dict[str, tuple[str, ...]] = {
    "update_a_factor": ("_a_factor",),
    "update_g_factor": ("_g_factor",),
    "reduce_a_factor": ("_a_factor",),
    "reduce_g_factor": ("_g_factor",),
    "compute_a_inv": ("_a_factor",),
    "compute_g_inv": ("_g_factor",),
    "preconditioned_grad": ("_qa", "_qg", "_da", "_dg", "_dgda", "_a_inv", "_g_inv"),
    "update_grad": ("_grad",),
}


class PhaseClock:
    """Seconds per K-FAC phase, added to by the wrapped methods.

    ``flush_phase`` is the phase a bucket flush belongs to: kfac-pytorch's ``step()`` flushes
    its all-reduce buckets after the factors, after the decompositions and after
    preconditioning, so the last wrapped method that ran names it.
    """

    def __init__(self) -> None:
        self.phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.flush_phase = "factor_comm"

    def take(self) -> dict[str, float]:
        """The phases so far, and start afresh."""
        phases, self.phases = self.phases, dict.fromkeys(PHASES, 0.0)
        self.flush_phase = "factor_comm"
        return phases

    def wait_futures(self, owner: Any, names: tuple[str, ...]) -> None:
        """Wait for every pending future among ``owner``'s ``names``, timed as its phase.

        Args:
            owner: A kfac-pytorch layer.
            names: Its attributes to resolve.
        """
        for name in names:
            value = owner.__dict__.get(name)
            if isinstance(value, FUTURE_TYPES):
                started = time.perf_counter()
                setattr(owner, name, cast(Any, value).wait())
                self.phases[FUTURE_PHASES[name]] += time.perf_counter() - started

    def wrap(self, owner: Any, method: str, phase: str) -> None:
        """Time ``owner.method`` as ``phase`` (after waiting on what it would wait on).

        Args:
            owner: The object whose method is wrapped (on the instance only).
            method: The method's name.
            phase: The phase its own time goes to.
        """
        inner: Callable[..., Any] = getattr(owner, method)
        waits = WAITS_BEFORE.get(method, ())
        # A flush after this method belongs to the communication that follows its phase.
        follows = {"decomposition": "decomposition_comm", "precondition": "precondition_comm"}
        after = follows.get(phase, phase if phase.endswith("_comm") else None)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.wait_futures(owner, waits)
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.phases[phase] += time.perf_counter() - started
                if after is not None:
                    self.flush_phase = after

        setattr(owner, method, timed)

    def wrap_flush(self, owner: Any, method: str) -> None:
        """Time a bucket flush as :attr:`flush_phase`.

        Args:
            owner: kfac-pytorch's communicator.
            method: Its flush method's name.
        """
        inner: Callable[..., Any] = getattr(owner, method)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.phases[self.flush_phase] += time.perf_counter() - started

        setattr(owner, method, timed)


class KfacPytorchPeer:
    """kfac-pytorch's ``KFACPreconditioner`` at its defaults (COMM-OPT, factors folded and
    all-reduced from its module hooks, ``update_factors_in_hook=True``), with the run's update
    intervals and learning rate.

    kfac-pytorch leaves a step's factor all-reduces pending when no decomposition follows and
    waits for them where it next reads a factor (the next iteration's first hook). The bench
    times each iteration on its own behind a barrier, so :meth:`finish` waits for them at the
    end of the iteration, inside its time: otherwise they would finish untimed in the next
    contender's barrier.

    On an :class:`~interlace.emulate.kfac.EmulatedKFACModel` it registers the emulated factor
    layers (:func:`emulated_module_helpers`) and spends the same device time as interlace's modes
    for their factors, decompositions and preconditioning (:func:`emulate_device_work`); its
    running averages, collectives and KL-clip stay its own.

    Args:
        model: The model, wrapped for data parallelism.
        factor_update_steps: Steps between factor updates.
        inv_update_steps: Steps between decompositions.
        compute_method: ``"eigen"`` or ``"inverse"``.
        lr: The learning rate (kfac-pytorch's KL clip uses it).
    """

    factor_comm = "kfac-pytorch"
    placement = "kaisa"
    factor_plan = None

    def __init__(
        self,
        model: Any,
        *,
        factor_update_steps: int,
        inv_update_steps: int,
        compute_method: str,
        lr: float,
    ) -> None:
        self.factor_owners: dict[str, Any] = {}
        # An optional peer, not a dependency: checked by check_kfac_pytorch before launching.
        from kfac.preconditioner import (  # type: ignore[import-not-found]  # noqa: PLC0415 - optional dependency
            KFACPreconditioner,
        )

        with emulated_module_helpers():
            self.inner = KFACPreconditioner(
                model,
                factor_update_steps=factor_update_steps,
                inv_update_steps=inv_update_steps,
                lr=lr,
                compute_method=compute_method,
            )
        self.clock = PhaseClock()
        #: ``(name, layer)`` of every registered module.
        self.kfac_layers: list[tuple[str, Any]] = list(self.inner._layers.values())
        self.layers = [name for name, _ in self.kfac_layers]
        for _, layer in self.kfac_layers:
            if isinstance(layer.module, EmulatedModuleHelper):
                emulate_device_work(layer, layer.module.helper, compute_method)
            for method, phase in LAYER_PHASES.items():
                self.clock.wrap(layer, method, phase)
        self.clock.wrap(self.inner, "_compute_grad_scale", "precondition")
        self.clock.wrap_flush(self.inner._tdc, "flush_allreduce_buckets")
        self.last_phase_s = dict.fromkeys(PHASES, 0.0)

    def step(self) -> None:
        """kfac-pytorch's ``step()``."""
        self.inner.step()

    def finish(self) -> None:
        """Wait for the iteration's pending factor all-reduces (after the optimizer's step,
        which they overlap) and close its phases into :attr:`last_phase_s`."""
        for _, layer in self.kfac_layers:
            self.clock.wait_futures(layer, ("_a_factor", "_g_factor"))
        self.last_phase_s = self.clock.take()


class EmulatedModuleHelper:
    """kfac-pytorch's module-helper interface (``kfac.layers.modules.ModuleHelper``) over an
    emulated layer's K-FAC helper: the same traced factor sizes and the same device time for
    factors as :class:`interlace.KFAC` gets from it.

    Args:
        helper: The emulated layer's helper (:meth:`EmulatedFactorLayer.kfac_helper`).
    """

    def __init__(self, helper: EmulatedFactorHelper) -> None:
        self.helper = helper
        self.module: nn.Module = helper.module

    @property
    def a_factor_shape(self) -> tuple[int, int]:
        """The shape of ``A``."""
        return (self.helper.a_dim, self.helper.a_dim)

    @property
    def g_factor_shape(self) -> tuple[int, int]:
        """The shape of ``G``."""
        return (self.helper.g_dim, self.helper.g_dim)

    @property
    def device(self) -> torch.device:
        """Where the layer's parameters are."""
        return self.helper.weight.device

    def get_a_factor(self, a: torch.Tensor) -> torch.Tensor:
        """``A`` of this batch, after its device time.

        Args:
            a: The layer's input.
        """
        return self.helper.a_factor(a)

    def get_g_factor(self, g: torch.Tensor) -> torch.Tensor:
        """``G`` of this batch, after its device time.

        Args:
            g: The gradient of the layer's output.
        """
        return self.helper.g_factor(g)

    def get_grad(self) -> torch.Tensor:
        """The ``G x A`` gradient matrix (bias last)."""
        matrix = self.helper.grad_matrix()
        if matrix is None:
            return torch.zeros(self.helper.g_dim, self.helper.a_dim)
        return matrix

    def get_weight_grad(self) -> torch.Tensor:
        """The weight's gradient as ``G`` rows (kfac-pytorch views slices of the matrix as it)."""
        return cast(torch.Tensor, self.helper.weight.grad).view(self.helper.g_dim, -1)

    def get_bias_grad(self) -> torch.Tensor:
        """The bias's gradient."""
        return cast(torch.Tensor, cast(torch.Tensor, self.helper.bias).grad)

    def has_bias(self) -> bool:
        """Whether the layer has a bias."""
        return self.helper.bias is not None

    def has_symmetric_factors(self) -> bool:
        """Factors are symmetric."""
        return True

    def set_grad(self, grad: torch.Tensor) -> None:
        """Write the ``G x A`` matrix back into the parameters' gradients.

        Args:
            grad: The preconditioned matrix.
        """
        self.helper.set_grad(grad)


@contextlib.contextmanager
def emulated_module_helpers() -> Iterator[None]:
    """While open, kfac-pytorch registers :class:`EmulatedFactorLayer` modules through
    :class:`EmulatedModuleHelper` (it registers only ``nn.Linear`` and ``nn.Conv2d`` itself)."""
    from kfac.layers import register  # type: ignore[import-not-found]  # noqa: PLC0415 - optional dependency

    known = register.get_module_helper

    def helper_for(module: nn.Module) -> Any:
        if isinstance(module, EmulatedFactorLayer):
            return EmulatedModuleHelper(module.kfac_helper())
        return known(module)

    register.get_module_helper = helper_for
    try:
        yield
    finally:
        register.get_module_helper = known


def emulate_device_work(layer: Any, helper: EmulatedFactorHelper, compute_method: str) -> None:
    """Replace a kfac-pytorch layer's decompositions and preconditioning, on the instance, by
    the emulated device's: the same device time as :class:`interlace.KFAC` spends on the layer,
    and identities of the real sizes, so its broadcasts move what they would.

    Args:
        layer: kfac-pytorch's ``KFACEigenLayer`` or ``KFACInverseLayer`` of an emulated layer.
        helper: The emulated layer's helper.
        compute_method: ``"eigen"`` or ``"inverse"``.
    """

    method = method_from(compute_method)

    def decompose(factor: str) -> Any:
        matrix = getattr(layer, f"{factor}_factor")
        if not isinstance(matrix, torch.Tensor):
            raise RuntimeError(f"cannot decompose {factor.upper()} before it has been computed")
        return helper.decompose(matrix, method, 0.0, layer.inv_dtype)

    def compute_a_inv(damping: float = 0.001) -> None:
        done = decompose("a")
        if compute_method == "eigen":
            layer.qa, layer.da = done.vectors, done.values
        else:
            layer.a_inv = done.inverse

    def compute_g_inv(damping: float = 0.001) -> None:
        done = decompose("g")
        if compute_method != "eigen":
            layer.g_inv = done.inverse
            return
        layer.qg, layer.dg = done.vectors, done.values
        if layer.prediv_eigenvalues:
            # 1 / (dg da^T + damping) of the identities' unit eigenvalues: outer, add, reciprocal.
            helper.clock.spend(3 * helper.costs.kernel_s)
            layer.dgda = torch.full((helper.g_dim, helper.a_dim), 1.0 / (1.0 + damping))
            layer.dg = layer.da = None

    def preconditioned_grad(damping: float = 0.001) -> None:
        # The helper prices preconditioning by the method alone; a rank that received the
        # decompositions holds kfac-pytorch's tensors, not interlace's, so describe them.
        described = FactorDecomposition(method)
        layer.grad = helper.precondition(layer.module.get_grad(), described, described, damping)

    layer.compute_a_inv = compute_a_inv
    layer.compute_g_inv = compute_g_inv
    layer.preconditioned_grad = preconditioned_grad
