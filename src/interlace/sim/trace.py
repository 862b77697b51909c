"""Reading traces: :func:`load_trace` from a shipped trace's name, an ``interlace-trace`` JSON
file or an MG-WFBP Caffe log (:func:`read_caffe_log`). Loading and simulating a trace needs no
torch.

The trace itself (:class:`Trace` and its parts, in :mod:`interlace.sim.trace_data`) is importable
from here too: traces are built from measurements by :mod:`interlace.sim.profiled`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from interlace.errors import UsageError
from interlace.sim.caffe_log import (
    CaffeMessages,
    CaffeRecord,
    TraceFormatError,
    choose_iteration,
    logged_messages,
    parse_caffe_log,
)
from interlace.sim.trace_data import (
    FORMAT,
    VERSION,
    ActivationTrace,
    FactorTrace,
    TensorTrace,
    Trace,
)
from interlace.sim.traces import shipped_trace, trace_names

__all__ = [
    "CAFFE_FORWARD_PER_BACKWARD",
    "FLOAT32_BYTES",
    "FORMAT",
    "VERSION",
    "ActivationTrace",
    "FactorTrace",
    "TensorTrace",
    "Trace",
    "TraceFormatError",
    "load_trace",
    "read_caffe_log",
]

#: Bytes of a float32 gradient element, the Caffe logs' element type.
FLOAT32_BYTES = 4

#: The MG-WFBP authors' simulator took the forward pass as half of the backward pass (their
#: logs time only backward); we follow it for traces read from those logs.
CAFFE_FORWARD_PER_BACKWARD = 0.5


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
