"""The K-FAC link's factor messages priced as the runtime sends them, diagonal factors included
(an embedding's ``A`` goes as its ``n`` values, not ``n x n``)."""

from __future__ import annotations

import sys
from typing import ClassVar

import pytest
import torch

from interlace.comm.cost import CostModel
from interlace.kfac import factor_bulk
from interlace.kfac.packing import pack_upper
from interlace.sim.kfac import simulate_kfac
from interlace.sim.kfac_link import bulk_messages
from interlace.sim.kfac_runtime import runtime_strategy
from interlace.sim.trace import FactorTrace, TensorTrace, Trace

MS = 1e-3
#: Layers ``(a_dim, g_dim, a_diagonal)``: an embedding of 50 tokens into 8, then a linear layer.
LAYERS = [(50, 8, True), (9, 4, False)]


class _Recording:
    """Stands in for the runtime's bucket engine: records the bytes of each bucket it gets."""

    launched: ClassVar[list[list[int]]] = []

    def __init__(self, tensors: list[torch.Tensor], groups: list[list[int]], group: object) -> None:
        self.tensors = tensors
        sizes = [t.numel() * t.element_size() for t in tensors]
        _Recording.launched.append([sum(sizes[i] for i in g) for g in groups])

    def add(self, index: int, tensor: torch.Tensor) -> None:
        del index, tensor

    def finish(self) -> list[None]:
        return [None] * len(self.tensors)


def _factors() -> list[torch.Tensor]:
    """Each layer's ``A`` then ``G`` as the runtime holds them: a diagonal as a vector."""
    tensors = []
    for a_dim, g_dim, diagonal in LAYERS:
        tensors.append(torch.ones(a_dim) if diagonal else torch.ones(a_dim, a_dim))
        tensors.append(torch.ones(g_dim, g_dim))
    return tensors


@pytest.mark.parametrize("cap_bytes", [0, 256, 1 << 20])
def test_bulk_factors_are_priced_as_the_runtime_buckets_them(
    monkeypatch: pytest.MonkeyPatch, cap_bytes: int
) -> None:
    monkeypatch.setattr(sys.modules[factor_bulk.__name__], "BucketEngine", _Recording)
    _Recording.launched = []
    factor_bulk.all_reduce_mean(_factors(), 2, None, cap_bytes)
    (runtime,) = _Recording.launched
    priced, _ = bulk_messages(
        [(a, g) for a, g, _ in LAYERS],
        4,
        0.0,
        packed=False,
        cap_bytes=cap_bytes,
        a_diagonal=[d for _, _, d in LAYERS],
    )
    assert [m.nbytes for m in priced] == runtime


def test_packed_and_pipelined_factors_are_the_runtimes_packed_sizes() -> None:
    # What the runtime packs (symmetry_aware bulk, and every pipelined factor).
    runtime = [pack_upper(t).numel() * 4 for t in _factors()]
    priced, _ = bulk_messages(
        [(a, g) for a, g, _ in LAYERS],
        4,
        0.0,
        packed=True,
        cap_bytes=0,
        a_diagonal=[d for _, _, d in LAYERS],
    )
    assert [m.nbytes for m in priced] == runtime
    trace = Trace(
        "embedded",
        tuple(
            TensorTrace(f"l{i}.weight", f"l{i}", a * g, 4 * a * g, 1 * MS, 1 * MS)
            for i, (a, g, _) in reversed(list(enumerate(LAYERS)))
        ),
        2 * MS,
        2 * MS,
        0.0,
        tuple(FactorTrace(f"l{i}", a, g, d) for i, (a, g, d) in enumerate(LAYERS)),
    )
    result = simulate_kfac(
        trace, runtime_strategy("spd", "pipelined", "lbp"), CostModel(1 * MS, 1e-9), 2
    )
    sent = sorted(event.args["bytes"] for event in result.events if "factor bucket" in event.name)
    assert sum(sent) == sum(runtime)


def test_bulk_messages_refuse_flags_for_other_layers() -> None:
    with pytest.raises(ValueError, match="2 flags for 1 layers"):
        bulk_messages([(3, 2)], 4, 0.0, packed=True, cap_bytes=None, a_diagonal=[True, False])
