"""``interlace bench kfac --compare kfac-pytorch``'s phase clock, on stand-in objects shaped
like kfac-pytorch's layers (kfac-pytorch itself is optional and not needed here)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from interlace.bench.kfac_peer import PhaseClock
from interlace.kfac import PHASES


class _Layer:
    """A stand-in with a kfac-pytorch layer's method names and future-holding attributes."""

    def __init__(self, future: torch.futures.Future[torch.Tensor]) -> None:
        self._a_factor: Any = future
        self.calls: list[str] = []

    def update_a_factor(self) -> str:
        # kfac-pytorch reads (and so waits on) the factor here: it must be resolved already.
        assert isinstance(self._a_factor, torch.Tensor)
        self.calls.append("update")
        return "updated"

    def compute_a_inv(self) -> None:
        self.calls.append("inverse")


class _Communicator:
    def __init__(self) -> None:
        self.flushes = 0

    def flush_allreduce_buckets(self) -> None:
        self.flushes += 1


def _done(value: float) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(torch.full((2, 2), value))
    return future


def test_wrapped_methods_resolve_their_futures_first_and_add_to_their_phase() -> None:
    clock = PhaseClock()
    layer = _Layer(_done(3.0))
    clock.wrap(layer, "update_a_factor", "factor_compute")
    assert layer.update_a_factor() == "updated"
    assert layer.calls == ["update"]
    assert torch.equal(layer._a_factor, torch.full((2, 2), 3.0))
    phases = clock.take()
    assert set(phases) == set(PHASES)
    assert phases["factor_compute"] > 0 and phases["factor_comm"] >= 0
    assert phases["decomposition"] == 0
    # take() starts afresh.
    assert all(value == 0 for value in clock.phases.values())


def test_a_chained_future_is_waited_for_too() -> None:
    # kfac-pytorch's collectives hand back ``future.then(...)``: the C++ future type.
    clock = PhaseClock()
    chained = _done(1.0).then(lambda done: done.value() * 2)
    assert not isinstance(chained, torch.futures.Future)
    layer = _Layer(chained)
    clock.wrap(layer, "update_a_factor", "factor_compute")
    layer.update_a_factor()
    assert torch.equal(layer._a_factor, torch.full((2, 2), 2.0))


def test_a_flush_counts_as_the_communication_after_the_last_phase() -> None:
    clock = PhaseClock()
    layer, tdc = _Layer(_done(1.0)), _Communicator()
    clock.wrap(layer, "compute_a_inv", "decomposition")
    clock.wrap_flush(tdc, "flush_allreduce_buckets")
    tdc.flush_allreduce_buckets()  # after the factors: factor communication
    assert clock.phases["factor_comm"] > 0 and clock.phases["decomposition_comm"] == 0
    layer.compute_a_inv()
    tdc.flush_allreduce_buckets()  # after the decompositions: their broadcast
    assert clock.phases["decomposition_comm"] > 0
    assert tdc.flushes == 2 and layer.calls == ["inverse"]
    clock.take()
    assert clock.flush_phase == "factor_comm"


def test_waiting_without_a_future_leaves_the_attribute_alone() -> None:
    clock = PhaseClock()
    layer = _Layer(_done(2.0))
    layer._a_factor = tensor = torch.ones(2)
    clock.wait_futures(layer, ("_a_factor", "_g_factor"))
    assert layer._a_factor is tensor
    assert clock.phases["factor_comm"] == pytest.approx(0.0)
