"""Adaptive damping for K-FAC: the Levenberg-Marquardt rule of Martens & Grosse (2015, sec. 6.5),
driven by the loss the caller passes to ``KFAC.step(loss=...)``; see docs/kfac/damping.md."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from interlace.checks import is_real
from interlace.errors import Named, OptionError, Setting, UsageError
from interlace.kfac.enums import DampingAdaptation, coerce_choice
from interlace.kfac.preconditioned_layer import KFACLayer

__all__ = [
    "AdaptiveDamping",
    "LevenbergMarquardt",
    "check_adaptation",
    "damping_adaptation_from",
    "levenberg_marquardt_update",
    "window_weights",
]


@dataclass(frozen=True)
class LevenbergMarquardt:
    """The Levenberg-Marquardt rule's settings; ``KFAC(damping_adaptation=LevenbergMarquardt())``.

    Every ``interval`` steps the loss change measured over the last ``2 * interval`` steps is
    compared with the change K-FAC's quadratic model predicted for the steps taken: ``rho``
    below ``1/4`` multiplies the damping by ``omega``, above ``3/4`` divides it by ``omega``,
    within ``[min_damping, max_damping]``.

    Args:
        interval: Steps between two adjustments (Martens & Grosse's ``T1``).
        omega: The factor (> 1); None is Martens & Grosse's ``(20/19) ** interval``.
        min_damping: The least damping the rule sets (None: the starting damping / 100).
        max_damping: The most damping the rule sets (None: the starting damping x 100).
    """

    interval: int = 5
    omega: float | None = None
    min_damping: float | None = None
    max_damping: float | None = None

    def __post_init__(self) -> None:
        interval = self.interval
        if not (isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1):
            raise UsageError(
                f"LevenbergMarquardt interval must be an integer >= 1, got {interval!r}"
            )
        if self.omega is not None and not (is_real(self.omega) and 1 < self.omega < math.inf):
            raise UsageError(f"LevenbergMarquardt omega must be a number > 1, got {self.omega!r}")
        low, high = self.min_damping, self.max_damping
        for name, bound in (("min_damping", low), ("max_damping", high)):
            if bound is not None and not (is_real(bound) and 0 < bound < math.inf):
                raise UsageError(
                    f"LevenbergMarquardt {name} must be a finite number > 0 or None, got {bound!r}"
                )
        if low is not None and high is not None and low > high:
            raise UsageError(
                f"LevenbergMarquardt min_damping {low!r} is above max_damping {high!r}; swap them"
            )

    @property
    def factor(self) -> float:
        """``omega``, or Martens & Grosse's ``(20/19) ** interval`` when not given."""
        return self.omega if self.omega is not None else (20 / 19) ** self.interval

    def bounds(self, start: float) -> tuple[float, float]:
        """``(min_damping, max_damping)`` for a run that starts at damping ``start``.

        Args:
            start: The starting damping.
        """
        low = self.min_damping if self.min_damping is not None else start / 100
        high = self.max_damping if self.max_damping is not None else start * 100
        return low, high


def damping_adaptation_from(value: object) -> LevenbergMarquardt | None:
    """``KFAC(damping_adaptation=...)`` as the rule's settings, or None for fixed damping.

    Args:
        value: A :class:`DampingAdaptation`, its string, or :class:`LevenbergMarquardt`.

    Raises:
        UsageError: Anything else (a ``ValueError``).
    """
    if isinstance(value, LevenbergMarquardt):
        return value
    choice = coerce_choice(DampingAdaptation, value, "damping_adaptation")
    return LevenbergMarquardt() if choice == DampingAdaptation.LEVENBERG_MARQUARDT else None


def check_adaptation(settings: LevenbergMarquardt | None, damping: object) -> None:
    """Refuse a starting damping the rule cannot adapt (a callable, or one out of its bounds).

    Args:
        settings: The rule's settings (None: fixed damping, nothing to check).
        damping: ``KFAC(damping=...)``.

    Raises:
        OptionError: A callable, or a number outside ``[min_damping, max_damping]``.
    """
    if settings is None:
        return
    if callable(damping):
        raise OptionError(
            "damping",
            Setting("damping_adaptation", "levenberg-marquardt"),
            " adapts a number, got a callable damping; pass ",
            Named("damping"),
            "=<number>, or ",
            Setting("damping_adaptation", "fixed"),
            " to schedule it yourself",
        )
    if not (is_real(damping) and 0 < damping < math.inf):
        raise OptionError(
            "damping",
            Setting("damping_adaptation", "levenberg-marquardt"),
            f" needs a damping > 0 to start from, got {damping!r}; pass ",
            Setting("damping_adaptation", "fixed"),
            " for a damping of 0",
        )
    low, high = settings.bounds(damping)
    if not low <= damping <= high:
        raise OptionError(
            "damping",
            f"{damping!r} is outside the Levenberg-Marquardt bounds [{low:g}, {high:g}]; "
            "pass a damping within them or LevenbergMarquardt(min_damping=..., max_damping=...)",
        )


def levenberg_marquardt_update(
    damping: float, rho: float, omega: float, bounds: tuple[float, float]
) -> float:
    """The damping after one adjustment: times ``omega`` when ``rho < 1/4`` (also when ``rho`` is
    NaN, a loss that is not finite), divided by ``omega`` when ``rho > 3/4``, within bounds.

    Args:
        damping: The damping now.
        rho: Measured loss change over predicted.
        omega: The factor (> 1).
        bounds: ``(min_damping, max_damping)``.
    """
    if math.isnan(rho) or rho < 0.25:
        damping *= omega
    elif rho > 0.75:
        damping /= omega
    return min(max(damping, bounds[0]), bounds[1])


def window_weights(interval: int) -> list[float]:
    """Weight of each of the ``2 * interval - 1`` steps in a window's loss change.

    The measured change is the mean loss of the window's last ``interval`` steps minus that of
    its first ``interval``: step ``j``'s own change (``loss[j + 1] - loss[j]``) enters it
    ``min(j + 1, 2 * interval - 1 - j) / interval`` times, so its predicted change is weighted
    alike.

    Args:
        interval: The rule's ``interval``.
    """
    return [min(j + 1, 2 * interval - 1 - j) / interval for j in range(2 * interval - 1)]


@dataclass
class _Snapshot:
    """One step's parameters and raw gradients (``(g_dim, a_dim)`` matrices, by layer name)."""

    params: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    scale: float


class AdaptiveDamping:
    """The damping of one :class:`~interlace.KFAC` under the Levenberg-Marquardt rule.

    At each step given a loss, the previous step's update ``d`` (parameters now minus then) is
    scored by K-FAC's quadratic model ``g.d + s/2 d.(A x G)d`` from that step's gradient ``g``
    and factors (``s`` turns them into the per-example Fisher of the mean loss). Losses and
    predictions stay on the device until a decision, which reads one all-reduced vector, so
    every rank sets the same damping.

    Args:
        settings: The rule's settings.
        damping: The starting damping (> 0).
        world_size: The ranks K-FAC runs on.
        group: Their process group.
    """

    def __init__(
        self,
        settings: LevenbergMarquardt,
        damping: float,
        world_size: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.settings = settings
        #: The damping now.
        self.damping = float(damping)
        #: ``(min_damping, max_damping)``.
        self.bounds = settings.bounds(self.damping)
        self._world_size = world_size
        self._group = group
        window = 2 * settings.interval
        self._losses: deque[torch.Tensor] = deque(maxlen=window)
        self._predicted: deque[torch.Tensor] = deque(maxlen=window - 1)
        self._since = 0
        self._snapshot: _Snapshot | None = None
        #: The ``rho`` of the last adjustment (None before the first).
        self.last_rho: float | None = None

    def observe(self, loss: torch.Tensor | float, layers: Sequence[KFACLayer]) -> None:
        """Take this step's loss (before the step's factor update) and adjust every interval.

        Args:
            loss: This rank's loss at this step's parameters.
            layers: The registered layers (their factors still those of the previous step).
        """
        device = _device(layers)
        value = torch.as_tensor(loss, dtype=torch.float64, device=device).detach().reshape(())
        predicted = self._predict(layers, device)
        if predicted is None:
            self._losses.clear()
            self._predicted.clear()
            self._since = 0
        else:
            self._predicted.append(predicted)
        self._losses.append(value)
        self._since += 1
        if len(self._losses) == self._losses.maxlen and self._since >= self.settings.interval:
            self._adjust(device)

    def remember(
        self, layers: Sequence[KFACLayer], raw_grads: Mapping[str, torch.Tensor], scale: float
    ) -> None:
        """Keep this step's parameters and raw gradients, to score its update at the next step.

        Args:
            layers: The registered layers.
            raw_grads: Each preconditioned layer's gradient before preconditioning, by name.
            scale: What turns the factors into the per-example Fisher (see the class).
        """
        params = {
            layer.name: layer.helper.param_matrix() for layer in layers if layer.name in raw_grads
        }
        grads = {name: grad.detach().clone() for name, grad in raw_grads.items()}
        self._snapshot = _Snapshot(params, grads, scale)

    def forget(self) -> None:
        """A step with nothing to score (no loss, or no preconditioning): no update to score."""
        self._snapshot = None

    def _predict(self, layers: Sequence[KFACLayer], device: torch.device) -> torch.Tensor | None:
        """The model's loss change for the update since the snapshot (None without one)."""
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is None or not snapshot.params:
            return None
        linear = torch.zeros((), dtype=torch.float64, device=device)
        quadratic = torch.zeros((), dtype=torch.float64, device=device)
        for layer in layers:
            if layer.name not in snapshot.params or layer.a_factor is None:
                continue
            assert layer.g_factor is not None
            step = (layer.helper.param_matrix() - snapshot.params[layer.name]).to(torch.float64)
            linear += torch.sum(snapshot.grads[layer.name].to(torch.float64) * step)
            a = layer.a_factor.to(torch.float64)
            g = layer.g_factor.to(torch.float64)
            right = step * a if a.dim() == 1 else step @ a  # a diagonal A is kept as a vector
            quadratic += torch.sum((g @ right) * step)
        return linear + 0.5 * snapshot.scale * quadratic

    def _adjust(self, device: torch.device) -> None:
        """One Levenberg-Marquardt adjustment from the window, the same on every rank."""
        interval = self.settings.interval
        losses = torch.stack(list(self._losses))
        weights = torch.tensor(window_weights(interval), dtype=torch.float64, device=device)
        predicted = torch.sum(weights * torch.stack(list(self._predicted)))
        measured = losses[interval:].mean() - losses[:interval].mean()
        summary = torch.stack([measured, predicted])
        if self._world_size > 1:
            # Losses differ by rank (local batches); predictions agree, but are averaged too so
            # that every rank divides the very same numbers.
            dist.all_reduce(summary, group=self._group)
            summary /= self._world_size
        measured_value, predicted_value = summary.tolist()
        self._since = 0
        if not math.isfinite(measured_value):
            rho = math.nan  # the loss diverged: more damping
        elif not (math.isfinite(predicted_value) and predicted_value < 0):
            rho = -math.inf  # the model predicts no decrease: the steps overshoot it
        else:
            rho = measured_value / predicted_value
        self.last_rho = rho
        self.damping = levenberg_marquardt_update(
            self.damping, rho, self.settings.factor, self.bounds
        )

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The damping, the window and the last step's snapshot: a resumed run decides alike."""
        snapshot = self._snapshot
        return {
            "damping": self.damping,
            "losses": [t.clone() for t in self._losses],
            "predicted": [t.clone() for t in self._predicted],
            "since": self._since,
            "last_rho": self.last_rho,
            "snapshot": None
            if snapshot is None
            else {
                "params": dict(snapshot.params),
                "grads": dict(snapshot.grads),
                "scale": snapshot.scale,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device) -> None:
        """Restore :meth:`state_dict`.

        Args:
            state: What :meth:`state_dict` returned.
            device: Where the layers live.
        """
        self.damping = float(state["damping"])
        self._losses.clear()
        self._losses.extend(t.to(device) for t in state["losses"])
        self._predicted.clear()
        self._predicted.extend(t.to(device) for t in state["predicted"])
        self._since = int(state["since"])
        self.last_rho = state["last_rho"]
        saved = state["snapshot"]
        self._snapshot = (
            None
            if saved is None
            else _Snapshot(
                {name: t.to(device) for name, t in saved["params"].items()},
                {name: t.to(device) for name, t in saved["grads"].items()},
                float(saved["scale"]),
            )
        )


def _device(layers: Sequence[KFACLayer]) -> torch.device:
    return layers[0].helper.weight.device if layers else torch.device("cpu")
