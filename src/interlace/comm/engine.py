"""The runtime half of the communication core: flat bucket buffers and asynchronous all-reduces.

Buckets are launched strictly in plan order, so every rank issues the same collectives in the
same order (docs/notes/dp.md).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from interlace.comm.hooks import HookBucket, HookSpec

CommRecorder = Callable[[int, int, int, float, float], None]
"""Called with (bucket index, channel, bytes, launch time, completion time) for each finished
all-reduce (one per slice of a partitioned bucket)."""

COMPRESSIONS: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class _Slot:
    bucket: int
    offset: int
    numel: int


class BucketEngine:
    """Flat buffers for ``groups`` of ``tensors`` and the all-reduces that average them.

    Args:
        tensors: the tensors whose gradients are averaged (all on one device).
        groups: the buckets, as indices into ``tensors``, in launch order; a bucket that mixes
            dtypes is split into one bucket per dtype, keeping the order.
        process_group: the group to average over (default: the world).
        recorder: called for each finished all-reduce (see :data:`CommRecorder`).
        channels: the process groups buckets travel on (default: ``process_group`` alone).
        assignment: for each bucket, the channel of each of its slices (default: channel 0).
        compression: ``None``, ``"fp16"`` or ``"bf16"``: float32 buckets travel in that type.
        hook: a DDP communication hook that averages each bucket instead of the engine's own
            all-reduce (then channels, assignment and compression do not apply): it gets the
            bucket's gradients undivided, and the used-tensor marks travel in one small
            all-reduce of their own after the hooks' futures are done.

    Raises:
        ValueError: for no tensors, an unknown compression, compression together with a hook,
            or an assignment that does not fit.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        groups: Sequence[Sequence[int]],
        process_group: dist.ProcessGroup | None = None,
        recorder: CommRecorder | None = None,
        *,
        channels: Sequence[dist.ProcessGroup | None] | None = None,
        assignment: Sequence[Sequence[int]] | None = None,
        compression: str | None = None,
        hook: HookSpec | None = None,
    ) -> None:
        if not tensors:
            raise ValueError("a bucket engine needs at least one tensor")
        if compression is not None and compression not in COMPRESSIONS:
            raise ValueError(
                f"unknown compression '{compression}'; choose one of {', '.join(COMPRESSIONS)}"
            )
        if compression is not None and hook is not None:
            raise ValueError("a communication hook and compression cannot be combined")
        self.tensors = list(tensors)
        self.hook = hook
        self.process_group = process_group
        self.channels = list(channels) if channels is not None else [process_group]
        self.world_size = dist.get_world_size(process_group)
        self.recorder = recorder
        self.compression = compression
        if assignment is None:
            assignment = [[0]] * len(groups)
        if len(assignment) != len(groups):
            raise ValueError(f"{len(assignment)} channel assignments for {len(groups)} buckets")
        for chans in assignment:
            if not chans or any(not 0 <= c < len(self.channels) for c in chans):
                raise ValueError(
                    f"channel assignment {list(chans)} is outside 0..{len(self.channels) - 1}"
                )
        split = _split_by_dtype(groups, self.tensors)
        self.groups = [group for group, _ in split]
        self.assignment: list[list[int]] = [list(assignment[origin]) for _, origin in split]
        """The channel of each slice of each bucket (after splitting buckets by dtype)."""
        self.slots: list[_Slot] = [_Slot(-1, 0, 0)] * len(self.tensors)
        self.buffers: list[torch.Tensor] = []
        self._data_numel: list[int] = []
        self._wires: list[torch.Tensor | None] = []
        device = self.tensors[0].device
        for bucket, group in enumerate(self.groups):
            offset = 0
            for index in group:
                numel = self.tensors[index].numel()
                self.slots[index] = _Slot(bucket, offset, numel)
                offset += numel
            # The last bucket also carries one "was used" mark per tensor.
            extra = len(self.tensors) if bucket == len(self.groups) - 1 else 0
            dtype = self.tensors[group[0]].dtype
            buffer = torch.zeros(offset + extra, dtype=dtype, device=device)
            self.buffers.append(buffer)
            self._data_numel.append(offset)
            wire = None
            if compression is not None and dtype == torch.float32:
                wire = torch.zeros(buffer.numel(), dtype=COMPRESSIONS[compression], device=device)
            self._wires.append(wire)
        self._usage = self.buffers[-1][self.buffers[-1].numel() - len(self.tensors) :]
        # Each tensor's place in its bucket, shaped like the tensor: made once, so a gradient
        # costs one copy in the hook (backward runs one hook per tensor; slicing and reshaping
        # there each time cost more than the copy for the small ones).
        self._views: list[torch.Tensor] = [
            self.buffers[slot.bucket][slot.offset : slot.offset + slot.numel].view_as(tensor)
            for slot, tensor in zip(self.slots, self.tensors, strict=True)
        ]
        self._sizes = [len(group) for group in self.groups]
        element = [self.tensors[group[0]].element_size() for group in self.groups]
        self.bucket_bytes: list[int] = [
            sum(self.tensors[i].numel() for i in group) * size
            for group, size in zip(self.groups, element, strict=True)
        ]
        """Bytes of gradient data in each bucket (without the usage marks), before compression."""
        self._pending: list[int] = []
        self._ready: list[bool] = []
        self._used: list[bool] = []
        self._handles: list[list[dist.Work]] = []
        self._futures: list[torch.futures.Future[torch.Tensor] | None] = []
        self._next_launch = 0
        self.begin()

    def begin(self) -> None:
        """Reset for a new iteration."""
        self._pending = list(self._sizes)
        self._ready = [False] * len(self.tensors)
        self._used = [False] * len(self.tensors)
        self._handles = [[] for _ in self.groups]
        self._futures = [None] * len(self.groups)
        self._next_launch = 0

    def add(self, index: int, grad: torch.Tensor) -> None:
        """Copy tensor ``index``'s gradient into its bucket; launch every bucket now complete.

        Args:
            index: the tensor's index.
            grad: its gradient.
        """
        if self._ready[index]:
            # A second gradient for the same tensor within one backward cannot happen for a leaf
            # (its hook fires after accumulation); treat it as the newer value.
            self._write(index, grad)
            return
        self._ready[index] = True
        self._used[index] = True
        self._write(index, grad)
        slot = self.slots[index]
        self._pending[slot.bucket] -= 1
        if self._pending[slot.bucket] == 0:
            self._launch_ready()

    def finish(self) -> list[torch.Tensor | None]:
        """Send what is left, wait for every all-reduce, and return the averaged gradients.

        Entry ``i`` is a view of tensor ``i``'s averaged gradient, or None when no rank
        produced a gradient for it this iteration.
        """
        for index, ready in enumerate(self._ready):
            if not ready:
                self._views[index].zero_()
                self._ready[index] = True
                self._pending[self.slots[index].bucket] -= 1
        self._launch_ready()
        for bucket, handles in enumerate(self._handles):
            for handle in handles:
                handle.wait()
            wire = self._wires[bucket]
            if wire is not None:
                self.buffers[bucket].copy_(wire)
        if self.hook is not None:
            self._finish_hooks()
        if all(self._used):
            # This rank used every tensor, so every sum of marks is positive: no need to read
            # them back (on a GPU that read would wait for the whole backward to finish).
            return list(self._views)
        usage = self._usage.tolist()
        return [view if used > 0 else None for view, used in zip(self._views, usage, strict=True)]

    def _finish_hooks(self) -> None:
        """Wait for each hook's future, write its value into the bucket, share the marks."""
        for bucket, future in enumerate(self._futures):
            if future is None:
                continue
            result = future.wait()
            grads = self.buffers[bucket][: self._data_numel[bucket]]
            # Hooks that work in place return the buffer itself; others (a wrapper that swapped
            # the buffer, a hook that allocates) return a new tensor: copy it, casting back.
            if result.data_ptr() != grads.data_ptr() or result.dtype != grads.dtype:
                grads.copy_(result.reshape(grads.shape))
        # After every hook is done, so that this collective cannot interleave with those a
        # hook issues from its callbacks (PowerSGD does) in a different order on other ranks.
        dist.all_reduce(self._usage, group=self.process_group)

    def _call_hook(self, bucket: int, hook: HookSpec) -> None:
        group = self.groups[bucket]
        view = HookBucket(
            bucket,
            self.buffers[bucket][: self._data_numel[bucket]],
            [self._views[i] for i in group],
            [self.tensors[i] for i in group],
            is_last=bucket == len(self.groups) - 1,
        )
        launched = time.perf_counter()
        future = hook.hook(hook.state, view)
        if self.recorder is not None:
            future.add_done_callback(
                functools.partial(
                    _report_done, self.recorder, bucket, 0, self.bucket_bytes[bucket], launched
                )
            )
        self._futures[bucket] = future

    def _slice_bytes(self, bucket: int, numel: int, total: int) -> int:
        return self.bucket_bytes[bucket] * numel // max(total, 1)

    def _write(self, index: int, grad: torch.Tensor) -> None:
        self._views[index].copy_(grad)

    def _launch_ready(self) -> None:
        # Strictly in plan order: a complete bucket waits for earlier incomplete ones, so all
        # ranks issue identical collective sequences even if hooks fire in different orders.
        while self._next_launch < len(self.groups) and self._pending[self._next_launch] == 0:
            bucket = self._next_launch
            buffer = self.buffers[bucket]
            if bucket == len(self.groups) - 1:
                # Every tensor is accounted for once the last bucket is complete: write all the
                # usage marks in one copy rather than one tensor write per gradient.
                if all(self._used):
                    self._usage.fill_(1)
                else:
                    self._usage.copy_(torch.tensor(self._used, dtype=self._usage.dtype))
            if self.hook is not None:
                self._call_hook(bucket, self.hook)
                self._next_launch += 1
                continue
            # Divide before summing, as DDP does: the average without risking overflow.
            buffer.div_(self.world_size)
            wire = self._wires[bucket]
            if wire is not None:
                wire.copy_(buffer)
                buffer = wire
            chans = self.assignment[bucket]
            slices = torch.tensor_split(buffer, len(chans)) if len(chans) > 1 else (buffer,)
            for channel, piece in zip(chans, slices, strict=True):
                launched = time.perf_counter()
                handle = dist.all_reduce(piece, group=self.channels[channel], async_op=True)
                if handle is None:
                    continue
                if self.recorder is not None:
                    nbytes = self._slice_bytes(bucket, piece.numel(), buffer.numel())
                    done = functools.partial(
                        _report_done, self.recorder, bucket, channel, nbytes, launched
                    )
                    handle.get_future().then(done)
                self._handles[bucket].append(handle)
            self._next_launch += 1


def _report_done(
    recorder: CommRecorder,
    bucket: int,
    channel: int,
    nbytes: int,
    launched: float,
    _future: object,
) -> None:
    # Runs on the backend's thread when the all-reduce completes: the true end time.
    recorder(bucket, channel, nbytes, launched, time.perf_counter())


def _split_by_dtype(
    groups: Sequence[Sequence[int]], tensors: Sequence[torch.Tensor]
) -> list[tuple[list[int], int]]:
    """Split any bucket that mixes dtypes (one flat buffer has one dtype), keeping the order;
    each piece comes with the index of the bucket it came from."""
    result: list[tuple[list[int], int]] = []
    for origin, group in enumerate(groups):
        current: list[int] = []
        for index in group:
            if current and tensors[index].dtype != tensors[current[-1]].dtype:
                result.append((current, origin))
                current = []
            current.append(index)
        if current:
            result.append((current, origin))
    return result
