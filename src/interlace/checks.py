"""Type guards for checking user-given options: numbers that are not bools."""

from __future__ import annotations

from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """An integer, and not a bool (``True`` is an ``int`` to Python, never a count here).

    Args:
        value: What the user passed.
    """
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> TypeGuard[int | float]:
    """A real number (int or float), and not a bool.

    Args:
        value: What the user passed.
    """
    return isinstance(value, int | float) and not isinstance(value, bool)
