"""What every training job shares beside its config: the result it reports, the warm-up +
cosine learning-rate shape, and folder-safe labels of model and data specs."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainResult:
    """What a finished run reports back: its final numbers and where its folder is.

    Args:
        final_test_accuracy: test accuracy after the last epoch, in [0, 1] (a language
            model's: of its next-token predictions).
        final_train_loss: mean training loss of the last epoch.
        samples_per_s: training throughput of the last epoch.
        run_dir: the run folder on rank 0; None on the other ranks.
        epochs: epochs trained.
        final_test_perplexity: a language model's held-out perplexity after the last epoch
            (``exp`` of the mean loss per token); None for a classifier.
        unigram_perplexity: the held-out perplexity of the corpus's unigram model (each
            byte's training-split frequency); None for a classifier.
    """

    final_test_accuracy: float
    final_train_loss: float
    samples_per_s: float
    run_dir: str | None
    epochs: int
    final_test_perplexity: float | None = None
    unigram_perplexity: float | None = None


class WarmupCosine:
    """Linear warm-up then cosine decay to zero: the usual recipe for SGD with momentum.

    A multiplier of the peak rate for :class:`torch.optim.lr_scheduler.LambdaLR`. A class rather
    than a closure so the config and schedule pickle across processes.

    Args:
        total_steps: optimizer steps of the whole run.
        warmup_steps: steps of the linear warm-up (cut to leave at least one cosine step).
    """

    def __init__(self, total_steps: int, warmup_steps: int) -> None:
        self.total_steps = max(total_steps, 1)
        self.warmup_steps = max(min(warmup_steps, self.total_steps - 1), 0)

    def __call__(self, step: int) -> float:
        """The multiplier of the peak learning rate at optimizer step ``step`` (from 0)."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        progress = (step - self.warmup_steps) / max(self.total_steps - self.warmup_steps, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def run_label(spec: str) -> str:
    """A folder-name-safe short form of a model or data spec.

    Args:
        spec: a zoo or data name, a ``package.module:callable`` or a folder path.

    Returns:
        Its last path part, with ``:`` as ``.`` and any other unsafe character as ``_``.
    """
    tail = spec.rstrip("/").replace(":", ".").split("/")[-1]
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in tail) or "run"
