"""Factor-communication modes as objects: what an option names, and the pipelined settings."""

from __future__ import annotations

import pytest

from interlace.comm.cost import CostModel
from interlace.comm.plan import Bucketing
from interlace.errors import OptionError
from interlace.kfac.enums import FactorCommChoice
from interlace.kfac.factor_modes import Bulk, Pipelined, factor_comm_from


def test_an_option_names_a_mode_by_enum_string_or_object() -> None:
    assert factor_comm_from("bulk") == Bulk()
    assert factor_comm_from(FactorCommChoice.PIPELINED) == Pipelined()
    mine = Pipelined(fusion="fixed", profile_steps=5, factor_cost=CostModel(1e-5, 1e-9))
    assert factor_comm_from(mine) is mine
    assert (Bulk().pipelined, mine.pipelined) == (False, True)


def test_a_fusion_is_kept_as_dataparallels_bucketing() -> None:
    assert Pipelined().fusion is Bucketing.MERGED
    assert Pipelined(fusion="none").fusion is Bucketing.PER_TENSOR
    assert Pipelined(fusion="fixed") == Pipelined(fusion=Bucketing.FIXED)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("eager", "factor_comm must be one of 'bulk', 'pipelined'"),
        (3, "factor_comm must be 'bulk', 'pipelined', a FactorCommChoice"),
        (object(), "factor_comm must be 'bulk', 'pipelined', a FactorCommChoice"),
    ],
)
def test_anything_else_is_one_error_naming_the_option(value: object, message: str) -> None:
    with pytest.raises(OptionError, match=message) as bad:
        factor_comm_from(value)
    assert bad.value.option == "factor_comm"


@pytest.mark.parametrize(
    ("settings", "option", "message"),
    [
        ({"fusion": "smart"}, "fusion", "fusion must be one of none, fixed, merged, got 'smart'"),
        ({"profile_steps": 0}, "profile_steps", "profile_steps must be an integer >= 1, got 0"),
        ({"profile_steps": 1.0}, "profile_steps", "must be an integer >= 1, got 1.0"),
        ({"profile_steps": True}, "profile_steps", "must be an integer >= 1, got True"),
        ({"tune_steps": -1}, "tune_steps", r"must be an integer >= 0 \(0: no trials\), got -1"),
        ({"tune_steps": 2.5}, "tune_steps", "must be an integer >= 0"),
    ],
)
def test_pipelined_settings_are_checked_where_they_are_made(
    settings: dict[str, object], option: str, message: str
) -> None:
    with pytest.raises(OptionError, match=message) as bad:
        Pipelined(**settings)  # type: ignore[arg-type]
    assert bad.value.option == option
