"""K-FAC's warning category, shared by the modules that skip or work around something."""

from __future__ import annotations

__all__ = ["KFACWarning"]


class KFACWarning(UserWarning):
    """Something K-FAC skipped or worked around; training goes on."""
