"""PyTorch Lightning: a strategy that trains a LightningModule with :class:`interlace.DataParallel`.

``Trainer(strategy=InterlaceStrategy(...))``, or ``strategy="interlace"`` once this module is
imported; optionally with K-FAC (:class:`interlace.KFAC`). Recipe: docs/integrations.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import Optimizer

from interlace.comm.hooks import CommHook
from interlace.dp import DataParallel
from interlace.errors import UsageError
from interlace.kfac import KFAC

__all__ = ["InterlaceStrategy"]


class InterlaceStrategy(DDPStrategy):
    """Lightning's DDP strategy with :class:`interlace.DataParallel` in place of torch's DDP.

    Processes, rendezvous, samplers and checkpoints are Lightning's DDP ones (so ``devices``,
    ``num_nodes``, torchrun and SLURM work as they do with ``strategy="ddp"``); only the
    gradient averaging is interlace's. Gradient accumulation skips the averaging of all but
    the last micro-batch, as DDP's ``no_sync`` does.

    Args:
        kfac: when given, precondition the gradients with :class:`interlace.KFAC` built with
            these options between backward and each optimizer step (default ``lr``: the first
            optimizer's current rate; default ``accumulation_steps``: the Trainer's
            ``accumulate_grad_batches``). ``{}`` uses K-FAC's defaults.
        comm_state: the state passed to ``comm_hook``.
        comm_hook: a DDP communication hook run on every bucket (see
            :meth:`interlace.DataParallel.register_comm_hook`).
        accelerator: as :class:`~lightning.pytorch.strategies.DDPStrategy`'s.
        parallel_devices: as DDPStrategy's.
        cluster_environment: as DDPStrategy's.
        checkpoint_io: as DDPStrategy's.
        precision_plugin: as DDPStrategy's.
        process_group_backend: as DDPStrategy's (default: gloo on CPUs, NCCL on GPUs).
        timeout: as DDPStrategy's: how long a collective may wait.
        start_method: as DDPStrategy's.
        **data_parallel: passed to :class:`interlace.DataParallel` (``bucketing``,
            ``channels``, ``compression``, ...).

    Raises:
        UsageError: when ``kfac`` is not a dict.
    """

    strategy_name = "interlace"

    def __init__(
        self,
        *,
        kfac: dict[str, Any] | None = None,
        comm_state: Any = None,
        comm_hook: CommHook | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[Any] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        **data_parallel: Any,
    ) -> None:
        if kfac is not None and not isinstance(kfac, dict):
            raise UsageError(
                f"kfac must be a dict of interlace.KFAC options (or None), got {kfac!r}"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
            **data_parallel,
        )
        self._kfac_options = kfac
        self._comm_state = comm_state
        self._comm_hook = comm_hook
        self.kfac: KFAC | None = None
        """The K-FAC preconditioner while fitting with ``kfac`` set."""

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Name this strategy ``"interlace"`` in Lightning's registry.

        Args:
            strategy_registry: Lightning's ``StrategyRegistry``.
        """
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="interlace.DataParallel: planned gradient buckets (MG-WFBP)",
            )

    def _setup_model(self, model: Module) -> DataParallel:  # type: ignore[override]
        """Wrap the LightningModule in :class:`interlace.DataParallel` with the options given."""
        return DataParallel(model, **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        """Register the communication hook (on any device, unlike DDP's CUDA-only one)."""
        if self._comm_hook is not None:
            assert isinstance(self.model, DataParallel)
            self.model.register_comm_hook(self._comm_state, self._comm_hook)

    def configure_ddp(self) -> None:
        """Wrap the model, then build K-FAC on the wrapped model when asked for."""
        super().configure_ddp()
        if self._kfac_options is None:
            return
        options = dict(self._kfac_options)
        options.setdefault("lr", self._current_lr)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            options.setdefault("accumulation_steps", trainer.accumulate_grad_batches)
        assert self.model is not None
        self.kfac = KFAC(self.model, **options)

    def _current_lr(self, _step: int) -> float:
        """The first optimizer's learning rate now (K-FAC's KL-clip follows schedules)."""
        if not self.optimizers:
            return 0.1
        return float(self.optimizers[0].param_groups[0]["lr"])

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward, backward, averaging), precondition with K-FAC when on,
        then step the optimizer.

        Args:
            optimizer: the optimizer to step.
            closure: Lightning's closure: forward and backward of one micro-batch.
            model: the LightningModule, for the optimizer-step hooks.
            **kwargs: passed to ``optimizer.step``.
        """
        kfac = self.kfac
        if kfac is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def preconditioned() -> Any:
            result = closure()
            if result is not None:  # None: training_step skipped this batch, no gradients
                # The closure returns the loss, which drives K-FAC's adaptive damping.
                kfac.step(loss=result.detach() if isinstance(result, torch.Tensor) else None)
            return result

        return super().optimizer_step(optimizer, preconditioned, model, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally (the micro-batches before the last of a step)."""
        if isinstance(self.model, DataParallel):
            with self.model.no_sync():
                yield
        else:
            yield

    def teardown(self) -> None:
        """Unwrap the model and remove K-FAC's hooks."""
        if self.kfac is not None:
            self.kfac.remove_hooks()
            self.kfac = None
        if isinstance(self.model, DataParallel):
            self.model = self.lightning_module
        super().teardown()


InterlaceStrategy.register_strategies(StrategyRegistry)
