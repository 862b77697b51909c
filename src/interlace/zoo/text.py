"""Text corpora for the language-model job: their bytes, the fixed held-out split, a baseline.

``pydoc-topics`` is packaged (the documentation topics CPython 3.11.7 ships, see
``data/PYDOC_TOPICS_LICENSE.md``); :func:`read_text_file` reads a user's own. Tokens are bytes
(a vocabulary of 256, no tokenizer), and :func:`unigram_perplexity` is the baseline to beat.
"""

from __future__ import annotations

import gzip
import math
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from interlace.errors import UsageError
from interlace.zoo.samples import DataBundle, Sample, SampleDataset

__all__ = [
    "DEFAULT_SEQ_LEN",
    "HELD_OUT_FRACTION",
    "TEXT_FILE",
    "TEXT_NAMES",
    "VOCAB_SIZE",
    "TokenWindows",
    "corpus_bytes",
    "load_text",
    "read_text_file",
    "split_tokens",
    "unigram_perplexity",
]

#: The packaged corpora, by ``--data`` name.
TEXT_NAMES: tuple[str, ...] = ("pydoc-topics",)
#: The ``--data`` name of a user's own text file (given by ``--data-file``).
TEXT_FILE = "text"
#: Tokens are bytes.
VOCAB_SIZE = 256
#: Sequence length when none is given: the zoo GPT's context.
DEFAULT_SEQ_LEN = 128
#: The held-out split: this fraction of the bytes, at the end of the corpus.
HELD_OUT_FRACTION = 0.1

_PACKAGED = {"pydoc-topics": "data/pydoc_topics.txt.gz"}


def corpus_bytes(name: str) -> bytes:
    """The bytes of the packaged corpus ``name``: the same on every machine.

    Args:
        name: one of :data:`TEXT_NAMES`.
    """
    if name not in _PACKAGED:
        raise UsageError(f"unknown text corpus {name!r}; choose one of {', '.join(TEXT_NAMES)}")
    blob = resources.files("interlace.zoo").joinpath(_PACKAGED[name]).read_bytes()
    return gzip.decompress(blob)


def read_text_file(path: str | Path) -> bytes:
    """The bytes of a user's text file, to train on as a corpus.

    Args:
        path: the file.

    Raises:
        UsageError: naming the file, when it does not exist, is not a file, cannot be read or
            is empty.
    """
    file = Path(path).expanduser()
    if not file.exists():
        raise UsageError(f"--data-file {str(file)!r} does not exist; give a text file to train on")
    if not file.is_file():
        raise UsageError(f"--data-file {str(file)!r} is not a file; give a text file to train on")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise UsageError(f"--data-file {str(file)!r} cannot be read: {exc.strerror}") from exc
    if not data:
        raise UsageError(f"--data-file {str(file)!r} is empty; give a text file to train on")
    return data


def split_tokens(data: bytes) -> tuple[Tensor, Tensor]:
    """The corpus as byte tokens, cut into its fixed (train, held-out) split.

    The held-out split is the last ``len(data) // 10`` bytes (:data:`HELD_OUT_FRACTION`), the
    training split everything before: no seed, no shuffle, the same split on every run.

    Args:
        data: the corpus.

    Returns:
        ``(train, held_out)``, uint8 tensors of token ids.
    """
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    cut = len(tokens) - math.floor(HELD_OUT_FRACTION * len(tokens))
    return tokens[:cut].clone(), tokens[cut:].clone()


def unigram_perplexity(train: Tensor, targets: Tensor, vocab_size: int = VOCAB_SIZE) -> float:
    """Perplexity of a unigram model on ``targets``: each token's frequency, nothing else.

    Frequencies are counted on ``train`` with add-one (Laplace) smoothing over the
    ``vocab_size`` tokens, so a token never seen in training still has a probability; the
    perplexity is ``exp`` of the mean negative log-probability of ``targets``.

    Args:
        train: the training split's token ids.
        targets: the token ids to score (the held-out split's predicted tokens).
        vocab_size: tokens in the vocabulary.
    """
    counts = torch.bincount(train.long().flatten(), minlength=vocab_size).double() + 1.0
    log_p = torch.log(counts / counts.sum())
    return math.exp(-float(log_p[targets.long().flatten()].mean()))


class TokenWindows(SampleDataset):
    """A token stream cut into consecutive windows for next-token prediction.

    Sample ``i`` is the ids ``tokens[i*L : i*L + L]`` and, as its targets, the same window
    shifted by one, ``tokens[i*L + 1 : i*L + L + 1]`` (``L`` = ``seq_len``), both int64; the
    windows do not overlap, so every token but the first is predicted once per epoch, and the
    tail shorter than a window is left out.

    Args:
        tokens: the token ids, 1-D.
        seq_len: tokens per window (>= 1).
    """

    def __init__(self, tokens: Tensor, seq_len: int) -> None:
        if seq_len < 1:
            raise UsageError(f"--seq-len must be >= 1, got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(len(self.tokens) - 1, 0) // self.seq_len

    def __getitem__(self, index: int) -> Sample:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} windows")
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]

    def targets(self) -> Tensor:
        """Every token the windows predict, in order (what a held-out score is over)."""
        return self.tokens[1 : len(self) * self.seq_len + 1]


def load_text(spec: str, *, data_file: str | None = None, seq_len: int | None = None) -> DataBundle:
    """A text corpus as next-token windows: the packaged one named ``spec``, or ``data_file``.

    Args:
        spec: one of :data:`TEXT_NAMES`, or :data:`TEXT_FILE` for ``data_file``.
        data_file: the text file to read when ``spec`` is :data:`TEXT_FILE`.
        seq_len: tokens per window (None: :data:`DEFAULT_SEQ_LEN`).

    Raises:
        UsageError: for a file that is missing or empty, or a held-out split shorter than one
            window.
    """
    if spec == TEXT_FILE:
        if data_file is None:
            raise UsageError("--data text trains on your own file: add --data-file PATH")
        data, name = read_text_file(data_file), Path(data_file).name
    else:
        data, name = corpus_bytes(spec), spec
    length = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    train, held_out = split_tokens(data)
    bundle = DataBundle(
        name=name,
        train=TokenWindows(train, length),
        test=TokenWindows(held_out, length),
        input_shape=(length,),
        num_classes=VOCAB_SIZE,
        source={"tokens": "bytes", "bytes": len(data), "held_out_bytes": len(held_out)},
    )
    if len(bundle.test) == 0:
        raise UsageError(
            f"the held-out tenth of {name} has {len(held_out)} bytes, fewer than one sequence "
            f"of {length} + 1; give a longer file or a lower --seq-len"
        )
    return bundle
