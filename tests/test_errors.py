"""An option's error kept in parts: the Python API's words, or a command line's flags."""

from __future__ import annotations

import pickle

from interlace.errors import Named, OptionError, Setting, UsageError


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _setting(name: str, value: object) -> str:
    return f"{_flag(name)} {str(value).lower()}"


def test_the_message_names_the_option_first_unless_it_starts_with_one() -> None:
    plain = OptionError("damping", "must be >= 0, got -1")
    assert str(plain) == "damping must be >= 0, got -1"
    assert plain.spelt(_flag, _setting) == "--damping must be >= 0, got -1"
    led = OptionError("placement", Setting("placement", "lbp"), " needs ", Named("workers"))
    assert str(led) == "placement='lbp' needs workers"
    assert led.spelt(_flag, _setting) == "--placement lbp needs --workers"


def test_it_is_a_usage_error_and_survives_a_trip_between_processes() -> None:
    error = OptionError("a", Setting("b", True), " contradicts ", Named("a"))
    assert isinstance(error, UsageError) and isinstance(error, ValueError)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.option, copy.problem, str(copy)) == (error.option, error.problem, str(error))
    assert str(copy) == "b=True contradicts a"
