"""InterlaceTrainer and InterlaceAccelerator against the Trainer's and Accelerate's own torch DDP,
K-FAC through the Trainer against K-FAC by hand, exact resume, and the refusals; on 2 ranks."""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

tf = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import interlace  # noqa: E402
from interlace.errors import UsageError  # noqa: E402
from interlace.integrations.huggingface import (  # noqa: E402
    KFAC_STATE_NAME,
    InterlaceAccelerator,
    InterlaceTrainer,
)
from interlace.testing import raised_message, run_ranks, run_scenarios  # noqa: E402

BATCH = 4  # per rank and micro-batch
ACCUMULATION = 2
STEPS = 4
SEQUENCE = 16
VOCAB = 64
LR = 1e-3
#: The forward overlap planned at once, so that the few steps here run on a forward plan.
OVERLAP = {"overlap": "forward", "tune_steps": 0, "profile_steps": 1}
KFAC_OPTIONS = {"inv_update_steps": 3, "damping": 0.01}


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = tf.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, loss_type="ForCausalLM"
    )
    return tf.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    torch.manual_seed(0)
    config = tf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return tf.BertForSequenceClassification(config)


def _data(kind: str, count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (count, SEQUENCE), generator=generator)
    if kind == "gpt2":
        return [{"input_ids": row, "labels": row} for row in ids]
    labels = (ids[:, 0] > VOCAB // 2).long()
    return [{"input_ids": row, "labels": label} for row, label in zip(ids, labels, strict=True)]


def _samples(world: int) -> int:
    return BATCH * ACCUMULATION * STEPS * world


def _arguments(out: str, name: str, **extra: Any) -> Any:
    settings: dict[str, Any] = {
        "output_dir": os.path.join(out, name),
        "use_cpu": True,
        "report_to": "none",
        "disable_tqdm": True,
        "per_device_train_batch_size": BATCH,
        "per_device_eval_batch_size": BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "max_steps": STEPS,
        "learning_rate": LR,
        "warmup_steps": 1,
        "max_grad_norm": 0.5,  # small enough to clip
        "save_strategy": "no",
        "logging_strategy": "no",
        "seed": 0,
        **extra,
    }
    return tf.TrainingArguments(**settings)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def _relative(mine: torch.Tensor, reference: torch.Tensor) -> float:
    return float((mine - reference).norm() / reference.norm())


def _fit(
    trainer_class: Any, kind: str, out: str, name: str, trainer_options: Any = None, **extra: Any
) -> tuple[torch.Tensor, Any]:
    """A Trainer run; the trained parameters and the trainer."""
    model = _gpt2() if kind == "gpt2" else _bert()
    if extra.pop("frozen", False):
        model.transformer.wpe.weight.requires_grad_(False)
    options = {} if trainer_options is None else trainer_options
    trainer = trainer_class(
        model=model,
        args=_arguments(out, name, **extra),
        train_dataset=_data(kind, _samples(dist.get_world_size())),
        eval_dataset=_data(kind, 16),
        **options,
    )
    trainer.train()
    return _flat(model), trainer


def _trainer_against_ddp(out: str, kind: str, **extra: Any) -> dict[str, Any]:
    reference, ddp = _fit(tf.Trainer, kind, out, f"{kind}-ddp", **extra)
    assert isinstance(ddp.model_wrapped, DistributedDataParallel)
    result: dict[str, Any] = {}
    for label, options in {
        "default": {},
        "overlap": OVERLAP,
        "per-tensor-2-channels": {"bucketing": "per-tensor", "channels": 2},
    }.items():
        mine, trainer = _fit(
            InterlaceTrainer, kind, out, f"{kind}-{label}", {"data_parallel": options}, **extra
        )
        wrapped = trainer.model_wrapped
        assert isinstance(wrapped, interlace.DataParallel)
        assert trainer.accelerator.unwrap_model(wrapped) is trainer.model
        if label == "overlap":
            assert wrapped.plan is not None and wrapped.plan.overlaps_forward
        result[label] = _relative(mine, reference)
    # evaluate() on the trained model, as the Trainer runs it (unwrapped, under no_grad).
    result["evaluate"] = abs(trainer.evaluate()["eval_loss"] - ddp.evaluate()["eval_loss"])
    return result


def _accelerate_loop(out: str, accelerator: Any) -> tuple[torch.Tensor, Any]:
    """A plain Accelerate loop: accumulation through ``accumulate``, clipping, AdamW."""
    net = _gpt2()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(
        _data("gpt2", _samples(accelerator.num_processes)), batch_size=BATCH
    )
    model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    assert accelerator.unwrap_model(model) is net
    return _flat(net), model


def _accelerate_against_ddp(out: str) -> dict[str, Any]:
    mixed = {"gradient_accumulation_steps": ACCUMULATION, "mixed_precision": "bf16"}
    reference, ddp = _accelerate_loop(out, accelerate.Accelerator(**mixed))
    assert isinstance(ddp, DistributedDataParallel)
    result = {}
    for label, options in {"default": {}, "overlap": OVERLAP}.items():
        mine, model = _accelerate_loop(out, InterlaceAccelerator(data_parallel=options, **mixed))
        assert isinstance(model, interlace.DataParallel)
        result[label] = _relative(mine, reference)
    # Compressed averages round: near DDP's, not equal. The DDP handler's hook runs on
    # DataParallel as on DDP (torch's bf16 hook; DDP itself takes it only on NCCL).
    hook = accelerate.utils.DistributedDataParallelKwargs(
        comm_hook=accelerate.utils.DDPCommunicationHookType.BF16
    )
    for label, settings in {
        "compression-bf16": {"data_parallel": {"compression": "bf16"}},
        "ddp-handler-bf16-hook": {"kwargs_handlers": [hook]},
    }.items():
        mine, model = _accelerate_loop(out, InterlaceAccelerator(**settings, **mixed))
        assert isinstance(model, interlace.DataParallel)
        result[label] = _relative(mine, reference)
    return result


def _kfac_by_hand(out: str) -> torch.Tensor:
    """BERT with torch DDP and interlace.KFAC in a plain loop, the Trainer's steps written out:
    its sequential shards, its loss normalisation (summed over the step's items on all ranks),
    K-FAC after the last micro-batch's backward, clipping, AdamW and a constant rate."""
    world, rank = dist.get_world_size(), dist.get_rank()
    net = _bert()
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)  # the Trainer's
    kfac = interlace.KFAC(model, lr=LR, accumulation_steps=ACCUMULATION, **KFAC_OPTIONS)
    data = _data("bert", _samples(world))
    items = torch.tensor(float(BATCH * ACCUMULATION * world))
    for step in range(STEPS):
        loss_sum = 0.0
        for micro in range(ACCUMULATION):
            first = ((step * ACCUMULATION + micro) * world + rank) * BATCH
            batch = {
                key: torch.stack([row[key] for row in data[first : first + BATCH]])
                for key in data[0]
            }
            last = micro == ACCUMULATION - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = model(**batch, num_items_in_batch=items).loss * world
                loss.backward()
            loss_sum += float(loss.detach())
        kfac.step(loss=loss_sum)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        optimizer.step()
        model.zero_grad()
    return _flat(net)


def _kfac_through_trainer(out: str) -> dict[str, Any]:
    reference = _kfac_by_hand(out)
    plain = {"train_sampling_strategy": "sequential", "warmup_steps": 0}
    plain["lr_scheduler_type"] = "constant"
    mine, trainer = _fit(InterlaceTrainer, "bert", out, "kfac", {"kfac": KFAC_OPTIONS}, **plain)
    assert trainer.kfac is not None and trainer.kfac.steps == STEPS
    overlap, _ = _fit(
        InterlaceTrainer,
        "bert",
        out,
        "kfac-overlap",
        {"kfac": KFAC_OPTIONS, "data_parallel": OVERLAP},
        **plain,
    )
    _, ddp = _fit(tf.Trainer, "bert", out, "kfac-ddp-plain", **plain)
    return {
        "kfac": _relative(mine, reference),
        "kfac-overlap": _relative(overlap, reference),
        # K-FAC changed the steps: the comparison is not between two plain runs.
        "kfac-vs-plain": _relative(mine, _flat(ddp.model)),
    }


def _resume(out: str, kind: str, options: dict[str, Any]) -> float:
    """Four steps in one run against two, then a resumed run from its checkpoint."""
    saving = {"save_strategy": "steps", "save_steps": 2}
    whole, _ = _fit(InterlaceTrainer, kind, out, f"resume-{kind}-whole", options, **saving)
    checkpoint = os.path.join(out, f"resume-{kind}-whole", "checkpoint-2")
    if "kfac" in options:
        assert os.path.isfile(os.path.join(checkpoint, KFAC_STATE_NAME.format(rank=0)))
    model = _gpt2() if kind == "gpt2" else _bert()
    trainer = InterlaceTrainer(
        model=model,
        args=_arguments(out, f"resume-{kind}-rest", **saving),
        train_dataset=_data(kind, _samples(dist.get_world_size())),
        **options,
    )
    trainer.train(resume_from_checkpoint=checkpoint)
    return _relative(_flat(model), whole)


def _refusals_on_ranks(out: str) -> dict[str, str]:
    wrapped = DistributedDataParallel(_bert())
    return {
        "wrapped": raised_message(
            lambda: InterlaceTrainer(model=wrapped, args=_arguments(out, "wrapped"))
        ),
        "prepare-wrapped": raised_message(
            lambda: InterlaceAccelerator().prepare_model(DistributedDataParallel(_bert()))
        ),
        "conflict": raised_message(
            lambda: InterlaceTrainer(
                model=_bert(),
                args=_arguments(out, "conflict", ddp_bucket_cap_mb=10),
                data_parallel={"bucket_cap_mb": 5.0},
            )
        ),
    }


def _scenarios(out: str) -> dict[str, Any]:
    import transformers  # noqa: PLC0415 - in the rank

    transformers.logging.set_verbosity_error()
    scenarios: dict[str, Callable[[], Any]] = {
        "gpt2": lambda: _trainer_against_ddp(out, "gpt2"),
        "bert": lambda: _trainer_against_ddp(out, "bert"),
        "gpt2-bf16-checkpointing-frozen": lambda: _trainer_against_ddp(
            out, "gpt2", bf16=True, gradient_checkpointing=True, frozen=True
        ),
        "accelerate": lambda: _accelerate_against_ddp(out),
        "kfac": lambda: _kfac_through_trainer(out),
        "resume": lambda: _resume(out, "gpt2", {"data_parallel": OVERLAP}),
        "resume-kfac": lambda: _resume(out, "bert", {"kfac": KFAC_OPTIONS}),
        "refusals": lambda: _refusals_on_ranks(out),
    }
    return run_scenarios(scenarios)


@pytest.mark.timeout(660)  # above the harness's own limit, which reports better
def test_trainer_and_accelerate_train_like_ddp(tmp_path: Path) -> None:
    results = run_ranks(_scenarios, 2, str(tmp_path), timeout=600)
    for rank, result in enumerate(results):
        print(f"rank {rank}: {result}")
        for scenario in ("gpt2", "bert", "gpt2-bf16-checkpointing-frozen", "accelerate"):
            for label, error in result[scenario].items():
                bound = 1e-2 if "bf16" in label else 1e-6
                assert error <= bound, (scenario, label, error)
        # They did compress.
        assert result["accelerate"]["compression-bf16"] > 0
        assert result["accelerate"]["ddp-handler-bf16-hook"] > 0
        assert result["kfac"]["kfac"] <= 1e-6
        assert result["kfac"]["kfac-overlap"] <= 1e-6
        assert result["kfac"]["kfac-vs-plain"] > 1e-4
        assert result["resume"] <= 1e-6
        assert result["resume-kfac"] <= 1e-6
        refusals = result["refusals"]
        assert "already wrapped in DistributedDataParallel" in refusals["wrapped"]
        assert "already wrapped in DistributedDataParallel" in refusals["prepare-wrapped"]
        assert "bucket_cap_mb is given twice" in refusals["conflict"]


# ---------------------------------------------------------------- refusals on one process


def test_trainer_refuses_deepspeed_and_fsdp(tmp_path: Path) -> None:
    args = _arguments(str(tmp_path), "refused")
    args.deepspeed = "ds_config.json"  # deepspeed itself is not installed here
    with pytest.raises(UsageError, match="deepspeed="):
        InterlaceTrainer(model=_bert(), args=args)
    args.deepspeed = None
    args.fsdp = ["full_shard"]
    with pytest.raises(UsageError, match="fsdp="):
        InterlaceTrainer(model=_bert(), args=args)


def test_trainer_refuses_a_wrapped_model_and_unknown_options(tmp_path: Path) -> None:
    args = _arguments(str(tmp_path), "refused")
    with pytest.raises(UsageError, match="already wrapped in DataParallel"):
        InterlaceTrainer(model=nn.DataParallel(_bert()), args=args)
    with pytest.raises(UsageError, match="takes no option 'overlapp'"):
        InterlaceTrainer(model=_bert(), args=args, data_parallel={"overlapp": "forward"})
    with pytest.raises(UsageError, match="takes no option 'model'"):
        InterlaceTrainer(model=_bert(), args=args, kfac={"model": None})


def test_accelerator_refuses_fsdp_and_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match="fsdp_plugin="):
        InterlaceAccelerator(fsdp_plugin=object())
    with pytest.raises(UsageError, match="deepspeed_plugin="):
        InterlaceAccelerator(deepspeed_plugin=object())
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(UsageError, match="asks for FSDP"):
        InterlaceAccelerator()
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(UsageError, match="asks for DeepSpeed"):
        InterlaceAccelerator()


def test_one_process_leaves_the_model_unwrapped() -> None:
    model = _bert()
    accelerator = InterlaceAccelerator()
    assert accelerator.prepare(model) is model


# ---------------------------------------------------------------- the hooks relied on


def test_the_hooks_interlace_relies_on_are_still_there() -> None:
    """Fails when transformers or Accelerate change what the integration overrides: the
    Trainer building its accelerator in ``create_accelerator_and_postprocess`` (called from
    ``__init__``) and preparing the model through ``accelerator.prepare``, and Accelerate's
    ``prepare_model(model, device_placement, evaluation_mode)`` and ``unwrap_model``."""
    assert list(inspect.signature(tf.Trainer.create_accelerator_and_postprocess).parameters) == [
        "self"
    ]
    init = inspect.getsource(tf.Trainer.__init__)
    assert "self.create_accelerator_and_postprocess()" in init
    creation = inspect.getsource(tf.Trainer.create_accelerator_and_postprocess)
    assert "self.accelerator = Accelerator(" in creation
    assert list(inspect.signature(accelerate.Accelerator.prepare_model).parameters) == [
        "self",
        "model",
        "device_placement",
        "evaluation_mode",
    ]
    assert list(inspect.signature(accelerate.Accelerator.unwrap_model).parameters) == [
        "self",
        "model",
        "keep_fp32_wrapper",
        "keep_torch_compile",
    ]
    trainer_step = inspect.signature(tf.Trainer.training_step).parameters
    assert list(trainer_step) == ["self", "model", "inputs", "num_items_in_batch"]
