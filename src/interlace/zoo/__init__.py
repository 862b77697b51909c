"""Reference models and data sets for training and benchmarking interlace.

:func:`build_model` makes a zoo model (or a user's own, from ``package.module:callable``) for a
given input shape; :func:`load_data` loads digits, synthetic CIFAR-10/ImageNet stand-ins or a
CIFAR-10 folder, or a text corpus (byte tokens, for ``gpt``); :func:`make_loader` shards a data
set across ranks.
"""

from __future__ import annotations

from interlace.zoo.data import DATA_NAMES, DataBundle, load_data, make_loader, model_shape
from interlace.zoo.gpt import token_cross_entropy
from interlace.zoo.models import MODEL_NAMES, ModelSummary, build_model, summarize_model

__all__ = [
    "DATA_NAMES",
    "MODEL_NAMES",
    "DataBundle",
    "ModelSummary",
    "build_model",
    "load_data",
    "make_loader",
    "model_shape",
    "summarize_model",
    "token_cross_entropy",
]
