"""Tests for the zoo data sets and the per-rank loaders."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler

import interlace.zoo
from interlace.errors import UsageError
from interlace.zoo import DATA_NAMES, DataBundle, load_data, make_loader, model_shape
from interlace.zoo.data import CIFAR10_MEAN, CIFAR10_STD, SampleDataset, digits_split_indices

DIGITS_NPZ = Path(interlace.zoo.__file__).parent / "data" / "digits.npz"


def raw_digits() -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    with np.load(DIGITS_NPZ) as archive:
        return archive["images"], archive["labels"]


def stack(dataset: SampleDataset) -> tuple[Tensor, Tensor]:
    items = [dataset[i] for i in range(len(dataset))]
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


# --------------------------------------------------------------------------------------------
# digits
# --------------------------------------------------------------------------------------------


def test_digits_shapes_sizes_and_dtypes() -> None:
    bundle = load_data("digits")
    assert bundle.name == "digits"
    assert bundle.input_shape == (1, 8, 8)
    assert bundle.num_classes == 10
    assert (len(bundle.train), len(bundle.test)) == (1438, 359)
    assert len(bundle.train) + len(bundle.test) == 1797
    x, y = bundle.train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32
    assert y.shape == () and y.dtype == torch.int64


def test_digits_split_is_stratified_with_20_percent_test_per_class() -> None:
    _, labels = raw_digits()
    _, test_labels = stack(load_data("digits").test)
    test_counts = Counter(test_labels.tolist())
    for cls, count in enumerate(np.bincount(labels)):
        # 20% rounded to nearest: n/5 is never exactly k + 1/2, so (2n + 5) // 10 is unambiguous.
        assert test_counts[cls] == (2 * int(count) + 5) // 10, cls


def test_digits_train_and_test_are_disjoint_and_cover_the_raw_data() -> None:
    images, labels = raw_digits()
    bundle = load_data("digits")
    train_x, train_y = stack(bundle.train)
    test_x, test_y = stack(bundle.test)
    # Undo the normalisation with statistics computed here from the raw training pixels.
    train_idx, _ = digits_split_indices()
    scaled_train = images[train_idx].astype(np.float64) / 16.0
    mean, std = scaled_train.mean(), scaled_train.std(ddof=1)

    def raw_rows(x: Tensor, y: Tensor) -> set[bytes]:
        pixels = np.rint((x.double().numpy() * std + mean) * 16.0)
        assert np.abs(pixels - np.rint(pixels)).max() == 0
        return {
            bytes(row.astype(np.uint8).tobytes()) + bytes([int(label)])
            for row, label in zip(pixels.reshape(len(x), 64), y.tolist(), strict=True)
        }

    train_rows, test_rows = raw_rows(train_x, train_y), raw_rows(test_x, test_y)
    all_rows = {
        bytes(row.tobytes()) + bytes([int(label)])
        for row, label in zip(images.reshape(-1, 64), labels, strict=True)
    }
    assert len(all_rows) == 1797  # every raw image is distinct, so rows identify samples
    assert len(train_rows) == 1438 and len(test_rows) == 359
    assert not train_rows & test_rows
    assert train_rows | test_rows == all_rows


def test_digits_normalised_by_train_statistics() -> None:
    train_x, _ = stack(load_data("digits").train)
    assert abs(train_x.mean().item()) < 1e-5
    assert abs(train_x.std().item() - 1.0) < 1e-5
    test_x, _ = stack(load_data("digits").test)
    assert abs(test_x.mean().item()) < 0.1  # same distribution, but not exactly 0


def test_digits_deterministic_and_independent_of_seed() -> None:
    first, second, seeded = load_data("digits"), load_data("digits"), load_data("digits", seed=7)
    for split in ("train", "test"):
        x1, y1 = stack(getattr(first, split))
        for other in (second, seeded):
            x2, y2 = stack(getattr(other, split))
            assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_digits_split_indices_partition_the_data() -> None:
    train_idx, test_idx = digits_split_indices()
    assert np.all(np.diff(train_idx) > 0) and np.all(np.diff(test_idx) > 0)
    assert np.array_equal(np.union1d(train_idx, test_idx), np.arange(1797))
    assert np.intersect1d(train_idx, test_idx).size == 0
    # The test split is not simply the first or last samples of each class.
    assert test_idx.min() < 20 and test_idx.max() > 1777


# --------------------------------------------------------------------------------------------
# make_loader
# --------------------------------------------------------------------------------------------


class Indices(Dataset[int]):
    """A data set whose sample i is the integer i, to see which samples a rank receives."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def served(loader: torch.utils.data.DataLoader[int]) -> list[int]:
    return [int(i) for batch in loader for i in batch]


def test_four_ranks_cover_the_train_set_with_distributed_sampler_padding() -> None:
    n, world = len(load_data("digits").train), 4
    assert n == 1438  # 1438 = 4 * 359 + 2, so two samples are repeated to make 4 * 360
    loaders = [make_loader(Indices(n), 64, rank=r, world_size=world, seed=3) for r in range(world)]
    shards = [served(loader) for loader in loaders]
    assert [len(s) for s in shards] == [360] * 4
    assert [len(loader) for loader in loaders] == [6] * 4  # ceil(360 / 64)
    counts = Counter(i for shard in shards for i in shard)
    assert set(counts) == set(range(n))
    repeated = sorted(i for i, c in counts.items() if c > 1)
    assert len(repeated) == 2 and all(counts[i] == 2 for i in repeated)
    # DistributedSampler semantics: one permutation from seed + epoch shared by all ranks, padded
    # with its own head, rank r taking positions r, r + world, ...
    order = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()
    padded = order + order[: 4 * 360 - n]
    assert shards == [padded[r::world] for r in range(world)]
    assert sorted(repeated) == sorted(order[:2])
    for shard in shards:
        assert len(set(shard)) == len(shard)  # no rank sees a sample twice in one epoch


def test_drop_last_gives_disjoint_equal_shards_and_full_batches() -> None:
    n, world = 1438, 4
    loaders = [
        make_loader(Indices(n), 32, rank=r, world_size=world, drop_last=True) for r in range(world)
    ]
    shards = [served(loader) for loader in loaders]
    for loader in loaders:
        assert all(len(batch) == 32 for batch in loader)  # 359 // 32 = 11 full batches
        assert len(loader) == 11
    flat = [i for shard in shards for i in shard]
    assert len(flat) == len(set(flat)) == 4 * 11 * 32


def test_set_epoch_reshuffles_and_shuffle_false_keeps_order() -> None:
    loader = make_loader(Indices(100), 10, rank=1, world_size=2, seed=0)
    assert isinstance(loader.sampler, DistributedSampler)
    epoch0, epoch0_again = served(loader), served(loader)
    loader.sampler.set_epoch(1)
    epoch1 = served(loader)
    assert epoch0 == epoch0_again
    assert epoch0 != epoch1 and sorted(epoch0) != sorted(range(50))
    ordered = make_loader(Indices(10), 4, rank=1, world_size=3, shuffle=False)
    assert served(ordered) == [1, 4, 7, 0]  # 10 padded to 12 by repeating index 0, 1


def test_loader_over_digits_yields_typed_batches() -> None:
    batch_x, batch_y = next(iter(make_loader(load_data("digits").train, 16)))
    assert batch_x.shape == (16, 1, 8, 8) and batch_x.dtype == torch.float32
    assert batch_y.shape == (16,) and batch_y.dtype == torch.int64


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 8, "rank": 4, "world_size": 4}, "rank"),
        ({"batch_size": 8, "rank": -1, "world_size": 4}, "rank"),
        ({"batch_size": 8, "world_size": 0}, "world_size"),
        ({"batch_size": 8, "num_workers": -1}, "num_workers"),
    ],
)
def test_make_loader_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        make_loader(Indices(10), **kwargs)


# --------------------------------------------------------------------------------------------
# synthetic
# --------------------------------------------------------------------------------------------


# Prints a digest of one synthetic sample; run both here and in a fresh interpreter.
DIGEST_SCRIPT = """
import hashlib
from interlace.zoo import load_data
x, y = load_data("synthetic-imagenet", seed=5, synthetic_size=1000).train[123]
print(hashlib.sha256(x.numpy().tobytes()).hexdigest(), int(y))
"""


@pytest.mark.parametrize(
    ("name", "shape", "classes", "sizes"),
    [
        ("synthetic-cifar10", (3, 32, 32), 10, (50_000, 10_000)),
        ("synthetic-imagenet", (3, 224, 224), 1000, (12_800, 1_000)),
    ],
)
def test_synthetic_shapes_dtypes_and_default_sizes(
    name: str, shape: tuple[int, ...], classes: int, sizes: tuple[int, int]
) -> None:
    bundle = load_data(name)
    assert isinstance(bundle, DataBundle)
    assert (bundle.name, bundle.input_shape, bundle.num_classes) == (name, shape, classes)
    assert (len(bundle.train), len(bundle.test)) == sizes
    for dataset in (bundle.train, bundle.test):
        x, y = dataset[len(dataset) - 1]
        assert x.shape == shape and x.dtype == torch.float32
        assert y.shape == () and y.dtype == torch.int64 and 0 <= int(y) < classes


def test_synthetic_size_override() -> None:
    bundle = load_data("synthetic-cifar10", synthetic_size=100)
    assert (len(bundle.train), len(bundle.test)) == (100, 20)
    tiny = load_data("synthetic-imagenet", synthetic_size=3)
    assert (len(tiny.train), len(tiny.test)) == (3, 1)
    with pytest.raises(IndexError):
        tiny.train[3]
    assert torch.equal(tiny.train[-1][0], tiny.train[2][0])


def test_synthetic_is_deterministic_per_seed_and_index() -> None:
    a = load_data("synthetic-cifar10", seed=1)
    b = load_data("synthetic-cifar10", seed=1)
    c = load_data("synthetic-cifar10", seed=2)
    for i in (0, 17, 49_999):
        assert torch.equal(a.train[i][0], b.train[i][0]) and torch.equal(
            a.train[i][1], b.train[i][1]
        )
        assert not torch.equal(a.train[i][0], c.train[i][0])
    assert not torch.equal(a.train[5][0], a.train[6][0])
    assert not torch.equal(a.train[5][0], a.test[5][0])
    # The override only changes the length, not the samples.
    assert torch.equal(
        load_data("synthetic-cifar10", seed=1, synthetic_size=10).train[3][0], a.train[3][0]
    )


def test_synthetic_samples_identical_in_another_process(
    capsys: pytest.CaptureFixture[str],
) -> None:
    other = subprocess.run(
        [sys.executable, "-c", DIGEST_SCRIPT],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    exec(DIGEST_SCRIPT, {})
    assert other == capsys.readouterr().out
    assert len(other.split()) == 2


def test_synthetic_loader_workers_match_the_main_process() -> None:
    dataset = load_data("synthetic-cifar10", synthetic_size=64).train
    inline = list(make_loader(dataset, 16, seed=4))
    workers = list(make_loader(dataset, 16, seed=4, num_workers=2))
    assert len(inline) == len(workers) == 4
    for (x1, y1), (x2, y2) in zip(inline, workers, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_synthetic_labels_are_learnable() -> None:
    bundle = load_data("synthetic-cifar10", synthetic_size=1000, seed=3)
    train_x, train_y = stack(bundle.train)
    test_x, test_y = stack(bundle.test)
    # A nearest-class-mean classifier, the simplest learner there is, should do far above chance.
    means = torch.stack([train_x[train_y == c].mean(0) for c in range(10)]).flatten(1)
    predicted = torch.cdist(test_x.flatten(1), means).argmin(1)
    assert (predicted == test_y).float().mean().item() > 0.9
    assert set(train_y.tolist()) == set(range(10))


# --------------------------------------------------------------------------------------------
# CIFAR-10 folder
# --------------------------------------------------------------------------------------------


def write_fake_cifar(
    folder: Path, per_batch: int = 20
) -> dict[str, tuple[npt.NDArray[np.uint8], list[int]]]:
    """Write a CIFAR-10 python-format folder with ``per_batch`` images per batch file."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written: dict[str, tuple[npt.NDArray[np.uint8], list[int]]] = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=per_batch)]
        with (folder / name).open("wb") as handle:
            pickle.dump({b"batch_label": name.encode(), b"data": data, b"labels": labels}, handle)
        written[name] = (data, labels)
    return written


def expected_image(row: npt.NDArray[np.uint8]) -> npt.NDArray[np.float64]:
    # The row holds 1024 red, then 1024 green, then 1024 blue values, each 32x32 row-major.
    image = row.reshape(3, 32, 32).astype(np.float64) / 255.0
    mean = np.array(CIFAR10_MEAN).reshape(3, 1, 1)
    std = np.array(CIFAR10_STD).reshape(3, 1, 1)
    normalised: npt.NDArray[np.float64] = (image - mean) / std
    return normalised


@pytest.mark.parametrize("use_parent", [False, True])
def test_cifar_folder(tmp_path: Path, use_parent: bool) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    written = write_fake_cifar(folder)
    bundle = load_data(str(tmp_path if use_parent else folder))
    assert (bundle.name, bundle.input_shape, bundle.num_classes) == ("cifar10", (3, 32, 32), 10)
    assert (len(bundle.train), len(bundle.test)) == (100, 20)
    # Sample 47 is the 8th image of data_batch_3; test sample 5 is the 6th of test_batch.
    for dataset, index, batch, row in (
        (bundle.train, 47, "data_batch_3", 7),
        (bundle.test, 5, "test_batch", 5),
    ):
        x, y = dataset[index]
        assert x.dtype == torch.float32 and x.shape == (3, 32, 32)
        np.testing.assert_allclose(x.numpy(), expected_image(written[batch][0][row]), atol=1e-5)
        assert y.dtype == torch.int64 and int(y) == written[batch][1][row]
    _, train_y = stack(bundle.train)
    all_train_labels = [v for i in range(1, 6) for v in written[f"data_batch_{i}"][1]]
    assert train_y.tolist() == all_train_labels


def test_cifar_missing_path_names_the_path_files_and_builtin_names(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(UsageError) as info:
        load_data(str(missing))
    message = str(info.value)
    for fragment in (str(missing), "data_batch_1", "data_batch_5", "test_batch", *DATA_NAMES):
        assert fragment in message


def test_cifar_folder_missing_batches(tmp_path: Path) -> None:
    folder = tmp_path / "cifar"
    write_fake_cifar(folder, per_batch=2)
    (folder / "test_batch").unlink()
    (folder / "data_batch_4").unlink()
    with pytest.raises(UsageError) as info:
        load_data(str(folder))
    message = str(info.value)
    assert str(folder) in message and "lacks data_batch_4, test_batch" in message
    for name in DATA_NAMES:
        assert name in message


def test_cifar_bad_inputs(tmp_path: Path) -> None:
    archive = tmp_path / "cifar-10-python.tar.gz"
    archive.write_bytes(b"not a folder")
    with pytest.raises(UsageError, match="not a folder"):
        load_data(str(archive))
    folder = tmp_path / "cifar"
    write_fake_cifar(folder, per_batch=2)
    (folder / "data_batch_2").write_bytes(b"garbage")
    with pytest.raises(UsageError, match="data_batch_2"):
        load_data(str(folder))
    with (folder / "data_batch_2").open("wb") as handle:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, handle)
    with pytest.raises(UsageError, match="3072"):
        load_data(str(folder))


def test_synthetic_size_validation() -> None:
    with pytest.raises(UsageError, match="synthetic_size"):
        load_data("digits", synthetic_size=10)
    with pytest.raises(UsageError, match="synthetic_size"):
        load_data("synthetic-cifar10", synthetic_size=0)
    with pytest.raises(UsageError, match="seed"):
        load_data("synthetic-cifar10", seed=-1)


def test_model_shape_takes_what_is_given_and_the_rest_from_the_data() -> None:
    assert model_shape("digits", (3, 5), 7) == ((3, 5), 7)
    digits = load_data("digits")
    assert model_shape("digits", None, None) == (tuple(digits.input_shape), digits.num_classes)
    assert model_shape("digits", None, 4) == (tuple(digits.input_shape), 4)
    assert model_shape("synthetic-cifar10", None, None) == ((3, 32, 32), 10)
