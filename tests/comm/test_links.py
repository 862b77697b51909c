"""Tests of link rates by name: parsing ``--link`` and the emulated NIC's token bucket."""

from __future__ import annotations

import pytest

from interlace.comm.links import LINK_RATES, default_burst_bytes, parse_link
from interlace.errors import UsageError


def test_parse_link() -> None:
    assert parse_link("1gbit") == 1e9
    assert parse_link(" 100MBIT ") == 100e6
    assert parse_link("2.5gbit") == 2.5e9
    # Any tc-style rate, so a benchmark can aim at a communication/compute ratio.
    assert parse_link("300mbit") == 300e6
    assert parse_link("1.5gbit") == 1.5e9
    with pytest.raises(UsageError, match=r"accepted rates: 100mbit, 1gbit, 2\.5gbit, 10gbit"):
        parse_link("fast")
    with pytest.raises(UsageError):
        parse_link("0mbit")


def test_burst_holds_a_gso_packet_and_scales_with_rate() -> None:
    for rate in LINK_RATES.values():
        assert default_burst_bytes(rate) >= 96 * 1024
    assert default_burst_bytes(10e9) > default_burst_bytes(1e9)
