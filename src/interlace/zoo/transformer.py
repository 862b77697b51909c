"""The zoo's transformer: a small encoder classifier built only from Linear layers.

Images become sequences of square patches (:func:`patch_size_for`); a 1-D input shape means
integer token ids.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import Tensor, nn

from interlace.errors import UsageError


class SelfAttention(nn.Module):
    """Multi-head self-attention from two plain Linear layers (``qkv`` and ``out``).

    :class:`torch.nn.MultiheadAttention` is avoided on purpose: its output projection is applied
    functionally, so forward hooks on that Linear never fire and a preconditioner that hooks
    Linear modules (K-FAC) would silently skip it.

    Args:
        dim: The width.
        heads: The number of heads (dividing ``dim``).
        causal: Each position attends to itself and earlier ones only (a decoder).
    """

    def __init__(self, dim: int, heads: int, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal
        if dim % heads != 0:
            raise UsageError(f"transformer width {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [batch, heads, tokens, head_dim]
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        out: Tensor = self.out(attended.transpose(1, 2).reshape(batch, tokens, dim))
        return out


class TransformerBlock(nn.Module):
    """A pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``.

    Args:
        dim: The width.
        heads: The number of attention heads.
        mlp_dim: The MLP's hidden width.
        causal: Causal attention (a decoder block) instead of an encoder's.
    """

    def __init__(self, dim: int, heads: int, mlp_dim: int, causal: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, causal)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_dim)
        self.fc2 = nn.Linear(mlp_dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        out: Tensor = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return out


def _patches(x: Tensor, patch: int, pad: tuple[int, int]) -> Tensor:
    """Cut images ``[B, C, H, W]`` into flattened patches ``[B, tokens, C * patch * patch]``.

    ``pad`` is the zero padding ``(right, bottom)`` that makes the sides multiples of ``patch``.
    """
    if pad != (0, 0):
        x = F.pad(x, (0, pad[0], 0, pad[1]))
    p = patch
    batch, channels, height, width = x.shape
    x = x.reshape(batch, channels, height // p, p, width // p, p)
    x = x.permute(0, 2, 4, 1, 3, 5)  # [B, rows, cols, C, p, p]
    return x.reshape(batch, (height // p) * (width // p), channels * p * p)


class _TokenEmbedding(nn.Module):
    """The first part of :class:`PatchTransformer`'s forward: embed the tokens, add positions.

    It registers the transformer's own ``embed`` module and ``pos`` Parameter (the same objects,
    which stay registered on the transformer too), so a pipeline stage built from it trains the
    model's weights.
    """

    def __init__(
        self, embed: nn.Module, pos: nn.Parameter, patch: int, pad: tuple[int, int]
    ) -> None:
        super().__init__()
        self.embed = embed
        self.pos = pos
        self.patch = patch
        self.pad = pad

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.embed(x) if self.patch == 0 else self.embed(_patches(x, self.patch, self.pad))
        out: Tensor = tokens + self.pos
        return out


class _TokenHead(nn.Module):
    """The last part of :class:`PatchTransformer`'s forward: mean over tokens, LayerNorm, head."""

    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.head = head

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.norm(x.mean(dim=1)))
        return out


def patch_size_for(height: int, width: int, max_tokens: int = 64) -> int:
    """The square patch side the transformer uses for a ``height x width`` image.

    The side is ``ceil(max(height, width) / 8)``, at least 2 and at most ``max(height, width)``,
    so an image becomes at most an 8x8 grid of tokens (64 tokens, the bound that keeps attention
    cheap): 8x8 digits -> 2x2 patches (16 tokens of 4 pixels; 1-pixel tokens would carry too
    little to embed), 32x32 -> 4x4 patches (64 tokens), 224x224 -> 28x28 patches (64 tokens).
    Sides that are not a multiple of the patch are zero-padded at the bottom and right.

    Args:
        height: the image height.
        width: the image width.
        max_tokens: the most patches an image may become.
    """
    side = max(height, width)
    patch = min(max(2, math.ceil(side / math.isqrt(max_tokens))), side)
    return patch


class PatchTransformer(nn.Module):
    """A small pre-LayerNorm transformer encoder classifier built from plain Linear layers.

    Images ``[C, H, W]`` become sequences of non-overlapping square patches (side from
    :func:`patch_size_for`), each flattened and embedded by a Linear layer; a learned positional
    embedding is added; ``depth`` encoder blocks (``heads``-head attention through
    :func:`torch.nn.functional.scaled_dot_product_attention`, MLP ``dim -> mlp_dim -> dim`` with
    GELU) follow; tokens are mean-pooled (no class token, so every token is treated alike), then a
    final LayerNorm and a Linear head give the logits.

    A 1-D ``input_shape`` ``(seq_len,)`` means the input is integer token ids ``[batch, seq_len]``,
    embedded by an :class:`torch.nn.Embedding` of ``vocab_size`` rows.

    Args:
        input_shape: an image's (channels, height, width), or (seq_len,) for token ids.
        num_classes: outputs of the head.
        dim: the embedding width.
        depth: encoder blocks.
        heads: attention heads per block.
        mlp_dim: hidden width of each block's MLP.
        vocab_size: rows of the token embedding (token-id input only).
    """

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        dim: int = 128,
        depth: int = 4,
        heads: int = 4,
        mlp_dim: int = 256,
        vocab_size: int = 1000,
    ) -> None:
        super().__init__()
        self.patch = 0
        self.pad = (0, 0)
        self.embed: nn.Module
        if len(input_shape) == 1:
            if vocab_size < 1:
                raise UsageError(f"transformer vocab_size must be >= 1, got {vocab_size}")
            tokens = input_shape[0]
            self.embed = nn.Embedding(vocab_size, dim)
        elif len(input_shape) == 3:
            channels, height, width = input_shape
            self.patch = patch_size_for(height, width)
            rows, cols = math.ceil(height / self.patch), math.ceil(width / self.patch)
            self.pad = (cols * self.patch - width, rows * self.patch - height)
            tokens = rows * cols
            self.embed = nn.Linear(channels * self.patch * self.patch, dim)
        else:
            raise UsageError(
                "model 'transformer' needs an image input shape (channels, height, width) or a "
                f"sequence length (seq_len,), got {input_shape}"
            )
        # Small initial positional embedding, as in ViT/BERT, so it does not swamp the content.
        self.pos = nn.Parameter(torch.empty(1, tokens, dim))
        nn.init.normal_(self.pos, std=0.02)
        self.blocks = nn.Sequential(*(TransformerBlock(dim, heads, mlp_dim) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def patchify(self, x: Tensor) -> Tensor:
        """Cut images into the flattened patches the embedding reads.

        Args:
            x: images ``[B, C, H, W]``.

        Returns:
            ``[B, tokens, C * patch * patch]``, patches in row-major order, each laid out as
            (channel, row, column) like :func:`torch.nn.functional.unfold`.
        """
        return _patches(x, self.patch, self.pad)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[batch, num_classes]`` for images ``[batch, C, H, W]`` or ids ``[batch, T]``.

        Args:
            x: images [B, C, H, W], or token ids [B, seq_len].
        """
        tokens = self.embed(x) if self.patch == 0 else self.embed(self.patchify(x))
        out = self.blocks(tokens + self.pos)
        logits: Tensor = self.head(self.norm(out.mean(dim=1)))
        return logits

    def pipeline_blocks(self) -> list[nn.Module]:
        """Blocks for pipeline stages: embedding (+ positions), each encoder block, the head.

        The head is mean over tokens, LayerNorm and the Linear classifier. The blocks hold this
        model's own modules and its ``pos`` Parameter, so they share its parameters.
        """
        blocks: list[nn.Module] = [_TokenEmbedding(self.embed, self.pos, self.patch, self.pad)]
        blocks += list(self.blocks)
        blocks.append(_TokenHead(self.norm, self.head))
        return blocks


def bert_base(input_shape: tuple[int, ...] = (128,), num_classes: int = 2) -> PatchTransformer:
    """A transformer encoder of BERT-base's size: 12 blocks of width 768, 12 heads, MLP 3072,
    a 30,522-token vocabulary (110 M parameters at sequence length 128).

    The shapes are BERT-base's; the block is the zoo's pre-LayerNorm one, and the head
    classifies the mean-pooled tokens. Build it with ``--model
    interlace.zoo.transformer:bert_base --input-shape 128``.

    Args:
        input_shape: ``(seq_len,)`` for token ids (or an image's shape, cut into patches).
        num_classes: outputs of the head.
    """
    return PatchTransformer(
        input_shape, num_classes, dim=768, depth=12, heads=12, mlp_dim=3072, vocab_size=30522
    )
