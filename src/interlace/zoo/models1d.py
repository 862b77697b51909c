"""1-D models for sequence data such as MNIST-1D: the paper's MLP and CNN, and a small ResNet.

Each takes ``[batch, channels, length]`` inputs (a ``[batch, length]`` input is one channel).
"""

from __future__ import annotations

from typing import cast

from torch import Tensor, nn

from interlace.errors import UsageError

__all__ = ["CNN1d", "MLP1d", "ResNet1d"]


def _sequence_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, int]:
    if len(input_shape) == 1:
        return 1, input_shape[0]
    if len(input_shape) == 2:
        return input_shape[0], input_shape[1]
    raise UsageError(
        f"{name} takes sequences of shape (length,) or (channels, length), got {input_shape}; "
        "pass --input-shape 1,40 for MNIST-1D"
    )


def _as_channels(x: Tensor) -> Tensor:
    return x.unsqueeze(1) if x.dim() == 2 else x


class MLP1d(nn.Module):
    """The MNIST-1D paper's MLP: flatten, two hidden layers of 100 with ReLU, a linear head.

    Args:
        input_shape: one sample's shape, ``(length,)`` or ``(channels, length)``.
        num_classes: outputs of the head.
        width: features of each hidden layer.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 100) -> None:
        super().__init__()
        channels, length = _sequence_shape("mlp1d", input_shape)
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels * length, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[batch, num_classes]``.

        Args:
            x: a batch of sequences.
        """
        out: Tensor = self.net(x)
        return out

    def pipeline_blocks(self) -> list[nn.Module]:
        """Blocks for pipeline stages: each hidden layer with its ReLU, then the head."""
        layers = list(self.net)
        return [nn.Sequential(*layers[:3]), nn.Sequential(*layers[3:5]), layers[5]]


class CNN1d(nn.Module):
    """The MNIST-1D paper's CNN: three strided 1-D convolutions of 25 channels, a linear head.

    Kernel 5 then 3 and 3, stride 2, padding 1, ReLU after each: length 40 becomes 19, 10, 5,
    so the head sees ``25 * 5 = 125`` features.

    Args:
        input_shape: one sample's shape, ``(length,)`` or ``(channels, length)``.
        num_classes: outputs of the head.
        channels: channels of every convolution.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, channels: int = 25) -> None:
        super().__init__()
        in_channels, length = _sequence_shape("cnn1d", input_shape)
        self.features = nn.Sequential(
            nn.Conv1d(in_channels, channels, 5, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(channels, channels, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        for kernel in (5, 3, 3):
            length = (length + 2 - kernel) // 2 + 1
        if length < 1:
            raise UsageError(f"cnn1d needs sequences of length >= 6, got {input_shape}")
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(channels * length, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[batch, num_classes]``.

        Args:
            x: a batch of sequences.
        """
        out: Tensor = self.head(self.features(_as_channels(x)))
        return out

    def pipeline_blocks(self) -> list[nn.Module]:
        """Blocks for pipeline stages: each convolution with its ReLU, then the head.

        The first block also adds the channel dimension to a ``[batch, length]`` input.
        """
        layers = list(self.features)
        first = nn.Sequential(_Channels(), *layers[:2])
        return [first, nn.Sequential(*layers[2:4]), nn.Sequential(*layers[4:6]), self.head]


class _Channels(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return _as_channels(x)


class _Block1d(nn.Module):
    """Two kernel-3 convolutions with batch norm and an identity (or 1x1 strided) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm1d(out_channels)
        self.conv2 = nn.Conv1d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm1d(out_channels)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv1d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm1d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        result: Tensor = self.relu(out + self.shortcut(x))
        return result


class ResNet1d(nn.Module):
    """A small 1-D ResNet: a stem, three stages of two residual blocks, global pooling, a head.

    Stages of 32, 64 and 128 channels, the last two halving the length: about 0.2 M parameters.

    Args:
        input_shape: one sample's shape, ``(length,)`` or ``(channels, length)``.
        num_classes: outputs of the head.
        width: channels of the first stage (doubled by each later stage).
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 32) -> None:
        super().__init__()
        in_channels, _ = _sequence_shape("resnet1d", input_shape)
        self.stem = nn.Sequential(
            _Channels(),
            nn.Conv1d(in_channels, width, 5, 1, 2, bias=False),
            nn.BatchNorm1d(width),
            nn.ReLU(),
        )
        stages: list[nn.Module] = []
        channels = width
        for index in range(3):
            out_channels = width * 2**index
            stride = 1 if index == 0 else 2
            blocks = [_Block1d(channels, out_channels, stride)]
            blocks.append(_Block1d(out_channels, out_channels, 1))
            stages.append(nn.Sequential(*blocks))
            channels = out_channels
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(channels, num_classes)
        )
        for module in self.modules():
            if isinstance(module, nn.Conv1d):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
        # Last batch norm of each block starts at zero: each block starts as the identity.
        for module in self.modules():
            if isinstance(module, _Block1d):
                nn.init.zeros_(module.bn2.weight)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[batch, num_classes]``.

        Args:
            x: a batch of sequences.
        """
        out: Tensor = self.head(self.stages(self.stem(x)))
        return out

    def pipeline_blocks(self) -> list[nn.Module]:
        """Blocks for pipeline stages: the stem, each residual block, the head."""
        blocks: list[nn.Module] = [self.stem]
        for stage in self.stages:
            blocks += list(cast(nn.Sequential, stage))
        blocks.append(self.head)
        return blocks
