"""interlace.KFAC against an independent dense K-FAC written here, on one rank and on four.

The reference below shares no code with :mod:`interlace.kfac`: it captures each layer's input and
output gradient with its own hooks, cuts convolution patches with explicit loops, builds the
embedding's ``A`` from one-hot rows as a dense matrix, keeps its own running averages (from the
identity, kfac-pytorch's convention) and applies the textbook formulas in float64:

* ``inverse``: ``(G + damping I)^-1 V (A + damping I)^-1``;
* ``eigen``: ``Qg [(Qg^T V Qa) / (dg da^T + damping)] Qa^T`` with ``A = Qa diag(da) Qa^T`` and
  ``G = Qg diag(dg) Qg^T`` (eigenvalues clamped at 0);
* KL-clip: everything times ``min(1, sqrt(kl_clip / |lr^2 sum <V', V>|))``.

The multi-rank tests check that four ranks, each with a quarter of one global batch and averaged
gradients, precondition exactly like one process with the whole batch, in every distribution mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from interlace import KFAC
from interlace.testing import average_gradients, run_ranks

DTYPE = torch.float64
GLOBAL_BATCH = 8
WORLD = 4
SEQ = 5
VOCAB = 10
MODELS = ("mlp", "conv", "embedding", "deep")
#: Plain SGD between K-FAC steps, so that the second step sees other weights too.
SGD_LR = 0.1


# -- models and data -------------------------------------------------------------------------


class EmbeddingMean(nn.Module):
    """Embedding -> mean over the tokens -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.embed(tokens).mean(dim=1))
        return out


def _build(kind: str) -> nn.Module:
    torch.manual_seed(1234)
    model: nn.Module
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3, bias=False))
    elif kind == "conv":
        # Input (2, 7, 8), kernel (3, 2), stride 2, padding 1, dilation 2: a 3 x 4 output.
        model = nn.Sequential(
            nn.Conv2d(2, 3, kernel_size=(3, 2), stride=2, padding=1, dilation=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(3 * 3 * 4, 4),
        )
    elif kind == "embedding":
        model = EmbeddingMean()
    elif kind == "deep":
        # Four layers of different sizes, so that on four ranks every rank owns one.
        model = nn.Sequential(
            nn.Linear(6, 16),
            nn.ReLU(),
            nn.Linear(16, 12),
            nn.ReLU(),
            nn.Linear(12, 10, bias=False),
            nn.ReLU(),
            nn.Linear(10, 3),
        )
    else:  # pragma: no cover - a typo in a test
        raise ValueError(kind)
    return model.to(DTYPE)


def _batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same on every rank)."""
    generator = torch.Generator().manual_seed(100 + step)
    classes = 4 if kind == "conv" else 3
    targets = torch.randint(0, classes, (GLOBAL_BATCH,), generator=generator)
    if kind == "conv":
        inputs = torch.randn(GLOBAL_BATCH, 2, 7, 8, generator=generator, dtype=DTYPE)
    elif kind == "embedding":
        # Only 7 of the 10 tokens occur: absent tokens give zero entries on A's diagonal.
        inputs = torch.randint(0, VOCAB - 3, (GLOBAL_BATCH, SEQ), generator=generator)
    else:
        inputs = torch.randn(GLOBAL_BATCH, 6, generator=generator, dtype=DTYPE)
    return inputs, targets


def _layers(model: nn.Module) -> dict[str, nn.Module]:
    """The modules K-FAC should precondition, by name."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear | nn.Conv2d | nn.Embedding)
    }


# -- the independent dense reference ---------------------------------------------------------


def _patches(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """``(N, L, C * kh * kw)`` patches, cut by hand: zero padding, stride and dilation.

    Positions are ordered (row, column) and each patch (channel, kernel row, kernel column), the
    order of ``conv.weight.view(out, -1)``.
    """
    n, c, h, w = x.shape
    kh, kw = conv.kernel_size
    sh, sw = conv.stride
    ph, pw = conv.padding  # type: ignore[misc]
    dh, dw = conv.dilation
    out_h = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    out_w = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    patches = x.new_zeros(n, out_h, out_w, c, kh, kw)
    for oh in range(out_h):
        for ow in range(out_w):
            for i in range(kh):
                for j in range(kw):
                    row = oh * sh - ph + i * dh
                    col = ow * sw - pw + j * dw
                    if 0 <= row < h and 0 <= col < w:
                        patches[:, oh, ow, :, i, j] = x[:, :, row, col]
    return patches.reshape(n, out_h * out_w, c * kh * kw)


def _moment(rows: torch.Tensor) -> torch.Tensor:
    return rows.T @ rows / rows.shape[0]


def _has_bias(module: nn.Module) -> bool:
    return getattr(module, "bias", None) is not None


def _batch_factors(
    module: nn.Module, layer_input: torch.Tensor, grad_output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This batch's dense ``A`` and ``G`` of one layer, by kfac-pytorch's conventions."""
    if isinstance(module, nn.Embedding):
        tokens = layer_input.reshape(-1)
        onehot = functional.one_hot(tokens, module.num_embeddings).to(DTYPE)
        return _moment(onehot), _moment(grad_output.reshape(-1, grad_output.shape[-1]))
    if isinstance(module, nn.Conv2d):
        patches = _patches(layer_input, module)
        positions = patches.shape[1]
        rows = patches.reshape(-1, patches.shape[2])
        if _has_bias(module):
            rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
        g_rows = grad_output.permute(0, 2, 3, 1).reshape(-1, grad_output.shape[1])
        return _moment(rows / positions), _moment(g_rows / positions)
    rows = layer_input.reshape(-1, layer_input.shape[-1])
    if _has_bias(module):
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return _moment(rows), _moment(grad_output.reshape(-1, grad_output.shape[-1]))


def _grad_matrix(module: nn.Module) -> torch.Tensor:
    weight = module.weight.grad
    assert weight is not None
    if isinstance(module, nn.Embedding):
        return weight.T.clone()
    matrix = weight.reshape(weight.shape[0], -1)
    if _has_bias(module):
        assert module.bias.grad is not None
        matrix = torch.cat([matrix, module.bias.grad.reshape(-1, 1)], dim=1)
    return matrix.clone()


def _split_grads(name: str, module: nn.Module, matrix: torch.Tensor) -> dict[str, torch.Tensor]:
    """A preconditioned matrix as the expected ``.grad`` of each parameter of the module."""
    if isinstance(module, nn.Embedding):
        return {f"{name}.weight": matrix.T}
    if _has_bias(module):
        return {
            f"{name}.weight": matrix[:, :-1].reshape(module.weight.shape),
            f"{name}.bias": matrix[:, -1],
        }
    return {f"{name}.weight": matrix.reshape(module.weight.shape)}


def _precondition(
    v: torch.Tensor, a: torch.Tensor, g: torch.Tensor, method: str, damping: float
) -> torch.Tensor:
    if method == "inverse":
        eye_a = torch.eye(a.shape[0], dtype=DTYPE)
        eye_g = torch.eye(g.shape[0], dtype=DTYPE)
        return torch.linalg.inv(g + damping * eye_g) @ v @ torch.linalg.inv(a + damping * eye_a)
    da, qa = torch.linalg.eigh(a)
    dg, qg = torch.linalg.eigh(g)
    da, dg = da.clamp(min=0.0), dg.clamp(min=0.0)
    return qg @ ((qg.T @ v @ qa) / (dg[:, None] * da[None, :] + damping)) @ qa.T


class DenseKFAC:
    """Dense K-FAC on its own hooks; :meth:`expected` after ``backward()`` gives the answer."""

    def __init__(
        self,
        model: nn.Module,
        *,
        method: str,
        damping: float,
        decay: float,
        kl_clip: float | None,
        lr: float,
    ) -> None:
        self.method, self.damping, self.decay = method, damping, decay
        self.kl_clip, self.lr = kl_clip, lr
        self.layers = _layers(model)
        self.inputs: dict[str, torch.Tensor] = {}
        self.grad_outputs: dict[str, torch.Tensor] = {}
        self.a: dict[str, torch.Tensor] = {}
        self.g: dict[str, torch.Tensor] = {}
        #: The KL-clip factor of the last :meth:`expected`.
        self.scale = 1.0
        for name, module in self.layers.items():
            module.register_forward_hook(self.forward_hook(name))

    def forward_hook(self, name: str) -> Callable[..., None]:
        """A forward hook that keeps the layer's input and, later, its output gradient."""

        def keep_grad(grad: torch.Tensor) -> None:
            self.grad_outputs[name] = grad.detach().clone()

        def hook(_module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
            self.inputs[name] = inputs[0].detach().clone()
            output.register_hook(keep_grad)

        return hook

    def average(self, old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """The running average, from the identity."""
        if old is None:
            old = torch.eye(new.shape[0], dtype=DTYPE)
        return self.decay * old + (1.0 - self.decay) * new

    def expected(self) -> dict[str, torch.Tensor]:
        """Fold this batch into the factors; the preconditioned grads, by parameter name."""
        results: dict[str, torch.Tensor] = {}
        products = 0.0
        for name, module in self.layers.items():
            a, g = _batch_factors(module, self.inputs[name], self.grad_outputs[name])
            self.a[name] = self.average(self.a.get(name), a)
            self.g[name] = self.average(self.g.get(name), g)
            v = _grad_matrix(module)
            results[name] = _precondition(v, self.a[name], self.g[name], self.method, self.damping)
            products += float((results[name] * v).sum())
        self.scale = 1.0
        if self.kl_clip is not None:
            self.scale = min(1.0, math.sqrt(self.kl_clip / abs(self.lr**2 * products)))
        expected: dict[str, torch.Tensor] = {}
        for name, module in self.layers.items():
            expected.update(_split_grads(name, module, results[name] * self.scale))
        self.inputs.clear()
        self.grad_outputs.clear()
        return expected


# -- one training run, on one rank or many ---------------------------------------------------


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    atol = 1e-9 * float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def _train(
    kind: str,
    *,
    method: str,
    damping: float,
    decay: float,
    kl_clip: float | None = None,
    lr: float = 0.1,
    fraction: float = 1.0,
    steps: int = 2,
    check: bool = False,
    reference_damping: float | None = None,
) -> dict[str, Any]:
    """Train ``steps`` K-FAC steps on this rank's share of each global batch.

    On one process with ``check``, each step's preconditioned gradients are checked
    against :class:`DenseKFAC` (built with ``reference_damping`` when given). Returns every
    step's gradients (``grads``), the reference's KL-clip factors (``scales``), the layer
    owners (``layers``) and how far preconditioning moved the gradients (``moved``).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = _build(kind)
    precond = KFAC(
        model,
        factor_update_steps=1,
        inv_update_steps=1,
        damping=damping,
        factor_decay=decay,
        kl_clip=kl_clip,
        lr=lr,
        compute_method=method,
        grad_worker_fraction=fraction,
        inv_dtype=DTYPE,
    )
    dense = None
    if check:
        dense = DenseKFAC(
            model,
            method=method,
            damping=damping if reference_damping is None else reference_damping,
            decay=decay,
            kl_clip=kl_clip,
            lr=lr,
        )
    share = GLOBAL_BATCH // world
    record: dict[str, Any] = {"grads": [], "scales": [], "layers": precond.layers, "moved": []}
    for step in range(steps):
        inputs, targets = _batch(kind, step)
        local = slice(rank * share, (rank + 1) * share)
        model.zero_grad(set_to_none=True)
        loss = functional.cross_entropy(model(inputs[local]), targets[local])
        loss.backward()
        average_gradients(model)
        raw = {name: p.grad.clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]
        expected = dense.expected() if dense is not None else None
        precond.step()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}  # type: ignore[union-attr]
        record["moved"].append(
            min(float((grads[n] - raw[n]).norm() / raw[n].norm()) for n in grads)
        )
        if expected is not None:
            assert dense is not None
            record["scales"].append(dense.scale)
            assert set(expected) == set(grads)
            for name, value in expected.items():
                _close(grads[name], value, f"{kind} {method} step {step} {name}")
        record["grads"].append(grads)
        with torch.no_grad():
            for param in model.parameters():
                param.sub_(SGD_LR * param.grad)
    precond.remove_hooks()
    return record


# -- single-process numerics -----------------------------------------------------------------


@pytest.mark.parametrize("decay", [0.0, 0.5])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("kind", MODELS)
def test_preconditioned_gradients_match_dense_kfac(kind: str, method: str, decay: float) -> None:
    record = _train(kind, method=method, damping=0.01, decay=decay, steps=3, check=True)
    assert set(record["layers"]) == set(_layers(_build(kind)))
    # Preconditioning really changed every parameter's gradient (the check is not vacuous).
    assert min(record["moved"]) > 1e-2


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize(("kl_clip", "binds"), [(1e-6, True), (1e6, False)])
def test_kl_clip_scales_every_layer_by_one_factor(method: str, kl_clip: float, binds: bool) -> None:
    record = _train(
        "conv",
        method=method,
        damping=0.01,
        decay=0.5,
        kl_clip=kl_clip,
        lr=0.5,
        check=True,
    )
    if binds:
        assert max(record["scales"]) < 0.5
    else:
        assert record["scales"] == [1.0, 1.0]


def test_the_reference_catches_a_small_damping_change() -> None:
    """Self-check: a reference 1% off in damping fails the comparison, so the tests can fail."""
    with pytest.raises(AssertionError, match="step 0"):
        _train(
            "mlp",
            method="eigen",
            damping=0.01,
            decay=0.0,
            check=True,
            reference_damping=0.0101,
        )


def test_the_reference_unfold_reproduces_conv2d() -> None:
    """Self-check of the hand-cut patches: ``patches @ W^T + b`` is the convolution."""
    conv = _build("conv")[0]
    inputs, _ = _batch("conv", 0)
    patches = _patches(inputs, conv)
    out = conv(inputs)
    by_hand = patches @ conv.weight.reshape(conv.out_channels, -1).T + conv.bias
    assert out.shape[2:] == (3, 4)
    expected = out.permute(0, 2, 3, 1).reshape(by_hand.shape)
    torch.testing.assert_close(by_hand, expected, rtol=1e-12, atol=1e-12)


# -- distributed equivalence -----------------------------------------------------------------


def _rank_train(method: str, fraction: float) -> dict[str, Any]:
    return {
        kind: _train(kind, method=method, damping=0.01, decay=0.25, fraction=fraction)
        for kind in MODELS
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "fraction"),
    [("eigen", 1.0), ("eigen", 0.25), ("eigen", 0.5), ("inverse", 1.0)],
    ids=["eigen-comm-opt", "eigen-mem-opt", "eigen-hybrid", "inverse-comm-opt"],
)
def test_four_ranks_precondition_like_one_process(method: str, fraction: float) -> None:
    per_rank = run_ranks(_rank_train, WORLD, method, fraction, timeout=180)
    for kind in MODELS:
        single = _train(
            kind,
            method=method,
            damping=0.01,
            decay=0.25,
            check=True,
        )
        for rank, records in enumerate(per_rank):
            record = records[kind]
            assert record["layers"] == per_rank[0][kind]["layers"]
            for step, (ours, theirs) in enumerate(
                zip(record["grads"], single["grads"], strict=True)
            ):
                for name, value in theirs.items():
                    _close(ours[name], value, f"{kind} rank {rank} step {step} {name}")
    if fraction < 1:
        # The default placement off COMM-OPT is greedy: the deep model's four layers go to
        # all four ranks. (Under COMM-OPT it is LBP, which may keep small factors local.)
        assert sorted(per_rank[0]["deep"]["layers"].values()) == [0, 1, 2, 3]
