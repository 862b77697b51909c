"""A small interlace.DataParallel run for torchrun, one node or several: rank 0 saves the result.

Usage: ``torchrun ... multinode_script.py OUT``; OUT receives every rank's losses and the final
weights (``torch.save``), so runs with other node layouts can be compared exactly.
"""

from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as dist
from torch import nn

import interlace
from interlace.comm.cost import CostModel
from interlace.distenv import finish_distributed

STEPS = 5


def main(out: str) -> None:
    """Train a few steps on this rank's own data and save the result from rank 0.

    Args:
        out: where rank 0 writes the losses and weights.
    """
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    # One bucket, no plan trials and a given cost model: the same collectives on any layout,
    # so the sums are made in the same order and the results can be compared bit for bit.
    model = interlace.DataParallel(
        net, bucketing="single", tune_steps=0, cost_model=CostModel(a=1e-4, b=1e-9)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        inputs = torch.randn(8, 16, generator=generator)
        targets = torch.randint(0, 4, (8,), generator=generator)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    everyone: list[list[float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, losses)
    if rank == 0:
        torch.save({"losses": everyone, "weights": net.state_dict()}, out)
    # Release the wrapper while the process group still exists: left to the interpreter's exit,
    # its finalisation after the group's teardown can abort the rank (SIGABRT, "terminate called
    # without an active exception") after a successful run; torch DDP's does the same.
    del model, optimizer
    gc.collect()
    finish_distributed()  # a barrier, then the teardown


if __name__ == "__main__":
    main(sys.argv[1])
