"""The zoo's GPT-style decoder: a small causal language model built from Linear and Embedding.

:class:`GPT` predicts the next token at every position; :func:`token_cross_entropy` is the mean
loss over every predicted token, and equals plain cross-entropy for a classifier's logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import Tensor, nn

from interlace.errors import UsageError
from interlace.zoo.transformer import TransformerBlock

__all__ = ["GPT", "token_cross_entropy"]


def token_cross_entropy(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy of logits ``[..., classes]`` against targets ``[...]``, over every position.

    For a language model's ``[batch, tokens, vocab]`` logits and ``[batch, tokens]`` targets it
    is the mean loss per token; for a classifier's ``[batch, classes]`` and ``[batch]`` it is
    :func:`torch.nn.functional.cross_entropy` itself.

    Args:
        logits: unnormalised scores, classes last.
        targets: class indices, the logits' shape without its last dimension.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``, as cross_entropy takes it.
    """
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction=reduction)


class GPT(nn.Module):
    """A GPT-style decoder: next-token logits at every position of a sequence of token ids.

    Token and learned position embeddings (:class:`torch.nn.Embedding`), ``depth`` pre-LayerNorm
    blocks of causal self-attention (:func:`torch.nn.functional.scaled_dot_product_attention`
    with ``is_causal=True``) and a GELU MLP, a final LayerNorm and a Linear output head. Weights
    start as GPT-2's: normal with standard deviation 0.02, the residual projections scaled by
    ``1 / sqrt(2 * depth)``, biases zero.

    The head has its own weight unless ``tie_weights``: sharing it with the token embedding
    (GPT-2's choice) makes one parameter the weight of two layers, which a preconditioner that
    treats each layer on its own (K-FAC) would precondition twice. At a byte vocabulary the
    untied head costs ``vocab * dim`` parameters (32,768 at the defaults).

    Args:
        input_shape: ``(seq_len,)``, the length of the sequences trained on (at most
            ``context``).
        num_classes: the vocabulary size (256 for bytes).
        dim: the embedding width.
        depth: decoder blocks.
        heads: attention heads per block (``dim`` must be a multiple).
        mlp_dim: hidden width of each block's MLP (None: ``4 * dim``).
        context: positions the position embedding holds: the longest sequence the model reads.
        tie_weights: share the output head's weight with the token embedding.

    Raises:
        UsageError: for an input shape that is not a sequence length, a sequence longer than
            ``context``, or sizes that do not fit together.
    """

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        dim: int = 128,
        depth: int = 4,
        heads: int = 4,
        mlp_dim: int | None = None,
        context: int = 128,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        if len(input_shape) != 1:
            raise UsageError(
                "model 'gpt' reads token ids and needs a sequence length as its input shape "
                f"(seq_len,), got {tuple(input_shape)}: train it on a text corpus (--data "
                "pydoc-topics) or give --input-shape SEQ_LEN"
            )
        if min(dim, depth, heads, context, num_classes) < 1 or dim % heads != 0:
            raise UsageError(
                f"gpt needs positive sizes and a width divisible by the heads; got dim {dim}, "
                f"depth {depth}, heads {heads}, context {context}, vocabulary {num_classes}"
            )
        if input_shape[0] > context:
            raise UsageError(
                f"sequence length {input_shape[0]} is longer than the model's context of "
                f"{context} tokens; lower --seq-len to {context} or less"
            )
        self.context = context
        self.token = nn.Embedding(num_classes, dim)
        self.position = nn.Embedding(context, dim)
        hidden = 4 * dim if mlp_dim is None else mlp_dim
        blocks = (TransformerBlock(dim, heads, hidden, causal=True) for _ in range(depth))
        self.blocks = nn.Sequential(*blocks)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes, bias=False)
        self._init_weights(depth)
        if tie_weights:
            self.head.weight = self.token.weight

    def _init_weights(self, depth: int) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            assert isinstance(block, TransformerBlock)
            # GPT-2: each residual branch's last projection is scaled down, so the residual
            # stream's variance does not grow with depth.
            for projection in (block.attn.out, block.fc2):
                nn.init.normal_(projection.weight, std=0.02 / math.sqrt(2 * depth))

    def forward(self, ids: Tensor) -> Tensor:
        """Logits ``[batch, tokens, vocab]`` for token ids ``[batch, tokens]``.

        The logits at position ``t`` depend on the ids at positions ``0..t`` only.

        Args:
            ids: token ids, at most ``context`` per sequence.
        """
        tokens = ids.shape[-1]
        if tokens > self.context:
            raise UsageError(
                f"sequence length {tokens} is longer than the model's context of "
                f"{self.context} tokens"
            )
        positions = torch.arange(tokens, device=ids.device)
        x = self.blocks(self.token(ids) + self.position(positions))
        logits: Tensor = self.head(self.norm(x))
        return logits
