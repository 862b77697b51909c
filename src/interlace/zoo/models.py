"""The model zoo: reference networks that span the shapes distributed training cares about.

``mlp``, ``resnet20/32/56``, ``vgg11`` and ``transformer``, each adapting to the input shape it
is given, ``mlp1d``, ``cnn1d`` and ``resnet1d`` for sequences (MNIST-1D), and ``gpt``, a causal
language model over token ids;
:func:`build_model` also accepts a user's ``package.module:callable``.
"""

from __future__ import annotations

import importlib
import inspect
import math
import operator
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import Tensor, nn

from interlace.errors import UsageError
from interlace.zoo.gpt import GPT
from interlace.zoo.models1d import CNN1d, MLP1d, ResNet1d
from interlace.zoo.transformer import PatchTransformer

__all__ = [
    "GPT",
    "MLP",
    "MODEL_NAMES",
    "VGG11",
    "CifarResNet",
    "ModelSummary",
    "PatchTransformer",
    "build_model",
    "summarize_model",
]

MODEL_NAMES: tuple[str, ...] = (
    "mlp",
    "resnet20",
    "resnet32",
    "resnet56",
    "vgg11",
    "transformer",
    "mlp1d",
    "cnn1d",
    "resnet1d",
    "gpt",
)


def _image_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """Check that ``input_shape`` is ``(channels, height, width)`` and return it."""
    if len(input_shape) != 3:
        raise UsageError(
            f"model {name!r} needs an image input shape (channels, height, width), "
            f"got {input_shape}"
        )
    channels, height, width = input_shape
    return channels, height, width


# --------------------------------------------------------------------------------------------
# mlp
# --------------------------------------------------------------------------------------------


class MLP(nn.Module):
    """A deep, narrow multilayer perceptron: flatten, ``depth`` hidden layers, a linear head.

    With the defaults (12 hidden layers of width 128) it has 26 parameter tensors of at most
    64 KiB each on digits, which makes gradient communication latency-bound: the case that
    bucketing small tensors together is meant to fix. The first layer takes the whole flattened
    input, so on 224x224 images it alone holds ``3*224*224*128`` weights.

    Args:
        input_shape: one sample's shape (flattened at the input).
        num_classes: outputs of the head.
        width: features of every hidden layer.
        depth: hidden layers.
    """

    def __init__(
        self, input_shape: tuple[int, ...], num_classes: int, *, width: int = 128, depth: int = 12
    ) -> None:
        super().__init__()
        if depth < 1 or width < 1:
            raise UsageError(f"MLP needs depth >= 1 and width >= 1, got {depth} and {width}")
        layers: list[nn.Module] = [nn.Flatten()]
        features = math.prod(input_shape)
        for _ in range(depth):
            hidden = nn.Linear(features, width)
            # He initialisation: PyTorch's default Linear init shrinks activations layer after
            # layer, and twelve of them leave the network unable to learn at all.
            nn.init.kaiming_normal_(hidden.weight, nonlinearity="relu")
            nn.init.zeros_(hidden.bias)
            layers += [hidden, nn.ReLU(inplace=True)]
            features = width
        layers.append(nn.Linear(features, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``[batch, num_classes]`` for inputs of shape ``[batch, *input_shape]``.

        Args:
            x: a batch of samples.
        """
        out: Tensor = self.net(x)
        return out

    def pipeline_blocks(self) -> list[nn.Module]:
        """Blocks for pipeline stages: each Linear+ReLU (the first with the flatten), the head.

        The blocks hold this model's own layers, so they share its parameters.
        """
        layers = list(self.net)
        blocks: list[nn.Module] = [nn.Sequential(*layers[:3])]  # flatten, linear, relu
        blocks += [nn.Sequential(*layers[i : i + 2]) for i in range(3, len(layers) - 1, 2)]
        blocks.append(layers[-1])
        return blocks


# --------------------------------------------------------------------------------------------
# CIFAR ResNets
# --------------------------------------------------------------------------------------------


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (He et al. 2016, fig. 2).

    Where the block changes the channel count or the resolution the shortcut is a 1x1 convolution
    plus BatchNorm (a projection, option B of the paper); otherwise it is the identity.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        # No convolution biases: each convolution feeds a BatchNorm whose shift subsumes them.
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class _PoolHead(nn.Module):
    """Global average pooling, flatten and a classifier: the tail of the ResNet and VGG forwards.

    Holds the model's own modules, so a pipeline stage built from it shares their parameters.
    """

    def __init__(self, pool: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.pool = pool
        self.classifier = classifier

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.classifier(torch.flatten(self.pool(x), 1))
        return out


class CifarResNet(nn.Module):
    """The CIFAR-10 ResNet of He et al. 2016 (section 4.2), of depth ``6n + 2``.

    A 3x3 convolution to 16 channels, then three stages of ``n`` basic blocks with 16, 32 and 64
    channels (the first block of stages 2 and 3 has stride 2), global average pooling and a linear
    classifier. Depth 20, 32 and 56 give n = 3, 5 and 9.

    Shortcuts that change shape use a 1x1 convolution with BatchNorm (option B of the paper)
    rather than the zero-padded identity of option A: it is the common choice in reference code,
    and it keeps every tensor in the model a parameter or a buffer that is easy to reason about.

    The first convolution takes ``input_shape[0]`` channels. Global average pooling makes the model
    independent of resolution: 8x8 digits go 8 -> 4 -> 2 through the stages, 224x224 images
    224 -> 112 -> 56.

    Args:
        depth: 6n + 2 layers, e.g. 20, 32 or 56.
        input_shape: one image's shape (channels, height, width).
        num_classes: outputs of the head.
    """

    def __init__(self, depth: int, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6 != 0:
            raise UsageError(f"CIFAR ResNet depth must be 6n + 2 with n >= 1, got {depth}")
        channels, _, _ = _image_shape(f"resnet{depth}", input_shape)
        blocks_per_stage = (depth - 2) // 6
        self.stem = nn.Sequential(
            nn.Conv2d(channels, 16, 3, 1, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
        )
        stages: list[nn.Module] = []
        in_channels = 16
        for stage, out_channels in enumerate((16, 32, 64)):
            blocks: list[nn.Module] = []
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                blocks.append(_BasicBlock(in_channels, out_channels, stride))
                in_channels = out_channels
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                # He initialisation, as in the paper; BatchNorm and Linear keep PyTorch defaults.
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape ``[batch, num_classes]`` for images ``[batch, C, H, W]``.

        Args:
            x: a batch of images.
        """
        out = self.stages(self.stem(x))
        out = torch.flatten(self.pool(out), 1)
        logits: Tensor = self.fc(out)
        return logits

    def pipeline_blocks(self) -> list[nn.Module]:
        """Blocks for pipeline stages: the stem, each basic block, then pool+flatten+fc.

        The blocks hold this model's own modules, so they share its parameters.
        """
        blocks: list[nn.Module] = [self.stem]
        for stage in self.stages.children():
            blocks += stage.children()
        blocks.append(_PoolHead(self.pool, self.fc))
        return blocks


# --------------------------------------------------------------------------------------------
# VGG-11
# --------------------------------------------------------------------------------------------

_VGG11_CONFIG: tuple[int | str, ...] = (
    64,
    "M",
    128,
    "M",
    256,
    256,
    "M",
    512,
    512,
    "M",
    512,
    512,
    "M",
)


class VGG11(nn.Module):
    """VGG-11 with BatchNorm (configuration A of Simonyan and Zisserman 2015).

    Convolutions ``[64, M, 128, M, 256, 256, M, 512, 512, M, 512, 512, M]`` each followed by
    BatchNorm and ReLU, then adaptive average pooling to 1x1 and a classifier
    ``Linear(512, 512) - ReLU - Linear(512, 512) - ReLU - Linear(512, classes)`` (no dropout, so
    the model is deterministic). A 2x2 max-pool is skipped along a dimension that has already
    shrunk to 1, and skipped entirely once both have, so 8x8 digits work without upsampling.

    It has about 9.75M parameters on CIFAR-10 shapes, nearly all in a handful of large tensors:
    the bandwidth-bound case for gradient communication.

    Args:
        input_shape: one image's shape (channels, height, width).
        num_classes: outputs of the head.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        channels, height, width = _image_shape("vgg11", input_shape)
        layers: list[nn.Module] = []
        for item in _VGG11_CONFIG:
            if item == "M":
                kernel = (2 if height >= 2 else 1, 2 if width >= 2 else 1)
                if kernel != (1, 1):
                    layers.append(nn.MaxPool2d(kernel, kernel))
                    height //= kernel[0]
                    width //= kernel[1]
            else:
                out_channels = int(item)
                # No convolution bias: BatchNorm's shift subsumes it.
                layers += [
                    nn.Conv2d(channels, out_channels, 3, padding=1, bias=False),
                    nn.BatchNorm2d(out_channels),
                    nn.ReLU(inplace=True),
                ]
                channels = out_channels
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(512, 512),
            nn.ReLU(inplace=True),
            nn.Linear(512, 512),
            nn.ReLU(inplace=True),
            nn.Linear(512, num_classes),
        )
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape ``[batch, num_classes]`` for images ``[batch, C, H, W]``.

        Args:
            x: a batch of images.
        """
        out = torch.flatten(self.pool(self.features(x)), 1)
        logits: Tensor = self.classifier(out)
        return logits

    def pipeline_blocks(self) -> list[nn.Module]:
        """Blocks for pipeline stages: each conv+bn+relu (with a max-pool after it), then the head.

        The head is pool+flatten+classifier. The blocks hold this model's own modules, so they
        share its parameters.
        """
        groups: list[list[nn.Module]] = []
        for layer in self.features:
            if isinstance(layer, nn.Conv2d):
                groups.append([])
            groups[-1].append(layer)
        blocks: list[nn.Module] = [nn.Sequential(*group) for group in groups]
        blocks.append(_PoolHead(self.pool, self.classifier))
        return blocks


# --------------------------------------------------------------------------------------------
# Building and summarising
# --------------------------------------------------------------------------------------------


def _build_zoo_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if name == "mlp":
        return MLP(input_shape, num_classes)
    if name == "mlp1d":
        return MLP1d(input_shape, num_classes)
    if name == "cnn1d":
        return CNN1d(input_shape, num_classes)
    if name == "resnet1d":
        return ResNet1d(input_shape, num_classes)
    if name.startswith("resnet"):
        return CifarResNet(int(name.removeprefix("resnet")), input_shape, num_classes)
    if name == "vgg11":
        return VGG11(input_shape, num_classes)
    if name == "transformer":
        return PatchTransformer(input_shape, num_classes)
    if name == "gpt":
        return GPT(input_shape, num_classes)
    raise AssertionError(f"zoo name {name!r} has no builder")  # MODEL_NAMES and this disagree


def _import_factory(spec: str) -> Callable[..., Any]:
    """Resolve ``package.module:attr.path`` to a callable, raising UsageError on any failure."""
    module_name, _, attr_path = spec.partition(":")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not module_name or not attr_path:
        raise UsageError(
            f"model spec {spec!r} is not of the form 'package.module:callable' "
            "(a module to import and the name of a function or class in it that builds the model)"
        )
    # A user's own module usually sits in the folder they run from; scripts launched by path do not
    # have that folder on sys.path, so add it (first, as `python -m` does) when it is missing.
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    # The user may have just written the file; drop the finders' cached directory listings.
    importlib.invalidate_caches()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == module_name or module_name.startswith(missing + "."):
            raise UsageError(
                f"model spec {spec!r}: cannot find module {module_name!r}; check the spelling and "
                f"that it is on sys.path or in the current folder ({cwd})"
            ) from exc
        raise UsageError(
            f"model spec {spec!r}: importing module {module_name!r} failed because it needs "
            f"{missing!r}, which is not installed: {exc}"
        ) from exc
    except Exception as exc:
        raise UsageError(
            f"model spec {spec!r}: importing module {module_name!r} failed with "
            f"{type(exc).__name__}: {exc}; fix the error in that module"
        ) from exc
    target: Any = module
    walked = module_name
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise UsageError(
                f"model spec {spec!r}: {walked!r} has no attribute {part!r}; name a function or "
                f"class defined in module {module_name!r}"
            )
        target = getattr(target, part)
        walked += ("." if walked != module_name else ":") + part
    if isinstance(target, nn.Module):
        # An instance made at import time would ignore torch.manual_seed and be shared between
        # calls, so ask for the thing that builds it instead.
        raise UsageError(
            f"model spec {spec!r} names an nn.Module instance, not a callable that builds one; "
            "name its class or a function that returns a new model"
        )
    if not callable(target):
        raise UsageError(
            f"model spec {spec!r} names an object of type {type(target).__name__}, which is not "
            "callable; name a function or class that returns an nn.Module"
        )
    factory: Callable[..., Any] = target
    return factory


def _factory_kwargs(
    factory: Callable[..., Any], input_shape: tuple[int, ...], num_classes: int
) -> dict[str, Any]:
    """The keyword arguments among ``input_shape`` / ``num_classes`` that ``factory`` accepts."""
    offered: dict[str, Any] = {"input_shape": input_shape, "num_classes": num_classes}
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return {}  # no introspectable signature (some builtins): call it with no arguments
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return offered
    accepted = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {key: value for key, value in offered.items() if key in accepted}


def build_model(spec: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build a model for inputs of ``input_shape`` (no batch dimension) and ``num_classes`` classes.

    ``spec`` is a zoo name (see :data:`MODEL_NAMES`) or ``package.module:callable``, where
    ``callable`` (a dotted attribute path is allowed) is a function or class returning an
    :class:`torch.nn.Module`. The callable is passed ``input_shape=`` and ``num_classes=`` as
    keywords, each only if its signature accepts it (or has ``**kwargs``). The current working
    directory is added to ``sys.path`` when missing, so ``mymodels:net`` finds ``./mymodels.py``.

    Args:
        spec: a zoo name or package.module:callable.
        input_shape: one sample's shape, without the batch dimension.
        num_classes: classes the model predicts.

    Raises :class:`~interlace.errors.UsageError`, saying what to do, for an unknown zoo name, a
    module that cannot be imported, a missing attribute, something not callable, or a callable
    that returns something other than an nn.Module.
    """
    try:
        # operator.index accepts ints and NumPy integers but rejects floats such as 8.0.
        input_shape = tuple(operator.index(d) for d in input_shape)
        num_classes = operator.index(num_classes)
    except TypeError as exc:
        raise UsageError(
            f"input_shape must be a tuple of ints and num_classes an int, got {input_shape!r} "
            f"and {num_classes!r}"
        ) from exc
    if not input_shape or min(input_shape) < 1:
        raise UsageError(
            f"input_shape must be a non-empty tuple of positive ints, got {input_shape}"
        )
    if num_classes < 1:
        raise UsageError(f"num_classes must be >= 1, got {num_classes}")
    if ":" not in spec:
        if spec not in MODEL_NAMES:
            raise UsageError(
                f"unknown model {spec!r}; choose one of {', '.join(MODEL_NAMES)}, or give your "
                "own as 'package.module:callable' (a function or class returning an nn.Module)"
            )
        return _build_zoo_model(spec, input_shape, num_classes)
    factory = _import_factory(spec)
    kwargs = _factory_kwargs(factory, input_shape, num_classes)
    try:
        try:
            model = factory(**kwargs)
        except TypeError as exc:
            # A **kwargs factory that hands them to a class without input_shape (torchvision's
            # resnet50, vgg16, ...): call it again with num_classes alone.
            if "input_shape" not in kwargs or "input_shape" not in str(exc):
                raise
            del kwargs["input_shape"]
            model = factory(**kwargs)
    except Exception as exc:
        passed = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise UsageError(
            f"model spec {spec!r}: calling it with ({passed}) raised {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"model spec {spec!r} returned an object of type {type(model).__name__}, not a "
            "torch.nn.Module; make it return the model"
        )
    return model


@dataclass(frozen=True)
class ModelSummary:
    """Sizes of a model's trainable parameters, the quantities gradient communication moves.

    ``params`` is the number of trainable elements, ``tensors`` the number of trainable parameter
    tensors and ``trainable_bytes`` their total size; a parameter shared between modules counts
    once, as it has one gradient.

    Args:
        name: the model's spec.
        params: trainable elements.
        tensors: trainable parameter tensors.
        trainable_bytes: their total size in bytes.
    """

    name: str
    params: int
    tensors: int
    trainable_bytes: int


def summarize_model(name: str, model: nn.Module) -> ModelSummary:
    """Count ``model``'s trainable parameters (elements, tensors, bytes), shared ones once.

    Args:
        name: the model's spec, kept in the summary.
        model: the model to count.
    """
    # Module.parameters() already yields a shared Parameter only once.
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ModelSummary(
        name=name,
        params=sum(p.numel() for p in trainable),
        tensors=len(trainable),
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
    )
