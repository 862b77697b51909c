"""What K-FAC needs from each supported module: its two factors and its gradient as one matrix.

One :class:`LayerHelper` per module kind (Linear, Conv1d, Conv2d, Embedding, ``transformers``'
Conv1D); the state built on them lives in :mod:`interlace.kfac.preconditioned_layer`.
"""

from __future__ import annotations

import sys
from itertools import pairwise
from typing import cast

import torch
from torch import nn
from torch.nn import functional

from interlace.kfac.decomp import FactorDecomposition, decompose, precondition
from interlace.kfac.enums import LayerKind
from interlace.kfac.methods import DecompositionMethod

__all__ = [
    "Conv1dHelper",
    "Conv2dHelper",
    "EmbeddingHelper",
    "LayerHelper",
    "LinearHelper",
    "TransposedLinearHelper",
    "input_moment",
    "layer_kind",
    "make_helper",
    "second_moment",
]


class LayerHelper:
    """The factor and gradient arithmetic of one module kind.

    A layer's weight is seen as a matrix ``W`` of shape ``(out, in)`` (``in`` grows by one for
    the bias, whose column holds the bias gradient). K-FAC approximates the Fisher block of
    ``W`` by ``A (x) G``, with ``A`` the second moment of the layer's inputs ``a`` (a ones entry
    appended for the bias) and ``G`` that of the gradients ``g`` with respect to its outputs.
    Normalisation follows kfac-pytorch, so the same hyperparameters give the same numbers. A
    helper is stateless beyond its module: the running averages live in
    :class:`~interlace.kfac.preconditioned_layer.KFACLayer`.

    Args:
        module: The module whose factors and gradient this helper computes.
    """

    #: True when ``A`` is diagonal and stored as a vector of its diagonal.
    diagonal_a = False

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def weight(self) -> torch.Tensor:
        return cast(torch.Tensor, self.module.weight)

    @property
    def bias(self) -> torch.Tensor | None:
        bias = getattr(self.module, "bias", None)
        return bias if isinstance(bias, torch.Tensor) and bias.requires_grad else None

    @property
    def a_dim(self) -> int:
        """Side of ``A`` (inputs, plus one for the bias)."""
        raise NotImplementedError

    @property
    def g_dim(self) -> int:
        """Side of ``G`` (outputs)."""
        raise NotImplementedError

    def a_factor(self, layer_input: torch.Tensor) -> torch.Tensor:
        """This batch's ``A`` from the module's input (a vector when :attr:`diagonal_a`).

        Args:
            layer_input: The module's first input.
        """
        raise NotImplementedError

    def g_factor(self, grad_output: torch.Tensor) -> torch.Tensor:
        """This batch's ``G`` from the gradient with respect to the module's output.

        Args:
            grad_output: The gradient of the loss with respect to the module's output.
        """
        raise NotImplementedError

    def decompose(
        self,
        factor: torch.Tensor,
        method: DecompositionMethod,
        damping: float,
        dtype: torch.dtype,
    ) -> FactorDecomposition:
        """Decompose one of this layer's factors (:func:`interlace.kfac.decomp.decompose`).

        A helper that supplies its own compute (an emulated device) overrides this.

        Args:
            factor: The running average of ``A`` or ``G``.
            method: The decomposition method.
            damping: The damping.
            dtype: The dtype to decompose in.
        """
        return decompose(factor, method, damping, dtype)

    def precondition(
        self,
        grad: torch.Tensor,
        a: FactorDecomposition,
        g: FactorDecomposition,
        damping: float,
    ) -> torch.Tensor:
        """The preconditioned gradient (:func:`interlace.kfac.decomp.precondition`).

        A helper that supplies its own compute (an emulated device) overrides this.

        Args:
            grad: The ``(g_dim, a_dim)`` gradient.
            a: ``A``'s decomposition.
            g: ``G``'s decomposition.
            damping: The damping.
        """
        return precondition(grad, a, g, damping)

    def grad_matrix(self) -> torch.Tensor | None:
        """The gradient as the ``(g_dim, a_dim)`` matrix K-FAC preconditions, or None if absent."""
        grad = self.weight.grad
        if grad is None:
            return None
        matrix = grad.reshape(grad.shape[0], -1)
        bias = self.bias
        if bias is not None:
            bias_grad = bias.grad if bias.grad is not None else torch.zeros_like(bias)
            matrix = torch.cat([matrix, bias_grad.reshape(-1, 1)], dim=1)
        return matrix

    def param_matrix(self) -> torch.Tensor:
        """The parameters laid out as :meth:`grad_matrix` lays out their gradient (a copy)."""
        weight = self.weight.detach()
        matrix = weight.reshape(weight.shape[0], -1)
        bias = self.bias
        if bias is not None:
            return torch.cat([matrix, bias.detach().reshape(-1, 1)], dim=1)
        return matrix.clone()

    def set_grad(self, matrix: torch.Tensor) -> None:
        """Write a ``(g_dim, a_dim)`` matrix back into the weight's (and bias's) gradient.

        Args:
            matrix: The new gradient, laid out as :meth:`grad_matrix` gives it.
        """
        bias = self.bias
        weight_part = matrix[:, :-1] if bias is not None else matrix
        weight_grad = cast(torch.Tensor, self.weight.grad)
        weight_grad.copy_(weight_part.reshape(weight_grad.shape))
        if bias is not None:
            if bias.grad is None:
                bias.grad = torch.zeros_like(bias)
            bias.grad.copy_(matrix[:, -1].reshape(bias.shape))


def symmetric(matrix: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale * (M + M^T) / 2``: exactly symmetric, as the decompositions assume.

    The scale is applied in place to the sum, so the whole costs one new matrix rather than one
    per operation.

    Args:
        matrix: A square matrix.
        scale: A factor applied to the result (a normalisation).
    """
    return (matrix + matrix.t()).mul_(0.5 * scale)


#: The narrowest column block :func:`gram` multiplies on its own: narrower blocks would make
#: products too small to run near a CPU's peak.
GRAM_BLOCK = 128
#: The most column blocks :func:`gram` cuts: the saving approaches half the products as the
#: blocks multiply, while each block adds a product and a copy.
GRAM_MAX_BLOCKS = 4


def _launch_bound(tensor: torch.Tensor) -> bool:
    """Whether factor arithmetic on ``tensor``'s device is bound by kernel launches rather than
    flops at K-FAC's sizes: anywhere but a CPU. :func:`gram` and :func:`input_moment` choose
    their formulas by it."""
    return tensor.device.type != "cpu"


def gram(rows: torch.Tensor) -> torch.Tensor:
    """``rows^T rows``, with only its upper block triangle multiplied on a CPU.

    ``rows^T rows`` is symmetric, so a full product computes every off-diagonal entry twice.
    Cutting the columns into ``k`` blocks and multiplying only the pairs ``i <= j`` (mirroring
    each off-diagonal block) costs ``(k + 1) / (2 k)`` of the full product's flops: 3/4 for two
    blocks, 2/3 for three (a transformer's 384-wide ``qkv`` gradient). Blocks are at least
    :data:`GRAM_BLOCK` columns wide, so narrower matrices take the one product. On an
    accelerator these sizes are bound by kernel launches rather than flops, so the single
    product stays.

    Args:
        rows: One sample per row, ``(count, n)``.

    Returns:
        The ``(n, n)`` product; its off-diagonal blocks mirror each other exactly.
    """
    width = rows.shape[1]
    blocks = min(GRAM_MAX_BLOCKS, width // GRAM_BLOCK)
    if blocks < 2 or _launch_bound(rows):
        return rows.t() @ rows
    edges = [width * index // blocks for index in range(blocks + 1)]
    spans = list(pairwise(edges))
    product = rows.new_empty(width, width)
    for index, (top, bottom) in enumerate(spans):
        left_rows = rows[:, top:bottom]
        for start, stop in spans[index:]:
            block = left_rows.t() @ rows[:, start:stop]
            product[top:bottom, start:stop] = block
            if start != top:
                product[start:stop, top:bottom] = block.t()
    return product


def input_moment(
    rows: torch.Tensor, bias: bool, scale: float = 1.0, by_padding: bool | None = None
) -> torch.Tensor:
    """``A`` of a layer's ``(count, n)`` input rows, times ``scale``.

    With a bias each row carries an appended one, so
    ``A = scale * [[x^T x, sum x], [sum x^T, count]] / count``. It is built either from the
    sums, which copies no row (the CPU's way), or from the rows padded with a one: on an
    accelerator these sizes are bound by kernel launches, and padding takes one copy and one
    product where the sums take a reduction and four block copies besides.

    Args:
        rows: One sample per row.
        bias: Whether the layer has a bias (``A`` is then ``(n + 1, n + 1)``).
        scale: A factor applied to the result.
        by_padding: Pad the rows (True) or build from the sums (False); None picks by
            ``rows``' device (padding off the CPU).
    """
    count = rows.shape[0]
    if not bias:
        return symmetric(gram(rows), scale / count)
    if by_padding is None:
        by_padding = _launch_bound(rows)
    if by_padding:
        return symmetric(gram(functional.pad(rows, (0, 1), value=1.0)), scale / count)
    product = gram(rows)
    column_sum = rows.sum(dim=0)
    size = product.shape[0] + 1
    moment = product.new_empty(size, size)
    moment[:-1, :-1] = product
    moment[:-1, -1] = column_sum
    moment[-1, :-1] = column_sum
    moment[-1, -1] = count
    return symmetric(moment, scale / count)


def second_moment(rows: torch.Tensor) -> torch.Tensor:
    """``rows^T rows / len(rows)``, made exactly symmetric.

    Args:
        rows: One sample per row.
    """
    return symmetric(gram(rows), 1.0 / rows.shape[0])


class LinearHelper(LayerHelper):
    """:class:`torch.nn.Linear`: every leading position is a row, ``A = a^T a / rows``.

    Args:
        module: The linear layer.
    """

    @property
    def a_dim(self) -> int:
        return self.weight.shape[1] + int(self.bias is not None)

    @property
    def g_dim(self) -> int:
        return self.weight.shape[0]

    def a_factor(self, layer_input: torch.Tensor) -> torch.Tensor:
        rows = layer_input.reshape(-1, layer_input.shape[-1])
        return input_moment(rows, self.bias is not None)

    def g_factor(self, grad_output: torch.Tensor) -> torch.Tensor:
        return second_moment(grad_output.reshape(-1, grad_output.shape[-1]))


class TransposedLinearHelper(LinearHelper):
    """``transformers``' ``Conv1D`` (GPT-2's projections): ``y = x W + b`` with ``W`` stored
    ``(in, out)``, i.e. a Linear whose weight is kept transposed.

    The factors are a Linear's; the gradient is seen transposed, so the preconditioned gradient
    is exactly the equivalent ``nn.Linear``'s, transposed back.

    Args:
        module: The ``Conv1D`` layer.
    """

    @property
    def a_dim(self) -> int:
        return self.weight.shape[0] + int(self.bias is not None)

    @property
    def g_dim(self) -> int:
        return self.weight.shape[1]

    def grad_matrix(self) -> torch.Tensor | None:
        grad = self.weight.grad
        if grad is None:
            return None
        matrix = grad.t()
        bias = self.bias
        if bias is None:
            return matrix.contiguous()
        bias_grad = bias.grad if bias.grad is not None else torch.zeros_like(bias)
        return torch.cat([matrix, bias_grad.reshape(-1, 1)], dim=1)

    def param_matrix(self) -> torch.Tensor:
        matrix = self.weight.detach().t()
        bias = self.bias
        if bias is not None:
            return torch.cat([matrix, bias.detach().reshape(-1, 1)], dim=1)
        return matrix.clone()

    def set_grad(self, matrix: torch.Tensor) -> None:
        bias = self.bias
        weight_part = matrix[:, :-1] if bias is not None else matrix
        cast(torch.Tensor, self.weight.grad).copy_(weight_part.t())
        if bias is not None:
            if bias.grad is None:
                bias.grad = torch.zeros_like(bias)
            bias.grad.copy_(matrix[:, -1].reshape(bias.shape))


class Conv2dHelper(LayerHelper):
    """:class:`torch.nn.Conv2d` with ``groups=1``; any stride, padding and dilation.

    Rows are (sample, output position) patches; both ``a`` and ``g`` are divided by the number
    of output positions before ``x^T x / rows`` (kfac-pytorch's spatial averaging). Patches are
    cut as strided windows with the module's stride, padding *and dilation* (kfac-pytorch
    ignores dilation, which makes its ``A`` wrong for dilated convolutions).

    Args:
        module: The convolution (numeric padding, ``padding_mode="zeros"``).
    """

    module: nn.Conv2d

    @property
    def a_dim(self) -> int:
        kernel_h, kernel_w = self.module.kernel_size
        return self.module.in_channels * kernel_h * kernel_w + int(self.bias is not None)

    @property
    def g_dim(self) -> int:
        return self.module.out_channels

    def a_factor(self, layer_input: torch.Tensor) -> torch.Tensor:
        patches = self.patches(layer_input)
        positions = patches.shape[1] // layer_input.shape[0]
        # One Gram product of the (in*kh*kw, rows) patch matrix. kfac-pytorch divides every
        # patch by the number of positions before the moment, i.e. the moment by its square.
        scale = 1.0 / float(positions * positions)
        return input_moment(patches.t(), self.bias is not None, scale)

    def g_factor(self, grad_output: torch.Tensor) -> torch.Tensor:
        channels = grad_output.shape[1]
        positions = grad_output.shape[2] * grad_output.shape[3]
        # (out, batch * positions): one product for the whole batch, not one per sample.
        columns = grad_output.transpose(0, 1).reshape(channels, -1)
        rows = columns.shape[1]
        return symmetric(gram(columns.t()), 1.0 / float(rows * positions * positions))

    def patches(self, layer_input: torch.Tensor) -> torch.Tensor:
        """Every receptive field as a column: ``(in * kh * kw, batch * positions)``.

        The rows are in ``weight.view(out, -1)``'s (in, kh, kw) order, the columns cover
        every (sample, output position) pair. Cut as one strided view of the padded input and
        copied once: :func:`torch.nn.functional.unfold` launches one kernel per sample on a
        GPU, which cost several times the convolution itself.

        Args:
            layer_input: The convolution's ``(batch, in, height, width)`` input, any layout.
        """
        conv = self.module
        if isinstance(conv.padding, str):
            raise ValueError("string padding is resolved to numbers by Conv2dHelper's caller")
        (kernel_h, kernel_w), (stride_h, stride_w) = conv.kernel_size, conv.stride
        (dilation_h, dilation_w), (pad_h, pad_w) = conv.dilation, conv.padding
        padded = functional.pad(layer_input, (pad_w, pad_w, pad_h, pad_h))
        batch, channels, height, width = padded.shape
        out_h = (height - dilation_h * (kernel_h - 1) - 1) // stride_h + 1
        out_w = (width - dilation_w * (kernel_w - 1) - 1) // stride_w + 1
        step_n, step_c, step_h, step_w = padded.stride()
        windows = padded.as_strided(
            (channels, kernel_h, kernel_w, batch, out_h, out_w),
            (
                step_c,
                step_h * dilation_h,
                step_w * dilation_w,
                step_n,
                step_h * stride_h,
                step_w * stride_w,
            ),
            padded.storage_offset(),
        )
        return windows.reshape(channels * kernel_h * kernel_w, batch * out_h * out_w)


class Conv1dHelper(Conv2dHelper):
    """:class:`torch.nn.Conv1d` with ``groups=1``: a Conv2d of height 1 (kernel ``(1, k)``).

    The factors are those of :class:`Conv2dHelper` on the input seen as ``(batch, in, 1,
    length)``, so patches, spatial averaging and the weight's ``(in, k)`` column order agree.

    Args:
        module: The convolution (numeric padding, ``padding_mode="zeros"``).
    """

    module: nn.Conv1d  # type: ignore[assignment]

    @property
    def a_dim(self) -> int:
        (kernel,) = self.module.kernel_size
        return self.module.in_channels * kernel + int(self.bias is not None)

    def a_factor(self, layer_input: torch.Tensor) -> torch.Tensor:
        return super().a_factor(layer_input.unsqueeze(2))

    def g_factor(self, grad_output: torch.Tensor) -> torch.Tensor:
        return super().g_factor(grad_output.unsqueeze(2))

    def patches(self, layer_input: torch.Tensor) -> torch.Tensor:
        """Every receptive field as a column: ``(in * k, batch * positions)``.

        Args:
            layer_input: The convolution's ``(batch, in, length)`` input, or that input with a
                height-1 axis inserted, ``(batch, in, 1, length)``.
        """
        conv = self.module
        if isinstance(conv.padding, str):
            raise ValueError("string padding is resolved to numbers by Conv1dHelper's caller")
        if layer_input.dim() == 3:
            layer_input = layer_input.unsqueeze(2)
        (kernel,), (stride,), (dilation,), (pad,) = (
            conv.kernel_size,
            conv.stride,
            conv.dilation,
            conv.padding,
        )
        padded = functional.pad(layer_input, (pad, pad))
        batch, channels, _, length = padded.shape
        positions = (length - dilation * (kernel - 1) - 1) // stride + 1
        step_n, step_c, _, step_l = padded.stride()
        windows = padded.as_strided(
            (channels, kernel, batch, positions),
            (step_c, step_l * dilation, step_n, step_l * stride),
            padded.storage_offset(),
        )
        return windows.reshape(channels * kernel, batch * positions)


class EmbeddingHelper(LayerHelper):
    """:class:`torch.nn.Embedding` (dense gradients): a diagonal ``A`` from token counts.

    The input is a one-hot token, so ``A`` is diagonal: the share of rows that hold each token.
    It is kept as a vector (``vocab`` numbers instead of ``vocab^2``), and the layer's weight,
    stored ``(vocab, dim)``, is seen transposed.

    Args:
        module: The embedding (``sparse=False``).
    """

    diagonal_a = True
    module: nn.Embedding

    @property
    def bias(self) -> torch.Tensor | None:
        return None

    @property
    def a_dim(self) -> int:
        return self.module.num_embeddings

    @property
    def g_dim(self) -> int:
        return self.module.embedding_dim

    def a_factor(self, layer_input: torch.Tensor) -> torch.Tensor:
        tokens = layer_input.reshape(-1)
        counts = torch.bincount(tokens, minlength=self.module.num_embeddings)
        return counts.to(self.weight.dtype) / tokens.numel()

    def g_factor(self, grad_output: torch.Tensor) -> torch.Tensor:
        return second_moment(grad_output.reshape(-1, grad_output.shape[-1]))

    def grad_matrix(self) -> torch.Tensor | None:
        grad = self.weight.grad
        return None if grad is None else grad.t()

    def param_matrix(self) -> torch.Tensor:
        return self.weight.detach().t().clone()

    def set_grad(self, matrix: torch.Tensor) -> None:
        cast(torch.Tensor, self.weight.grad).copy_(matrix.t())


def _transformers_conv1d() -> type | None:
    """``transformers``' ``Conv1D`` class if ``transformers`` has been imported, else None.

    Looked up, never imported: a model holding one has imported it already, and
    ``transformers`` is optional (and slow to import).
    """
    module = sys.modules.get("transformers.pytorch_utils")
    found = getattr(module, "Conv1D", None)
    return found if isinstance(found, type) else None


def layer_kind(module: nn.Module) -> LayerKind | None:
    """The kind of ``module`` K-FAC knows, or None (a subclass counts as its base's kind).

    Args:
        module: Any module.
    """
    if callable(getattr(module, "kfac_helper", None)):
        return LayerKind.CUSTOM
    return _builtin_kind(module)


def _builtin_kind(module: nn.Module) -> LayerKind | None:
    """The kind of ``module`` by its class alone."""
    kinds: tuple[tuple[type, LayerKind], ...] = (
        (nn.Linear, LayerKind.LINEAR),
        (nn.Conv2d, LayerKind.CONV2D),
        (nn.Conv1d, LayerKind.CONV1D),
        (nn.Embedding, LayerKind.EMBEDDING),
    )
    for kind_type, kind in kinds:
        if isinstance(module, kind_type):
            return kind
    transposed = _transformers_conv1d()
    if transposed is not None and isinstance(module, transposed):
        return LayerKind.TRANSFORMERS_CONV1D
    return None


def make_helper(module: nn.Module) -> tuple[LayerHelper | None, str]:
    """The helper for ``module``, or None and the reason K-FAC leaves it to the optimizer.

    A module with a ``kfac_helper()`` method returning a :class:`LayerHelper` gets that helper:
    the extension point for layers whose factors, decompositions and preconditioning run
    elsewhere (``interlace.emulate``'s layers spend them as emulated device time).

    Args:
        module: Any module with parameters.
    """
    kind = layer_kind(module)
    if kind is LayerKind.CUSTOM:
        # A module may bring its own helper (an emulated layer whose compute is device time).
        helper = module.kfac_helper()  # type: ignore[operator]
        if isinstance(helper, LayerHelper):
            return helper, ""
        kind = _builtin_kind(module)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.requires_grad:
        return None, "no trainable weight"
    if kind is LayerKind.LINEAR:
        return LinearHelper(module), ""
    if kind is LayerKind.TRANSFORMERS_CONV1D:
        return TransposedLinearHelper(module), ""
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        if module.groups != 1:
            return None, f"grouped convolution (groups={module.groups}) is not supported"
        if module.padding_mode != "zeros":
            return None, f"padding_mode={module.padding_mode!r} is not supported (only 'zeros')"
        if isinstance(module.padding, str):
            return None, f"padding={module.padding!r} is not supported; give numbers"
        if isinstance(module, nn.Conv1d):
            return Conv1dHelper(module), ""
        return Conv2dHelper(module), ""
    if isinstance(module, nn.Embedding):
        if module.sparse:
            return None, "sparse embedding gradients are not supported"
        return EmbeddingHelper(module), ""
    return None, f"{type(module).__name__} has no K-FAC factors"
