"""Data parallelism with gradient buckets planned from measured times: :class:`DataParallel`."""

from interlace.dp.data_parallel import DataParallel

__all__ = ["DataParallel"]
