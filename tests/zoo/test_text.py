"""Text corpora: the packaged bytes, the fixed split, the windows, the unigram baseline."""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from importlib import resources
from pathlib import Path

import pytest
import torch

from interlace.errors import UsageError
from interlace.zoo import load_data
from interlace.zoo.text import (
    TokenWindows,
    corpus_bytes,
    read_text_file,
    split_tokens,
    unigram_perplexity,
)

#: The packaged corpus's digest, as its licence note states it.
PYDOC_SHA256 = "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee"


def test_the_packaged_corpus_is_the_bytes_its_licence_note_names() -> None:
    data = corpus_bytes("pydoc-topics")
    assert len(data) == 466_273
    assert hashlib.sha256(data).hexdigest() == PYDOC_SHA256
    note = resources.files("interlace.zoo").joinpath("data/PYDOC_TOPICS_LICENSE.md").read_text()
    assert PYDOC_SHA256 in note and "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in note


def test_the_split_holds_out_the_last_tenth_every_time() -> None:
    data = bytes(range(256)) * 4 + b"tail"  # 1,028 bytes
    train, held_out = split_tokens(data)
    assert len(held_out) == 102 and len(train) == 926
    assert bytes(train.tolist()) + bytes(held_out.tolist()) == data
    again = split_tokens(data)
    assert torch.equal(again[0], train) and torch.equal(again[1], held_out)


def test_windows_pair_each_token_with_the_next() -> None:
    tokens = torch.arange(23, dtype=torch.uint8)
    windows = TokenWindows(tokens, 5)
    assert len(windows) == 4  # 22 predictable tokens, 4 whole windows of 5
    inputs, targets = windows[2]
    assert inputs.tolist() == [10, 11, 12, 13, 14] and targets.tolist() == [11, 12, 13, 14, 15]
    assert inputs.dtype == torch.int64
    assert windows.targets().tolist() == list(range(1, 21))
    with pytest.raises(IndexError):
        windows[4]


def test_unigram_perplexity_matches_counting_by_hand() -> None:
    train = torch.tensor(list(b"abracadabra"), dtype=torch.uint8)
    test = torch.tensor(list(b"cadz"), dtype=torch.uint8)
    counts = Counter(b"abracadabra")
    total = len(b"abracadabra") + 256  # add-one smoothing over the byte vocabulary
    nll = [-math.log((counts.get(byte, 0) + 1) / total) for byte in b"cadz"]
    expected = math.exp(sum(nll) / len(nll))
    assert unigram_perplexity(train, test) == pytest.approx(expected, rel=1e-12)


def test_load_data_gives_windows_of_the_requested_length(tmp_path: Path) -> None:
    bundle = load_data("pydoc-topics", seq_len=64)
    assert bundle.input_shape == (64,) and bundle.num_classes == 256
    assert isinstance(bundle.test, TokenWindows)
    assert len(bundle.test) == (466_273 // 10 - 1) // 64
    own = tmp_path / "notes.txt"
    own.write_bytes(b"hello world, " * 40)
    mine = load_data("text", data_file=str(own), seq_len=8)
    assert mine.name == "notes.txt" and len(mine.test) == (52 - 1) // 8


@pytest.mark.parametrize("case", ["missing", "empty", "folder"])
def test_a_bad_text_file_is_a_one_line_error_naming_it(case: str, tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    if case == "empty":
        path.write_bytes(b"")
    elif case == "folder":
        path.mkdir()
    with pytest.raises(UsageError) as info:
        read_text_file(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_text_options_are_refused_where_they_do_not_apply(tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 30)
    with pytest.raises(UsageError, match=r"held-out tenth of short\.txt has 3 bytes"):
        load_data("text", data_file=str(short), seq_len=8)
    with pytest.raises(UsageError, match="--data-file PATH"):
        load_data("text")
    with pytest.raises(UsageError, match="--seq-len applies to text"):
        load_data("digits", seq_len=8)
    with pytest.raises(UsageError, match="--data-file"):
        load_data("digits", data_file=str(short))
