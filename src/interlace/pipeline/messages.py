"""Point-to-point messages between pipeline stages: one tensor as a header and a payload."""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist
from torch import Tensor

from interlace.errors import UsageError
from interlace.pipeline.block import HEADER_LEN, HEADER_TAG, MAX_DIMS, PAYLOAD_TAG

__all__ = [
    "DTYPES",
    "HEADER_LEN",
    "HEADER_TAG",
    "MAX_DIMS",
    "PAYLOAD_TAG",
    "Inbox",
    "header_of",
    "irecv",
    "send_tensor",
]

#: The dtypes a header can announce, by code.
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def header_of(tensor: Tensor) -> Tensor:
    """The header that announces ``tensor``: ``[dtype code, ndim, size_0, ..., size_7]``.

    Args:
        tensor: a floating tensor of at most :data:`MAX_DIMS` dimensions.

    Raises:
        UsageError: for any other tensor.
    """
    if tensor.dtype not in DTYPES:
        raise UsageError(
            f"a pipeline stage passed a {tensor.dtype} tensor; stages must exchange floating "
            f"tensors ({', '.join(str(d) for d in DTYPES)})"
        )
    if tensor.dim() > MAX_DIMS:
        raise UsageError(
            f"a pipeline stage passed a tensor of {tensor.dim()} dimensions; at most {MAX_DIMS}"
        )
    shape = list(tensor.shape) + [0] * (MAX_DIMS - tensor.dim())
    return torch.tensor(
        [DTYPES.index(tensor.dtype), tensor.dim(), *shape], dtype=torch.int64, device=tensor.device
    )


def irecv(tensor: Tensor, peer: int, group: dist.ProcessGroup | None, tag: int) -> dist.Work:
    """Post a receive of ``tensor`` from ``peer``; its handle.

    Args:
        tensor: the buffer to receive into.
        peer: the sending rank.
        group: the process group (the default group when None).
        tag: :data:`HEADER_TAG` or :data:`PAYLOAD_TAG`.
    """
    work = dist.irecv(tensor, peer, group=group, tag=tag)
    if work is None:  # only when this rank is outside ``group``, which the stage rules out
        raise RuntimeError(f"rank {dist.get_rank()} cannot receive from rank {peer}: not in group")
    return work


class Inbox:
    """The messages one stage receives from one peer, in order, each received as it arrives.

    Each :meth:`post` posts the receive of the next message's header (a stage posts those of
    its whole program as it starts). gloo moves a payload only once its receive is posted, so a
    small thread waits on each header in turn and posts the payload's receive the moment the
    header lands: the transfer then runs while the stage computes, instead of starting when the
    stage next asks for it. The stage takes messages in order and waits on each payload handle
    exactly once (waiting on a gloo receive twice would wait for a second message).

    Args:
        peer: the sending rank.
        count: messages whose receives are posted at once (more may be posted later).
        group: the process group (the default group when None).
        device: where the payloads are received.
    """

    def __init__(
        self, peer: int, count: int, group: dist.ProcessGroup | None, device: torch.device
    ) -> None:
        self.peer = peer
        self.group = group
        self.device = device
        self.headers: list[Tensor] = []
        self.header_work: list[dist.Work] = []
        self.payloads: list[Tensor | None] = []
        self.payload_work: list[dist.Work | None] = []
        self.arrived: list[threading.Event] = []
        self.error: BaseException | None = None
        self.taken = 0  # messages handed out so far
        self._posted: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._post_payloads, name=f"interlace-inbox-{peer}", daemon=True
        )
        self._thread.start()
        for _ in range(count):
            self.post()

    def post(self) -> int:
        """Post the receive of the next message's header; the message's index."""
        index = len(self.headers)
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        self.headers.append(header)
        self.header_work.append(irecv(header, self.peer, self.group, HEADER_TAG))
        self.payloads.append(None)
        self.payload_work.append(None)
        arrived = threading.Event()
        self.arrived.append(arrived)
        if self.error is not None:  # the thread has stopped: take() raises its error
            arrived.set()
        self._posted.put(index)
        return index

    def _post_payloads(self) -> None:
        try:
            while (index := self._posted.get()) is not None:
                self.header_work[index].wait()
                header = self.headers[index].tolist()
                dtype, ndim = DTYPES[header[0]], header[1]
                payload = torch.empty(header[2 : 2 + ndim], dtype=dtype, device=self.device)
                self.payloads[index] = payload
                self.payload_work[index] = irecv(payload, self.peer, self.group, PAYLOAD_TAG)
                self.arrived[index].set()
        except BaseException as error:  # handed to the stage, which raises it in take()
            self.error = error
            for event in list(self.arrived):
                event.set()

    def take(self, index: int) -> Tensor:
        """Message ``index``, waiting for it.

        Args:
            index: the message's position; messages are taken in order.
        """
        if index != self.taken:
            raise RuntimeError(
                f"messages must be taken in order: asked for {index}, next {self.taken}"
            )
        self.arrived[index].wait()
        if self.error is not None:
            raise RuntimeError(
                f"receiving from rank {self.peer} failed: {self.error}"
            ) from self.error
        work, payload = self.payload_work[index], self.payloads[index]
        assert work is not None and payload is not None
        work.wait()
        self.payloads[index] = None
        self.payload_work[index] = None
        self.taken += 1
        return payload

    def check_drained(self) -> None:
        """Fail loudly if a posted message was left untaken (its handle never waited on)."""
        if self.taken != len(self.headers):
            raise RuntimeError(
                f"{len(self.headers) - self.taken} messages from rank {self.peer} were not taken"
            )
        self._posted.put(None)
        self._thread.join()


def send_tensor(
    tensor: Tensor, peer: int, group: dist.ProcessGroup | None
) -> tuple[list[dist.Work], tuple[Tensor, Tensor]]:
    """Start sending ``tensor`` to ``peer``: its header and its payload, batched together.

    Args:
        tensor: a floating tensor (made contiguous for the send).
        peer: the receiving rank.
        group: the process group (the default group when None).

    Returns:
        The send handles, and the header and payload buffers, which must outlive them.
    """
    payload = tensor.contiguous()
    header = header_of(payload)
    ops = [
        dist.P2POp(dist.isend, header, peer, group, HEADER_TAG),
        dist.P2POp(dist.isend, payload, peer, group, PAYLOAD_TAG),
    ]
    works = dist.batch_isend_irecv(ops)
    return works, (header, payload)
