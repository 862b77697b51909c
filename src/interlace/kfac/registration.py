"""Which modules K-FAC preconditions: interlace's rule or kfac-pytorch's (``layer_rule``), the
opt-in kinds, and weights that two modules share (tied weights)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from interlace.errors import OptionError, Setting
from interlace.kfac.enums import LayerKind, LayerRule, coerce_choice
from interlace.kfac.methods import DecompositionMethod
from interlace.kfac.module_helpers import LayerHelper, layer_kind, make_helper
from interlace.kfac.preconditioned_layer import KFACLayer, unwrap

__all__ = [
    "KFAC_PYTORCH_KINDS",
    "FoundLayers",
    "check_layer_options",
    "find_layers",
    "layer_kinds_from",
    "skip_patterns",
]

#: The kinds kfac-pytorch registers; ``extra_layers`` adds to them under its rule.
KFAC_PYTORCH_KINDS = frozenset({LayerKind.LINEAR, LayerKind.CONV2D})


@dataclass
class FoundLayers:
    """What :func:`find_layers` found.

    Args:
        layers: The layers to precondition, in module order.
        skipped: ``{name: reason}`` for every module with trainable parameters left out.
        notes: What to tell the user about registered layers (a weight tied to a module that
            is not registered, preconditioned as kfac-pytorch does).
    """

    layers: list[KFACLayer]
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def layer_kinds_from(values: Iterable[LayerKind | str] | None) -> frozenset[LayerKind]:
    """``extra_layers`` as a set of :class:`LayerKind`.

    Args:
        values: Kinds, or their strings (``"embedding"``, ``"conv1d"``, ...); None: none.

    Raises:
        OptionError: A value that names no kind, or a single string (not a collection).
    """
    if values is None:
        return frozenset()
    if isinstance(values, str):
        raise OptionError(
            "extra_layers", f"must be a collection of layer kinds, got the string {values!r}"
        )
    return frozenset(coerce_choice(LayerKind, value, "extra_layers") for value in values)


def skip_patterns(skip_layers: Iterable[str], rule: LayerRule) -> list[re.Pattern[str] | None]:
    """Each ``skip_layers`` entry as a regular expression (None: not one, it still matches by
    name under interlace's rule).

    Args:
        skip_layers: The entries.
        rule: The layer rule; kfac-pytorch's reads every entry as a regular expression.

    Raises:
        OptionError: Under kfac-pytorch's rule, an entry that is no regular expression.
    """
    patterns: list[re.Pattern[str] | None] = []
    for text in skip_layers:
        try:
            patterns.append(re.compile(text))
        except re.error as error:
            if rule is LayerRule.KFAC_PYTORCH:
                raise OptionError(
                    "skip_layers",
                    f"{text!r} is not a regular expression ({error}); under "
                    "layer_rule='kfac-pytorch' every entry is one (escape it with re.escape)",
                ) from None
            patterns.append(None)
    return patterns


def check_layer_options(
    layer_rule: object, extra_layers: Iterable[LayerKind | str] | None, skip_layers: object
) -> tuple[LayerRule, frozenset[LayerKind]]:
    """``KFACPreconditioner``'s ``layer_rule`` and ``extra_layers`` checked, with the
    ``skip_layers`` they read (kfac-pytorch's rule needs regular expressions).

    Args:
        layer_rule: A :class:`LayerRule` or its string.
        extra_layers: :class:`LayerKind` members or their strings (None: none).
        skip_layers: The ``skip_layers`` given (None: none).

    Returns:
        The rule and the extra kinds.

    Raises:
        OptionError: A bad value, or ``extra_layers`` under interlace's rule.
    """
    rule = coerce_choice(LayerRule, layer_rule, "layer_rule")
    extra = layer_kinds_from(extra_layers)
    if extra and rule is LayerRule.INTERLACE:
        raise OptionError(
            "extra_layers",
            Setting("layer_rule", "interlace"),
            " registers every kind already; pass ",
            Setting("layer_rule", "kfac-pytorch"),
            " with it, or drop it",
        )
    if isinstance(skip_layers, Iterable) and not isinstance(skip_layers, str):
        skip_patterns([str(entry) for entry in skip_layers], rule)
    return rule, extra


def find_layers(
    model: nn.Module,
    skip_layers: Iterable[str],
    method: DecompositionMethod | str,
    inv_dtype: torch.dtype,
    *,
    rule: LayerRule | str = LayerRule.INTERLACE,
    extra_layers: Iterable[LayerKind | str] = (),
) -> FoundLayers:
    """The layers K-FAC preconditions in ``model``, and the modules with parameters it leaves.

    Args:
        model: The model, or a DataParallel / DDP wrapper around it (layers are named as in
            the model inside; kfac-pytorch's rule matches ``skip_layers`` against the names in
            the model given, as kfac-pytorch does).
        skip_layers: Modules to leave out (see :class:`~interlace.kfac.enums.LayerRule`).
        method: The decomposition method, or its name.
        inv_dtype: The dtype decompositions are kept in.
        rule: Interlace's rule or kfac-pytorch's.
        extra_layers: Kinds added to kfac-pytorch's Linear and Conv2d under its rule.

    Raises:
        ValueError: No layer is left to precondition.
        OptionError: A bad ``rule``, ``extra_layers`` or (kfac-pytorch's rule) skip pattern.
    """
    rule = coerce_choice(LayerRule, rule, "layer_rule")
    skip_layers = list(skip_layers)
    inner = unwrap(model)
    choose = _interlace_choice if rule is LayerRule.INTERLACE else _kfac_pytorch_choice
    context = _Context(
        prefix=_prefix(model, inner),
        skip=skip_layers,
        patterns=skip_patterns(skip_layers, rule),
        kinds=KFAC_PYTORCH_KINDS | layer_kinds_from(extra_layers),
    )
    chosen: dict[str, tuple[nn.Module, LayerHelper]] = {}
    skipped: dict[str, str] = {}
    for path, module in inner.named_modules():
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        name = path or type(module).__name__
        helper, reason = choose(name, module, context)
        if helper is None:
            skipped[name] = reason
        else:
            chosen[name] = (module, helper)
    notes = _untie(inner, chosen, skipped, rule)
    if not chosen:
        raise ValueError(_nothing_found(rule))
    layers = [KFACLayer(name, helper, method, inv_dtype) for name, (_, helper) in chosen.items()]
    return FoundLayers(layers, skipped, notes)


@dataclass(frozen=True)
class _Context:
    prefix: str
    skip: list[str]
    patterns: list[re.Pattern[str] | None]
    kinds: frozenset[LayerKind]


def _interlace_choice(
    name: str, module: nn.Module, context: _Context
) -> tuple[LayerHelper | None, str]:
    """Interlace's rule: any module of a known kind with a trainable weight, less the skips
    (its name, an enclosing module's name or its class name in any case, or a regex)."""
    skip = {s.lower() for s in context.skip}
    segments = name.lower().split(".")
    names = {".".join(segments[: i + 1]) for i in range(len(segments))}
    kind = type(module).__name__
    found = any(p is not None and (p.search(name) or p.search(kind)) for p in context.patterns)
    if names & skip or kind.lower() in skip or found:
        return None, "in skip_layers"
    return make_helper(module)


def _kfac_pytorch_choice(
    name: str, module: nn.Module, context: _Context
) -> tuple[LayerHelper | None, str]:
    """kfac-pytorch's rule: a leaf Linear or Conv2d (or an ``extra_layers`` kind) all of whose
    parameters are trainable, whose name in the model given and class name no skip pattern is
    found in."""
    full_name = context.prefix + name
    class_name = type(module).__name__
    if any(
        p is not None and (p.search(full_name) or p.search(class_name)) for p in context.patterns
    ):
        return None, "in skip_layers"
    if next(module.children(), None) is not None:
        return None, "not a leaf module (kfac-pytorch's rule registers leaves only)"
    if not all(p.requires_grad for p in module.parameters()):
        return None, "a parameter is frozen (kfac-pytorch's rule needs all of them trainable)"
    kind = layer_kind(module)
    if kind is not None and kind not in context.kinds:
        return None, f"{kind.value}: opt in with extra_layers=[{kind.value!r}]"
    return make_helper(module)


def _prefix(model: nn.Module, inner: nn.Module) -> str:
    """The name of ``inner`` inside its wrappers, with a trailing dot (``"module."``)."""
    for name, module in model.named_modules():
        if module is inner:
            return f"{name}." if name else ""
    return ""


def _untie(
    model: nn.Module,
    chosen: dict[str, tuple[nn.Module, LayerHelper]],
    skipped: dict[str, str],
    rule: LayerRule,
) -> list[str]:
    """Leave out the chosen layers whose parameters another module shares, in place; returns
    the notes for those kept.

    Two preconditioned layers sharing a weight would precondition its gradient twice, and one
    layer's factors do not describe a gradient summed over two uses: such layers go to the
    optimizer. kfac-pytorch's rule keeps a layer tied to a module it does not register (GPT-2's
    ``lm_head`` and its embedding), as kfac-pytorch does, with a note.
    """
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for parameter in module.parameters(recurse=False):
            owners.setdefault(id(parameter), []).append(name or type(module).__name__)
    shared: dict[str, list[str]] = {}
    for name, (module, _) in chosen.items():
        others = {o for p in module.parameters(recurse=False) for o in owners[id(p)]} - {name}
        if others:
            shared[name] = sorted(others)
    notes: list[str] = []
    for name, sharers in shared.items():
        listing = ", ".join(repr(other) for other in sharers)
        if rule is LayerRule.KFAC_PYTORCH and not any(other in chosen for other in sharers):
            notes.append(
                f"{name!r} shares its weight with {listing} (tied weights), which is not "
                "preconditioned: its gradient holds both uses and is preconditioned with "
                f"{name!r}'s factors alone, as kfac-pytorch does (skip_layers=[{name!r}] leaves "
                "it to the optimizer)"
            )
            continue
        skipped[name] = (
            f"its weight is shared with {listing} (tied weights): one layer's factors do not "
            "describe the gradient of both uses"
        )
    for name in shared:
        if name in skipped:
            del chosen[name]
    return notes


def _nothing_found(rule: LayerRule) -> str:
    if rule is LayerRule.INTERLACE:
        return (
            "K-FAC found no Linear, Conv1d, Conv2d or Embedding layer with a trainable weight to "
            "precondition in this model (check skip_layers)"
        )
    return (
        "K-FAC (layer_rule='kfac-pytorch') found no leaf Linear or Conv2d layer whose "
        "parameters are all trainable to precondition in this model (check skip_layers, or "
        "add kinds with extra_layers, or pass layer_rule='interlace')"
    )
