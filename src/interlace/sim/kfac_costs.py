"""What a K-FAC iteration costs beyond its trace: factors, decompositions, preconditioning.

:class:`KfacCosts` holds the models; :func:`parse_kfac_costs` reads ``--kfac-costs``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace

from interlace.errors import UsageError
from interlace.kfac.costs import DecompositionCostModel
from interlace.kfac.methods import DecompositionMethod, method_from

#: ``(c3, c2, c0)`` of the default decomposition model, seconds for an ``n x n`` factor: a
#: round-number model of a GPU-class symmetric eigensolver (cuSOLVER ``syevd``, float32), for
#: orders of magnitude only.
DEFAULT_DECOMPOSITION: tuple[float, float, float] = (5e-12, 5e-9, 5e-4)
#: Default rate of the preconditioning products, flop/s (GPU-class, float32).
DEFAULT_GEMM_FLOPS = 10e12
#: Default fixed cost of preconditioning one layer, seconds (its kernel launches).
DEFAULT_PRECONDITION_OVERHEAD_S = 20e-6


@dataclass(frozen=True)
class KfacCosts:
    """The costs a trace does not hold, as explicit models.

    Computing ``A`` costs ``a_dim / g_dim`` of its layer's forward and ``G`` ``g_dim / (2
    a_dim)`` of its backward, both times ``factor_scale``; preconditioning a ``g x a`` weight
    costs ``4 g a (g + a)`` flops for ``eigen`` and ``2 g a (g + a)`` for ``inverse``.

    Args:
        factor_scale: Factor computation relative to the layer's own products (1: equally
            efficient).
        decomposition: Seconds to decompose an ``n x n`` factor; None:
            :data:`DEFAULT_DECOMPOSITION`.
        gemm_flops: Flop/s of the preconditioning products.
        precondition_overhead_s: Seconds per preconditioned layer on top of its products.
        compute_method: The decomposition method the runtime uses, or its name: ``"eigen"``
            (eigenvectors and eigenvalues sent, four products to precondition) or
            ``"inverse"`` (the inverse sent, two products).
        element_bytes: Bytes per number of factors and decompositions on the wire (float32).
        source: Where the numbers come from, for the printed description.
        layer_factor_s: ``(layer, A seconds, G seconds)`` for layers whose factor computation
            is known; they take these instead of the relative model above.
        host_hooks_s: Host seconds of one iteration's factor hooks that the device does not
            overlap, spread over the factors by their numbers (``n^2``): an emulated device's,
            whose device time sleeps on the thread that does the host work; 0 on a GPU, whose
            kernels run while the host goes on.
        host_step_s: Host seconds of one ``step()`` the device does not overlap (as above).

    Raises:
        ValueError: For a negative or non-finite cost, or an unknown method.
    """

    factor_scale: float = 1.0
    decomposition: DecompositionCostModel | None = None
    gemm_flops: float = DEFAULT_GEMM_FLOPS
    precondition_overhead_s: float = DEFAULT_PRECONDITION_OVERHEAD_S
    compute_method: DecompositionMethod | str = "eigen"
    element_bytes: int = 4
    source: str = "defaults for a GPU-class device"
    layer_factor_s: tuple[tuple[str, float, float], ...] = ()
    host_hooks_s: float = 0.0
    host_step_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in (
            ("factor_scale", self.factor_scale),
            ("precondition_overhead_s", self.precondition_overhead_s),
            ("host_hooks_s", self.host_hooks_s),
            ("host_step_s", self.host_step_s),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if not (math.isfinite(self.gemm_flops) and self.gemm_flops > 0):
            raise ValueError(f"gemm_flops must be finite and > 0, got {self.gemm_flops}")
        method_from(self.compute_method)  # refuses an unknown method
        if self.element_bytes < 1:
            raise ValueError(f"element_bytes must be >= 1, got {self.element_bytes}")
        for layer, a_s, g_s in self.layer_factor_s:
            if not all(math.isfinite(t) and t >= 0 for t in (a_s, g_s)):
                raise ValueError(f"layer_factor_s of {layer!r} must be finite and >= 0")

    @property
    def method(self) -> DecompositionMethod:
        """The decomposition method priced (:attr:`compute_method` as an object)."""
        return method_from(self.compute_method)

    def decomposition_model(self) -> DecompositionCostModel:
        """The decomposition model: the one given, or :data:`DEFAULT_DECOMPOSITION`'s."""
        if self.decomposition is not None:
            return self.decomposition
        c3, c2, c0 = DEFAULT_DECOMPOSITION
        return DecompositionCostModel(c3=c3, c2=c2, c0=c0)

    def decomposition_s(self, n: int, diagonal: bool = False) -> float:
        """Seconds to decompose one ``n x n`` factor, by :meth:`decomposition_model`: the model
        that prices a decomposition also places it, as the runtime's LBP does.

        Args:
            n: The factor's side.
            diagonal: Whether the factor is kept as a diagonal (nothing to decompose).
        """
        return self.decomposition_model().time(n, diagonal)

    def layer_factors_s(
        self, layer: str, a_dim: int, g_dim: int, forward_s: float, backward_s: float
    ) -> tuple[float, float]:
        """Seconds to compute one layer's ``A`` and ``G``: :attr:`layer_factor_s`'s when it
        lists the layer, else :meth:`a_compute_s` and :meth:`g_compute_s`.

        Args:
            layer: The layer's name.
            a_dim: ``A``'s order.
            g_dim: ``G``'s order.
            forward_s: The layer's own forward.
            backward_s: The layer's own backward.
        """
        for name, a_s, g_s in self.layer_factor_s:
            if name == layer:
                return a_s, g_s
        return (
            self.a_compute_s(a_dim, g_dim, forward_s),
            self.g_compute_s(a_dim, g_dim, backward_s),
        )

    def a_compute_s(self, a_dim: int, g_dim: int, layer_forward_s: float) -> float:
        """Seconds to compute ``A``: ``a_dim / g_dim`` of the layer's forward, scaled.

        Args:
            a_dim: ``A``'s order.
            g_dim: ``G``'s order.
            layer_forward_s: The layer's own forward.
        """
        return self.factor_scale * layer_forward_s * a_dim / max(g_dim, 1)

    def g_compute_s(self, a_dim: int, g_dim: int, layer_backward_s: float) -> float:
        """Seconds to compute ``G``: ``g_dim / (2 a_dim)`` of the layer's backward, scaled.

        Args:
            a_dim: ``A``'s order.
            g_dim: ``G``'s order.
            layer_backward_s: The layer's own backward.
        """
        return self.factor_scale * layer_backward_s * g_dim / (2 * max(a_dim, 1))

    def precondition_s(self, a_dim: int, g_dim: int) -> float:
        """Seconds to precondition a ``g_dim x a_dim`` weight's gradient.

        Args:
            a_dim: ``A``'s order (the weight's columns, bias included).
            g_dim: ``G``'s order (the weight's rows).
        """
        flops = self.method.precondition_products * a_dim * g_dim * (a_dim + g_dim)
        return self.precondition_overhead_s + flops / self.gemm_flops

    def describe(self) -> str:
        """One line saying every cost and where it comes from."""
        model = self.decomposition_model()
        factors = (
            f"factors as measured for {len(self.layer_factor_s)} layers"
            if self.layer_factor_s
            else f"factors {self.factor_scale:g} x the layer's own products"
        )
        decomposition = (
            f"{self.method.name} decomposition through {len(model.points)} measured sizes "
            f"(fitted: {model.c0 * 1e3:.3g} ms + {model.c2:.3g} n^2 + {model.c3:.3g} n^3 s)"
            if model.points
            else f"{self.method.name} decomposition {model.c0 * 1e3:.3g} ms + "
            f"{model.c2:.3g} n^2 + {model.c3:.3g} n^3 s"
        )
        return (
            f"K-FAC costs ({self.source}): {factors}; {decomposition}; preconditioning at "
            f"{self.gemm_flops / 1e12:.3g} TFLOP/s + {self.precondition_overhead_s * 1e6:.3g} us "
            "per layer; broadcasts priced by the all-reduce model"
        )

    @classmethod
    def measure(cls, device: str = "cpu", compute_method: str = "eigen") -> KfacCosts:
        """Costs fitted on ``device`` here: the decomposition model
        (:meth:`DecompositionCostModel.measure`), the rate of a 512 x 512 float32 product and
        the time of four 8 x 8 ones (the per-layer overhead). For a trace profiled here.

        Args:
            device: Where to time the products and decompositions.
            compute_method: ``"eigen"`` or ``"inverse"``.
        """
        import torch  # noqa: PLC0415 - only `--kfac-costs measure` times kernels

        decomposition = DecompositionCostModel.measure(compute_method, device)

        def timed(size: int, repeats: int) -> float:
            left = torch.randn(size, size, device=device)
            right = torch.randn(size, size, device=device)
            samples = []
            for _ in range(repeats + 1):
                if left.device.type == "cuda":
                    torch.cuda.synchronize(left.device)
                started = time.perf_counter()
                for _ in range(4):
                    torch.mm(left, right)
                if left.device.type == "cuda":
                    torch.cuda.synchronize(left.device)
                samples.append(time.perf_counter() - started)
            return statistics.median(samples[1:])

        big = 512
        return cls(
            decomposition=decomposition,
            gemm_flops=4 * 2 * big**3 / timed(big, 3),
            precondition_overhead_s=timed(8, 5),
            compute_method=compute_method,
            source=f"measured on this machine's {device}",
        )


_COST_KEYS = ("factor_scale", "c3", "c2", "c0", "gemm_flops", "precondition_overhead")
KFAC_COSTS_HELP = (
    "gpu (default: a GPU-class device), measure (fit on this machine's CPU), and/or "
    "KEY=VALUE overrides, comma-separated; keys: " + ", ".join(_COST_KEYS) + " (seconds, flop/s)"
)


def parse_kfac_costs(text: str | None) -> KfacCosts:
    """``--kfac-costs``: ``gpu`` or ``measure``, then ``KEY=VALUE`` overrides (see
    :data:`KFAC_COSTS_HELP`), e.g. ``measure,factor_scale=2`` or ``c3=1e-11,c0=1e-3``.

    Args:
        text: The spec; None or empty gives the defaults.

    Raises:
        UsageError: For an unknown preset or key, or a value that is not a number >= 0.
    """
    preset = "gpu"
    values: dict[str, float] = {}
    for token in (text or "").split(","):
        part = token.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            if key not in ("gpu", "measure"):
                raise UsageError(f"--kfac-costs: unknown preset {key!r}; {KFAC_COSTS_HELP}")
            preset = key
            continue
        if key not in _COST_KEYS:
            raise UsageError(f"--kfac-costs: unknown key {key!r}; {KFAC_COSTS_HELP}")
        try:
            number = float(value)
        except ValueError:
            raise UsageError(f"--kfac-costs: {key}={value!r} is not a number") from None
        if not (math.isfinite(number) and number >= 0):
            raise UsageError(f"--kfac-costs: {key} must be finite and >= 0, got {number}")
        values[key] = number
    costs = KfacCosts.measure() if preset == "measure" else KfacCosts()
    model = costs.decomposition_model()
    decomposition = DecompositionCostModel(
        c3=values.get("c3", model.c3), c2=values.get("c2", model.c2), c0=values.get("c0", model.c0)
    )
    try:
        return replace(
            costs,
            factor_scale=values.get("factor_scale", costs.factor_scale),
            decomposition=decomposition,
            gemm_flops=values.get("gemm_flops", costs.gemm_flops),
            precondition_overhead_s=values.get(
                "precondition_overhead", costs.precondition_overhead_s
            ),
            source=costs.source
            + (", with " + ", ".join(f"{k}={v:g}" for k, v in values.items()) if values else ""),
        )
    except ValueError as error:
        raise UsageError(f"--kfac-costs: {error}") from None
