"""The runtime half of the communication core: flat bucket buffers and asynchronous all-reduces.

Slices of buckets are launched strictly in the plan's launch order (:mod:`interlace.comm.launcher`),
so every rank issues the same collectives in the same order (docs/notes/dp.md).
"""

from __future__ import annotations

import atexit
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from interlace.comm.hooks import HookBucket, HookSpec
from interlace.comm.launcher import LaunchOrder

CommRecorder = Callable[[int, int, int, float, float], None]
"""Called with (bucket index, channel, bytes, launch time, completion time) for each finished
all-reduce (one per slice of a partitioned bucket)."""

COMPRESSIONS: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}

#: Seconds the interpreter's exit waits for gloo to release the collectives a hook issued.
HOOK_WORK_SETTLE_S = 0.2


@functools.cache
def _settle_hook_work_at_exit() -> None:
    """Once a hook runs collectives, let the exit wait briefly before the interpreter finalizes.

    A hook's collectives are its own: the engine holds only their futures. gloo drops its last
    reference to a finished work on its own thread, a moment after the future completes; the
    work may hold Python objects it then frees (tensors made in the hook, the context torch's
    backward keeps in thread-local state), which needs the interpreter. A
    script that ends right after its last backward can reach finalization first and abort
    ("terminate called without an active exception"), under DDP as well. atexit callbacks run
    before finalization begins, while other threads can still take the GIL.
    """
    atexit.register(time.sleep, HOOK_WORK_SETTLE_S)


@dataclass(frozen=True)
class _Slot:
    bucket: int
    offset: int
    numel: int


@dataclass(frozen=True)
class _Send:
    """One launch as the engine issues it: a slice of a (dtype-split) bucket on a channel."""

    bucket: int
    part: int
    parts: int
    channel: int


class BucketEngine:
    """Flat buffers for ``groups`` of ``tensors`` and the all-reduces that average them.

    Args:
        tensors: the tensors whose gradients are averaged (their shapes and dtypes are what
            counts: meta tensors will do, with ``device``).
        groups: the buckets, as indices into ``tensors``, in plan order; a bucket that mixes
            dtypes is split into one bucket per dtype, keeping the order.
        process_group: the group to average over (default: the world).
        recorder: called for each finished all-reduce (see :data:`CommRecorder`).
        channels: the process groups buckets travel on (default: ``process_group`` alone).
        launches: ``(bucket, part, parts, channel)`` of each all-reduce in launch order (a
            :class:`~interlace.comm.plan.Launch` will do): slice ``part`` of ``parts`` equal
            slices of bucket ``bucket``, sent on ``channel``. Default: each bucket whole, in
            order, on channel 0.
        compression: ``None``, ``"fp16"`` or ``"bf16"``: float32 buckets travel in that type.
        hook: a DDP communication hook that averages each bucket instead of the engine's own
            all-reduce (then channels, slices and compression do not apply): it gets the
            bucket's gradients undivided, and the used-tensor marks travel in one small
            all-reduce of their own after the hooks' futures are done.
        device: where the buffers live (default: the first tensor's device).
        batched_copy: copy a bucket's gradients into it in one ``_foreach_copy_`` when it is
            launched, instead of one copy per gradient as it arrives (DDP's
            ``batched_grad_copy``: fewer kernel launches for many small tensors).

    Raises:
        ValueError: for no tensors, an unknown compression, compression together with a hook,
            or launches that do not fit.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        groups: Sequence[Sequence[int]],
        process_group: dist.ProcessGroup | None = None,
        recorder: CommRecorder | None = None,
        *,
        channels: Sequence[dist.ProcessGroup | None] | None = None,
        launches: Sequence[LaunchLike] | None = None,
        compression: str | None = None,
        hook: HookSpec | None = None,
        device: torch.device | None = None,
        batched_copy: bool = False,
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
        if hook is not None:
            _settle_hook_work_at_exit()
        self.batched_copy = batched_copy
        self.process_group = process_group
        self.channels = list(channels) if channels is not None else [process_group]
        self.world_size = dist.get_world_size(process_group)
        self.recorder = recorder
        self.compression = compression
        given = (
            [(number, 0, 1, 0) for number in range(len(groups))]
            if launches is None
            else [(x.bucket, x.part, x.parts, x.channel) for x in launches]
        )
        _check_launches(given, len(groups), len(self.channels))
        split = _split_by_dtype(groups, self.tensors)
        self.groups = [group for group, _ in split]
        pieces: dict[int, list[int]] = {}
        for number, (_, origin) in enumerate(split):
            pieces.setdefault(origin, []).append(number)
        #: Each launch after splitting by dtype: a launch of a mixed bucket goes once per piece.
        self.sends = [
            _Send(piece, part, parts, channel)
            for bucket, part, parts, channel in given
            for piece in pieces[bucket]
        ]
        self.launcher = LaunchOrder(self.groups, [send.bucket for send in self.sends])
        #: The channel of each slice of each bucket (after splitting buckets by dtype).
        self.assignment: list[list[int]] = [[] for _ in self.groups]
        for send in self.sends:
            self.assignment[send.bucket].append(send.channel)
        self.slots: list[_Slot] = [_Slot(-1, 0, 0)] * len(self.tensors)
        self.buffers: list[torch.Tensor] = []
        self._data_numel: list[int] = []
        self._wires: list[torch.Tensor | None] = []
        device = self.tensors[0].device if device is None else device
        #: Each bucket's "was used" marks, one per tensor, after its gradients: they travel with
        #: the bucket, so its averages are usable as soon as it arrives, whatever comes later.
        self._usage: list[torch.Tensor] = []
        for bucket, group in enumerate(self.groups):
            offset = 0
            for index in group:
                numel = self.tensors[index].numel()
                self.slots[index] = _Slot(bucket, offset, numel)
                offset += numel
            dtype = self.tensors[group[0]].dtype
            buffer = torch.zeros(offset + len(group), dtype=dtype, device=device)
            self.buffers.append(buffer)
            self._data_numel.append(offset)
            self._usage.append(buffer[offset:])
            wire = None
            if compression is not None and dtype == torch.float32:
                wire = torch.zeros(buffer.numel(), dtype=COMPRESSIONS[compression], device=device)
            self._wires.append(wire)
        self._all_used = [torch.ones_like(marks) for marks in self._usage]
        # Each tensor's place in its bucket, shaped like the tensor: made once, so a gradient
        # costs one copy in the hook (backward runs one hook per tensor; slicing and reshaping
        # there each time cost more than the copy for the small ones).
        self._views: list[torch.Tensor] = [
            self.buffers[slot.bucket][slot.offset : slot.offset + slot.numel].view_as(tensor)
            for slot, tensor in zip(self.slots, self.tensors, strict=True)
        ]
        element = [self.tensors[group[0]].element_size() for group in self.groups]
        self.bucket_bytes: list[int] = [
            sum(self.tensors[i].numel() for i in group) * size
            for group, size in zip(self.groups, element, strict=True)
        ]
        """Bytes of gradient data in each bucket (without the usage marks), before compression."""
        #: Bytes of gradient data in each launch's slice (the marks not counted).
        self._send_bytes = [
            _data_in_slice(self.buffers[send.bucket].numel(), self._data_numel[send.bucket], send)
            * element[send.bucket]
            for send in self.sends
        ]
        # Each launch's slice of its bucket and of the bucket's wire, cut once: cutting them in
        # every launch cost as much host time as the launch itself for the small slices.
        self._pieces = [_slice(self.buffers[send.bucket], send) for send in self.sends]
        self._wire_pieces = [
            None if wire is None else _slice(wire, send)
            for wire, send in ((self._wires[send.bucket], send) for send in self.sends)
        ]
        self._sends_of: list[list[int]] = [[] for _ in self.groups]
        for position, send in enumerate(self.sends):
            self._sends_of[send.bucket].append(position)
        self._used: list[bool] = []
        self._handles: list[dist.Work | None] = []
        self._waited: list[bool] = []
        self._futures: list[torch.futures.Future[torch.Tensor] | None] = []
        self._copies: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.begin()

    def begin(self) -> None:
        """Reset for a new iteration."""
        self.launcher.reset()
        self._used = [False] * len(self.tensors)
        self._handles = [None] * len(self.sends)
        #: When each bucket's first slice was launched this iteration (``time.perf_counter()``),
        #: None until it is: its all-reduce timed from the waiting side, with no recorder.
        self.launched_s: list[float | None] = [None] * len(self.groups)
        self._waited = [False] * len(self.groups)
        self._futures = [None] * len(self.groups)
        self._copies = [[] for _ in self.groups]
        # Every tensor used until :meth:`close` finds one that was not: one fill per iteration.
        torch._foreach_copy_(self._usage, self._all_used)

    def add(self, index: int, grad: torch.Tensor) -> None:
        """Copy tensor ``index``'s gradient into its bucket; launch every slice now due.

        Args:
            index: the tensor's index.
            grad: its gradient.
        """
        # A second gradient for the same tensor within one backward (a reentrant backward that
        # reaches a leaf twice) is the accumulated one: it counts as the newer value.
        self._used[index] = True
        view = self._views[index]
        if grad is view:
            pass  # written in place already (gradient_as_bucket_view, or through slot())
        elif self.batched_copy:
            self._copies[self.slots[index].bucket].append((view, grad))
        else:
            view.copy_(grad)
        for position in self.launcher.add(index):
            self._launch(position)

    def slot(self, index: int) -> torch.Tensor:
        """Tensor ``index``'s place in its bucket, shaped like the tensor: a producer that writes
        its value there and then calls :meth:`add` with this view spares the engine a copy.

        Args:
            index: the tensor's index.
        """
        return self._views[index]

    def sent(self, index: int) -> bool:
        """Whether tensor ``index``'s bucket has gone out this iteration (a gradient arriving
        now would be too late for it).

        Args:
            index: the tensor's index.
        """
        return self._sends_of[self.slots[index].bucket][0] < self.launcher.launched

    def close(self) -> None:
        """Backward is over: zeros for the tensors this rank has no gradient for, and every
        slice not yet sent goes out."""
        unused: dict[int, list[int]] = {}
        for index in self.launcher.missing():
            self._views[index].zero_()
            unused.setdefault(self.slots[index].bucket, []).append(index)
        for bucket, members in unused.items():
            # Only buckets not sent yet can hold a tensor that has not arrived.
            missing = set(members)
            marks = [0.0 if index in missing else 1.0 for index in self.groups[bucket]]
            self._usage[bucket].copy_(torch.tensor(marks, dtype=self._usage[bucket].dtype))
        for position in self.launcher.rest():
            self._launch(position)

    def wait(self, buckets: Sequence[int]) -> None:
        """Wait for every slice of ``buckets`` (launched already, see :meth:`close`); their
        buffers then hold the averages.

        Args:
            buckets: bucket indices (after splitting by dtype, as :attr:`groups` has them).
        """
        for bucket in buckets:
            if self._waited[bucket]:
                continue
            for position in self._sends_of[bucket]:
                handle = self._handles[position]
                if handle is not None:
                    handle.wait()
            wire = self._wires[bucket]
            if wire is not None:
                self.buffers[bucket].copy_(wire)
            self._waited[bucket] = True

    def waited_buckets(self) -> list[int]:
        """The buckets waited for since :meth:`begin` (their averages are in), in index order."""
        return [bucket for bucket, waited in enumerate(self._waited) if waited]

    def bucket_of(self, index: int) -> int:
        """The bucket tensor ``index`` is in.

        Args:
            index: the tensor's index.
        """
        return self.slots[index].bucket

    def averaged(self, indices: Sequence[int]) -> list[torch.Tensor | None]:
        """The averaged gradients of ``indices`` (their buckets waited for), or None for a
        tensor no rank produced a gradient for; a view into the bucket.

        Only the marks of the buckets holding a tensor this rank did not use are read (on a GPU
        that read waits for those buckets' all-reduces, and for nothing else).

        Args:
            indices: tensor indices.
        """
        marks: dict[int, list[float]] = {}
        found: list[torch.Tensor | None] = []
        for index in indices:
            if self._used[index]:
                # This rank's mark is positive, so is the sum: no need to read it back.
                found.append(self._views[index])
                continue
            bucket = self.slots[index].bucket
            usage = marks.get(bucket)
            if usage is None:
                self.wait([bucket])
                usage = marks[bucket] = self._usage[bucket].tolist()
            used = usage[self.groups[bucket].index(index)] > 0
            found.append(self._views[index] if used else None)
        return found

    def finish(self) -> list[torch.Tensor | None]:
        """Send what is left, wait for every all-reduce, and return the averaged gradients.

        Entry ``i`` is a view of tensor ``i``'s averaged gradient, or None when no rank
        produced a gradient for it this iteration.
        """
        self.close()
        if self.hook is not None:
            self._finish_hooks()
        else:
            self.wait(range(len(self.groups)))
        return self.averaged(range(len(self.tensors)))

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
            self._waited[bucket] = True
        # After every hook is done, so that this collective cannot interleave with those a
        # hook issues from its callbacks (PowerSGD does) in a different order on other ranks.
        usage = torch.cat([marks.to(torch.float32) for marks in self._usage])
        dist.all_reduce(usage, group=self.process_group)
        for marks, summed in zip(
            self._usage, usage.split([len(m) for m in self._usage]), strict=True
        ):
            marks.copy_(summed)

    def _call_hook(self, bucket: int, hook: HookSpec) -> None:
        group = self.groups[bucket]
        view = HookBucket(
            bucket,
            self.buffers[bucket][: self._data_numel[bucket]],
            [self._views[i] for i in group],
            [self.tensors[i] for i in group],
            is_last=bucket == self.sends[-1].bucket,
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

    def _launch(self, position: int) -> None:
        send = self.sends[position]
        bucket = send.bucket
        copies = self._copies[bucket]
        if copies:
            torch._foreach_copy_([view for view, _ in copies], [grad for _, grad in copies])
            copies.clear()
        if self.launched_s[bucket] is None:
            self.launched_s[bucket] = time.perf_counter()
        if self.hook is not None:
            self._call_hook(bucket, self.hook)
            return
        piece = self._pieces[position]
        # Divide before summing, as DDP does: the average without risking overflow.
        piece.div_(self.world_size)
        wired = self._wire_pieces[position]
        if wired is not None:
            wired.copy_(piece)
            piece = wired
        launched = time.perf_counter()
        handle = dist.all_reduce(piece, group=self.channels[send.channel], async_op=True)
        if handle is not None and self.recorder is not None:
            done = functools.partial(
                _report_done,
                self.recorder,
                bucket,
                send.channel,
                self._send_bytes[position],
                launched,
            )
            handle.get_future().then(done)
        self._handles[position] = handle


LaunchLike = Any
"""Anything with ``bucket``, ``part``, ``parts`` and ``channel`` attributes (a plan's
:class:`~interlace.comm.plan.Launch`)."""


def _check_launches(
    launches: Sequence[tuple[int, int, int, int]], buckets: int, channels: int
) -> None:
    parts_seen: dict[int, set[int]] = {}
    for bucket, part, parts, channel in launches:
        if not 0 <= bucket < buckets:
            raise ValueError(f"a launch names bucket {bucket}; there are {buckets}")
        if not 0 <= channel < channels:
            raise ValueError(f"a launch is on channel {channel}, outside 0..{channels - 1}")
        if not 0 <= part < parts:
            raise ValueError(f"a launch is slice {part} of {parts}")
        parts_seen.setdefault(bucket, set()).add(part)
    for bucket in range(buckets):
        seen = parts_seen.get(bucket, set())
        total = {parts for b, _, parts, _ in launches if b == bucket}
        if len(total) != 1 or seen != set(range(total.pop())):
            raise ValueError(f"bucket {bucket} is not launched as a whole set of slices")


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


def _slice(buffer: torch.Tensor, send: _Send) -> torch.Tensor:
    """``send``'s slice of ``buffer`` (all of it for a whole-bucket launch), as
    ``torch.tensor_split`` cuts it."""
    return buffer if send.parts == 1 else torch.tensor_split(buffer, send.parts)[send.part]


def _data_in_slice(numel: int, data: int, send: _Send) -> int:
    """How many of the first ``data`` of ``numel`` elements fall in ``send``'s slice (cut as
    ``torch.tensor_split`` cuts)."""
    size, extra = divmod(numel, send.parts)
    start = send.part * size + min(send.part, extra)
    end = start + size + (1 if send.part < extra else 0)
    return max(min(end, data) - start, 0)


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
