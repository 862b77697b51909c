"""Tests for the model zoo: shapes, gradients, parameter counts, determinism, user models."""

from __future__ import annotations

import math
import sys
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional alias
from torch import nn

from interlace.errors import UsageError
from interlace.zoo import MODEL_NAMES, ModelSummary, build_model, summarize_model
from interlace.zoo.transformer import PatchTransformer, patch_size_for

#: The zoo's models for images; the 1-D ones (MNIST-1D) have tests/zoo/test_models1d.py, the
#: language model tests/zoo/test_gpt.py.
IMAGE_MODELS = tuple(name for name in MODEL_NAMES if not name.endswith("1d") and name != "gpt")

DIGITS = ((1, 8, 8), 10)
CIFAR = ((3, 32, 32), 10)
IMAGENET = ((3, 224, 224), 1000)


@pytest.fixture(autouse=True)
def _two_threads() -> None:
    # Keep the intra-op pool small so the timings match a 2-core CI machine and stay stable.
    torch.set_num_threads(2)


# --------------------------------------------------------------------------------------------
# Independent parameter arithmetic, written from the architecture descriptions
# --------------------------------------------------------------------------------------------


def linear(fan_in: int, fan_out: int) -> int:
    return fan_in * fan_out + fan_out


def conv(c_in: int, c_out: int, k: int) -> int:
    return c_in * c_out * k * k  # convolutions feeding BatchNorm carry no bias


def bn(c: int) -> int:
    return 2 * c


def layer_norm(d: int) -> int:
    return 2 * d


def mlp_params(features: int, classes: int) -> int:
    return linear(features, 128) + 11 * linear(128, 128) + linear(128, classes)


def resnet_params(depth: int, c_in: int, classes: int) -> int:
    n = (depth - 2) // 6
    total = conv(c_in, 16, 3) + bn(16)
    total += n * 2 * (conv(16, 16, 3) + bn(16))
    for c_prev, c in ((16, 32), (32, 64)):
        # First block of the stage: strided 3x3 conv, 3x3 conv, and the 1x1 projection shortcut.
        total += conv(c_prev, c, 3) + bn(c) + conv(c, c, 3) + bn(c) + conv(c_prev, c, 1) + bn(c)
        total += (n - 1) * 2 * (conv(c, c, 3) + bn(c))
    return total + linear(64, classes)


def vgg11_params(c_in: int, classes: int) -> int:
    widths = [64, 128, 256, 256, 512, 512, 512, 512]
    total = 0
    for c in widths:
        total += conv(c_in, c, 3) + bn(c)
        c_in = c
    return total + linear(512, 512) + linear(512, 512) + linear(512, classes)


def transformer_params(patch_features: int, tokens: int, classes: int) -> int:
    block = (
        layer_norm(128)
        + linear(128, 3 * 128)
        + linear(128, 128)
        + layer_norm(128)
        + linear(128, 256)
        + linear(256, 128)
    )
    return (
        linear(patch_features, 128)
        + tokens * 128
        + 4 * block
        + layer_norm(128)
        + linear(128, classes)
    )


EXPECTED_PARAMS: dict[tuple[str, tuple[int, ...]], int] = {
    ("mlp", DIGITS[0]): mlp_params(64, 10),
    ("mlp", CIFAR[0]): mlp_params(3 * 32 * 32, 10),
    ("resnet20", DIGITS[0]): resnet_params(20, 1, 10),
    ("resnet20", CIFAR[0]): resnet_params(20, 3, 10),
    ("resnet32", CIFAR[0]): resnet_params(32, 3, 10),
    ("resnet56", CIFAR[0]): resnet_params(56, 3, 10),
    ("vgg11", DIGITS[0]): vgg11_params(1, 10),
    ("vgg11", CIFAR[0]): vgg11_params(3, 10),
    # digits: 2x2 patches of 1 channel, 16 tokens; CIFAR: 4x4 patches of 3 channels, 64 tokens.
    ("transformer", DIGITS[0]): transformer_params(4, 16, 10),
    ("transformer", CIFAR[0]): transformer_params(48, 64, 10),
}

# Trainable tensors: a weight and bias per Linear/BatchNorm/LayerNorm, one weight per conv.
EXPECTED_TENSORS = {
    "mlp": 13 * 2,
    "resnet20": 3 + 3 * 3 * 6 + 2 * 3 + 2,  # stem, 9 blocks, 2 projections, fc
    "resnet32": 3 + 3 * 5 * 6 + 2 * 3 + 2,
    "resnet56": 3 + 3 * 9 * 6 + 2 * 3 + 2,
    "vgg11": 8 * 3 + 3 * 2,
    "transformer": 2 + 1 + 4 * (2 * 2 + 4 * 2) + 2 + 2,
}


# --------------------------------------------------------------------------------------------
# Zoo models
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", IMAGE_MODELS)
@pytest.mark.parametrize("shape_classes", [DIGITS, CIFAR], ids=["digits", "cifar"])
def test_forward_shape_and_every_parameter_gets_a_gradient(
    name: str, shape_classes: tuple[tuple[int, ...], int]
) -> None:
    input_shape, classes = shape_classes
    torch.manual_seed(0)
    model = build_model(name, input_shape, classes)
    x = torch.randn(3, *input_shape)
    logits = model(x)
    assert logits.shape == (3, classes)
    assert logits.dtype == torch.float32
    torch.autograd.backward(F.cross_entropy(logits, torch.tensor([0, 1, 2])))
    for pname, param in model.named_parameters():
        assert param.grad is not None, f"{name}: {pname} got no gradient"
        assert torch.isfinite(param.grad).all(), pname
        assert param.grad.abs().sum() > 0, f"{name}: {pname} got an all-zero gradient"


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_imagenet_shape_forward(name: str) -> None:
    input_shape, classes = IMAGENET
    torch.manual_seed(0)
    model = build_model(name, input_shape, classes).eval()
    with torch.no_grad():
        logits = model(torch.randn(1, *input_shape))
    assert logits.shape == (1, classes)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(("name", "input_shape"), list(EXPECTED_PARAMS))
def test_parameter_counts_match_the_architecture(name: str, input_shape: tuple[int, ...]) -> None:
    model = build_model(name, input_shape, 10)
    summary = summarize_model(name, model)
    assert summary == ModelSummary(
        name=name,
        params=EXPECTED_PARAMS[(name, input_shape)],
        tensors=EXPECTED_TENSORS[name],
        trainable_bytes=4 * EXPECTED_PARAMS[(name, input_shape)],
    )


def test_parameter_counts_agree_with_published_sizes() -> None:
    # He et al. 2016 table 6 lists ResNet-20 at 0.27M parameters (option A shortcuts); option B
    # adds exactly the two projections: 16*32 + 2*32 and 32*64 + 2*64.
    resnet20 = summarize_model("resnet20", build_model("resnet20", (3, 32, 32), 10))
    assert resnet20.params == 269_722 + (16 * 32 + 64) + (32 * 64 + 128)
    vgg = summarize_model("vgg11", build_model("vgg11", (3, 32, 32), 10))
    assert 9.5e6 < vgg.params < 9.9e6


def test_mlp_is_many_small_tensors_and_vgg_few_large_ones() -> None:
    mlp = build_model("mlp", (1, 8, 8), 10)
    vgg = build_model("vgg11", (1, 8, 8), 10)
    assert max(p.numel() for p in mlp.parameters()) == 128 * 128
    assert max(p.numel() for p in vgg.parameters()) == 512 * 512 * 9
    assert sum(isinstance(m, nn.Linear) for m in mlp.modules()) == 13


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_models_are_deterministic_given_the_seed(name: str) -> None:
    def make() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        torch.manual_seed(1234)
        model = build_model(name, (1, 8, 8), 10)
        x = torch.randn(4, 1, 8, 8)
        return model.state_dict(), model(x)

    (state_a, out_a), (state_b, out_b) = make(), make()
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key
    assert torch.equal(out_a, out_b)
    torch.manual_seed(99)
    other = build_model(name, (1, 8, 8), 10).state_dict()
    assert any(
        not torch.equal(state_a[k], other[k]) for k in state_a if state_a[k].is_floating_point()
    )


def test_resnet_spatial_path_and_first_conv_channels() -> None:
    model = build_model("resnet20", (1, 8, 8), 10)
    sizes: list[tuple[int, ...]] = []
    stages = model.get_submodule("stages")
    for stage in stages.children():
        stage.register_forward_hook(lambda _m, _i, out: sizes.append(tuple(out.shape[1:])))
    model(torch.randn(2, 1, 8, 8))
    assert sizes == [(16, 8, 8), (32, 4, 4), (64, 2, 2)]
    first_conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert first_conv.in_channels == 1
    assert not any(isinstance(m, nn.Upsample) for m in model.modules())


def test_vgg_skips_pooling_once_spatial_size_is_one() -> None:
    pools_digits = [m for m in build_model("vgg11", (1, 8, 8), 10).modules()]
    pools_cifar = [m for m in build_model("vgg11", (3, 32, 32), 10).modules()]
    assert sum(isinstance(m, nn.MaxPool2d) for m in pools_digits) == 3  # 8 -> 4 -> 2 -> 1
    assert sum(isinstance(m, nn.MaxPool2d) for m in pools_cifar) == 5  # 32 -> ... -> 1
    # A non-square input keeps pooling the dimension that is still larger than 1.
    wide = build_model("vgg11", (1, 2, 64), 3)
    assert wide(torch.randn(2, 1, 2, 64)).shape == (2, 3)


# --------------------------------------------------------------------------------------------
# Transformer details
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("height", "width", "patch", "tokens"),
    [(8, 8, 2, 16), (32, 32, 4, 64), (224, 224, 28, 64), (30, 30, 4, 64), (28, 28, 4, 49)],
)
def test_transformer_patch_size_keeps_at_most_64_tokens(
    height: int, width: int, patch: int, tokens: int
) -> None:
    assert patch_size_for(height, width) == patch
    assert math.ceil(height / patch) * math.ceil(width / patch) == tokens <= 64
    model = build_model("transformer", (3, height, width), 5)
    assert isinstance(model, PatchTransformer)
    assert model.pos.shape == (1, tokens, 128)
    assert model(torch.randn(2, 3, height, width)).shape == (2, 5)


def test_transformer_patches_match_unfold() -> None:
    model = build_model("transformer", (3, 32, 32), 10)
    assert isinstance(model, PatchTransformer)
    x = torch.randn(2, 3, 32, 32)
    # F.unfold lays out each patch as (channel, row, col) and patches in row-major order.
    expected = F.unfold(x, kernel_size=4, stride=4).transpose(1, 2)
    assert torch.equal(model.patchify(x), expected)


def test_transformer_uses_only_linear_layers_whose_hooks_fire() -> None:
    model = build_model("transformer", (1, 8, 8), 10)
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 1 + 4 * 4 + 1  # patch embedding, 4 per block, head
    fired: set[int] = set()
    for layer in linears:
        layer.register_forward_hook(lambda m, _i, _o: fired.add(id(m)))
    model(torch.randn(2, 1, 8, 8))
    assert fired == {id(m) for m in linears}


def test_transformer_attention_matches_a_reference_computation() -> None:
    torch.manual_seed(0)
    model = build_model("transformer", (1, 8, 8), 10)
    attn = model.get_submodule("blocks.0.attn")
    x = torch.randn(2, 16, 128)
    qkv = attn.get_submodule("qkv")(x)
    q, k, v = qkv.split(128, dim=-1)
    heads = []
    for h in range(4):
        sl = slice(32 * h, 32 * (h + 1))
        weights = torch.softmax(q[..., sl] @ k[..., sl].transpose(1, 2) / math.sqrt(32), dim=-1)
        heads.append(weights @ v[..., sl])
    expected = attn.get_submodule("out")(torch.cat(heads, dim=-1))
    torch.testing.assert_close(attn(x), expected, rtol=1e-5, atol=1e-5)


def test_transformer_on_token_ids() -> None:
    model = build_model("transformer", (12,), 4)
    ids = torch.randint(0, 1000, (3, 12))
    assert model(ids).shape == (3, 4)
    assert isinstance(model.get_submodule("embed"), nn.Embedding)
    small_vocab = PatchTransformer((12,), 4, vocab_size=50)
    assert small_vocab.get_submodule("embed").num_embeddings == 50


# --------------------------------------------------------------------------------------------
# summarize_model
# --------------------------------------------------------------------------------------------


def test_summary_counts_shared_parameters_once_and_skips_frozen_ones() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4, bias=False)
            self.b = nn.Linear(4, 4, bias=True)
            self.b.weight = self.a.weight  # tied: one tensor, one gradient
            self.frozen = nn.Linear(4, 4)
            self.frozen.requires_grad_(False)
            self.wide = nn.Parameter(torch.zeros(3, dtype=torch.float64))

    assert summarize_model("tied", Tied()) == ModelSummary(
        name="tied", params=16 + 4 + 3, tensors=3, trainable_bytes=(16 + 4) * 4 + 3 * 8
    )


# --------------------------------------------------------------------------------------------
# User models: package.module:callable
# --------------------------------------------------------------------------------------------

USER_MODULE = """
    import math
    from torch import nn

    def net(input_shape, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))

    def no_args():
        return nn.Linear(3, 7)

    def only_classes(num_classes):
        return nn.Linear(5, num_classes)

    SEEN = {}

    def with_kwargs(**kwargs):
        SEEN.update(kwargs)
        return nn.Identity()

    def forwards_kwargs(**kwargs):
        # As torchvision's resnet50: **kwargs handed on to a class without input_shape.
        return Net(**kwargs)

    class Net(nn.Module):
        def __init__(self, num_classes, hidden=6):
            super().__init__()
            self.fc = nn.Linear(hidden, num_classes)

    class Factories:
        @staticmethod
        def make(input_shape):
            return nn.Linear(input_shape[-1], 2)

    NOT_CALLABLE = 3
    INSTANCE = nn.Linear(2, 2)

    def returns_int():
        return 3

    def boom(num_classes):
        raise RuntimeError("no such width")
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], str]:
    """Write a module into tmp_path, chdir there with tmp_path off sys.path; return its name."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.chdir(tmp_path)

    def write(source: str) -> str:
        name = f"usermodels_{uuid.uuid4().hex[:12]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.delitem(sys.modules, name, raising=False)
        return name

    return write


def test_callable_from_the_working_directory(
    user_module: Callable[[str], str], tmp_path: Path
) -> None:
    mod = user_module(USER_MODULE)
    model = build_model(f"{mod}:net", (1, 8, 8), 10)
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    assert str(tmp_path) in sys.path
    sys.modules.pop(mod, None)


def test_callable_gets_only_the_keywords_it_accepts(user_module: Callable[[str], str]) -> None:
    mod = user_module(USER_MODULE)
    no_args = build_model(f"{mod}:no_args", (1, 8, 8), 10)
    assert isinstance(no_args, nn.Linear) and no_args.out_features == 7
    only = build_model(f"{mod}:only_classes", (1, 8, 8), 4)
    assert isinstance(only, nn.Linear) and only.out_features == 4
    build_model(f"{mod}:with_kwargs", (2, 3), 9)
    assert sys.modules[mod].SEEN == {"input_shape": (2, 3), "num_classes": 9}
    cls_model = build_model(f"{mod}:Net", (1, 8, 8), 3)
    assert cls_model.get_submodule("fc").out_features == 3
    forwarded = build_model(f"{mod}:forwards_kwargs", (1, 8, 8), 5)
    assert forwarded.get_submodule("fc").out_features == 5
    assert cls_model.get_submodule("fc").out_features == 3
    dotted = build_model(f"{mod}:Factories.make", (4, 11), 10)
    assert isinstance(dotted, nn.Linear) and dotted.in_features == 11


def test_callable_from_an_installed_package() -> None:
    model = build_model("torch.nn:Identity", (1, 8, 8), 10)
    assert isinstance(model, nn.Identity)


@pytest.mark.parametrize(
    ("attr", "fragments"),
    [
        ("missing", ["has no attribute 'missing'"]),
        ("Factories.nope", ["has no attribute 'nope'"]),
        ("NOT_CALLABLE", ["type int", "not callable"]),
        ("INSTANCE", ["instance", "class"]),
        ("returns_int", ["returned an object of type int", "nn.Module"]),
        ("boom", ["RuntimeError", "no such width", "num_classes=10"]),
    ],
)
def test_callable_errors(
    user_module: Callable[[str], str], attr: str, fragments: list[str]
) -> None:
    mod = user_module(USER_MODULE)
    with pytest.raises(UsageError) as info:
        build_model(f"{mod}:{attr}", (1, 8, 8), 10)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_module_errors(user_module: Callable[[str], str]) -> None:
    with pytest.raises(UsageError, match="cannot find module 'no_such_module_xyz'"):
        build_model("no_such_module_xyz:net", (1, 8, 8), 10)
    with pytest.raises(UsageError, match=r"cannot find module 'no_such_pkg_xyz\.sub'"):
        build_model("no_such_pkg_xyz.sub:net", (1, 8, 8), 10)
    needs_dep = user_module("import no_such_dependency_xyz\n")
    with pytest.raises(UsageError, match="needs 'no_such_dependency_xyz'"):
        build_model(f"{needs_dep}:net", (1, 8, 8), 10)
    broken = user_module("def net(:\n")
    with pytest.raises(UsageError, match="SyntaxError"):
        build_model(f"{broken}:net", (1, 8, 8), 10)
    raises = user_module("raise RuntimeError('bad config')\n")
    with pytest.raises(UsageError, match="bad config"):
        build_model(f"{raises}:net", (1, 8, 8), 10)


@pytest.mark.parametrize("spec", [":net", "torch.nn:", " : "])
def test_malformed_callable_spec(spec: str) -> None:
    with pytest.raises(UsageError, match=r"package\.module:callable"):
        build_model(spec, (1, 8, 8), 10)


def test_unknown_zoo_name_lists_names_and_the_callable_form() -> None:
    with pytest.raises(UsageError) as info:
        build_model("resnet18", (3, 32, 32), 10)
    message = str(info.value)
    assert "'resnet18'" in message
    for name in MODEL_NAMES:
        assert name in message
    assert "package.module:callable" in message


@pytest.mark.parametrize(
    ("name", "input_shape", "classes", "match"),
    [
        ("resnet20", (64,), 10, "channels, height, width"),
        ("vgg11", (1, 8), 10, "channels, height, width"),
        ("transformer", (1, 8), 10, "seq_len"),
        ("mlp", (1, 0, 8), 10, "positive"),
        ("mlp", (), 10, "non-empty"),
        ("mlp", (1, 8.0, 8), 10, "tuple of ints"),
        ("mlp", (1, 8, 8), 0, "num_classes"),
    ],
)
def test_bad_shapes_raise_usage_error(
    name: str, input_shape: tuple[int, ...], classes: int, match: str
) -> None:
    with pytest.raises(UsageError, match=match):
        build_model(name, input_shape, classes)
