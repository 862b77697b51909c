"""The traces and OSU logs shipped inside the package, by name.

``--trace googlenet-k80`` and ``--network osu:10gbe`` name them; docs/traces.md says where each
file comes from and what it holds.
"""

from __future__ import annotations

import atexit
from contextlib import ExitStack
from importlib.resources import as_file, files
from pathlib import Path

#: Shipped traces: name -> file in ``interlace/sim/data``.
TRACES: dict[str, str] = {
    "googlenet-k80": "googlenet_k80_8workers.log",
    # CPU-profiled zoo models (with activation sizes and K-FAC factor sizes), labelled -cpu.
    "resnet20-cpu": "resnet20_cpu.json",
    "resnet32-cpu": "resnet32_cpu.json",
    "vgg11-cpu": "vgg11_cpu.json",
    # The zoo's GPT decoder at one 128-token sequence, `interlace trace` on one CPU thread.
    "gpt-cpu": "gpt_b1_cpu.json",
    # Recorded with CUDA events on one NVIDIA H200 by `interlace trace` (benchmarks/gpu_traces.sh):
    # torchvision's ResNet-50 and VGG-16 at 3x224x224, a BERT-base-sized encoder at 128 tokens,
    # and the zoo's CIFAR-sized models, each at the batch its name gives.
    "resnet50-h200": "resnet50_b32_h200.json",
    "resnet50-b64-h200": "resnet50_b64_h200.json",
    "vgg16-h200": "vgg16_b32_h200.json",
    "vgg16-b64-h200": "vgg16_b64_h200.json",
    "bert-base-h200": "bert-base_b32_h200.json",
    "resnet20-h200": "resnet20_b32_h200.json",
    "resnet32-h200": "resnet32_b32_h200.json",
    "vgg11-h200": "vgg11_b32_h200.json",
    "transformer-h200": "transformer_b32_h200.json",
}

#: Shipped OSU all-reduce log sets: name -> files in ``interlace/sim/data``.
OSU_SETS: dict[str, tuple[str, ...]] = {
    "10gbe": tuple(f"osu_allreduce_{n}workers_10gbe.log" for n in (2, 4, 8)),
}

# Package data is a plain folder in a normal install; a zipped install gets temporary copies,
# kept until the interpreter exits.
_COPIES = ExitStack()
atexit.register(_COPIES.close)


def data_path(filename: str) -> Path:
    """A file path to the shipped data file ``filename``.

    Args:
        filename: A file in ``interlace/sim/data``.
    """
    resource = files("interlace.sim") / "data" / filename
    if isinstance(resource, Path):
        return resource
    return _COPIES.enter_context(as_file(resource))


def trace_names() -> list[str]:
    """The names of the shipped traces."""
    return sorted(TRACES)


def osu_set_names() -> list[str]:
    """The names of the shipped OSU log sets."""
    return sorted(OSU_SETS)


def shipped_trace(name: str) -> Path | None:
    """The file of the shipped trace ``name``, or None when no trace has that name.

    Args:
        name: A shipped trace name such as ``googlenet-k80`` (case-insensitive).
    """
    filename = TRACES.get(name.strip().lower())
    return data_path(filename) if filename else None


def shipped_osu_set(name: str) -> list[Path] | None:
    """The files of the shipped OSU log set ``name``, or None when no set has that name.

    Args:
        name: A shipped set name such as ``10gbe`` (case-insensitive).
    """
    filenames = OSU_SETS.get(name.strip().lower())
    return [data_path(f) for f in filenames] if filenames else None
