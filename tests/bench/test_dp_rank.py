"""``interlace bench dp``'s rank code: the end of an async collective as it completes."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from interlace.bench import dp_rank
from interlace.testing import run_ranks


def _completion_before_wait() -> tuple[float, float, int]:
    tensor = torch.ones(64)
    issued = time.perf_counter()
    handle = dist.all_reduce(tensor, async_op=True)
    ends = dp_rank.record_completion(handle)
    time.sleep(0.5)  # stands in for a backward that outlasts the all-reduce
    handle.wait()
    waited = time.perf_counter()
    return ends[0] - issued, waited - issued, len(ends)


def test_record_completion_gives_the_collectives_own_end() -> None:
    # A wait after a long backward returns no earlier than that backward; the recorded end is
    # the all-reduce's, long before.
    for own, waited, count in run_ranks(_completion_before_wait, 2, timeout=120):
        assert count == 1
        assert waited >= 0.5
        assert 0.0 < own < 0.4
