"""Tests of the multi-rank harness: real gloo process groups through :func:`run_ranks`."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from interlace.errors import RankFailedError
from interlace.testing import average_gradients, raised_message, run_ranks, run_scenarios

# -- rank targets (run in the worker processes) ---------------------------------------------------


def allreduce_sum(n: int) -> list[float]:
    import torch  # noqa: PLC0415 - a spawned rank's entry point
    import torch.distributed as dist  # noqa: PLC0415 - a spawned rank's entry point

    tensor = torch.full((n,), float(dist.get_rank() + 1))
    dist.all_reduce(tensor)
    return tensor.tolist()


def averaged_gradients() -> list[list[float]]:
    """Rank r's gradients are r + 1 on the first parameter; the second has none on rank 0."""
    import torch  # noqa: PLC0415 - a spawned rank's entry point
    import torch.distributed as dist  # noqa: PLC0415 - a spawned rank's entry point

    model = torch.nn.Linear(2, 1)
    rank = dist.get_rank()
    model.weight.grad = torch.full((1, 2), float(rank + 1))
    model.bias.grad = None if rank == 0 else torch.full((1,), 3.0)
    average_gradients(model)
    return [p.grad.reshape(-1).tolist() for p in model.parameters()]  # type: ignore[union-attr]


def raise_in_group() -> None:
    import torch.distributed as dist  # noqa: PLC0415 - a spawned rank's entry point

    if dist.get_rank() == 1:
        raise RuntimeError("deliberate failure inside the process group")
    dist.barrier()


# -- tests ----------------------------------------------------------------------------------------


def test_run_ranks_gloo_allreduce() -> None:
    values = run_ranks(allreduce_sum, 3, 5, timeout=60)
    assert values == [[6.0] * 5] * 3


def test_average_gradients_averages_and_counts_a_missing_one_as_zeros() -> None:
    # Ranks 1, 2, 3: mean 2; the bias 0, 3, 3: mean 2.
    assert run_ranks(averaged_gradients, 3, timeout=60) == [[[2.0, 2.0], [2.0]]] * 3


def test_run_ranks_reports_failing_rank_traceback() -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(raise_in_group, 2, timeout=60)
    assert info.value.rank == 1
    assert "deliberate failure inside the process group" in str(info.value)


def test_run_scenarios_returns_each_result_and_names_the_one_that_fails() -> None:
    ran: list[str] = []

    def scenario(name: str, value: int) -> Callable[[], int]:
        def run() -> int:
            ran.append(name)
            return value

        return run

    assert run_scenarios({"a": scenario("a", 1), "b": scenario("b", 2)}) == {"a": 1, "b": 2}
    assert ran == ["a", "b"]

    def broken() -> int:
        raise ValueError("bad input")

    with pytest.raises(RuntimeError, match="scenario 'second' failed") as raised:
        run_scenarios({"first": scenario("c", 3), "second": broken, "third": scenario("d", 4)})
    assert isinstance(raised.value.__cause__, ValueError)
    assert ran == ["a", "b", "c"]  # nothing runs after the failure


def test_raised_message_is_the_errors_text_or_says_there_was_none() -> None:
    def refuse() -> None:
        raise ValueError("pass the same value on every rank")

    assert raised_message(refuse) == "pass the same value on every rank"
    assert raised_message(lambda: None) == "no error"
