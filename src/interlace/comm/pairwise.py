"""The greedy pairwise merge of MG-WFBP's published simulator (not the paper's Theorem 1).

Pure: from message sizes, ready times and a cost model to groups; :func:`interlace.comm.planners.
plan_pairwise` prices them. docs/simulate.md compares it with Theorem 1's rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from interlace.comm.cost import CostModel


def pairwise_groups(
    sizes: Sequence[int], ready_s: Sequence[float], cost: CostModel
) -> list[list[int]]:
    """Groups of consecutive messages, merged pairwise walking in ready order.

    The pending message (ready at ``ready_s[i]``, its all-reduce starting once the channel is
    free) is merged into the next one when its all-reduce cannot end before the next message
    is ready and merging is faster: if it starts only after the next message is ready, when
    one all-reduce of both is shorter than the two; otherwise when the next message's ready
    time plus the merged all-reduce ends before this start plus both all-reduces back to back.
    The merged message is then the pending one, ready with the next; start times follow from
    the groups sent so far, so they are recomputed after every merge.

    Args:
        sizes: Each message's bytes, in ready order.
        ready_s: When each is ready (non-decreasing).
        cost: The price of one all-reduce.

    Raises:
        ValueError: For sizes and ready times of different lengths.
    """
    if len(sizes) != len(ready_s):
        raise ValueError(f"{len(sizes)} sizes but {len(ready_s)} ready times")
    if not sizes:
        return []
    groups: list[list[int]] = []
    current, pending = [0], sizes[0]
    free = 0.0  # when the channel is free: the end of the last group sent
    for index in range(len(sizes) - 1):
        start = max(free, ready_s[index])
        alone = cost.time(pending)
        following, following_ready = sizes[index + 1], ready_s[index + 1]
        merged = cost.time(pending + following)
        if start + alone <= following_ready:
            merge = False  # hidden behind the next message's backward
        elif start >= following_ready:
            merge = merged < alone + cost.time(following)
        else:
            merge = following_ready + merged < start + alone + cost.time(following)
        if merge:
            current.append(index + 1)
            pending += following
        else:
            groups.append(current)
            free = start + alone
            current, pending = [index + 1], following
    groups.append(current)
    return groups
