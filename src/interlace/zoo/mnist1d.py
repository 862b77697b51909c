"""MNIST-1D (Greydanus & Kobak, 2020): generated locally by the ``mnist1d`` package, cached.

4,000 training and 1,000 test sequences of length 40 in 10 classes by default (any size on
request); small enough to train in seconds, built so that model families and optimisers differ
on it (docs/kfac/mnist1d.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from interlace.errors import UsageError

__all__ = ["MNIST1D_DEFAULTS", "mnist1d_arrays", "mnist1d_cache_dir", "mnist1d_num_samples"]

#: The generator's arguments: the package's own defaults (the paper's data set), stated here
#: so that a run's config records exactly what it trained on.
MNIST1D_DEFAULTS: dict[str, Any] = {
    "num_samples": 5000,
    "train_split": 0.8,
    "template_len": 12,
    "padding": [36, 60],
    "scale_coeff": 0.4,
    "max_translation": 48,
    "corr_noise_scale": 0.25,
    "iid_noise_scale": 2e-2,
    "shear_scale": 0.75,
    "shuffle_seq": False,
    "final_seq_length": 40,
    "seed": 42,
}


def mnist1d_cache_dir() -> Path:
    """Where generated data sets are kept: ``$INTERLACE_CACHE`` or ``~/.cache/interlace``."""
    root = os.environ.get("INTERLACE_CACHE") or Path.home() / ".cache" / "interlace"
    return Path(root) / "mnist1d"


def _generate(arguments: dict[str, Any]) -> dict[str, np.ndarray]:
    try:
        from mnist1d.data import make_dataset  # noqa: PLC0415 - optional dependency
        from mnist1d.utils import ObjectView  # noqa: PLC0415 - optional dependency
    except ImportError:
        raise UsageError(
            "--data mnist1d needs the mnist1d package: pip install 'interlace[mnist1d]'"
        ) from None
    # make_dataset seeds numpy's global generator; keep the caller's state as it was.
    state = np.random.get_state()
    try:
        data = make_dataset(ObjectView(dict(arguments)))
    finally:
        np.random.set_state(state)
    return {
        "x": np.asarray(data["x"], dtype=np.float32),
        "y": np.asarray(data["y"], dtype=np.int64),
        "x_test": np.asarray(data["x_test"], dtype=np.float32),
        "y_test": np.asarray(data["y_test"], dtype=np.int64),
    }


def mnist1d_num_samples(train_samples: int, train_split: float = 0.8) -> int:
    """The generator's ``num_samples`` whose training split has exactly ``train_samples``.

    Args:
        train_samples: training sequences wanted (the test split gets the rest).
        train_split: the generator's share of samples that train.
    """
    if train_samples < 1:
        raise UsageError(f"MNIST-1D needs at least one training sequence, got {train_samples}")
    total = math.ceil(train_samples / train_split)
    # The generator splits at int(len * train_split); step past any rounding below the target.
    while int(total * train_split) < train_samples:
        total += 1
    return total


def mnist1d_arrays(
    seed: int | None = None, cache: Path | None = None, train_samples: int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The MNIST-1D splits as tensors, and the generator arguments that made them.

    Generated once per argument set and cached as ``.npz`` (written atomically, so two ranks
    generating at once never read a half-written file).

    Args:
        seed: The generator's seed; None keeps the paper's data set (seed 42).
        cache: The cache folder; None takes :func:`mnist1d_cache_dir`.
        train_samples: training sequences to generate (the test split gets a quarter as many);
            None keeps the paper's 4,000.

    Returns:
        ``({"x", "y", "x_test", "y_test"}, arguments)``: float32 ``[N, 40]`` sequences, int64
        labels, and the generator's arguments.
    """
    arguments = dict(MNIST1D_DEFAULTS)
    if seed is not None:
        arguments["seed"] = int(seed)
    if train_samples is not None:
        arguments["num_samples"] = mnist1d_num_samples(train_samples, arguments["train_split"])
    key = hashlib.sha256(json.dumps(arguments, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache if cache is not None else mnist1d_cache_dir()
    path = folder / f"mnist1d-{key}.npz"
    if path.is_file():
        with np.load(path) as stored:
            arrays = {name: stored[name] for name in ("x", "y", "x_test", "y_test")}
    else:
        arrays = _generate(arguments)
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, suffix=".npz.tmp")
        with os.fdopen(handle, "wb") as out:
            np.savez(
                out, x=arrays["x"], y=arrays["y"], x_test=arrays["x_test"], y_test=arrays["y_test"]
            )
        os.replace(temporary, path)
    return {name: torch.from_numpy(array) for name, array in arrays.items()}, arguments
