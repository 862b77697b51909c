"""Checking at construction that every rank was built alike, in one small collective.

Ranks that disagree on a setting that decides which collectives run (or what they compute) would
hang, abort in gloo or drift apart later; compared here, every rank raises the same error naming
the setting, the ranks and their values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from interlace.errors import UsageError

__all__ = ["check_agreement", "describe_tensors", "disagreement"]

#: What a rank that lacks an entry shows in the message.
ABSENT = "absent"


def describe_tensors(kind: str, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """A model description for :func:`check_agreement`: each tensor's shape and dtype, and
    their order (collectives pack tensors in it).

    Args:
        kind: What the tensors are, e.g. ``"parameter"`` or ``"buffer"``.
        named: ``(name, tensor)`` pairs, in registration order.

    Returns:
        ``{"<kind> '<name>'": "shape (4, 3) float32", ..., "<kind> order": "a, b, ..."}``.
    """
    entries: dict[str, str] = {}
    names: list[str] = []
    for name, tensor in named:
        dtype = str(tensor.dtype).removeprefix("torch.")
        entries[f"{kind} '{name}'"] = f"shape {tuple(tensor.shape)} {dtype}"
        names.append(name)
    entries[f"{kind} order"] = ", ".join(names) if names else "(none)"
    return entries


def check_agreement(
    what: str,
    settings: Mapping[str, Any],
    model: Mapping[str, str] | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Raise the same :class:`UsageError` on every rank unless every rank passes equal values.

    One ``all_gather_object`` of a short digest; only when the digests differ are the
    descriptions themselves gathered (every rank sees the same digests, so every rank takes
    the same branch: the check itself cannot hang on a mismatch). Call it on every rank of
    ``process_group``, at the same point, before the first collective the values decide.

    Args:
        what: Whose settings, for the message (e.g. ``"DataParallel"``).
        settings: Setting name -> value (compared by ``repr``; an enum by its value).
        model: Entries that describe the model (see :func:`describe_tensors`).
        process_group: The ranks to compare (default: the world).

    Raises:
        UsageError: Naming the first entry that differs, each value and the ranks that hold it.
    """
    description = {name: _text(value) for name, value in settings.items()}
    model_keys = list(model or {})
    description.update(model or {})
    world = dist.get_world_size(process_group)
    if world == 1:
        return
    digest = hashlib.sha256(repr(sorted(description.items())).encode()).hexdigest()[:16]
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, digest, group=process_group)
    if len(set(digests)) == 1:
        return
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (description, model_keys), group=process_group)
    ranks = (
        list(range(world)) if process_group is None else dist.get_process_group_ranks(process_group)
    )
    every_model_key = {key for _, keys in gathered for key in keys}
    raise UsageError(disagreement(what, [entry for entry, _ in gathered], every_model_key, ranks))


def disagreement(
    what: str,
    descriptions: Sequence[Mapping[str, str]],
    model_keys: Iterable[str] = (),
    ranks: Sequence[int] | None = None,
) -> str:
    """The message for descriptions that differ: the first differing entry, in the order of the
    lowest rank that has it, with every value and its ranks.

    Args:
        what: Whose settings (e.g. ``"K-FAC"``).
        descriptions: Each rank's ``{entry: text}``, by position in the group.
        model_keys: The entries that describe the model rather than a setting.
        ranks: The rank to name for each position (default: the position).

    Returns:
        One line, e.g. ``"DataParallel settings differ between ranks: tune_steps is 2 on rank
        0 but 5 on rank 1; pass the same value on every rank"``.
    """
    names = list(ranks) if ranks is not None else list(range(len(descriptions)))
    keys = list(dict.fromkeys(key for entry in descriptions for key in entry))
    differing = [key for key in keys if len({d.get(key, ABSENT) for d in descriptions}) > 1]
    if not differing:
        return f"{what} settings are the same on every rank"
    # Named entries before the order entries: a missing tensor is the clearer report.
    differing.sort(key=lambda key: key.endswith(" order"))
    models = set(model_keys)
    key = differing[0]
    holders: dict[str, list[int]] = {}
    for rank, entry in zip(names, descriptions, strict=True):
        holders.setdefault(entry.get(key, ABSENT), []).append(rank)
    values = [f"{_shorten(value)} on {_ranks(held)}" for value, held in holders.items()]
    listed = values[0] + " but " + " and ".join(values[1:])
    if key in models:
        message = f"{what}'s model differs between ranks: {key} is {listed}"
        advice = "build the same model on every rank"
    else:
        message = f"{what} settings differ between ranks: {key} is {listed}"
        advice = "pass the same value on every rank"
    # An order that differs because an entry does is no news.
    others = [other for other in differing[1:] if not other.endswith(" order")]
    if others:
        shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
        message += f" (and {len(others)} more differ: {shown})"
    return f"{message}; {advice}"


def _ranks(held: Sequence[int]) -> str:
    return f"rank {held[0]}" if len(held) == 1 else "ranks " + ", ".join(map(str, held))


def _text(value: Any) -> str:
    """A setting's value as compared and shown: an enum by its value, the rest by ``repr``."""
    return repr(value.value if isinstance(value, Enum) else value)


def _shorten(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
