"""Traces: one training iteration of a model as the simulator needs it.

A :class:`Trace` is read from an ``interlace-trace`` JSON file or an MG-WFBP Caffe log
(:func:`load_trace`), or built from measurements (:mod:`interlace.sim.profiled`). Loading and
simulating a trace needs no torch.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from interlace.comm.plan import Gate, ReadyTensor
from interlace.errors import UsageError
from interlace.sim.caffe_log import (
    CaffeMessages,
    CaffeRecord,
    choose_iteration,
    logged_messages,
    parse_caffe_log,
)
from interlace.sim.caffe_log import TraceFormatError as TraceFormatError  # noqa: PLC0414
from interlace.sim.traces import shipped_trace, trace_names

FORMAT = "interlace-trace"
VERSION = 1

#: Bytes of a float32 gradient element, the Caffe logs' element type.
FLOAT32_BYTES = 4

#: The MG-WFBP authors' simulator took the forward pass as half of the backward pass (their
#: logs time only backward); we follow it for traces read from those logs.
CAFFE_FORWARD_PER_BACKWARD = 0.5


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


def load_trace(
    path: str | Path,
    *,
    iteration: int | None = None,
    messages: CaffeMessages | str = CaffeMessages.TENSORS,
) -> Trace:
    """A trace from a shipped trace's name, an ``interlace-trace`` JSON file or a Caffe log.

    A file's format is told by its content.

    Args:
        path: A shipped trace name (:func:`interlace.sim.traces.trace_names`, such as
            ``googlenet-k80``) or a file.
        iteration: A Caffe log's iteration to read, from 1 (None: the last complete one).
        messages: Which lines of a Caffe log are messages (:func:`read_caffe_log`).

    Raises:
        TraceFormatError: ``FILE:LINE: what is wrong``, for a file that cannot be read, or an
            unknown name (naming the shipped ones).
    """
    if isinstance(path, str) and (shipped := shipped_trace(path)) is not None:
        path = shipped
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise TraceFormatError(
            f"{path}: cannot read the trace ({error.strerror}); give a file or a shipped trace "
            f"name ({', '.join(trace_names())})"
        ) from None
    except UnicodeDecodeError:
        raise TraceFormatError(
            f"{path}: not a text file; a trace is an {FORMAT} JSON file (interlace profile "
            "--trace-out) or an MG-WFBP Caffe log"
        ) from None
    if text.lstrip().startswith("{"):
        if iteration is not None or CaffeMessages(messages) is not CaffeMessages.TENSORS:
            raise TraceFormatError(
                f"{path}: an {FORMAT} file holds one iteration of its own tensors; choosing an "
                "iteration or the logged messages reads Caffe logs only"
            )
        return _from_json(path, text)
    return read_caffe_log(path, text, iteration=iteration, messages=messages)


def _from_json(path: Path, text: str) -> Trace:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":
            raise TraceFormatError(
                f"{path}:{error.lineno}: more after the JSON object; a trace file holds one JSON "
                f'object (with "format": "{FORMAT}", as interlace profile --trace-out writes)'
            ) from None
        raise TraceFormatError(f"{path}:{error.lineno}: not valid JSON ({error.msg})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TraceFormatError(f'{path}:1: not an {FORMAT} file (no "format": "{FORMAT}")')
    if data.get("version") != VERSION:
        raise TraceFormatError(
            f"{path}:1: {FORMAT} version {data.get('version')!r}; this interlace reads "
            f"version {VERSION}"
        )
    lines = text.splitlines()

    def line_of(needle: str, after: int = 0) -> int:
        for number in range(after, len(lines)):
            if needle in lines[number]:
                return number + 1
        return 1

    tensors: list[TensorTrace] = []
    cursor = line_of('"tensors"')
    for index, item in enumerate(data.get("tensors") or []):
        where = line_of(json.dumps(item.get("name")) if isinstance(item, dict) else "{", cursor)
        cursor = where
        try:
            tensors.append(
                TensorTrace(
                    name=str(item["name"]),
                    layer=str(item["layer"]),
                    numel=_int(item["numel"]),
                    nbytes=_int(item["nbytes"]),
                    layer_forward_s=_float(item["layer_forward_s"]),
                    layer_backward_s=_float(item["layer_backward_s"]),
                )
            )
        except (KeyError, TypeError, ValueError) as error:
            raise TraceFormatError(
                f"{path}:{where}: tensor {index} is malformed ({_reason(error)}); each needs "
                "name, layer, numel, nbytes, layer_forward_s and layer_backward_s"
            ) from None
    factors: list[FactorTrace] = []
    cursor = line_of('"factors"')
    for index, item in enumerate(data.get("factors") or []):
        where = line_of("{", cursor + 1)
        cursor = where
        try:
            factors.append(
                FactorTrace(
                    str(item["layer"]),
                    _int(item["a_dim"]),
                    _int(item["g_dim"]),
                    bool(item.get("a_diagonal", False)),
                )
            )
        except (KeyError, TypeError, ValueError) as error:
            raise TraceFormatError(
                f"{path}:{where}: factor {index} is malformed ({_reason(error)}); each needs "
                "layer, a_dim and g_dim"
            ) from None
    activations: list[ActivationTrace] = []
    cursor = line_of('"activations"')
    for index, item in enumerate(data.get("activations") or []):
        where = line_of("{", cursor)
        cursor = where
        try:
            activations.append(ActivationTrace(str(item["layer"]), _shape(item["shape"])))
        except (KeyError, TypeError, ValueError) as error:
            raise TraceFormatError(
                f"{path}:{where}: activation {index} is malformed ({_reason(error)}); each "
                "needs layer and shape (a list of integers)"
            ) from None
    try:
        return Trace(
            model=str(data["model"]),
            tensors=tuple(tensors),
            forward_s=_float(data["forward_s"]),
            backward_s=_float(data["backward_s"]),
            step_s=_float(data.get("step_s", 0.0)),
            factors=tuple(factors),
            source=str(data.get("source", "")),
            workers=_int(data.get("workers", 1)),
            notes=str(data.get("notes", "")),
            broadcast_bytes=tuple(_int(v) for v in data.get("broadcast_bytes") or ()),
            activations=tuple(activations),
            batch_size=_int(data.get("batch_size", 0)),
            input_shape=_shape(data.get("input_shape") or []),
            extra=dict(data.get("extra") or {}),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise TraceFormatError(f"{path}:1: {_reason(error)}") from None


def _reason(error: Exception) -> str:
    if isinstance(error, KeyError):
        return f"missing key {error.args[0]!r}"
    return str(error)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"expected a list of integers, got {value!r}")
    return tuple(_int(v) for v in value)


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")
    return float(value)


# ---------------------------------------------------------------------- Caffe logs


def read_caffe_log(
    path: str | Path,
    text: str | None = None,
    *,
    model: str = "",
    iteration: int | None = None,
    messages: CaffeMessages | str = CaffeMessages.TENSORS,
) -> Trace:
    """One complete iteration of an MG-WFBP Caffe log as a :class:`Trace`.

    Each line ends with ``[i, numel, backward_us, comm_us, merged_comm_us]`` (see
    docs/traces.md): tensor ``i`` counts from the input side, even ``i`` a layer's weight and
    odd ``i`` its bias, both carrying the layer's backward time; an iteration is the run of
    lines ``i = 0, 1, ...`` and backward visits it from the highest ``i`` down. With
    ``messages="logged"`` only the lines with a backward and an all-reduce time logged stay,
    each one message and one layer with its own backward time, as the authors' simulator
    read the logs (no K-FAC factor sizes then).

    Args:
        path: The log (for messages, and read when ``text`` is None).
        text: The log's text.
        model: The model's name (default: the file name up to its first ``_``).
        iteration: Which iteration, counting from 1 (None: the last complete one).
        messages: A :class:`~interlace.sim.caffe_log.CaffeMessages` or its string.

    Raises:
        TraceFormatError: ``FILE:LINE: what is wrong``.
    """
    path = Path(path)
    try:
        unit = CaffeMessages(messages)
    except ValueError:
        raise UsageError(
            f"unknown Caffe messages {messages!r}; choose {', '.join(map(str, CaffeMessages))}"
        ) from None
    if text is None:
        try:
            text = path.read_text()
        except OSError as error:
            raise TraceFormatError(f"{path}: cannot read the trace ({error.strerror})") from None
    iterations = parse_caffe_log(path, text)
    number, records = choose_iteration(path, iterations, iteration)
    factors: list[FactorTrace] = []
    inexact: list[int] = []
    if unit is CaffeMessages.LOGGED:
        tensors = _logged_tensors(path, records)
    else:
        tensors, factors, inexact = _paired_tensors(path, records)
    layer_s = {t.layer: t.layer_backward_s for t in tensors}
    backward_s = sum(layer_s.values())
    return Trace(
        model=model or _model_from_name(path),
        tensors=tuple(tensors),
        forward_s=backward_s * CAFFE_FORWARD_PER_BACKWARD,
        backward_s=backward_s,
        step_s=0.0,
        factors=tuple(factors),
        source=f"Caffe log {path.name}",
        workers=_workers_from_name(path),
        notes=(
            f"iteration {number} of {len(iterations)} in the log; "
            + ("one message per logged all-reduce; " if unit is CaffeMessages.LOGGED else "")
            + f"forward taken as {CAFFE_FORWARD_PER_BACKWARD:g} x backward per layer, as the "
            "authors' simulator did"
            + (
                f"; K-FAC A sizes rounded where a weight is not a multiple of its bias (lines "
                f"{', '.join(map(str, sorted(inexact)))})"
                if inexact
                else ""
            )
        ),
        extra={"comm_s": [record.comm_s for record in records]},
    )


def _caffe_tensor(name: str, layer: str, numel: int, backward_s: float) -> TensorTrace:
    return TensorTrace(
        name,
        layer,
        numel,
        numel * FLOAT32_BYTES,
        backward_s * CAFFE_FORWARD_PER_BACKWARD,
        backward_s,
    )


def _logged_tensors(path: Path, records: list[CaffeRecord]) -> list[TensorTrace]:
    kept = logged_messages(records)
    if not kept:
        raise TraceFormatError(
            f"{path}:{records[0].line}: no line of the iteration logged both a backward and an "
            "all-reduce time; read it with messages='tensors'"
        )
    names = [f"layer{r.index // 2}.{'bias' if r.index % 2 else 'weight'}" for r in kept]
    return [
        _caffe_tensor(name, name, record.numel, record.backward_s)
        for name, record in zip(reversed(names), reversed(kept), strict=True)
    ]


def _paired_tensors(
    path: Path, records: list[CaffeRecord]
) -> tuple[list[TensorTrace], list[FactorTrace], list[int]]:
    if len(records) % 2:
        raise TraceFormatError(
            f"{path}:{records[-1].line}: {len(records)} tensors in an iteration; weights and "
            "biases come in pairs"
        )
    tensors: list[TensorTrace] = []
    factors: list[FactorTrace] = []
    inexact: list[int] = []
    for layer in reversed(range(len(records) // 2)):
        weight, bias = records[2 * layer : 2 * layer + 2]
        if not math.isclose(weight.backward_s, bias.backward_s, rel_tol=1e-6):
            raise TraceFormatError(
                f"{path}:{bias.line}: a bias's backward time ({bias.backward_s * 1e6:g} us) "
                f"differs from its weight's on line {weight.line} ({weight.backward_s * 1e6:g} us)"
            )
        if weight.numel % bias.numel:
            inexact.append(weight.line)
        name = f"layer{layer}"
        for suffix, numel in (("weight", weight.numel), ("bias", bias.numel)):
            tensors.append(_caffe_tensor(f"{name}.{suffix}", name, numel, weight.backward_s))
        # A Caffe convolution or inner product: G is out x out (bias length), A is the unfolded
        # input plus the ones column of the bias. A weight that is not a multiple of its bias
        # (the log pairs a few tensors of different layers) gets the nearest size, said in notes.
        factors.append(FactorTrace(name, max(round(weight.numel / bias.numel), 1) + 1, bias.numel))
    return tensors, factors, inexact


def _model_from_name(path: Path) -> str:
    return path.stem.split("_")[0] or path.stem


def _workers_from_name(path: Path) -> int:
    match = re.search(r"(\d+)\s*workers", path.name)
    return int(match[1]) if match else 1
