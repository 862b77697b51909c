"""What a trace is: one training iteration of a model as the simulator needs it.

A :class:`Trace` holds the gradient tensors in backward order with their layers' times, K-FAC's
factor sizes and the layers' activations, and writes itself as ``interlace-trace`` JSON;
:mod:`interlace.sim.trace` reads traces back. No torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from interlace.comm.plan import Gate, ReadyTensor

__all__ = ["FORMAT", "VERSION", "ActivationTrace", "FactorTrace", "TensorTrace", "Trace"]

FORMAT = "interlace-trace"
VERSION = 1


@dataclass(frozen=True)
class TensorTrace:
    """One gradient tensor: its name and layer, its size, and its layer's compute times.

    Args:
        name: The parameter's name.
        layer: Its layer; tensors of one layer sit next to each other and share its times.
        numel: Its elements.
        nbytes: Its bytes.
        layer_forward_s: Forward time of the tensor's layer, seconds.
        layer_backward_s: Backward time of the tensor's layer, seconds: from the end of the
            previous layer's backward to the moment this layer's gradients are ready.
    """

    name: str
    layer: str
    numel: int
    nbytes: int
    layer_forward_s: float
    layer_backward_s: float


@dataclass(frozen=True)
class FactorTrace:
    """K-FAC factor sizes of one layer.

    Args:
        layer: The layer.
        a_dim: ``A`` is ``a_dim x a_dim`` (the layer's input, plus one for a bias).
        g_dim: ``G`` is ``g_dim x g_dim`` (the layer's output).
        a_diagonal: ``A`` is kept as its diagonal (an embedding's: ``a_dim`` numbers).
    """

    layer: str
    a_dim: int
    g_dim: int
    a_diagonal: bool = False


@dataclass(frozen=True)
class ActivationTrace:
    """The output of one traced layer, as one sample of the batch gives it.

    Args:
        layer: The layer (a name of :attr:`Trace.layers`).
        shape: One sample's output shape (the batch dimension left out).
    """

    layer: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of one sample's output."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class Trace:
    """One iteration of one model on one kind of device.

    A tensor is ready when its layer's backward ends, so every ready time is the running sum
    of the layers' backward times.

    Args:
        model: The model's name.
        tensors: The gradient tensors in backward order (first ready first).
        forward_s: Whole forward pass, seconds.
        backward_s: Whole backward pass, seconds: at least the sum of the layers' backward
            times (what follows the last gradient, if anything, is the rest).
        step_s: Optimizer step after backward, seconds (0 where the source does not say).
        factors: K-FAC factor sizes of every preconditioned layer.
        broadcast_bytes: Bytes of each collective made before every forward: DDP and
            DataParallel re-broadcast the module's buffers (BatchNorm statistics), one message
            per dtype. Empty for Caffe.
        source: Where the trace was measured: device, ranks, link; free text.
        workers: Ranks the trace was profiled with (compute per rank depends on it on a shared
            CPU).
        notes: Free text.
        activations: Every traced layer's output size, in forward order (empty where the
            source does not say, as in Caffe logs): what crosses a pipeline's stage boundary
            and how many rows a K-FAC factor is computed from.
        batch_size: The per-rank batch the trace was measured with (0: not known).
        input_shape: One sample's input shape (empty: not known).
        extra: Anything else the source had (a Caffe log's communication times).

    Raises:
        ValueError: For no tensors, a negative time, a backward shorter than its layers, or an
            activation of no elements.
    """

    model: str
    tensors: tuple[TensorTrace, ...]
    forward_s: float
    backward_s: float
    step_s: float = 0.0
    factors: tuple[FactorTrace, ...] = ()
    broadcast_bytes: tuple[int, ...] = ()
    source: str = ""
    workers: int = 1
    notes: str = ""
    activations: tuple[ActivationTrace, ...] = ()
    batch_size: int = 0
    input_shape: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError(f"trace of {self.model!r} has no tensors")
        for value, what in (
            (self.forward_s, "forward_s"),
            (self.backward_s, "backward_s"),
            (self.step_s, "step_s"),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"trace of {self.model!r}: {what} must be >= 0, got {value}")
        for tensor in self.tensors:
            if tensor.numel < 1 or tensor.nbytes < 1:
                raise ValueError(f"tensor {tensor.name!r} has no elements")
            if not (tensor.layer_backward_s >= 0 and tensor.layer_forward_s >= 0):
                raise ValueError(f"tensor {tensor.name!r} has a negative layer time")
        for activation in self.activations:
            if not activation.shape or min(activation.shape) < 1:
                raise ValueError(
                    f"activation of layer {activation.layer!r} has shape {activation.shape}; "
                    "every dimension must be >= 1"
                )
        if self.batch_size < 0:
            raise ValueError(f"trace of {self.model!r}: batch_size must be >= 0")
        layers_s = self.layer_backward_total_s
        if self.backward_s < layers_s * (1 - 1e-9):
            raise ValueError(
                f"trace of {self.model!r}: backward_s {self.backward_s} is shorter than its "
                f"layers' backward times together ({layers_s})"
            )

    # ------------------------------------------------------------------ derived views

    @property
    def layers(self) -> list[tuple[str, list[int]]]:
        """Runs of consecutive tensors of one layer: ``(layer, tensor indices)`` in backward
        order. A layer whose tensors are not adjacent counts once per run."""
        runs: list[tuple[str, list[int]]] = []
        for index, tensor in enumerate(self.tensors):
            if runs and runs[-1][0] == tensor.layer:
                runs[-1][1].append(index)
            else:
                runs.append((tensor.layer, [index]))
        return runs

    @property
    def layer_backward_total_s(self) -> float:
        return sum(self.tensors[indices[0]].layer_backward_s for _, indices in self.layers)

    @property
    def layer_forward_total_s(self) -> float:
        return sum(self.tensors[indices[0]].layer_forward_s for _, indices in self.layers)

    @property
    def pass_scales(self) -> tuple[float, float]:
        """``(forward, backward)`` factors that spread each pass's time outside its layers (ops
        between them, such as activations and additions) over the layers, in proportion to
        their own times; 1 where the layers own the whole pass or record no time."""
        forward = self.layer_forward_total_s
        backward = self.layer_backward_total_s
        return (
            max(self.forward_s / forward, 1.0) if forward > 0 else 1.0,
            max(self.backward_s / backward, 1.0) if backward > 0 else 1.0,
        )

    @property
    def total_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors)

    @property
    def total_numel(self) -> int:
        return sum(tensor.numel for tensor in self.tensors)

    def activation(self, layer: str) -> ActivationTrace | None:
        """The traced output of ``layer``, or None when the trace does not record it.

        Args:
            layer: A layer name.
        """
        return next((a for a in self.activations if a.layer == layer), None)

    def factor(self, layer: str) -> FactorTrace | None:
        """The K-FAC factor sizes of ``layer``, or None when the trace has none for it.

        Args:
            layer: A layer name.
        """
        return next((f for f in self.factors if f.layer == layer), None)

    def ready_times(self) -> list[float]:
        """Seconds from the start of backward at which each tensor is ready."""
        ready = [0.0] * len(self.tensors)
        clock = 0.0
        for _, indices in self.layers:
            clock += self.tensors[indices[0]].layer_backward_s
            for index in indices:
                ready[index] = clock
        return ready

    def ready_tensors(self, per_layer: bool = False) -> list[ReadyTensor]:
        """The planners' input: every tensor in ready order.

        Args:
            per_layer: Every layer as one message instead, as Caffe's WFBP sent a layer's
                weight and bias together.
        """
        ready = self.ready_times()
        if not per_layer:
            return [
                ReadyTensor(tensor.name, tensor.nbytes, ready[index])
                for index, tensor in enumerate(self.tensors)
            ]
        return [
            ReadyTensor(layer, sum(self.tensors[i].nbytes for i in indices), ready[indices[-1]])
            for layer, indices in self.layers
        ]

    def forward_gates(self, per_layer: bool = False) -> list[Gate]:
        """The next forward's gates for a plan of :meth:`ready_tensors`: one per layer, in
        forward order (the backward order reversed), each waiting for that layer's tensors and
        computing its forward with its share of the pass's time outside the layers
        (:attr:`pass_scales`), which is what an emulated model spends there.

        Args:
            per_layer: Index the tensors as :meth:`ready_tensors` does with ``per_layer``.
        """
        forward_scale, _ = self.pass_scales
        gates = []
        for number, (layer, indices) in reversed(list(enumerate(self.layers))):
            tensors = (number,) if per_layer else tuple(indices)
            forward_s = self.tensors[indices[0]].layer_forward_s * forward_scale
            gates.append(Gate(layer, tensors, forward_s))
        return gates

    def describe(self) -> str:
        """One line: model, tensors, layers, size and compute times."""
        return (
            f"{self.model}: {len(self.tensors)} tensors in {len(self.layers)} layers, "
            f"{self.total_numel:,} parameters ({self.total_bytes / 1e6:.2f} MB); forward "
            f"{self.forward_s * 1e3:.2f} ms, backward {self.backward_s * 1e3:.2f} ms, step "
            f"{self.step_s * 1e3:.2f} ms" + (f" ({self.source})" if self.source else "")
        )

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        """The trace as a JSON object with its format and version."""
        data = asdict(self)
        # Only a diagonal factor says so: traces without one read as before.
        for factor in data["factors"]:
            if not factor["a_diagonal"]:
                del factor["a_diagonal"]
        return {"format": FORMAT, "version": VERSION, **data}

    def save(self, path: str | Path) -> Path:
        """Write the trace as JSON: a header, then one tensor per line (diffable, greppable).

        Args:
            path: The file (folders are made).
        """
        path = Path(path)
        data = self.to_dict()
        tensors = data.pop("tensors")
        factors = data.pop("factors")
        activations = data.pop("activations")
        head = json.dumps(data, indent=1, allow_nan=False)[:-2]
        lines = [head + ",", ' "tensors": [']
        lines += [f"  {json.dumps(t, allow_nan=False)}," for t in tensors]
        lines[-1] = lines[-1].rstrip(",")
        for key, items in (("factors", factors), ("activations", activations)):
            lines += [" ],", f' "{key}": [']
            lines += [f"  {json.dumps(item, allow_nan=False)}," for item in items]
            if items:
                lines[-1] = lines[-1].rstrip(",")
        lines += [" ]", "}"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        return path
