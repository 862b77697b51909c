"""K-FAC on emulated compute: traced layers K-FAC can register, and device-time cost models.

:class:`EmulatedKFACModel` is an :class:`~interlace.emulate.model.EmulatedModel` whose layers
with traced factor sizes are preconditioned by :class:`interlace.KFAC`; their factors,
decompositions and preconditioning take device time from :class:`KFACDeviceCosts` (H100 solver
measurements shipped here), while every collective K-FAC makes stays real. See docs/kfac.md.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import torch
from torch import nn

from interlace.emulate.device import DeviceClock
from interlace.emulate.dilation import DEFAULT_DILATION
from interlace.emulate.model import EmulatedLayer, EmulatedModel
from interlace.kfac.costs import DecompositionCostModel, log_log_interpolate
from interlace.kfac.decomp import COMPUTE_METHODS, FactorDecomposition
from interlace.kfac.methods import DecompositionMethod, method_from
from interlace.kfac.module_helpers import LayerHelper
from interlace.sim.kfac_costs import KfacCosts
from interlace.sim.trace import FactorTrace, Trace

#: ``torch.linalg.eigh`` of a float32 ``n x n`` SPD matrix on one NVIDIA H100 80GB (torch
#: 2.11, cuSOLVER), seconds: ``(n, seconds)``, measured 2026-11-24 (docs/gpu/paths.md).
H100_EIGH_S: tuple[tuple[int, float], ...] = (
    (64, 0.000853),
    (256, 0.005171),
    (1024, 0.010746),
    (2048, 0.026065),
    (4096, 0.097110),
)
#: The damped inverse (Cholesky) of the same matrices on the same H100, seconds.
H100_INVERSE_S: tuple[tuple[int, float], ...] = (
    (64, 0.000147),
    (256, 0.000331),
    (1024, 0.001151),
    (2048, 0.002623),
    (4096, 0.008267),
)
#: Dense float32 matrix products on an H100 are priced at this rate. An assumption, not a
#: measurement: about 40% of the H100 SXM's 67 TFLOP/s float32 peak, for the tall-skinny
#: products of factors and preconditioning.
H100_GEMM_FLOPS = 25e12
#: Seconds per kernel launched (a factor: one product and a symmetrisation).
H100_KERNEL_S = 10e-6

#: The library's eigen decomposition (:func:`interlace.kfac.decomp.decompose`, ``eigh`` and its
#: checks) of a float32 SPD matrix on one NVIDIA H200 (torch 2.11), device seconds from CUDA
#: events, measured 2026-11-26 (benchmarks/gpu_kfac_costs.py, docs/gpu.md).
H200_EIGH_S: tuple[tuple[int, float], ...] = (
    (64, 0.001104),
    (256, 0.005540),
    (1024, 0.010945),
    (2048, 0.025419),
    (4096, 0.091241),
)
#: The library's damped inverse (``decompose(..., "inverse")``: ``torch.linalg.inv``) of the
#: same matrices on the same H200, seconds.
H200_INVERSE_S: tuple[tuple[int, float], ...] = (
    (64, 0.000374),
    (256, 0.000763),
    (1024, 0.002814),
    (2048, 0.006526),
    (4096, 0.017748),
)
#: Float32 products (TF32 off) on the same H200: 50-52 TFLOP/s measured for factors of side
#: 1024 and more; smaller ones are bounded by the launches below.
H200_GEMM_FLOPS = 50e12
#: Seconds per kernel launched back to back, measured on the same H200.
H200_KERNEL_S = 6.8e-6
#: Kernels launched to precondition one layer: four products and a division (eigen), or two
#: products (inverse).
PRECONDITION_KERNELS = {"eigen": 5, "inverse": 2}


@dataclass(frozen=True)
class KFACDeviceCosts:
    """Device seconds of K-FAC's compute on one device, undilated.

    Decompositions are interpolated log-log between measured ``(n, seconds)`` points (and
    extended along the end segments); factors and preconditioning are matrix products priced
    by a throughput and a launch cost per kernel.

    Args:
        eigen_s: ``(n, seconds)`` of an eigendecomposition, in increasing ``n``.
        inverse_s: ``(n, seconds)`` of a damped inverse, in increasing ``n``.
        gemm_flops: Matrix-product throughput, flop/s.
        kernel_s: Launch cost per kernel, seconds.
        device: What the numbers describe, for rows and docs.
    """

    eigen_s: tuple[tuple[int, float], ...] = H100_EIGH_S
    inverse_s: tuple[tuple[int, float], ...] = H100_INVERSE_S
    gemm_flops: float = H100_GEMM_FLOPS
    kernel_s: float = H100_KERNEL_S
    device: str = "H100"

    def __post_init__(self) -> None:
        for name, points in (("eigen_s", self.eigen_s), ("inverse_s", self.inverse_s)):
            sizes = [n for n, _ in points]
            if len(points) < 2 or sizes != sorted(set(sizes)) or min(sizes) < 1:
                raise ValueError(f"{name} needs >= 2 points of increasing size >= 1")
            if any(not (math.isfinite(t) and t > 0) for _, t in points):
                raise ValueError(f"{name} needs finite times > 0")
        if not (self.gemm_flops > 0 and self.kernel_s >= 0):
            raise ValueError("gemm_flops must be > 0 and kernel_s >= 0")

    @classmethod
    def for_trace(cls, trace: Trace) -> KFACDeviceCosts:
        """The measured costs of the GPU ``trace`` was recorded on: an H200's for H200 traces,
        else the H100's.

        Args:
            trace: The trace the emulated model is built from.
        """
        if "H200" in trace.source:
            return cls(H200_EIGH_S, H200_INVERSE_S, H200_GEMM_FLOPS, H200_KERNEL_S, "H200")
        return cls()

    def decomposition_s(self, method: str, n: int) -> float:
        """Seconds to decompose one ``n x n`` factor.

        Args:
            method: ``"eigen"`` or ``"inverse"``.
            n: The factor's side.
        """
        if method not in COMPUTE_METHODS:
            raise ValueError(f"method must be one of {COMPUTE_METHODS}, got {method!r}")
        if n < 1:
            return 0.0
        return log_log_interpolate(self.eigen_s if method == "eigen" else self.inverse_s, n)

    def decomposition_model(self, method: str, dilation: float = 1.0) -> DecompositionCostModel:
        """LBP's model of the measurements, times ``dilation``: it interpolates them as
        :meth:`decomposition_s` does, so the placement balances what the device spends.

        Args:
            method: ``"eigen"`` or ``"inverse"``.
            dilation: The dilation the placement's broadcasts run under.
        """
        points = self.eigen_s if method == "eigen" else self.inverse_s
        fit = DecompositionCostModel.fit([(n, t * dilation) for n, t in points])
        return fit

    def gemm_s(self, flops: float, kernels: int = 1) -> float:
        """Seconds of ``kernels`` matrix products doing ``flops`` together.

        Args:
            flops: Floating-point operations.
            kernels: Kernels launched.
        """
        return kernels * self.kernel_s + max(flops, 0.0) / self.gemm_flops

    def factor_s(self, rows: int, dim: int) -> float:
        """Seconds to compute one ``dim x dim`` factor from ``rows`` rows: ``X^T X`` and its
        symmetrisation.

        Args:
            rows: Rows of ``X`` (the batch times the layer's output positions).
            dim: The factor's side.
        """
        return self.gemm_s(2.0 * rows * dim * dim, kernels=2)

    def precondition_s(self, method: str, a_dim: int, g_dim: int) -> float:
        """Seconds to precondition one ``g_dim x a_dim`` gradient: the method's products
        (``eigen``: four, into and out of both eigenbases, and one elementwise division;
        ``inverse``: two), each ``2 g a n`` flops, and its kernels.

        Args:
            method: ``"eigen"`` or ``"inverse"``.
            a_dim: Side of ``A``.
            g_dim: Side of ``G``.
        """
        products = method_from(method, "method").precondition_products
        flops = products * (g_dim * g_dim * a_dim + g_dim * a_dim * a_dim)
        return self.gemm_s(flops, kernels=PRECONDITION_KERNELS[method])

    def kfac_costs(
        self, method: str, layer_factor_s: tuple[tuple[str, float, float], ...] = ()
    ) -> KfacCosts:
        """The simulator's costs of the same device work, undilated: decompositions through the
        same measurements (placed by :meth:`decomposition_model`'s fit, as LBP places them),
        preconditioning at the same rate and launches, and the factors of ``layer_factor_s``.

        Args:
            method: ``"eigen"`` or ``"inverse"``.
            layer_factor_s: ``(layer, A seconds, G seconds)`` (see
                :meth:`EmulatedKFACModel.kfac_costs`).
        """
        if method not in COMPUTE_METHODS:
            raise ValueError(f"method must be one of {COMPUTE_METHODS}, got {method!r}")
        return KfacCosts(
            decomposition=self.decomposition_model(method),
            gemm_flops=self.gemm_flops,
            # The simulator prices 4 g a (g + a) flops for eigen and half for inverse, as here.
            precondition_overhead_s=PRECONDITION_KERNELS[method] * self.kernel_s,
            compute_method=method,
            layer_factor_s=layer_factor_s,
            source=f"the emulated {self.device}'s device costs",
        )


class EmulatedFactorHelper(LayerHelper):
    """K-FAC's view of one emulated layer: traced factor sizes, compute as device time.

    Factors come back as identity matrices (finite, symmetric, of the traced sizes), so the
    running averages, all-reduces and broadcasts move real tensors of the right sizes;
    decompositions are identities too, and preconditioning returns the gradient unchanged. Each
    takes its device time from ``costs`` on ``clock``.

    Args:
        module: The emulated layer: a weight of ``g_dim x (a_dim - 1)`` elements and a bias of
            ``g_dim`` (or a weight of ``g_dim x a_dim`` alone), in either order.
        factor: The layer's traced factor sizes.
        rows: Rows each factor is computed from (batch x output positions).
        costs: The device's cost models.
        clock: Where device time is spent (dilated).
    """

    def __init__(
        self,
        module: nn.Module,
        factor: FactorTrace,
        rows: int,
        costs: KFACDeviceCosts,
        clock: DeviceClock,
    ) -> None:
        super().__init__(module)
        weight, bias = _weight_and_bias(module, factor)
        self._weight: torch.Tensor = weight
        self._bias = bias
        self.factor_dims = factor
        self.rows = rows
        self.costs = costs
        self.clock = clock

    @property
    def weight(self) -> torch.Tensor:
        return self._weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self._bias

    @property
    def a_dim(self) -> int:
        return self.factor_dims.a_dim

    @property
    def g_dim(self) -> int:
        return self.factor_dims.g_dim

    def a_factor(self, layer_input: torch.Tensor) -> torch.Tensor:
        self.clock.spend(self.costs.factor_s(self.rows, self.a_dim))
        return torch.eye(self.a_dim)

    def g_factor(self, grad_output: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        seconds = self.costs.factor_s(self.rows, self.g_dim)
        self.clock.spend(seconds)
        meter = getattr(self.module, "meter", None)
        if meter is not None:
            # One device stream: the layer's backward runs after G's products, so its deadline
            # counts from their end (else it would absorb them as host time).
            meter.device_free = max(meter.device_free, started) + seconds * self.clock.dilation
        return torch.eye(self.g_dim)

    def decompose(
        self,
        factor: torch.Tensor,
        method: DecompositionMethod,
        damping: float,
        dtype: torch.dtype,
    ) -> FactorDecomposition:
        n = factor.shape[0]
        self.clock.spend(self.costs.decomposition_s(method.name, n))
        # The identity factor's decomposition, in the method's dense shapes.
        return method.dense_from_diagonal(torch.ones(n, dtype=dtype))

    def precondition(
        self,
        grad: torch.Tensor,
        a: FactorDecomposition,
        g: FactorDecomposition,
        damping: float,
    ) -> torch.Tensor:
        self.clock.spend(self.costs.precondition_s(g.method.name, self.a_dim, self.g_dim))
        return grad.clone()

    def grad_matrix(self) -> torch.Tensor | None:
        grad = self._weight.grad
        if grad is None:
            return None
        matrix = grad.reshape(self.g_dim, -1)
        if self._bias is not None:
            bias_grad = self._bias.grad
            column = torch.zeros(self.g_dim) if bias_grad is None else bias_grad
            matrix = torch.cat([matrix, column.reshape(-1, 1)], dim=1)
        return matrix

    def set_grad(self, matrix: torch.Tensor) -> None:
        weight_grad = cast(torch.Tensor, self._weight.grad)
        weight_part = matrix[:, :-1] if self._bias is not None else matrix
        weight_grad.copy_(weight_part.reshape(weight_grad.shape))
        if self._bias is not None:
            if self._bias.grad is None:
                self._bias.grad = torch.zeros_like(self._bias)
            self._bias.grad.copy_(matrix[:, -1])


class EmulatedFactorLayer(EmulatedLayer):
    """An emulated layer with traced K-FAC factor sizes, which :class:`interlace.KFAC`
    preconditions through :class:`EmulatedFactorHelper`.

    Args:
        layer: The emulated layer it replaces (its name, parameters and times are kept).
        first: The index of the layer's first parameter in the model.
        factor: Its traced factor sizes.
        rows: Rows each factor is computed from.
        costs: The device's cost models.
        clock: Where K-FAC's device time is spent.
    """

    def __init__(
        self,
        layer: EmulatedLayer,
        first: int,
        *,
        factor: FactorTrace,
        rows: int,
        costs: KFACDeviceCosts,
        clock: DeviceClock,
    ) -> None:
        super().__init__(
            layer.name,
            layer.index,
            [(name, p.numel()) for name, p in layer.named_parameters()],
            forward_s=layer.forward_s,
            backward_s=layer.backward_s,
            first=first,
            meter=layer.meter,
        )
        #: Its traced factor sizes.
        self.factor = factor
        #: Rows each factor is computed from.
        self.rows = rows
        self._costs = costs
        self._clock = clock

    def kfac_helper(self) -> EmulatedFactorHelper:
        """K-FAC's helper for this layer (see :func:`interlace.kfac.module_helpers.make_helper`)."""
        return EmulatedFactorHelper(self, self.factor, self.rows, self._costs, self._clock)


class EmulatedKFACModel(EmulatedModel):
    """An emulated model whose traced factor layers :class:`interlace.KFAC` preconditions.

    Every traced layer with factor sizes whose weight (and bias) have ``g_dim x (a_dim - 1)``
    (and ``g_dim``) elements, or ``g_dim x a_dim`` without a bias, becomes an
    :class:`EmulatedFactorLayer`; the others (normalisations, a Caffe layer whose sizes were
    rounded) stay plain and are left to the optimizer. Each layer's forward sleeps its own time
    before the next layer runs, so K-FAC's forward hooks fire as on the traced device.

    Args:
        trace: A :class:`~interlace.sim.trace.Trace`, a shipped trace's name or a file.
        dilation: Multiplies every device time.
        costs: K-FAC's device costs (default: :meth:`KFACDeviceCosts.for_trace`, the shipped
            measurements of the H200 for H200 traces, of the H100 otherwise).
        batch_size: The per-rank batch factors are priced for (default: the trace's, else 32).

    Raises:
        UsageError: For an unknown trace name, an unreadable trace or a bad dilation.
        ValueError: For a trace with no layer K-FAC can precondition.
    """

    def __init__(
        self,
        trace: Trace | str | Path,
        dilation: float = DEFAULT_DILATION,
        *,
        costs: KFACDeviceCosts | None = None,
        batch_size: int | None = None,
    ) -> None:
        super().__init__(trace, dilation)
        self.costs = costs or KFACDeviceCosts.for_trace(self.trace)
        #: Where K-FAC's factor, decomposition and preconditioning time is spent.
        self.clock = DeviceClock(self.dilation)
        batch = batch_size or self.trace.batch_size or 32
        layers: list[nn.Module] = []
        first = 0
        for layer in self.emulated_layers():
            count = len(list(layer.parameters()))
            factor = self.trace.factor(layer.name)
            if factor is not None and _fits(layer, factor):
                rows = batch * _positions(self.trace, layer.name, factor.g_dim)
                layers.append(
                    EmulatedFactorLayer(
                        layer, first, factor=factor, rows=rows, costs=self.costs, clock=self.clock
                    )
                )
            else:
                layers.append(layer)
            first += count
        if not any(isinstance(layer, EmulatedFactorLayer) for layer in layers):
            raise ValueError(
                f"trace {self.trace.model!r} has no layer with K-FAC factor sizes that match its "
                "tensors; profile the model with `interlace profile --trace-out`"
            )
        self.layers = nn.ModuleList(layers)

    def factor_layers(self) -> list[EmulatedFactorLayer]:
        """The layers K-FAC can precondition, in forward order."""
        return [layer for layer in self.layers if isinstance(layer, EmulatedFactorLayer)]

    def kfac_trace(self) -> Trace:
        """The (undilated) trace of the iteration this model runs, for the simulator, its tensors
        named as the model's parameters (:meth:`named_trace`).

        There are no buffers to broadcast, and the factors are those of
        :meth:`factor_layers` (K-FAC leaves the others alone).
        """
        trace = self.named_trace()
        fitting = {layer.name for layer in self.factor_layers()}
        return replace(
            trace,
            broadcast_bytes=(),
            factors=tuple(f for f in trace.factors if f.layer in fitting),
        )

    def kfac_costs(self, method: str) -> KfacCosts:
        """The simulator's costs of the K-FAC work this model's device does, undilated
        (:meth:`KFACDeviceCosts.kfac_costs`, with each factor layer's ``A`` and ``G``).

        Args:
            method: ``"eigen"`` or ``"inverse"``.
        """
        per_layer = tuple(
            (
                layer.name,
                self.costs.factor_s(layer.rows, layer.factor.a_dim),
                self.costs.factor_s(layer.rows, layer.factor.g_dim),
            )
            for layer in self.factor_layers()
        )
        return self.costs.kfac_costs(method, per_layer)


def _weight_and_bias(
    layer: nn.Module, factor: FactorTrace
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's weight and bias by their sizes (a trace lists them in either order).

    Raises:
        ValueError: When the tensors are not a weight (and bias) of the traced factor sizes.
    """
    params = list(layer.parameters())
    g, a = factor.g_dim, factor.a_dim
    if len(params) == 1 and params[0].numel() == g * a:
        return params[0], None
    if len(params) == 2 and a > 1:
        for weight, bias in (params, params[::-1]):
            if weight.numel() == g * (a - 1) and bias.numel() == g:
                return weight, bias
    raise ValueError(
        f"layer {factor.layer!r}: tensors of {[p.numel() for p in params]} elements are not a "
        f"weight and bias of K-FAC factors {a} x {a} and {g} x {g}"
    )


def _fits(layer: EmulatedLayer, factor: FactorTrace) -> bool:
    """Whether the layer's tensors are a ``G x A`` weight (and a bias) of the traced sizes."""
    try:
        _weight_and_bias(layer, factor)
    except ValueError:
        return False
    return True


def _positions(trace: Trace, layer: str, g_dim: int) -> int:
    """Output positions per sample (a convolution's height x width; 1 for a linear layer)."""
    activation = trace.activation(layer)
    if activation is None or activation.numel % g_dim:
        return 1
    return max(activation.numel // g_dim, 1)
