"""``interlace train``'s K-FAC flags: one per keyword of ``KFACPreconditioner``, declared once each.

A ``kfac_*`` field of :class:`~interlace.train.config.TrainConfig` declared with
:func:`kfac_option` names a keyword of :class:`~interlace.kfac.KFACPreconditioner` (``KFAC``'s
own, kfac-pytorch's, or a policy object's setting spelt flat); its flag, its default (the
keyword's, read from the signature) and its value in the call all come from that declaration.
The library checks the values (before any rank starts, as it would in each), and its errors are
shown as they are, each option named by its flag.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import logging
import math
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from interlace.errors import OptionError, UsageError
from interlace.kfac import KFAC, DistributedStrategy, KFACPreconditioner

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
    "kfac_keywords",
    "kfac_option",
    "kfac_options",
    "shown_as_flags",
]


def _defaults(function: Any) -> dict[str, Any]:
    return {
        name: parameter.default
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }


#: The keywords' defaults, read from the signatures: ``KFAC``'s own, then the ones
#: ``KFACPreconditioner`` adds (its fixed-damping default is kfac-pytorch's, not the job's).
KFAC_DEFAULTS: dict[str, Any] = {
    **{k: v for k, v in _defaults(KFACPreconditioner).items() if k != "damping_adaptation"},
    **_defaults(KFAC),
}
_METADATA_KEY = "kfac"
_UNSET = object()


def _normal(text: str) -> str:
    return text.strip().lower().replace("_", "-")


class Kind:
    """An option's values: read from the flag, held by the config, given to ``KFAC``.

    The base holds the values as they are; each kind below overrides what differs. Whether a
    value is in range is the library's to say (:meth:`KFAC.check_options`).
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
        """What keeps ``value`` from becoming a keyword at all (None: nothing)."""
        return None

    def to_config(self, value: Any) -> Any:
        """``KFAC``'s default as the config holds it (plain data, for ``config.json``)."""
        return value

    def to_kfac(self, value: Any) -> Any:
        """The config's value as ``KFAC`` takes it."""
        return value

    def show(self, value: Any) -> str:
        """The value as the help and the messages print it."""
        return str(value)


@dataclass(frozen=True)
class Count(Kind):
    """An integer (the library wants it >= ``minimum``).

    Args:
        minimum: the least value the library takes, for the message.
    """

    minimum: int = 1

    @property
    def metavar(self) -> str:
        return "N"

    def parse(self, text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {self.minimum}, got {text!r}"
            ) from None


@dataclass(frozen=True)
class Real(Kind):
    """A finite number; ``zero_is_none``: 0 on the command line is ``KFAC``'s None.

    Args:
        zero_is_none: 0 on the command line is ``KFAC``'s None (kl_clip: no clip).
        name: the value's name in the help.
    """

    zero_is_none: bool = False
    name: str = "X"

    @property
    def metavar(self) -> str:
        return self.name

    def parse(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        return value

    def to_config(self, value: Any) -> Any:
        return 0.0 if value is None and self.zero_is_none else value

    def to_kfac(self, value: Any) -> Any:
        return None if self.zero_is_none and value == 0 else value

    def show(self, value: Any) -> str:
        return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Choice(Kind):
    """One of a few strings; any case, ``-`` or ``_``, and an enum's member names too.

    Args:
        enum_type: the enum whose values are the strings (and whose member names are accepted).
        values: the strings, when there is no enum.
        levels: the strings are logging level names, given to ``KFAC`` as numbers.
    """

    enum_type: type[enum.Enum] | None = None
    values: tuple[str, ...] = ()
    levels: bool = False

    @property
    def choices(self) -> tuple[str, ...]:
        """The strings, as the config holds them."""
        if self.enum_type is not None:
            return tuple(str(member.value) for member in self.enum_type)
        return self.values

    @property
    def metavar(self) -> str:
        return "{" + ",".join(self.choices) + "}"

    def parse(self, text: str) -> str:
        value = self.canonical(text)
        if value is None:
            raise argparse.ArgumentTypeError(
                f"expected one of {', '.join(self.choices)}, got {text!r}"
            )
        return value

    def canonical(self, value: object) -> str | None:
        """``value`` as one of :attr:`choices`, or None when it names none."""
        if isinstance(value, enum.Enum):
            value = value.value
        if not isinstance(value, str):
            return None
        wanted = _normal(value)
        for choice in self.choices:
            if _normal(choice) == wanted:
                return choice
        if self.enum_type is not None:
            for name, member in self.enum_type.__members__.items():
                if _normal(name) == wanted:
                    return str(member.value)
        return None

    def normalize(self, value: Any) -> Any:
        return self.canonical(value) or value

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

    strategies: Choice = Choice(DistributedStrategy)

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
                f"expected a number in [0, 1] or one of {', '.join(self.strategies.choices)}, "
                f"got {text!r}"
            ) from None

    def to_config(self, value: Any) -> Any:
        return 1.0 if value is None else value

    def show(self, value: Any) -> str:
        return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Switch(Kind):
    """True or false; the flag alone means true."""

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

    def show(self, value: Any) -> str:
        return str(value).lower()


#: The dtypes ``--kfac-factor-dtype`` and ``--kfac-inv-dtype`` name.
DTYPES = ("float32", "float64", "float16", "bfloat16")


@dataclass(frozen=True)
class DType(Kind):
    """A floating-point dtype by its torch name (the config holds the name)."""

    choice: Choice = Choice(values=DTYPES)

    @property
    def metavar(self) -> str:
        return self.choice.metavar

    def parse(self, text: str) -> str:
        return self.choice.parse(text.strip().removeprefix("torch."))

    def normalize(self, value: Any) -> Any:
        return value if value is None else self.choice.normalize(self.to_config(value))

    def problem(self, value: object) -> str | None:
        ok = value is None or value in DTYPES
        return None if ok else f"must be one of {', '.join(DTYPES)}"

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
    """One keyword of ``KFACPreconditioner`` as a ``TrainConfig`` field and a flag.

    Args:
        field: the config field, ``kfac_`` and the keyword.
        keyword: the keyword.
        kind: its values: how they are read and handed over.
        help: the flag's help, without the default.
        default: the config's default (None: not given, ``KFAC``'s default applies).
        unset: what None (the flag not given) means, for the help.
        aliases: other keywords the same flag sets (kfac-pytorch's names).
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
    """A ``TrainConfig`` field for ``keyword``: ``kfac_<keyword>``, one declaration.

    Args:
        keyword: a keyword of ``KFACPreconditioner``; the field is named ``kfac_<keyword>``.
        kind: its values (:class:`Count`, :class:`Real`, :class:`Choice`, ...).
        help: the flag's help; the default is appended.
        default: the config's default when it must differ from the signature's (say why in
            ``help``; None: not given); otherwise the signature's.
        unset: what None (the flag not given) means, for the help.
        aliases: kfac-pytorch's other names for the same keyword (more spellings of the flag).

    Raises:
        KeyError: ``keyword`` is no keyword with a default.
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


def check_kfac_options(config: Any, world_size: int | None = None) -> None:
    """Check the K-FAC options as ``KFACPreconditioner`` would, and write choices in their
    canonical spelling.

    Args:
        config: a :class:`~interlace.train.config.TrainConfig`; its choices are rewritten
            (``EIGEN`` becomes ``eigen``).
        world_size: the ranks the job will start (None: not known yet; the gradient-worker
            fraction is then checked for range only).

    Raises:
        UsageError: the library's message, each option named by its flag.
    """
    options = kfac_options(type(config))
    for option in options:
        value = option.kind.normalize(getattr(config, option.field))
        setattr(config, option.field, value)
        problem = option.kind.problem(value)
        if problem is not None:
            raise UsageError(f"{option.flag} {problem}, got {value!r}")
    keywords = kfac_keywords(config)
    keywords.setdefault("lr", config.lr)  # the job's K-FAC follows the SGD's rate: its peak
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each rank's K-FAC warns of a rounded fraction itself
        try:
            KFACPreconditioner.check_options(world_size, **keywords)
        except OptionError as error:
            raise UsageError(shown_as_flags(error, options)) from None


def kfac_keywords(config: Any) -> dict[str, Any]:
    """The K-FAC options as ``KFACPreconditioner``'s keywords; one not given (None) is left out,
    so that its default applies.

    Args:
        config: a :class:`~interlace.train.config.TrainConfig`.
    """
    return {
        option.keyword: option.kind.to_kfac(value)
        for option in kfac_options(type(config))
        if (value := getattr(config, option.field)) is not None
    }


def shown_as_flags(error: OptionError, options: list[KfacOption]) -> str:
    """The library's message with each option it names written as its flag (and a value as the
    command line writes it), led by the flag of the option to blame.

    Args:
        error: what the library raised.
        options: the declared options.
    """
    by_keyword = {
        keyword: option for option in options for keyword in (option.keyword, *option.aliases)
    }

    def flag(name: str) -> str:
        option = by_keyword.get(name)
        return name if option is None else option.flag

    def setting(name: str, value: object) -> str:
        option = by_keyword.get(name)
        if option is None:
            return f"{name}={value!r}"
        shown = value.value if isinstance(value, enum.Enum) else value
        return f"{option.flag} {option.kind.show(shown) if shown is not None else 'none'}"

    return error.spelt(flag, setting)
