"""``interlace.KFAC``'s keywords as ``interlace train`` flags, declared once each.

A ``kfac_*`` field of :class:`~interlace.train.config.TrainConfig` declared with
:func:`kfac_option` takes its default from ``KFAC``'s signature; its flag, its check and its
keyword in the call to ``KFAC`` are all made from that declaration.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import logging
import math
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from interlace.errors import UsageError
from interlace.kfac import KFAC, DistributedStrategy
from interlace.kfac.compat import (
    asks_for_comm_opt,
    factor_comm_from,
    placement_from,
    resolve_grad_worker_fraction,
)

__all__ = [
    "KFAC_DEFAULTS",
    "Choice",
    "Count",
    "DType",
    "Fraction",
    "KfacOption",
    "Names",
    "Real",
    "Switch",
    "add_kfac_arguments",
    "check_kfac_options",
    "check_worker_fraction",
    "kfac_keywords",
    "kfac_option",
    "kfac_options",
    "kfac_usage_error",
]

#: ``KFAC``'s keyword defaults, read from its signature.
KFAC_DEFAULTS: dict[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(KFAC).parameters.items()
    if parameter.default is not inspect.Parameter.empty
}
_METADATA_KEY = "kfac"
_UNSET = object()


def _normal(text: str) -> str:
    return text.strip().lower().replace("_", "-")


class Kind:
    """An option's values: parsed from the flag, checked, held by the config, given to ``KFAC``.

    The base holds the values as they are; each kind below overrides what differs.
    """

    @property
    def metavar(self) -> str | None:
        """The value's name in the help."""
        return None

    def parse(self, text: str) -> Any:
        """The flag's value; ``argparse`` reports an ``ArgumentTypeError`` as one line."""
        return text

    def normalize(self, value: Any) -> Any:
        """``value`` in its canonical spelling (a choice's any-case name as its value)."""
        return value

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value``, e.g. ``must be >= 0`` (None: nothing)."""
        return None

    def to_config(self, value: Any) -> Any:
        """``KFAC``'s default as the config holds it."""
        return value

    def to_kfac(self, value: Any) -> Any:
        """The config's value as ``KFAC`` takes it."""
        return value

    def show(self, value: Any) -> str:
        """The value as the help prints it."""
        return str(value)


@dataclass(frozen=True)
class Count(Kind):
    """An integer >= 1."""

    @property
    def metavar(self) -> str:
        return "N"

    def parse(self, text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None

    def problem(self, value: object) -> str | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        return None if ok else "must be an integer >= 1"


@dataclass(frozen=True)
class Real(Kind):
    """A finite number in a range; ``optional`` also allows None (not given).

    Args:
        low: the smallest value allowed (or, with ``low_open``, the bound above which).
        high: the largest value allowed (or, with ``high_open``, the bound below which).
        low_open: exclude ``low``.
        high_open: exclude ``high``.
        optional: None is allowed (the flag not given).
        zero_is_none: 0 on the command line is ``KFAC``'s None (kl_clip: no clip).
        name: the value's name in the help.
    """

    low: float = 0.0
    high: float = math.inf
    low_open: bool = False
    high_open: bool = True
    optional: bool = False
    zero_is_none: bool = False
    name: str = "X"

    @property
    def metavar(self) -> str:
        return self.name

    def parse(self, text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None

    def problem(self, value: object) -> str | None:
        if value is None and self.optional:
            return None
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and math.isfinite(value) and self._in_range(float(value)):  # type: ignore[arg-type]
            return None
        if self.high == math.inf:
            return f"must be {'>' if self.low_open else '>='} {self.low:g}"
        left, right = ("(" if self.low_open else "["), (")" if self.high_open else "]")
        return f"must be in {left}{self.low:g}, {self.high:g}{right}"

    def _in_range(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def to_config(self, value: Any) -> Any:
        return 0.0 if value is None and self.zero_is_none else value

    def to_kfac(self, value: Any) -> Any:
        return None if self.zero_is_none and value == 0 else value

    def show(self, value: Any) -> str:
        return f"{value:g}"


@dataclass(frozen=True)
class Choice(Kind):
    """One of a few strings; any case, ``-`` or ``_``, and an enum's member names too.

    Args:
        values: the strings, as the config holds them.
        enum_type: the enum the strings belong to, whose member names are accepted as well.
        levels: the strings are logging level names, given to ``KFAC`` as numbers.
        optional: None is allowed (the flag not given).
    """

    values: tuple[str, ...]
    enum_type: type[enum.Enum] | None = None
    levels: bool = False
    optional: bool = False

    @property
    def metavar(self) -> str:
        return "{" + ",".join(self.values) + "}"

    def parse(self, text: str) -> str:
        value = self.canonical(text)
        if value is None:
            raise argparse.ArgumentTypeError(
                f"expected one of {', '.join(self.values)}, got {text!r}"
            )
        return value

    def canonical(self, value: object) -> str | None:
        """``value`` as one of :attr:`values`, or None when it names none."""
        if isinstance(value, enum.Enum):
            value = value.value
        if not isinstance(value, str):
            return None
        wanted = _normal(value)
        for choice in self.values:
            if _normal(choice) == wanted:
                return choice
        if self.enum_type is not None:
            for name, member in self.enum_type.__members__.items():
                if _normal(name) == wanted:
                    return str(member.value)
        return None

    def normalize(self, value: Any) -> Any:
        return self.canonical(value) or value

    def problem(self, value: object) -> str | None:
        if (value is None and self.optional) or value in self.values:
            return None
        return f"must be one of {', '.join(self.values)}"

    def to_config(self, value: Any) -> Any:
        if self.levels and isinstance(value, int):
            return logging.getLevelName(value).lower()
        return None if value is None else self.canonical(value)

    def to_kfac(self, value: Any) -> Any:
        if self.levels and isinstance(value, str):
            return logging.getLevelName(value.upper())
        return value


@dataclass(frozen=True)
class Fraction(Kind):
    """``grad_worker_fraction``: a number in [0, 1] (0: MEM-OPT) or a ``DistributedStrategy``."""

    strategies: Choice = Choice(
        tuple(str(member.value) for member in DistributedStrategy), DistributedStrategy
    )

    @property
    def metavar(self) -> str:
        return "{F,comm-opt,hybrid-opt,mem-opt}"

    def normalize(self, value: Any) -> Any:
        return value if isinstance(value, int | float) else self.strategies.normalize(value)

    def parse(self, text: str) -> float | str:
        named = self.strategies.canonical(text)
        if named is not None:
            return named
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a number in [0, 1] or one of {', '.join(self.strategies.values)}, "
                f"got {text!r}"
            ) from None

    def problem(self, value: object) -> str | None:
        if isinstance(value, str):
            return self.strategies.problem(value)
        return Real(0.0, 1.0, high_open=False).problem(value)

    def to_config(self, value: Any) -> Any:
        return 1.0 if value is None else value

    def show(self, value: Any) -> str:
        return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Switch(Kind):
    """True or false; the flag alone means true. ``optional``: None (not given) too."""

    optional: bool = False

    @property
    def metavar(self) -> str:
        return "{true,false}"

    def parse(self, text: str) -> bool:
        word = text.strip().lower()
        if word in ("true", "yes", "on", "1"):
            return True
        if word in ("false", "no", "off", "0"):
            return False
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")

    def problem(self, value: object) -> str | None:
        ok = isinstance(value, bool) or (value is None and self.optional)
        return None if ok else "must be true or false"

    def show(self, value: Any) -> str:
        return str(value).lower()


#: The dtypes ``--kfac-factor-dtype`` and ``--kfac-inv-dtype`` name.
DTYPES = ("float32", "float64", "float16", "bfloat16")


@dataclass(frozen=True)
class DType(Kind):
    """A floating-point dtype by its torch name; ``optional``: None (not given) too."""

    optional: bool = False
    choice: Choice = Choice(DTYPES)

    @property
    def metavar(self) -> str:
        return self.choice.metavar

    def parse(self, text: str) -> str:
        return self.choice.parse(text.strip().removeprefix("torch."))

    def normalize(self, value: Any) -> Any:
        return value if value is None else self.choice.normalize(self.to_config(value))

    def problem(self, value: object) -> str | None:
        return None if value is None and self.optional else self.choice.problem(value)

    def to_config(self, value: Any) -> Any:
        return None if value is None else str(value).removeprefix("torch.")

    def to_kfac(self, value: Any) -> Any:
        return None if value is None else getattr(torch, value)


@dataclass(frozen=True)
class Names(Kind):
    """Module names or class names, comma-separated (``""``: none)."""

    @property
    def metavar(self) -> str:
        return "NAME[,NAME...]"

    def parse(self, text: str) -> str:
        return ",".join(name.strip() for name in text.split(",") if name.strip())

    def problem(self, value: object) -> str | None:
        return None if isinstance(value, str) else "must be comma-separated names"

    def to_config(self, value: Any) -> Any:
        return ",".join(value or ())

    def to_kfac(self, value: Any) -> Any:
        return tuple(name for name in value.split(",") if name)

    def show(self, value: Any) -> str:
        return value or "none"


@dataclass(frozen=True)
class KfacOption:
    """One ``KFAC`` keyword as a ``TrainConfig`` field and an ``interlace train`` flag.

    Args:
        field: the config field, ``kfac_`` and the keyword.
        keyword: ``KFAC``'s keyword.
        kind: its values: how they are parsed, checked and handed to ``KFAC``.
        help: the flag's help, without the default.
        default: the config's default.
        unset: what None (the flag not given) means, for the help.
        aliases: other ``KFAC`` keywords the same flag sets (kfac-pytorch's names).
    """

    field: str
    keyword: str
    kind: Kind
    help: str
    default: Any
    unset: str | None = None
    aliases: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        """The command-line flag: the field's name with dashes."""
        return "--" + self.field.replace("_", "-")

    @property
    def flags(self) -> list[str]:
        """The flag and its spellings after kfac-pytorch's names."""
        return [self.flag, *("--kfac-" + alias.replace("_", "-") for alias in self.aliases)]

    def shown_default(self) -> str:
        """The default as the help prints it: ``(default 25)``, ``(default: the layer's)``."""
        if self.default is None:
            return f"(default: {self.unset or 'not given'})"
        return f"(default {self.kind.show(self.default)})"


def kfac_option(
    keyword: str,
    kind: Kind,
    help: str,
    *,
    default: Any = _UNSET,
    unset: str | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A ``TrainConfig`` field for ``KFAC``'s ``keyword``: ``kfac_<keyword>``, one declaration.

    Args:
        keyword: ``KFAC``'s keyword; the field must be named ``kfac_<keyword>``.
        kind: its values (:class:`Count`, :class:`Real`, :class:`Choice`, ...).
        help: the flag's help; the default is appended.
        default: the config's default when it must differ from ``KFAC``'s (say why in
            ``help``); otherwise ``KFAC``'s, from its signature.
        unset: what None (the flag not given) means, for the help.
        aliases: kfac-pytorch's other names for the same keyword (more spellings of the flag).

    Raises:
        KeyError: ``keyword`` is not one of ``KFAC``'s keywords with a default.
    """
    value = kind.to_config(KFAC_DEFAULTS[keyword]) if default is _UNSET else default
    metadata = {
        _METADATA_KEY: {"keyword": keyword, "kind": kind, "help": help, "unset": unset,
                        "aliases": aliases}
    }  # fmt: skip
    return field(default=value, metadata=metadata)


def kfac_options(config_type: type) -> list[KfacOption]:
    """The :func:`kfac_option` fields of a config dataclass, in declaration order.

    Args:
        config_type: :class:`~interlace.train.config.TrainConfig`.
    """
    found = []
    for item in fields(config_type):
        declared = item.metadata.get(_METADATA_KEY)
        if declared is not None:
            found.append(KfacOption(field=item.name, default=item.default, **declared))
    return found


def add_kfac_arguments(group: argparse._ArgumentGroup, config_type: type) -> None:
    """One flag per K-FAC option, its default shown in its help.

    Args:
        group: the parser's K-FAC group.
        config_type: :class:`~interlace.train.config.TrainConfig`.
    """
    for option in kfac_options(config_type):
        extra: dict[str, Any] = {}
        if isinstance(option.kind, Switch):
            extra = {"nargs": "?", "const": True}  # the flag alone means true
        group.add_argument(
            *option.flags,
            dest=option.field,
            type=option.kind.parse,
            default=option.default,
            metavar=option.kind.metavar,
            help=f"{option.help} {option.shown_default()}",
            **extra,
        )
    group.add_argument(
        "--kfac-accumulation-steps",
        type=_refuse_accumulation,
        default=argparse.SUPPRESS,
        metavar="1",
        help="only 1: interlace train runs one backward per optimizer step, with no gradient "
        "accumulation (default 1)",
    )


def _refuse_accumulation(text: str) -> int:
    if text.strip() != "1":
        raise argparse.ArgumentTypeError(
            f"{text!r}: interlace train runs one backward per optimizer step (no gradient "
            "accumulation), so K-FAC's accumulation_steps is 1; raise --batch-size instead"
        )
    return 1


def check_kfac_options(config: Any) -> None:
    """Check the K-FAC options and write choices in their canonical spelling.

    Args:
        config: a :class:`~interlace.train.config.TrainConfig`; its choices are rewritten
            (``EIGEN`` becomes ``eigen``).

    Raises:
        UsageError: naming the flag of the first bad value, or of two that contradict.
    """
    options = kfac_options(type(config))
    for option in options:
        value = option.kind.normalize(getattr(config, option.field))
        setattr(config, option.field, value)
        problem = option.kind.problem(value)
        if problem is not None:
            raise UsageError(f"{option.flag} {problem}, got {value!r}")
    keywords = kfac_keywords(config)
    try:
        factor_comm_from(keywords["factor_comm"], keywords["update_factors_in_hook"])
        placement_from(
            keywords["placement"],
            keywords["assignment_strategy"],
            keywords["colocate_factors"],
            keywords["compute_eigenvalue_outer_product"],
            eigen=keywords["compute_method"] == "eigen",
        )
    except UsageError as error:
        raise kfac_usage_error(error, options) from None
    lbp = keywords["placement"] == "lbp" or keywords["colocate_factors"] is False
    if lbp and not asks_for_comm_opt(keywords["grad_worker_fraction"]):
        raise UsageError(
            "--kfac-placement lbp sends every decomposition to every rank: it needs "
            "--kfac-grad-worker-fraction 1 (comm-opt); use --kfac-placement greedy for mem-opt "
            "or hybrid-opt"
        )


def check_worker_fraction(config: Any, world_size: int) -> None:
    """Refuse a gradient-worker fraction that gives no equal groups of ``world_size`` ranks.

    Args:
        config: a :class:`~interlace.train.config.TrainConfig`.
        world_size: the ranks the job will start.

    Raises:
        UsageError: naming ``--kfac-grad-worker-fraction``.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each rank's K-FAC warns of the rounding itself
        try:
            resolve_grad_worker_fraction(config.kfac_grad_worker_fraction, world_size)
        except UsageError as error:
            raise kfac_usage_error(error, kfac_options(type(config))) from None


def kfac_keywords(config: Any) -> dict[str, Any]:
    """The K-FAC options as ``KFAC``'s keywords and values.

    Args:
        config: a :class:`~interlace.train.config.TrainConfig`.
    """
    return {
        option.keyword: option.kind.to_kfac(getattr(config, option.field))
        for option in kfac_options(type(config))
    }


def kfac_usage_error(error: Exception, options: Iterable[KfacOption]) -> UsageError:
    """``KFAC``'s error in the command line's words, led by the flag it names first.

    ``placement='lbp'`` becomes ``--kfac-placement lbp``, a keyword with an underscore its
    flag, ``True`` ``true``; the first flag named leads the message.

    Args:
        error: what ``KFAC`` (or its checks) raised.
        options: the declared options, whose keywords are looked for in the message.
    """
    flags = {
        keyword: option.flag for option in options for keyword in (option.keyword, *option.aliases)
    }

    def as_flag(match: re.Match[str]) -> str:
        keyword, value = match.group(1), match.group(3)
        if keyword not in flags:
            return match.group(0)
        return f"{flags[keyword]} {value.lower()}" if value else flags[keyword]

    assigned = re.compile(r"\b([a-z_]+)=(['\"]?)([\w.\-]+)\2")
    message = assigned.sub(as_flag, str(error))
    message = re.sub(r"\b([a-z]+_[a-z_]+)\b()()", as_flag, message)
    message = re.sub(r"\b(True|False|None)\b", lambda word: word.group(0).lower(), message)
    first = re.search(r"--kfac-[a-z\-]+", message)
    if first is not None and first.start() == 0:
        return UsageError(message)
    return UsageError(f"{first.group(0) if first else '--optimizer kfac'}: {message}")
