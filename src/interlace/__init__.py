"""interlace: faster distributed PyTorch training by interlacing computation with communication.

The public API is imported lazily, so ``import interlace`` stays cheap for the launcher and for
every rank it starts (importing torch alone costs over a second).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["KFAC", "DataParallel", "__version__"]

if TYPE_CHECKING:
    from interlace.dp import DataParallel
    from interlace.kfac import KFAC


def __getattr__(name: str) -> Any:
    """``interlace.DataParallel`` and ``interlace.KFAC``, imported on first use.

    Args:
        name: the attribute asked for.
    """
    if name == "DataParallel":
        from interlace.dp import DataParallel  # noqa: PLC0415 - heavy (torch), on first use only

        return DataParallel
    if name == "KFAC":
        from interlace.kfac import KFAC  # noqa: PLC0415 - heavy (torch), on first use only

        return KFAC
    raise AttributeError(f"module 'interlace' has no attribute {name!r}")
