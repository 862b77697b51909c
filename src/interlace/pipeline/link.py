"""One pipeline stage's messages to and from its neighbours: sends in flight, inboxes, and the
timing of each send and each wait for a receive."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from interlace.pipeline.messages import Inbox, send_tensor

#: Records a timed action: ``(name, category, started, batch)``.
Recorder = Callable[[str, str, float, int | None], None]


class StageLink:
    """The point-to-point plumbing of one stage: it sends to and receives from other stages by
    their index, and keeps every send's buffers until the send completes.

    Args:
        stage: this stage's index.
        ranks: ``ranks[k]`` is the global rank that holds stage ``k``.
        group: the process group the stages talk over (the default group when None).
        device: where received tensors go.
        record: called with each send's and each receive wait's timing.
    """

    def __init__(
        self,
        stage: int,
        ranks: Sequence[int],
        group: dist.ProcessGroup | None,
        device: torch.device,
        record: Recorder,
    ) -> None:
        self.stage = stage
        self.ranks = list(ranks)
        self.group = group
        self.device = device
        self._record = record
        self._sends: list[tuple[list[dist.Work], tuple[Tensor, ...]]] = []

    def inbox(self, peer_stage: int, count: int) -> Inbox:
        """An inbox for messages from stage ``peer_stage``.

        Args:
            peer_stage: the sending stage.
            count: receives to post up front.
        """
        return Inbox(self.ranks[peer_stage], count, self.group, self.device)

    def take(self, inbox: Inbox, index: int, batch: int, what: str) -> Tensor:
        """Message ``index`` from ``inbox``, the wait timed.

        Args:
            inbox: where the message arrives.
            index: the message's index in ``inbox``.
            batch: the batch it belongs to, for the event.
            what: ``"act"`` or ``"grad"``, for the event's name.
        """
        started = time.perf_counter()
        tensor = inbox.take(index)
        self._record(f"recv {what}", "comm", started, batch)
        return tensor

    def send(self, tensor: Tensor, peer_stage: int) -> None:
        """Start sending ``tensor`` to stage ``peer_stage``.

        Args:
            tensor: the activation or gradient.
            peer_stage: the receiving stage.
        """
        started = time.perf_counter()
        works, buffers = send_tensor(tensor, self.ranks[peer_stage], self.group)
        self._sends.append((works, buffers))
        # Completed sends release their buffers; the rest are waited on at the end.
        self._sends = [(w, t) for w, t in self._sends if not all(x.is_completed() for x in w)]
        what = "act" if peer_stage > self.stage else "grad"
        self._record(f"send {what}", "comm", started, None)

    def finish_sends(self) -> None:
        """Wait for every send still in flight."""
        for works, _ in self._sends:
            for work in works:
                work.wait()
        self._sends = []
