"""The agreement check's message and model descriptions (the collective is covered by the
DataParallel and K-FAC agreement tests, which run it on two ranks)."""

from __future__ import annotations

import torch
from torch import nn

from interlace.comm.agree import describe_tensors, disagreement


def test_the_message_names_the_setting_the_values_and_their_ranks() -> None:
    same = {"tune_steps": "2", "profile_steps": "5"}
    message = disagreement("DataParallel", [same, {**same, "tune_steps": "5"}])
    assert message == (
        "DataParallel settings differ between ranks: tune_steps is 2 on rank 0 but 5 on "
        "rank 1; pass the same value on every rank"
    )


def test_ranks_that_share_a_value_are_named_together_and_other_differences_counted() -> None:
    base = {"a": "1", "b": "1", "c": "1"}
    message = disagreement(
        "K-FAC",
        [base, {"a": "2", "b": "2", "c": "1"}, base, {"a": "3", "b": "1", "c": "3"}],
        ranks=[4, 5, 6, 7],
    )
    assert message == (
        "K-FAC settings differ between ranks: a is 1 on ranks 4, 6 but 2 on rank 5 and 3 on "
        "rank 7 (and 2 more differ: b, c); pass the same value on every rank"
    )


def test_a_tensor_on_one_rank_only_is_reported_before_the_order_it_shifts() -> None:
    torch.manual_seed(0)
    plain = nn.BatchNorm1d(3)
    extended = nn.BatchNorm1d(3)
    extended.register_buffer("extra", torch.zeros(2, dtype=torch.int64))
    first = describe_tensors("buffer", plain.named_buffers())
    second = describe_tensors("buffer", extended.named_buffers())
    message = disagreement("DataParallel", [first, second], model_keys=set(first) | set(second))
    assert message == (
        "DataParallel's model differs between ranks: buffer 'extra' is absent on rank 0 but "
        "shape (2,) int64 on rank 1; build the same model on every rank"
    )


def test_tensors_are_described_by_name_shape_dtype_and_order() -> None:
    entries = describe_tensors("parameter", nn.Linear(3, 2).named_parameters())
    assert entries == {
        "parameter 'weight'": "shape (2, 3) float32",
        "parameter 'bias'": "shape (2,) float32",
        "parameter order": "weight, bias",
    }
    reordered = describe_tensors("parameter", reversed(list(nn.Linear(3, 2).named_parameters())))
    message = disagreement("DataParallel", [entries, reordered], model_keys=entries)
    assert "parameter order is weight, bias on rank 0 but bias, weight on rank 1" in message


def test_long_values_are_compared_whole_but_shortened_in_the_message() -> None:
    long = "x" * 300
    message = disagreement("K-FAC", [{"v": long}, {"v": long + "y"}])
    assert "..." in message and len(message) < 400


def test_equal_descriptions_are_not_a_disagreement() -> None:
    same = {"a": "1"}
    assert disagreement("K-FAC", [same, dict(same)]) == "K-FAC settings are the same on every rank"
