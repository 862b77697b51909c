"""What every data set of the zoo is: ``(input, target)`` samples, and a bundle of two splits."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["DataBundle", "Sample", "SampleDataset"]

Sample = tuple[Tensor, Tensor]


class SampleDataset(Dataset[Sample], abc.ABC):
    """A map-style data set of ``(input, label)`` pairs with a known length.

    :class:`torch.utils.data.Dataset` itself declares no ``__len__``, so ``len(bundle.train)``
    would not type-check against it; every data set :func:`load_data` returns is one of these.
    """

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @abc.abstractmethod
    def __getitem__(self, index: int) -> Sample:
        """Sample ``index``: an input tensor and a 0-d int64 label tensor."""


@dataclass(frozen=True)
class DataBundle:
    """A data set's train and test splits and the shapes a model needs to be built for it.

    ``input_shape`` is one sample's shape without the batch dimension; every split yields
    ``(input float32 [*input_shape], label int64 [])`` pairs.

    Args:
        name: the data set's name.
        train: the training split.
        test: the test split.
        input_shape: the shape of one sample, e.g. (3, 32, 32).
        num_classes: how many classes the labels run over.
        source: how a generated data set was made (its generator's arguments), for the run's
            record; empty for fixed data.
    """

    name: str
    train: SampleDataset
    test: SampleDataset
    input_shape: tuple[int, ...]
    num_classes: int
    source: dict[str, Any] = field(default_factory=dict)
