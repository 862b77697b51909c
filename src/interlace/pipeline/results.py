"""What a pipeline stage's training and evaluation passes report: :class:`StepResult`,
:class:`EvalResult`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepResult:
    """What one call of :meth:`~interlace.pipeline.runtime.PipelineStage.run` did on this rank.

    Args:
        losses: the loss of every (micro-)batch, on the last stage only (empty elsewhere).
        samples: samples that went through the pipeline.
        updates: weight updates made on this stage.
        seconds: wall time of the call.
    """

    #: Loss of every (micro-)batch, on the last stage only (empty elsewhere).
    losses: list[float] = field(default_factory=list)
    #: Samples that went through the pipeline.
    samples: int = 0
    #: Weight updates made on this stage.
    updates: int = 0
    #: Wall time of the call.
    seconds: float = 0.0


@dataclass(frozen=True)
class EvalResult:
    """A forward-only pass's score, the same on every stage.

    Args:
        correct: samples whose arg-max prediction was the target.
        total: samples scored.
        mean_loss: the loss averaged over the samples.
    """

    correct: int
    total: int
    mean_loss: float

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.total, 1)
