"""Link rates by name: what ``--link`` accepts, in bits per second (pure; no processes, no torch).

The simulator, the benchmarks and the emulated network (:mod:`interlace.launch.netem`) all read
rates through :func:`parse_link`.
"""

from __future__ import annotations

import re

from interlace.errors import UsageError

__all__ = ["LINK_RATES", "default_burst_bytes", "parse_link"]

#: Line rates a rank's NIC can have, in bits per second, by the name ``--link`` accepts. The names
#: are also valid ``tc`` rate strings, and are what ``INTERLACE_LINK`` carries into the ranks.
LINK_RATES: dict[str, float] = {
    "100mbit": 100e6,
    "1gbit": 1e9,
    "2.5gbit": 2.5e9,
    "10gbit": 10e9,
}

_RATE = re.compile(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)")
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_link(text: str) -> float:
    """Return the line rate in bits/s named by ``text``.

    Args:
        text: One of :data:`LINK_RATES` or, as ``tc`` writes rates, a positive number with a
            unit ``kbit``, ``mbit`` or ``gbit`` (``300mbit``), so a benchmark can pick a rate
            that gives a chosen communication/compute ratio. Case and surrounding spaces are
            ignored.

    Returns:
        The rate in bits per second.

    Raises:
        UsageError: For anything else, naming the accepted forms, so ``--link fast`` is
            answered with what would have worked.
    """
    key = text.strip().lower()
    if key in LINK_RATES:
        return LINK_RATES[key]
    match = _RATE.fullmatch(key)
    if match and float(match[1]) > 0:
        return float(match[1]) * _UNITS[match[2]]
    accepted = ", ".join(LINK_RATES)
    raise UsageError(
        f"unknown link rate {text!r}; accepted rates: {accepted} (or any NUMBER followed by "
        "kbit, mbit or gbit, e.g. 300mbit)"
    )


def default_burst_bytes(rate_bps: float) -> int:
    """The token-bucket (tbf) size, in bytes, that shapes an emulated NIC of ``rate_bps``.

    The bucket must hold the largest segment TCP hands a veth (64 KiB) with room to spare, and
    at fast rates the line rate times the shaper's timer latency; docs/notes/launch.md has the
    measurements behind both bounds.

    Args:
        rate_bps: The NIC's line rate in bits per second.

    Returns:
        ``max(96 KiB, 0.2 ms of line rate)``.
    """
    return max(96 * 1024, int(rate_bps / 8.0 * 0.2e-3))
