"""Data sets for the zoo and per-rank data loaders.

``digits`` (packaged), ``mnist1d``, ``synthetic-cifar10`` and ``synthetic-imagenet`` (generated),
a path to a CIFAR-10 folder, or text for a language model (``pydoc-topics`` packaged, ``text``
from a file); :func:`make_loader` shards a data set across ranks.
"""

from __future__ import annotations

import io
import pickle
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from interlace.errors import UsageError
from interlace.zoo.mnist1d import mnist1d_arrays
from interlace.zoo.samples import DataBundle, Sample, SampleDataset
from interlace.zoo.text import TEXT_FILE, TEXT_NAMES, TokenWindows, load_text

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "DATA_NAMES",
    "CifarDataset",
    "DataBundle",
    "SampleDataset",
    "SyntheticImages",
    "TensorPairs",
    "TokenWindows",
    "digits_split_indices",
    "load_data",
    "make_loader",
]

DATA_NAMES: tuple[str, ...] = (
    "digits",
    "mnist1d",
    "synthetic-cifar10",
    "synthetic-imagenet",
    *TEXT_NAMES,
    TEXT_FILE,
)

#: Per-channel mean and standard deviation of the CIFAR-10 training images scaled to [0, 1].
CIFAR10_MEAN: tuple[float, float, float] = (0.4914, 0.4822, 0.4465)
CIFAR10_STD: tuple[float, float, float] = (0.2470, 0.2435, 0.2616)

CIFAR10_TRAIN_FILES: tuple[str, ...] = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"

#: Fraction of each digit class held out for the test split.
DIGITS_TEST_FRACTION = 0.2

# Default (train, test) sizes of the synthetic data sets: CIFAR-10's real sizes, and for ImageNet
# 100 batches of 128 for training, which is enough for steady-state throughput measurements.
_SYNTHETIC: dict[str, tuple[tuple[int, int, int], int, int, int]] = {
    # name: (input_shape, num_classes, train size, test size)
    "synthetic-cifar10": ((3, 32, 32), 10, 50_000, 10_000),
    "synthetic-imagenet": ((3, 224, 224), 1000, 12_800, 1_000),
}

# --------------------------------------------------------------------------------------------
# digits
# --------------------------------------------------------------------------------------------


def _load_digits_arrays() -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """The packaged digits as (images uint8 [1797, 8, 8] in 0..16, labels uint8 [1797])."""
    # importlib.resources rather than a path relative to __file__, so it also works from a wheel
    # or a zip import; read into memory because np.load needs a seekable file.
    blob = resources.files("interlace.zoo").joinpath("data/digits.npz").read_bytes()
    with np.load(io.BytesIO(blob)) as archive:
        return archive["images"], archive["labels"]


def digits_split_indices(
    labels: npt.NDArray[np.integer[Any]] | None = None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The fixed (train, test) indices into the packaged digits, each sorted ascending.

    The split is stratified: for each class in order 0..9 the class's indices are shuffled with
    one ``numpy.random.default_rng(0)`` stream and the first ``round(0.2 * count)`` go to test.
    With the packaged class counts (178, 182, 177, 183, 181, 182, 181, 179, 174, 180) that is
    1,438 training and 359 test samples. It depends on nothing else (not on any seed given to
    :func:`load_data`), so every run and every rank evaluates on the same test set.

    Args:
        labels: the digits' labels (default: the packaged ones).
    """
    if labels is None:
        labels = _load_digits_arrays()[1]
    rng = np.random.default_rng(0)
    train: list[npt.NDArray[np.int64]] = []
    test: list[npt.NDArray[np.int64]] = []
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls).astype(np.int64))
        # round() of a multiple of 0.2 never lands on .5, so there is no tie-breaking subtlety.
        n_test = round(DIGITS_TEST_FRACTION * len(members))
        test.append(members[:n_test])
        train.append(members[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


class TensorPairs(SampleDataset):
    """Samples held in memory as an inputs tensor and a labels tensor of the same length.

    Like :class:`torch.utils.data.TensorDataset` for exactly two tensors, typed as pairs.

    Args:
        inputs: the samples, stacked along the first dimension.
        labels: one class index per sample.
    """

    def __init__(self, inputs: Tensor, labels: Tensor) -> None:
        if len(inputs) != len(labels):
            raise ValueError(f"{len(inputs)} inputs but {len(labels)} labels")
        self.inputs = inputs
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Sample:
        return self.inputs[index], self.labels[index]


def _load_digits() -> DataBundle:
    images, labels = _load_digits_arrays()
    train_idx, test_idx = digits_split_indices(labels)
    pixels = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)  # [N, 1, 8, 8]
    targets = torch.from_numpy(labels.astype(np.int64))
    # Normalise with statistics of the training split only, so nothing about the test set leaks
    # into training; one scalar mean/std since the images have one channel.
    train_pixels = pixels[torch.from_numpy(train_idx)]
    mean, std = train_pixels.mean(), train_pixels.std()
    pixels = (pixels - mean) / std
    train_t, test_t = torch.from_numpy(train_idx), torch.from_numpy(test_idx)
    return DataBundle(
        name="digits",
        train=TensorPairs(pixels[train_t], targets[train_t]),
        test=TensorPairs(pixels[test_t], targets[test_t]),
        input_shape=(1, 8, 8),
        num_classes=10,
    )


def _load_mnist1d(seed: int | None, train_samples: int | None) -> DataBundle:
    arrays, arguments = mnist1d_arrays(seed, train_samples=train_samples)
    # [N, 40] -> [N, 1, 40]: one channel, so 1-D convolutions take it as it is.
    return DataBundle(
        name="mnist1d",
        train=TensorPairs(arrays["x"].unsqueeze(1), arrays["y"]),
        test=TensorPairs(arrays["x_test"].unsqueeze(1), arrays["y_test"]),
        input_shape=(1, 40),
        num_classes=10,
        source={"generator": "mnist1d.data.make_dataset", **arguments},
    )


# --------------------------------------------------------------------------------------------
# synthetic
# --------------------------------------------------------------------------------------------


class SyntheticImages(SampleDataset):
    """Deterministic synthetic images, each generated on demand from ``(seed, split, index)``.

    Nothing per sample is stored, so a 12,800-image ImageNet-shaped set costs no memory, and
    sample ``i`` is bit-identical across calls, processes and machines because it is drawn from
    ``numpy.random.default_rng([seed, split, i])`` (NumPy's generators are platform-independent).

    The labels are *learnable*: sample ``i`` has a uniformly random label ``y`` and the image is
    ``template[y] + noise``, where ``template[y]`` is a fixed random 8x8 pattern per channel and
    class (drawn from ``seed`` alone, so train and test share it), blown up to the image size by
    nearest-neighbour repetition, and the noise is standard normal per pixel. A model can fit it,
    so a falling loss in a throughput run is a sign that training is wired up correctly.

    Args:
        size: samples in the data set (>= 1).
        input_shape: the image shape (channels, height, width).
        num_classes: classes (>= 1).
        seed: selects the class patterns (shared by train and test) and the samples.
        split: which split's samples to draw (0 train, 1 test).
    """

    def __init__(
        self,
        size: int,
        input_shape: tuple[int, int, int],
        num_classes: int,
        *,
        seed: int = 0,
        split: int = 0,
    ) -> None:
        if size < 1 or num_classes < 1 or seed < 0 or split < 0:
            raise UsageError(
                f"synthetic data needs size >= 1, num_classes >= 1 and seed, split >= 0; got "
                f"{size}, {num_classes}, {seed}, {split}"
            )
        self.size = size
        self.input_shape = input_shape
        self.num_classes = num_classes
        self.seed = seed
        self.split = split
        channels, height, width = input_shape
        grid_h, grid_w = min(8, height), min(8, width)
        # The last entry keeps the template stream apart from every (split, index) sample stream.
        template_rng = np.random.default_rng([seed, 2**32])
        self._templates = template_rng.standard_normal(
            (num_classes, channels, grid_h, grid_w), dtype=np.float32
        )
        self._rows = np.arange(height) * grid_h // height  # template row of each image row
        self._cols = np.arange(width) * grid_w // width

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Sample:
        if index < 0:
            index += self.size
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} samples")
        rng = np.random.default_rng([self.seed, self.split, int(index)])
        label = int(rng.integers(self.num_classes))
        image = rng.standard_normal(self.input_shape, dtype=np.float32)
        image += self._templates[label][:, self._rows][:, :, self._cols]
        return torch.from_numpy(image), torch.tensor(label, dtype=torch.int64)


def _load_synthetic(name: str, synthetic_size: int | None, seed: int) -> DataBundle:
    input_shape, num_classes, train_size, test_size = _SYNTHETIC[name]
    if synthetic_size is not None:
        if synthetic_size < 1:
            raise UsageError(f"synthetic_size must be >= 1, got {synthetic_size}")
        train_size, test_size = synthetic_size, max(1, synthetic_size // 5)
    if seed < 0:
        raise UsageError(f"seed must be >= 0 for synthetic data, got {seed}")
    return DataBundle(
        name=name,
        train=SyntheticImages(train_size, input_shape, num_classes, seed=seed, split=0),
        test=SyntheticImages(test_size, input_shape, num_classes, seed=seed, split=1),
        input_shape=input_shape,
        num_classes=num_classes,
    )


# --------------------------------------------------------------------------------------------
# CIFAR-10 folder
# --------------------------------------------------------------------------------------------


class CifarDataset(SampleDataset):
    """CIFAR-10 images held as uint8 and normalised per sample with the standard channel stats.

    Keeping uint8 (150 MiB for the training set instead of 600 MiB as float32) matters when
    every rank on a machine holds its own copy.

    Args:
        images: uint8 images [N, 3, 32, 32].
        labels: one class index per image.
    """

    def __init__(self, images: npt.NDArray[np.uint8], labels: npt.NDArray[np.int64]) -> None:
        self.images = torch.from_numpy(images)  # [N, 3, 32, 32] uint8
        self.labels = torch.from_numpy(labels)  # [N] int64
        self._mean = torch.tensor(CIFAR10_MEAN).view(3, 1, 1)
        self._std = torch.tensor(CIFAR10_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Sample:
        image = self.images[index].to(torch.float32).div_(255.0)
        return (image - self._mean) / self._std, self.labels[index]


def _expected_cifar_note() -> str:
    return (
        f"a CIFAR-10 python-format folder holds {', '.join(CIFAR10_TRAIN_FILES)} and "
        f"{CIFAR10_TEST_FILE} (the folder 'cifar-10-batches-py' from cifar-10-python.tar.gz, or "
        f"the folder containing it); built-in data sets are {', '.join(DATA_NAMES)}"
    )


def _read_cifar_batch(path: Path) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """Read one CIFAR-10 batch file: images uint8 [N, 3, 32, 32] and labels int64 [N]."""
    try:
        with path.open("rb") as handle:
            # The official format is a pickle; only point this at files you trust.
            batch = pickle.load(handle, encoding="bytes")
        # Official files have bytes keys; accept str keys too, for re-pickled copies.
        data = np.asarray(batch.get(b"data", batch.get("data")), dtype=np.uint8)
        labels = np.asarray(batch.get(b"labels", batch.get("labels")), dtype=np.int64)
    except Exception as exc:
        raise UsageError(
            f"cannot read CIFAR-10 batch {path}: {type(exc).__name__}: {exc}; "
            "expected a pickled dict with b'data' (uint8 [N, 3072]) and b'labels' (N ints)"
        ) from exc
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.shape != (data.shape[0],):
        raise UsageError(
            f"CIFAR-10 batch {path} has data of shape {data.shape} and {labels.size} labels; "
            "expected data uint8 [N, 3072] and N labels"
        )
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise UsageError(f"CIFAR-10 batch {path} has labels outside 0..9")
    return data.reshape(-1, 3, 32, 32), labels


def _load_cifar_folder(spec: str) -> DataBundle:
    folder = Path(spec).expanduser()
    if not folder.exists():
        raise UsageError(
            f"unknown data set {spec!r}: not a built-in name and no such path; "
            f"{_expected_cifar_note()}"
        )
    if not folder.is_dir():
        raise UsageError(
            f"data set path {str(folder)!r} is a file, not a folder (extract the archive first); "
            f"{_expected_cifar_note()}"
        )
    if (folder / "cifar-10-batches-py").is_dir():
        folder = folder / "cifar-10-batches-py"
    expected = (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE)
    missing = [name for name in expected if not (folder / name).is_file()]
    if missing:
        raise UsageError(
            f"data set folder {str(folder)!r} lacks {', '.join(missing)}; {_expected_cifar_note()}"
        )
    parts = [_read_cifar_batch(folder / name) for name in CIFAR10_TRAIN_FILES]
    train_images = np.concatenate([images for images, _ in parts])
    train_labels = np.concatenate([labels for _, labels in parts])
    test_images, test_labels = _read_cifar_batch(folder / CIFAR10_TEST_FILE)
    return DataBundle(
        name="cifar10",
        train=CifarDataset(train_images, train_labels),
        test=CifarDataset(test_images, test_labels),
        input_shape=(3, 32, 32),
        num_classes=10,
    )


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def model_shape(
    data: str, input_shape: tuple[int, ...] | None, classes: int | None
) -> tuple[tuple[int, ...], int]:
    """The sample shape and class count a model is built for: those given, the rest from
    ``data`` (a synthetic set is made small, since only its sizes are read).

    Args:
        data: A data set name, as ``--data`` takes it.
        input_shape: ``--input-shape``, or None.
        classes: ``--classes``, or None.
    """
    if input_shape is not None and classes is not None:
        return tuple(input_shape), classes
    bundle = load_data(data, synthetic_size=64 if data.startswith("synthetic") else None)
    return tuple(input_shape or bundle.input_shape), classes or bundle.num_classes


def load_data(
    spec: str,
    *,
    synthetic_size: int | None = None,
    seed: int = 0,
    data_seed: int | None = None,
    seq_len: int | None = None,
    data_file: str | None = None,
) -> DataBundle:
    """Load the data set named by ``spec``: a name in :data:`DATA_NAMES` or a CIFAR-10 folder.

    ``digits``: float32 [1, 8, 8] images scaled to [0, 1] then normalised by the training split's
    scalar mean and std, int64 labels, with the fixed split of :func:`digits_split_indices`
    (1,438 train / 359 test) whatever ``seed`` is.

    ``mnist1d``: float32 [1, 40] sequences, 4,000 train / 1,000 test, 10 classes, generated by
    the ``mnist1d`` package (an optional dependency) with the paper's arguments and cached; see
    :func:`interlace.zoo.mnist1d.mnist1d_arrays`. ``data_seed`` replaces the generator's seed
    (42, the paper's data set) and ``synthetic_size`` the number of training sequences (the
    test split gets a quarter as many); the bundle's ``source`` records the arguments.

    ``synthetic-cifar10`` ([3, 32, 32], 10 classes, 50,000 / 10,000 samples) and
    ``synthetic-imagenet`` ([3, 224, 224], 1000 classes, 12,800 / 1,000 samples): see
    :class:`SyntheticImages`. ``synthetic_size`` replaces the training size, and the test size
    becomes ``max(1, synthetic_size // 5)``; ``seed`` selects the samples.

    ``pydoc-topics`` (packaged) and ``text`` (the file ``data_file``): a corpus of byte tokens
    (256 classes) cut into :class:`TokenWindows` of ``seq_len`` tokens (default 128), the last
    tenth of its bytes held out as the test split (:func:`interlace.zoo.text.split_tokens`).

    Anything else is a path to a CIFAR-10 python-format folder (``data_batch_1`` ..
    ``data_batch_5`` and ``test_batch``) or the folder containing ``cifar-10-batches-py``;
    images are normalised with :data:`CIFAR10_MEAN` / :data:`CIFAR10_STD`.

    Args:
        spec: digits, mnist1d, synthetic-cifar10, synthetic-imagenet, pydoc-topics, text, or a
            CIFAR-10 folder.
        synthetic_size: training samples of a generated data set (synthetic or mnist1d).
        seed: selects a synthetic data set's samples.
        data_seed: the seed of a generated data set (mnist1d); None keeps its default.
        seq_len: tokens per sample of a text corpus (None: 128).
        data_file: the text file of ``spec`` ``"text"``.

    Raises :class:`~interlace.errors.UsageError` for a path that does not exist or lacks batch
    files, for ``synthetic_size`` given with a data set that is not synthetic, for a text file
    that is missing or empty, and for ``seq_len`` or ``data_file`` given with data that is not
    text.
    """
    if spec in (*TEXT_NAMES, TEXT_FILE):
        if synthetic_size is not None or data_seed is not None:
            raise UsageError(f"synthetic_size and data_seed do not apply to text data {spec!r}")
        return load_text(spec, data_file=data_file, seq_len=seq_len)
    if data_file is not None:
        raise UsageError(f"--data-file is the file of --data text, not of --data {spec}")
    if seq_len is not None:
        raise UsageError(f"--seq-len applies to text data ({', '.join(TEXT_NAMES)}, text)")
    if spec in _SYNTHETIC:
        return _load_synthetic(spec, synthetic_size, seed)
    if data_seed is not None and spec != "mnist1d":
        raise UsageError(f"data_seed applies only to mnist1d, not to data set {spec!r}")
    if spec == "mnist1d":
        return _load_mnist1d(data_seed, synthetic_size)
    if synthetic_size is not None:
        raise UsageError(
            f"synthetic_size applies only to {', '.join(_SYNTHETIC)} and mnist1d, not to data "
            f"set {spec!r}"
        )
    if spec == "digits":
        return _load_digits()
    return _load_cifar_folder(spec)


def make_loader(
    dataset: Dataset[Any],
    batch_size: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    num_workers: int = 0,
) -> DataLoader[Any]:
    """A DataLoader over this rank's shard of ``dataset``.

    Sharding is :class:`torch.utils.data.DistributedSampler`'s, built with ``num_replicas`` and
    ``rank`` given explicitly so no process group is needed: each epoch the indices are shuffled
    with ``seed + epoch`` (the same order on every rank) and rank ``r`` takes every
    ``world_size``-th index starting at ``r``. Without ``drop_last`` the index list is padded by
    repeating its start so every rank gets ``ceil(len / world_size)`` samples, hence the same
    number of steps (a rank with fewer steps would leave the others waiting in a collective).
    With ``drop_last`` the tail is dropped instead, giving ``len // world_size`` samples each, and
    the loader also drops a final partial batch, so every batch has exactly ``batch_size``.

    Call ``loader.sampler.set_epoch(epoch)`` before each epoch for a fresh shuffle.

    Args:
        dataset: the whole data set, the same on every rank.
        batch_size: samples per batch (>= 1).
        rank: this rank's index in [0, world_size).
        world_size: ranks sharing the data set.
        shuffle: shuffle the indices each epoch.
        seed: the base seed of the shuffle.
        drop_last: drop the tail that does not split evenly, and a final partial batch.
        num_workers: DataLoader worker processes.
    """
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1:
        raise UsageError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise UsageError(
            f"rank must be in 0..{world_size - 1} for world_size {world_size}, got {rank}"
        )
    if num_workers < 0:
        raise UsageError(f"num_workers must be >= 0, got {num_workers}")
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        num_workers=num_workers,
    )
