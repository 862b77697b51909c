"""No rule priced twice: what the runtime runs and what the simulator prices come from one
object, and these tests fail if the two drift apart."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from interlace.kfac.factor_comm import all_reduce_mean
from interlace.sim.kfac_link import bulk_messages
from interlace.sim.trace import load_trace

MIB = 2**20


#: The buckets each engine the runtime built was given.
_LAUNCHED: list[list[list[int]]] = []


class _RecordingEngine:
    """Stands in for the bucket engine: records the buckets the runtime launches."""

    def __init__(self, tensors: list[torch.Tensor], groups: list[list[int]], group: Any) -> None:
        self.tensors = tensors
        _LAUNCHED.append([list(members) for members in groups])

    def add(self, index: int, tensor: torch.Tensor) -> None:
        del index, tensor

    def finish(self) -> list[None]:
        return [None] * len(self.tensors)


def _runtime_bulk_bytes(
    monkeypatch: pytest.MonkeyPatch, dims: list[tuple[int, int]], cap_bytes: int
) -> list[int]:
    """The bytes per bucket of the runtime's bulk factor all-reduce, for whole float32 factors
    (meta tensors: sizes without memory), as it hands them to the bucket engine."""
    tensors = [
        torch.empty(dim, dim, device="meta") for pair in dims for dim in pair
    ]  # each layer's A, then G
    monkeypatch.setattr(sys.modules[all_reduce_mean.__module__], "BucketEngine", _RecordingEngine)
    _LAUNCHED.clear()
    all_reduce_mean(tensors, 2, None, cap_bytes)
    (groups,) = _LAUNCHED
    return [sum(tensors[i].numel() * tensors[i].element_size() for i in g) for g in groups]


@pytest.mark.parametrize(
    "trace", ["resnet32-h200", "resnet50-h200", "vgg16-h200", "bert-base-h200"]
)
@pytest.mark.parametrize("cap_mib", [0, 1, 25])
def test_the_simulator_prices_the_runtimes_bulk_factor_buckets(
    monkeypatch: pytest.MonkeyPatch, trace: str, cap_mib: int
) -> None:
    dims = [(factor.a_dim, factor.g_dim) for factor in load_trace(trace).factors]
    priced, _ = bulk_messages(dims, 4, 0.0, packed=False, cap_bytes=cap_mib * MIB)
    assert [m.nbytes for m in priced] == _runtime_bulk_bytes(monkeypatch, dims, cap_mib * MIB)
