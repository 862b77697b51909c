"""Which modules K-FAC preconditions: kfac-pytorch's rule (written out here) in the compat class,
interlace's in ``KFAC``, the opt-in kinds, and tied weights."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable

import pytest
import torch
from torch import nn

from interlace.errors import UsageError
from interlace.kfac import KFAC, KFACPreconditioner, KFACWarning
from interlace.kfac.enums import LayerKind
from interlace.kfac.registration import find_layers


class Wrapper(nn.Module):
    """A DataParallel-like wrapper: the model as ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


class WideLinear(nn.Linear):
    """A Linear subclass (kfac-pytorch registers subclasses too)."""


class Scaled(nn.Module):
    """A module with a parameter of its own and a child: not a leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.inner = nn.Linear(4, 4)


def _mixed() -> nn.Module:
    """Every case the rule tells apart, under nested names."""
    torch.manual_seed(0)
    frozen_bias = nn.Linear(4, 4)
    frozen_bias.bias.requires_grad_(False)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    block = nn.Sequential(
        nn.Linear(4, 4), nn.LayerNorm(4), frozen_bias, frozen, WideLinear(4, 4), Scaled()
    )
    model = nn.Module()
    model.add_module("tokens", nn.Embedding(10, 4))
    model.add_module("conv1d", nn.Conv1d(4, 4, 3))
    model.add_module("conv", nn.Conv2d(3, 4, 3))
    model.add_module("block", block)
    model.add_module("attn", nn.MultiheadAttention(4, 2))
    model.add_module("head_linear", nn.Linear(4, 2))
    return model


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.Sequential(nn.Conv2d(4, 4, 3), nn.Conv1d(4, 4, 1)),
        nn.Flatten(),
        nn.Linear(4, 2),
    )


#: The kinds ``extra_layers`` adds that these models hold, as types.
EXTRA_TYPES: dict[str, type[nn.Module]] = {"embedding": nn.Embedding, "conv1d": nn.Conv1d}


def kfac_pytorch_rule(model: nn.Module, skip: list[str], extra: Iterable[str]) -> list[str]:
    """kfac-pytorch's registration, written out: leaf ``Linear`` / ``Conv2d`` modules (and the
    ``extra`` kinds) all of whose parameters require grad, less those whose name in the model
    given, or class name, some skip pattern is ``re.search``-found in."""
    kinds = (nn.Linear, nn.Conv2d, *(EXTRA_TYPES[kind] for kind in extra))
    names = []
    for name, module in model.named_modules():
        if list(module.children()) or not isinstance(module, kinds):
            continue
        if any(re.search(p, name) or re.search(p, type(module).__name__) for p in skip):
            continue
        if all(p.requires_grad for p in module.parameters()):
            names.append(name.removeprefix("module."))
    return names


CASES = [
    ([], ()),
    (["Embedding"], ("embedding",)),
    (["^block"], ()),
    (["Conv"], ("conv1d",)),
    (["linear"], ()),  # case-sensitive: the name "head_linear", not the class Linear
    (["Linear"], ("embedding", "conv1d")),  # the class, and its subclass's name
    ([r"\.[0-2]$", "attn"], ("embedding",)),
    (["LayerNorm", "out_proj"], ()),
    (["^module\\.block"], ()),  # names in the model given: wrappers included
]


@pytest.mark.parametrize("wrapped", [False, True])
@pytest.mark.parametrize("build", [_mixed, _conv_net])
@pytest.mark.parametrize(("skip", "extra"), CASES)
def test_the_compat_class_registers_what_kfac_pytorchs_rule_does(
    build: object, wrapped: bool, skip: list[str], extra: tuple[str, ...]
) -> None:
    model = build()  # type: ignore[operator]
    given = Wrapper(model) if wrapped else model
    expected = kfac_pytorch_rule(given, skip, extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KFACWarning)
        if not expected:
            with pytest.raises(ValueError, match="layer_rule='kfac-pytorch'"):
                KFACPreconditioner(given, skip_layers=skip, extra_layers=extra)
            return
        precond = KFACPreconditioner(given, skip_layers=skip, extra_layers=extra)
    assert list(precond.layers) == expected


def test_the_compat_class_says_why_each_module_is_left() -> None:
    with pytest.warns(KFACWarning, match="opt in with extra_layers"):
        precond = KFACPreconditioner(_mixed(), extra_layers=[LayerKind.CONV1D])
    assert precond.skipped == {
        "tokens": "embedding: opt in with extra_layers=['embedding']",
        "block.1": "LayerNorm has no K-FAC factors",
        "block.2": "a parameter is frozen (kfac-pytorch's rule needs all of them trainable)",
        "block.5": "not a leaf module (kfac-pytorch's rule registers leaves only)",
        "attn": "not a leaf module (kfac-pytorch's rule registers leaves only)",
    }
    assert "  left to the optimizer: tokens (embedding: opt in" in precond.describe()


def test_interlaces_own_rule_stays_kfacs_default() -> None:
    model = _mixed()
    with pytest.warns(KFACWarning):
        precond = KFAC(model, skip_layers=["LINEAR"])  # a name or class name, in any case
    # Subclasses are named otherwise (WideLinear, MultiheadAttention's out_proj), so they stay.
    assert list(precond.layers) == ["tokens", "conv1d", "conv", "block.4", "attn.out_proj"]
    with pytest.warns(KFACWarning):
        every = KFAC(model)
    assert "block.2" in every.layers and "tokens" in every.layers and "attn" not in every.layers
    with pytest.warns(KFACWarning):
        assert KFACPreconditioner(model, layer_rule="interlace").layers == every.layers


def test_find_layers_unwraps_and_lists_what_it_leaves() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 1))
    found = find_layers(Wrapper(Wrapper(model)), ["2"], "eigen", torch.float32)
    assert [layer.name for layer in found.layers] == ["0"]
    assert found.skipped == {"1": "BatchNorm1d has no K-FAC factors", "2": "in skip_layers"}
    with pytest.raises(ValueError, match="no Linear"):
        find_layers(model, ["linear"], "eigen", torch.float32)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"extra_layers": ["embedding"], "layer_rule": "interlace"}, "registers every kind"),
        ({"extra_layers": ["lstm"]}, "extra_layers must be one of"),
        ({"extra_layers": "embedding"}, "must be a collection of layer kinds"),
        ({"skip_layers": ["block["]}, "'block\\[' is not a regular expression"),
        ({"skip_layers": "Embedding"}, "must be a collection of names"),
        ({"layer_rule": "torch"}, "layer_rule must be one of"),
    ],
)
def test_bad_layer_options_are_one_clear_error(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        KFACPreconditioner(_conv_net(), **kwargs)
    with pytest.raises(UsageError, match=match):
        KFACPreconditioner.check_options(2, **kwargs)


class Tied(nn.Module):
    """A language model's ends: the output layer's weight is the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(12, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 12, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(tokens))))


def _tied_step(precond: KFAC, model: Tied) -> tuple[torch.Tensor, torch.Tensor]:
    """One backward and step; the tied weight's gradient before and after the step."""
    tokens = torch.randint(0, 12, (4, 5), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    nn.functional.cross_entropy(logits.reshape(-1, 12), tokens.reshape(-1)).backward()
    assert model.embed.weight.grad is not None
    before = model.embed.weight.grad.clone()
    precond.step()
    return before, model.embed.weight.grad


def test_tied_weights_are_left_to_the_optimizer_with_the_reason() -> None:
    model = Tied()
    with pytest.warns(KFACWarning, match=r"head \(its weight is shared with 'embed' \(tied"):
        precond = KFAC(model)
    assert list(precond.layers) == ["body"]
    assert set(precond.skipped) == {"embed", "head"}
    assert "left to the optimizer: embed (its weight is shared with 'head'" in precond.describe()
    before, after = _tied_step(precond, model)
    torch.testing.assert_close(after, before, rtol=0, atol=0)  # never preconditioned at all
    with pytest.warns(KFACWarning, match="tied"):
        both = KFACPreconditioner(Tied(), extra_layers=["embedding"])
    assert list(both.layers) == ["body"]


def test_the_compat_class_keeps_kfac_pytorchs_tied_output_layer_and_says_so() -> None:
    with pytest.warns(KFACWarning) as caught:
        precond = KFACPreconditioner(Tied())
    notes = [str(w.message) for w in caught if "tied weights" in str(w.message)]
    assert len(notes) == 1 and "'head' shares its weight with 'embed'" in notes[0]
    assert list(precond.layers) == ["body", "head"]  # kfac-pytorch registers the head


def test_gpt2s_projections_are_preconditioned_and_its_tied_ends_are_not() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=40,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.warns(KFACWarning, match="tied weights"):
        precond = KFAC(model)
    block = "transformer.h.0"
    assert list(precond.layers) == [
        "transformer.wpe",
        f"{block}.attn.c_attn",
        f"{block}.attn.c_proj",
        f"{block}.mlp.c_fc",
        f"{block}.mlp.c_proj",
    ]
    assert "tied weights" in precond.skipped["lm_head"]
    assert "tied weights" in precond.skipped["transformer.wte"]
    tokens = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=tokens, labels=tokens).loss.backward()
    precond.step()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
