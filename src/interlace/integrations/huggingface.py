"""Hugging Face: ``transformers.Trainer`` and ``accelerate`` on :class:`interlace.DataParallel`.

``InterlaceTrainer(...)`` in place of ``Trainer(...)``; ``InterlaceAccelerator(...)`` in place of
``Accelerator(...)``; optionally with K-FAC (:class:`interlace.KFAC`) through the Trainer.
Recipe, supported features and refusals: docs/integrations.md.
"""

from __future__ import annotations

import inspect
import logging
import os
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType, parse_flag_from_env
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from interlace.dp import DataParallel
from interlace.errors import UsageError
from interlace.kfac import KFAC

__all__ = ["KFAC_STATE_NAME", "InterlaceAccelerator", "InterlaceTrainer"]

logger = logging.getLogger("interlace")

#: K-FAC's state in a Trainer checkpoint, one file per rank (``{rank}``: the rank).
KFAC_STATE_NAME = "interlace_kfac_rank{rank}.pt"

#: Accelerate's distributed types that wrap the model in torch DDP: interlace takes their place.
_DDP_TYPES = frozenset(
    getattr(DistributedType, name)
    for name in (
        "MULTI_CPU",
        "MULTI_GPU",
        "MULTI_NPU",
        "MULTI_MLU",
        "MULTI_SDAA",
        "MULTI_MUSA",
        "MULTI_XPU",
        "MULTI_HPU",
        "MULTI_NEURON",
    )
    if hasattr(DistributedType, name)  # the newer device kinds are missing from older releases
)
#: DataParallel arguments the accelerator sets itself.
_SET_BY_ACCELERATOR = ("module", "device_ids", "output_device")
#: DDP arguments accelerate's ``DistributedDataParallelKwargs`` (and the Trainer's ``ddp_*``)
#: may give, all of which DataParallel takes (``bucket_cap_mb`` in MiB in both).
_DDP_KWARGS = (
    "dim",
    "broadcast_buffers",
    "bucket_cap_mb",
    "find_unused_parameters",
    "check_reduction",
    "gradient_as_bucket_view",
    "static_graph",
)


def _keywords(function: Any, skip: tuple[str, ...]) -> set[str]:
    return {name for name in inspect.signature(function).parameters if name not in skip}


def _checked_options(
    options: Mapping[str, Any] | None, what: str, target: Any, skip: tuple[str, ...]
) -> dict[str, Any] | None:
    """``options`` as a dict, after checking they are keyword arguments ``target`` takes."""
    if options is None:
        return None
    if not isinstance(options, Mapping):
        raise UsageError(f"{what} must be a dict of {target.__name__} options, got {options!r}")
    known = _keywords(target, ("self", *skip))
    unknown = sorted(set(options) - known)
    if unknown:
        raise UsageError(
            f"{what}: {target.__name__} takes no option {unknown[0]!r} "
            f"(it takes {', '.join(sorted(known))})"
        )
    return dict(options)


def _refuse_wrapped(model: Any, where: str) -> None:
    """A model already inside a data-parallel wrapper would be averaged twice."""
    for kind in (DistributedDataParallel, nn.DataParallel, DataParallel):
        if isinstance(model, kind):
            raise UsageError(
                f"{where}: the model is already wrapped in {kind.__name__}; pass the bare "
                "module (interlace wraps it in interlace.DataParallel itself)"
            )


def _refuse_plugins(kwargs: Mapping[str, Any]) -> None:
    """FSDP, DeepSpeed, Megatron-LM or a parallelism config, given as arguments or by the
    environment ``accelerate launch`` sets from its config file."""
    for name in ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin"):
        if kwargs.get(name) is not None:
            raise UsageError(
                f"InterlaceAccelerator cannot take {name}=: interlace.DataParallel replaces "
                "DDP only; drop the plugin, or use accelerate's Accelerator for it"
            )
    if kwargs.get("parallelism_config") is not None:
        raise UsageError(
            "InterlaceAccelerator cannot take parallelism_config=: interlace.DataParallel "
            "replicates the whole model; drop it"
        )
    for variable, name in (
        ("ACCELERATE_USE_FSDP", "FSDP"),
        ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"),
        ("ACCELERATE_USE_MEGATRON_LM", "Megatron-LM"),
    ):
        if parse_flag_from_env(variable):
            raise UsageError(
                f"the accelerate config asks for {name} ({variable} is set), which "
                "InterlaceAccelerator cannot combine with interlace.DataParallel; choose "
                "multi-GPU or multi-CPU in `accelerate config`"
            )


class InterlaceAccelerator(Accelerator):  # type: ignore[misc]
    """Accelerate's ``Accelerator`` with :class:`interlace.DataParallel` where it builds torch DDP.

    ``prepare`` places the model, applies mixed precision and ``torch.compile`` as Accelerate
    does (its ``prepare_model(..., evaluation_mode=True)``), then wraps it in DataParallel on
    more than one process (on one process nothing is wrapped, as with DDP). The DDP options
    of a ``DistributedDataParallelKwargs`` handler go to DataParallel (``bucket_cap_mb`` in
    MiB in both), its communication hook is registered on it; ``no_sync``, ``accumulate``,
    ``clip_grad_norm_``, ``save_state`` work unchanged and ``unwrap_model`` returns the user's
    module.

    Args:
        *args: Accelerate's ``Accelerator`` arguments.
        data_parallel: options for :class:`interlace.DataParallel` (``bucketing``,
            ``channels``, ``compression``, ``overlap``, ...); None or ``{}``: its defaults.
        **kwargs: Accelerate's ``Accelerator`` keyword arguments.

    Raises:
        UsageError: for FSDP, DeepSpeed, Megatron-LM or a parallelism config (as arguments
            or from the accelerate config), an option DataParallel does not take, or a DDP
            handler option that contradicts ``data_parallel``.
    """

    def __init__(
        self, *args: Any, data_parallel: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        _refuse_plugins(kwargs)
        options = _checked_options(
            data_parallel or {}, "data_parallel", DataParallel.__init__, _SET_BY_ACCELERATOR
        )
        super().__init__(*args, **kwargs)
        self._interlace_setup(options or {})

    @classmethod
    def adopt(
        cls, accelerator: Accelerator, data_parallel: Mapping[str, Any] | None = None
    ) -> InterlaceAccelerator:
        """Turn an ``Accelerator`` built elsewhere (the Trainer's) into this class, in place.

        Args:
            accelerator: an ``accelerate.Accelerator`` that has prepared no model yet.
            data_parallel: as the constructor's.

        Raises:
            UsageError: as the constructor.
        """
        options = _checked_options(
            data_parallel or {}, "data_parallel", DataParallel.__init__, _SET_BY_ACCELERATOR
        )
        if type(accelerator) is not Accelerator and not isinstance(accelerator, cls):
            raise UsageError(
                f"can only adopt an accelerate.Accelerator, got {type(accelerator).__name__}"
            )
        # The same object with this class's methods: the Trainer keeps its references to it.
        accelerator.__class__ = cls
        adopted: InterlaceAccelerator = accelerator
        adopted._interlace_setup(options or {})
        return adopted

    def _interlace_setup(self, options: dict[str, Any]) -> None:
        if self.distributed_type not in _DDP_TYPES and self.distributed_type != DistributedType.NO:
            raise UsageError(
                f"the accelerate configuration asks for {self.distributed_type.value}, which "
                "InterlaceAccelerator cannot combine with interlace.DataParallel; choose "
                "multi-GPU or multi-CPU in `accelerate config`"
            )
        self.data_parallel_options = self._merged_options(options)
        self._interlace_wrapped: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def _merged_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """DataParallel's options: the DDP handler's, then ``data_parallel``'s; a key both set
        differently is refused."""
        handler = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        merged = {key: handler[key] for key in _DDP_KWARGS if key in handler}
        for key, value in options.items():
            if key in merged and key != "find_unused_parameters" and merged[key] != value:
                raise UsageError(
                    f"{key} is given twice, {merged[key]!r} by the DDP settings (the "
                    f"Trainer's ddp_{key} or DistributedDataParallelKwargs) and {value!r} in "
                    "data_parallel; give it once"
                )
            merged[key] = value
        return merged

    def prepare_model(
        self,
        model: nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> nn.Module:
        """Accelerate's ``prepare_model`` with :class:`interlace.DataParallel` in place of DDP.

        Args:
            model: the user's module (not wrapped yet).
            device_placement: as Accelerate's.
            evaluation_mode: as Accelerate's: no wrapper, only mixed precision and compile.

        Raises:
            UsageError: for a model already in a data-parallel wrapper.
        """
        if model in self._interlace_wrapped:
            return model
        _refuse_wrapped(model, "InterlaceAccelerator.prepare_model")
        wraps = not evaluation_mode and self.distributed_type in _DDP_TYPES
        prepared: nn.Module = super().prepare_model(
            model, device_placement=device_placement, evaluation_mode=evaluation_mode or wraps
        )
        if not wraps or not any(p.requires_grad for p in prepared.parameters()):
            return prepared
        device_ids = [self.device] if self.device.type == "cuda" else None
        wrapped = DataParallel(prepared, device_ids, **self.data_parallel_options)
        if self.ddp_handler is not None:
            self.ddp_handler.register_comm_hook(wrapped)
        self._interlace_wrapped.add(wrapped)
        return wrapped

    def unwrap_model(
        self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> nn.Module:
        """The user's module out of :class:`interlace.DataParallel` and Accelerate's wrappers.

        Args:
            model: the prepared model.
            keep_fp32_wrapper: as Accelerate's.
            keep_torch_compile: as Accelerate's.
        """
        if isinstance(model, DataParallel):
            model = model.module
        unwrapped: nn.Module = super().unwrap_model(
            model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile
        )
        return unwrapped


def _refuse_trainer_args(args: Any) -> None:
    """Trainer arguments that choose another distribution than data parallelism."""
    if args is None:
        return
    if getattr(args, "deepspeed", None):
        raise UsageError(
            "InterlaceTrainer cannot combine with deepspeed=: interlace.DataParallel replaces "
            "DDP only; remove deepspeed from the TrainingArguments, or use Trainer"
        )
    if getattr(args, "fsdp", None):
        raise UsageError(
            "InterlaceTrainer cannot combine with fsdp=: interlace.DataParallel replicates the "
            "whole model; remove fsdp from the TrainingArguments, or use Trainer"
        )
    if getattr(args, "parallelism_config", None) is not None:
        raise UsageError(
            "InterlaceTrainer cannot combine with parallelism_config=: interlace.DataParallel "
            "replicates the whole model; remove it from the TrainingArguments"
        )


class InterlaceTrainer(Trainer):
    """``transformers.Trainer`` training on :class:`interlace.DataParallel` instead of torch DDP.

    Everything else is the Trainer's: processes, data sharding, accumulation (``no_sync``),
    clipping, mixed precision, checkpoints, ``evaluate``. With ``kfac`` the gradients are
    preconditioned by :class:`interlace.KFAC` after the backward of each step's last
    micro-batch, before the Trainer clips them and steps; its state goes into every
    checkpoint (one file per rank, :data:`KFAC_STATE_NAME`) and comes back on resume.

    Args:
        *args: the Trainer's arguments (``model``, ``args``, ...).
        data_parallel: options for :class:`interlace.DataParallel` (``bucketing``,
            ``channels``, ``compression``, ``overlap``, ...); None: its defaults.
        kfac: when given, options for :class:`interlace.KFAC` (``{}``: its defaults); ``lr``
            defaults to the optimizer's current learning rate and ``accumulation_steps`` to
            ``gradient_accumulation_steps``.
        **kwargs: the Trainer's keyword arguments.

    Raises:
        UsageError: for a model already wrapped, ``deepspeed=``, ``fsdp=`` or
            ``parallelism_config=`` in the arguments, an option DataParallel or KFAC does not
            take, or a ``ddp_*`` argument contradicting ``data_parallel``.
    """

    def __init__(
        self,
        *args: Any,
        data_parallel: Mapping[str, Any] | None = None,
        kfac: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        _refuse_wrapped(kwargs.get("model", args[0] if args else None), "InterlaceTrainer")
        _refuse_trainer_args(kwargs.get("args", args[1] if len(args) > 1 else None))
        self._data_parallel = _checked_options(
            data_parallel or {}, "data_parallel", DataParallel.__init__, _SET_BY_ACCELERATOR
        )
        self._kfac_options = _checked_options(kfac, "kfac", KFAC.__init__, ("model",))
        self.kfac: KFAC | None = None
        """The K-FAC preconditioner once training has started with ``kfac`` set."""
        self._kfac_resume: str | None = None
        self._kfac_loss = 0.0
        super().__init__(*args, **kwargs)
        if self._kfac_options is not None:
            self.add_callback(_KFACCheckpoints(self))

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, turned into an :class:`InterlaceAccelerator`."""
        _refuse_trainer_args(self.args)
        super().create_accelerator_and_postprocess()
        self.accelerator = InterlaceAccelerator.adopt(self.accelerator, self._data_parallel)

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """The Trainer's ``train``; on resume, K-FAC's state is loaded from the checkpoint too.

        Args:
            resume_from_checkpoint: as the Trainer's.
            trial: as the Trainer's.
            ignore_keys_for_eval: as the Trainer's.
            **kwargs: as the Trainer's.
        """
        resume = resume_from_checkpoint
        if resume is True:
            resume = get_last_checkpoint(self.args.output_dir)  # type: ignore[no-untyped-call]
        self._kfac_resume = resume if isinstance(resume, str) else None
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """The Trainer's forward and backward of one micro-batch; after the last micro-batch of
        an optimizer step, K-FAC's step when on.

        Args:
            model: the wrapped model.
            inputs: the micro-batch.
            num_items_in_batch: as the Trainer's.
        """
        if self._kfac_options is not None and self.kfac is None:
            self.kfac = self._build_kfac(model)
        loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
        if self.kfac is not None:
            # The Trainer's losses are scaled for accumulation: their sum is the step's loss.
            self._kfac_loss += float(loss)
            if self.accelerator.sync_gradients:
                self.kfac.step(loss=self._kfac_loss)
                self._kfac_loss = 0.0
        return loss

    def _build_kfac(self, model: nn.Module) -> KFAC:
        assert self._kfac_options is not None
        options = dict(self._kfac_options)
        accumulation = self.args.gradient_accumulation_steps
        if options.setdefault("accumulation_steps", accumulation) != accumulation:
            raise UsageError(
                f"kfac accumulation_steps={options['accumulation_steps']} differs from the "
                f"Trainer's gradient_accumulation_steps={accumulation}; leave it out"
            )
        options.setdefault("lr", self._current_lr)
        kfac = KFAC(model, **options)
        if self._kfac_resume is not None:
            path = os.path.join(self._kfac_resume, KFAC_STATE_NAME.format(rank=_rank()))
            if os.path.isfile(path):
                kfac.load_state_dict(torch.load(path, weights_only=False))
            else:
                logger.warning("no K-FAC state in %s: K-FAC starts afresh", self._kfac_resume)
        return kfac

    def _current_lr(self, _step: int) -> float:
        """The optimizer's learning rate now (K-FAC's KL-clip follows the schedule)."""
        assert self.optimizer is not None  # K-FAC steps only once the Trainer has one
        return float(self.optimizer.param_groups[0]["lr"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class _KFACCheckpoints(TrainerCallback):
    """Saves K-FAC's state beside each checkpoint the Trainer writes."""

    def __init__(self, trainer: InterlaceTrainer) -> None:
        self._trainer = weakref.ref(trainer)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is None or trainer.kfac is None:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, KFAC_STATE_NAME.format(rank=_rank()))
        torch.save(trainer.kfac.state_dict(), path)
