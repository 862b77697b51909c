"""The device clock: dilated device time as sleep, with short costs summed rather than rounded."""

from __future__ import annotations

import copy
import pickle
import time

import pytest

from interlace.comm.links import parse_link
from interlace.emulate.device import MAX_CREDIT_S, DeviceClock, dilate_link

#: How late a sleep may end on a loaded test machine (a busy 2-core host wakes threads late).
SLACK_S = 0.25


def test_a_spend_of_t_at_dilation_d_takes_t_times_d() -> None:
    clock = DeviceClock(dilation=3.0)
    start = time.perf_counter()
    clock.spend(0.02)
    elapsed = time.perf_counter() - start
    assert 0.06 <= elapsed < 0.06 + SLACK_S
    assert clock.spent_s == 0.06


def test_many_short_spends_take_their_sum_not_a_sleep_resolution_each() -> None:
    clock = DeviceClock(dilation=2.0)
    start = time.perf_counter()
    for _ in range(100):
        clock.spend(100e-6)  # 0.2 ms each at D=2: 20 ms in all
    elapsed = time.perf_counter() - start
    assert abs(clock.spent_s - 0.02) < 1e-12
    # Never early by more than the credit one overshoot can leave, and not 100 overshoots late.
    assert 0.02 - MAX_CREDIT_S <= elapsed < 0.02 + SLACK_S


def test_nothing_and_negative_spends_take_no_time() -> None:
    clock = DeviceClock(dilation=4.0)
    clock.spend(0.0)
    clock.spend(-1.0)
    assert clock.spent_s == 0.0


def test_a_sleeps_overshoot_is_paid_when_it_happens_not_when_repaid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every sleep overruns by exactly 1 ms: the overshoot is credit, paid for already.
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(time, "sleep", lambda s: now.__setitem__(0, now[0] + s + 1e-3))
    clock = DeviceClock()
    clock.spend(0.01)
    assert abs(clock.paid_s - 0.011) < 1e-12 and clock.spent_s == 0.01
    before = clock.paid_s
    clock.spend(0.5e-3)  # taken from the credit: spent, but no wall time paid
    assert clock.spent_s == 0.0105 and clock.paid_s == before
    assert now[0] == 0.011


def test_a_clock_copies_and_pickles_with_its_totals() -> None:
    clock = DeviceClock(dilation=2.0)
    clock.spend(1e-4)
    for copied in (copy.deepcopy(clock), pickle.loads(pickle.dumps(clock))):
        assert (copied.dilation, copied.spent_s) == (2.0, clock.spent_s)
        copied.spend(1e-4)
        assert copied.spent_s == clock.spent_s + 2e-4


def test_dilate_link_divides_the_rate() -> None:
    assert parse_link(dilate_link("1gbit", 4)) == 250e6
    assert abs(parse_link(dilate_link("100mbit", 3)) - 100e6 / 3) < 1e3
    # Rates of a million kbit and more: written out, never in exponent form.
    assert parse_link(dilate_link("25gbit", 16)) == 25e9 / 16
    assert parse_link(dilate_link("100gbit", 2)) == 50e9
