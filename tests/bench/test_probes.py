"""The contention probes on two gloo ranks: every probe sampled, each sample the slowest rank's."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from interlace.bench.probes import ContentionProbe, hooked_stream_sample
from interlace.sim.contention import ContentionSamples
from interlace.testing import run_ranks

ITERATIONS = 3


def _probe_rank() -> ContentionSamples:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    probe = ContentionProbe(model, optimizer, flat)
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    batch = (torch.randn(4, 8, generator=generator), torch.randint(0, 4, (4,), generator=generator))
    probe.block(ITERATIONS, lambda: batch)
    # The bytes probe comes from the caller; different on each rank, so the maxima show.
    probe.add_bulk(0.002 if rank == 0 else 0.004, 0.003 if rank == 0 else 0.001)
    return probe.finish()


def test_the_probes_sample_every_block_and_take_the_slowest_rank() -> None:
    first, second = run_ranks(_probe_rank, 2, timeout=120)
    assert first == second  # maxima over ranks: the same on both
    assert first.stream_count == 4  # two Linear layers, weight and bias each
    for name in ("stream", "mixed"):
        backward = getattr(first, f"{name}_backward_s")
        done = getattr(first, f"{name}_done_s")
        assert len(backward) == len(done) == ITERATIONS
        # The last all-reduce is waited for after backward, so it ends no earlier.
        assert all(0.0 < b <= d for b, d in zip(backward, done, strict=True))
    assert len(first.serial_s) == ITERATIONS and min(first.serial_s) > 0.0
    assert first.flat_backward_s == [0.004]
    assert first.flat_done_s == [0.003]


def _hooked_stream_rank() -> tuple[float, int, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stream = {id(p): torch.ones(p.numel()) for p in model.parameters()}
    batch = (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    done = hooked_stream_sample(model, optimizer, *batch, stream)
    left = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    # Every parameter's all-reduce ran: each stream tensor now holds the world size.
    summed = sum(int(t.eq(dist.get_world_size()).all()) for t in stream.values())
    return done, left, summed


def test_the_hooked_stream_times_every_all_reduce_and_leaves_no_hook() -> None:
    for done, left, summed in run_ranks(_hooked_stream_rank, 2, timeout=120):
        assert done > 0.0
        assert left == 0
        assert summed == 4
