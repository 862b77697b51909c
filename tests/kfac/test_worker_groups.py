"""KAISA's gradient workers: blocks, receiver groups, and the fractions that make them."""

from __future__ import annotations

import pytest

from interlace.kfac.worker_groups import WorkerGroups, worker_count


def test_worker_groups_follow_kaisa() -> None:
    hybrid = WorkerGroups.for_fraction(0.5, 8)
    assert hybrid.workers == 4
    assert hybrid.blocks() == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert hybrid.receiver_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # A layer owned by rank 6: its gradient workers are 4..7; rank 1 hears from rank 5.
    assert hybrid.block_of(6) == (4, 5, 6, 7)
    assert hybrid.gradient_source(6, 1) == 5
    assert hybrid.broadcasts_decompositions and hybrid.broadcasts_gradients

    comm_opt = WorkerGroups.for_fraction(1.0, 4)
    assert comm_opt.broadcasts_decompositions and not comm_opt.broadcasts_gradients
    mem_opt = WorkerGroups.for_fraction(0.25, 4)
    assert not mem_opt.broadcasts_decompositions and mem_opt.broadcasts_gradients
    assert mem_opt.receiver_groups() == [(0, 1, 2, 3)]
    assert mem_opt.gradient_source(2, 0) == 2


@pytest.mark.parametrize("fraction", [0.0, 1.5, 0.3, 0.375])
def test_impossible_grad_worker_fractions_are_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match="grad_worker_fraction"):
        worker_count(fraction, 8)
