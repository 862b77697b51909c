"""Network models for the simulator: the all-reduce cost ``a + b*M`` at any number of workers.

Each :class:`Network` answers :meth:`Network.cost` ``(workers)``: ring, double binary tree,
hierarchical ring (a two-level network), a fitted model, or a ring fitted on OSU logs; pipelines
also ask for its point-to-point links (:meth:`Network.point_to_point`). :func:`parse_network` reads
``--network``.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from interlace.comm.cost import CostModel, fit_osu_log
from interlace.comm.links import parse_link
from interlace.errors import UsageError
from interlace.sim.traces import osu_set_names, shipped_osu_set

#: Latency per step of a link when a ``--network`` spec gives none: a small-message round on
#: 10 GbE with TCP and MPI costs tens of microseconds.
DEFAULT_LATENCY_S = 25e-6
#: The link inside a node of :class:`HierarchicalRing` when none is given: PCIe 3.0 x16 class.
DEFAULT_INTRA_RATE_BPS = 100e9
DEFAULT_INTRA_LATENCY_S = 5e-6
#: OSU messages below this are dominated by per-call software costs that a ring's alpha does not
#: describe; the fits use the larger ones.
OSU_MIN_BYTES = 0
#: The links of the MG-WFBP authors' simulator by network (``--network paper:10gbe``): its
#: ring "lower bound" prices an all-reduce as ``2(n-1) alpha + 2(n-1)/n M beta + (n-1)/n M gamma``
#: with these ``(alpha, beta, gamma)``, their constants as they wrote them (docs/simulate.md).
PAPER_LINKS: dict[str, tuple[float, float, float]] = {
    "10gbe": (45.25e-6, 1.2 / (9 * 2**30 / 8), 160 / (16e9 * 4)),
}


@dataclass(frozen=True)
class Link:
    """A point-to-point link.

    Args:
        alpha: Seconds per message.
        beta: Seconds per byte on the wire.
        gamma: Seconds per byte reduced.

    Raises:
        ValueError: For a negative or non-finite parameter.
    """

    alpha: float
    beta: float
    gamma: float = 0.0

    def __post_init__(self) -> None:
        values = (self.alpha, self.beta, self.gamma)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"link parameters must be finite and >= 0, got {values}")

    @classmethod
    def from_rate(cls, rate_bps: float, latency_s: float | None = None) -> Link:
        """A link of ``rate_bps`` bits per second.

        Args:
            rate_bps: The rate, > 0.
            latency_s: Seconds per message (default :data:`DEFAULT_LATENCY_S`).
        """
        if not rate_bps > 0:
            raise ValueError(f"a link rate must be > 0, got {rate_bps}")
        return cls(DEFAULT_LATENCY_S if latency_s is None else latency_s, 8.0 / rate_bps)

    def describe(self) -> str:
        """One line: latency, rate and reduction cost."""
        rate = 8.0 / self.beta if self.beta > 0 else math.inf
        text = f"alpha {self.alpha * 1e6:.1f} us, {_rate_text(rate)}"
        return text + (f", gamma {self.gamma * 1e9:.3f} ns/B" if self.gamma else "")


class Network(ABC):
    """A way to price an all-reduce on any number of workers."""

    #: The ``--network`` spec this model was built from (for tables and file names).
    spec: str = ""

    @abstractmethod
    def cost(self, workers: int) -> CostModel:
        """``a + b*M`` of one all-reduce on ``workers`` workers.

        Args:
            workers: The worker count, >= 1.
        """

    @abstractmethod
    def describe(self) -> str:
        """One line saying what the model is and where its numbers come from."""

    @property
    def node_size(self) -> int | None:
        """Workers per node of a two-level network; None where every link is alike."""
        return None

    def point_to_point(self, same_node: bool = False) -> Link | None:
        """The point-to-point link between two workers (inside one node or between nodes), or
        None where the model prices all-reduces only.

        Args:
            same_node: The two workers share a node (a two-level network's intra link).
        """
        return None

    def group_cost(self, workers: int, per_node: int = 1) -> CostModel:
        """``a + b*M`` of one all-reduce over a group of ``workers`` spread ``per_node`` to a
        node (a flat network: :meth:`cost`).

        Args:
            workers: The group's size, >= 1.
            per_node: Members of the group on each node it spans.
        """
        return self.cost(workers)


def _check_workers(workers: int) -> None:
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")


@dataclass(frozen=True)
class Ring(Network):
    """Ring all-reduce over identical links (:meth:`CostModel.ring`).

    Args:
        link: Every link of the ring.
        spec: The ``--network`` spec it was built from.
    """

    link: Link
    spec: str = ""

    def cost(self, workers: int) -> CostModel:
        _check_workers(workers)
        return CostModel.ring(workers, self.link.alpha, self.link.beta, self.link.gamma)

    def describe(self) -> str:
        return f"ring all-reduce, {self.link.describe()}"

    def point_to_point(self, same_node: bool = False) -> Link | None:
        return self.link


@dataclass(frozen=True)
class PaperRing(Ring):
    """The ring all-reduce of the MG-WFBP authors' simulator on ``network``
    (:data:`PAPER_LINKS`): the same formula as :class:`Ring`, their constants.

    Args:
        link: Their link.
        network: The network's name in :data:`PAPER_LINKS`.
        spec: The ``--network`` spec it was built from.
    """

    network: str = ""

    def describe(self) -> str:
        link = self.link
        return (
            f"ring all-reduce of MG-WFBP's simulator ({self.network}): alpha "
            f"{link.alpha * 1e6:g} us, beta {link.beta * 1e9:.4g} ns/B "
            f"({_rate_text(8.0 / link.beta)}), gamma {link.gamma * 1e9:g} ns/B"
        )


@dataclass(frozen=True)
class Tree(Network):
    """Double binary tree all-reduce over identical links
    (:meth:`CostModel.double_binary_tree`).

    Args:
        link: Every link of the trees.
        spec: The ``--network`` spec it was built from.
    """

    link: Link
    spec: str = ""

    def cost(self, workers: int) -> CostModel:
        _check_workers(workers)
        return CostModel.double_binary_tree(
            workers, self.link.alpha, self.link.beta, self.link.gamma
        )

    def describe(self) -> str:
        return f"double binary tree all-reduce, {self.link.describe()}"

    def point_to_point(self, same_node: bool = False) -> Link | None:
        return self.link


@dataclass(frozen=True)
class HierarchicalRing(Network):
    """A two-level network: nodes of ``gpus_per_node`` workers joined by ``intra`` links, each
    worker with its own ``inter`` link (NIC lane) to the other nodes.

    An all-reduce is priced hierarchically: ring reduce-scatter inside the node, ring all-reduce
    of each member's ``1/G`` share across the nodes (the node's ``G`` rings at once, one per
    lane), ring all-gather inside the node. A ring over every member would carry the whole
    message over the slowest (inter-node) link on each step and leave the other lanes idle; the
    hierarchy is what NCCL's and Horovod's multi-node all-reduces do. Fewer workers than a node
    are one partial node. A point-to-point message uses ``intra`` inside a node, ``inter``
    between nodes.

    Args:
        gpus_per_node: Workers per node, >= 1.
        inter: The link between nodes.
        intra: The link inside a node.
        spec: The ``--network`` spec it was built from.
    """

    gpus_per_node: int
    inter: Link
    intra: Link
    spec: str = ""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus per node must be >= 1, got {self.gpus_per_node}")

    @property
    def node_size(self) -> int | None:
        return self.gpus_per_node

    def cost(self, workers: int) -> CostModel:
        _check_workers(workers)
        return self.group_cost(workers, min(self.gpus_per_node, workers))

    def group_cost(self, workers: int, per_node: int = 1) -> CostModel:
        _check_workers(workers)
        local = max(1, min(per_node, workers))
        nodes = math.ceil(workers / local)
        # Reduce-scatter then all-gather inside the node is one intra-node ring all-reduce.
        inside = CostModel.ring(local, self.intra.alpha, self.intra.beta, self.intra.gamma)
        across = CostModel.ring(nodes, self.inter.alpha, self.inter.beta, self.inter.gamma)
        # Across nodes each worker carries only its 1/local share of the message.
        return CostModel(inside.a + across.a, inside.b + across.b / local)

    def point_to_point(self, same_node: bool = False) -> Link | None:
        return self.intra if same_node else self.inter

    def describe(self) -> str:
        return (
            f"two-level, {self.gpus_per_node} workers per node, hierarchical all-reduce; "
            f"between nodes {self.inter.describe()}; inside a node {self.intra.describe()}"
        )


@dataclass(frozen=True)
class Fitted(Network):
    """A measured ``a + b*M``: as it is at every size, or extrapolated with the ring formula.

    Args:
        model: The measured cost.
        fitted_on: The worker count it was measured on (None: use it at every count).
        spec: The ``--network`` spec it was built from.
    """

    model: CostModel
    fitted_on: int | None = None
    spec: str = ""

    def cost(self, workers: int) -> CostModel:
        _check_workers(workers)
        if self.fitted_on is None:
            return self.model
        return self.model.scaled_to(workers, self.fitted_on)

    def point_to_point(self, same_node: bool = False) -> Link | None:
        """The ring link behind a fit made on ``N`` workers (``a = 2(N-1) alpha``,
        ``b = 2(N-1)/N beta``); None for a fit used as it is at every count."""
        n = self.fitted_on
        if n is None or n < 2:
            return None
        return Link(self.model.a / (2 * (n - 1)), self.model.b * n / (2 * (n - 1)))

    def describe(self) -> str:
        base = f"fitted a={self.model.a * 1e6:.1f} us, b={self.model.b * 1e9:.3f} ns/B"
        if self.fitted_on is None:
            return base + " at every worker count"
        return base + f" on {self.fitted_on} workers, extrapolated as a ring"


def fit_ring_link(models: dict[int, CostModel]) -> Link:
    """Per-link ``alpha`` and ``beta`` that best explain fits at several worker counts.

    A ring on ``N`` workers has ``a = 2(N-1) alpha`` and ``b = 2(N-1)/N beta``; each is a line
    through the origin in its coefficient, fitted by least squares over the worker counts.

    Args:
        models: ``a + b*M`` by worker count.

    Raises:
        UsageError: Without a count of 2 or more.
    """
    counts = sorted(n for n in models if n >= 2)
    if not counts:
        raise UsageError("fitting a ring needs all-reduce times on 2 or more workers")
    xa = [2.0 * (n - 1) for n in counts]
    xb = [2.0 * (n - 1) / n for n in counts]
    alpha = sum(x * models[n].a for x, n in zip(xa, counts, strict=True)) / sum(x * x for x in xa)
    beta = sum(x * models[n].b for x, n in zip(xb, counts, strict=True)) / sum(x * x for x in xb)
    return Link(max(alpha, 0.0), max(beta, 0.0))


def osu_logs(paths: Sequence[str | Path]) -> list[Path]:
    """The OSU logs named by ``paths``; a folder stands for its ``osu_allreduce*`` files.

    Args:
        paths: Shipped log set names (:func:`interlace.sim.traces.osu_set_names`, such as
            ``10gbe``), files or folders.

    Raises:
        UsageError: For a path that does not exist, or no logs at all.
    """
    found: list[Path] = []
    for item in paths:
        if isinstance(item, str) and (shipped := shipped_osu_set(item)) is not None:
            found.extend(shipped)
            continue
        path = Path(item).expanduser()
        if path.is_dir():
            found.extend(sorted(path.glob("osu_allreduce*")))
        elif path.exists():
            found.append(path)
        else:
            raise UsageError(
                f"--network osu: {path} does not exist and is not a shipped log set "
                f"({', '.join(osu_set_names())})"
            )
    if not found:
        raise UsageError(f"--network osu: no osu_allreduce* logs in {', '.join(map(str, paths))}")
    return found


def fits_from_osu(paths: Sequence[str | Path]) -> dict[int, CostModel]:
    """One ``a + b*M`` per worker count found in the OSU logs.

    Args:
        paths: Files or folders (:func:`osu_logs`).
    """
    models: dict[int, CostModel] = {}
    for path in osu_logs(paths):
        try:
            models.update(fit_osu_log(path, min_bytes=OSU_MIN_BYTES))
        except ValueError as error:
            raise UsageError(f"--network osu: {error}") from None
    return models


def link_from_osu(paths: Sequence[str | Path]) -> tuple[Link, dict[int, CostModel]]:
    """The per-link ring parameters fitted on OSU logs, and the per-size fits behind them.

    Args:
        paths: Files or folders (:func:`osu_logs`).
    """
    models = fits_from_osu(paths)
    return fit_ring_link(models), models


_LATENCY = re.compile(r"^(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)\s*(ns|us|ms|s)$")
_LATENCY_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}

NETWORK_HELP = (
    "ring:RATE[:LATENCY[:GAMMA]] | tree:RATE[:LATENCY[:GAMMA]] | "
    "hier:G:RATE[:LATENCY[:INTRA_RATE]] | two-level:G:INTRA_RATE:INTER_RATE[:INTRA_LATENCY"
    "[:INTER_LATENCY]] | osu:NAME|PATH[,PATH...] | fitted:A,B[@N] | "
    f"paper:{'|'.join(PAPER_LINKS)}"
)


def parse_network(text: str) -> Network:
    """A :class:`Network` from a ``--network`` spec.

    - ``ring:10gbit`` / ``ring:10gbit:50us`` / ``ring:10gbit:50us:2.5ns``: ring all-reduce
      over links of that rate, per-step latency (default :data:`DEFAULT_LATENCY_S`) and
      reduction time per byte (default 0);
    - ``tree:10gbit[:50us[:2.5ns]]``: double binary tree over the same links;
    - ``hier:8:10gbit[:50us[:100gbit]]``: hierarchical ring, 8 workers per node, the given
      link between nodes and (default :data:`DEFAULT_INTRA_RATE_BPS`) inside a node;
    - ``two-level:8:100gbit:10gbit[:5us[:25us]]``: the same two-level network
      (:class:`HierarchicalRing`) with both links named: 8 workers per node, 100 Gbit/s inside
      a node, 10 Gbit/s between nodes, and their latencies (default
      :data:`DEFAULT_INTRA_LATENCY_S`, :data:`DEFAULT_LATENCY_S`);
    - ``osu:PATH[,PATH...]``: a ring whose per-link alpha and beta are fitted on OSU all-reduce
      logs at several worker counts (a folder means its ``osu_allreduce*`` files; a shipped
      set's name, such as ``osu:10gbe``, its files);
    - ``fitted:A,B``: ``a = A`` seconds and ``b = B`` seconds/byte at every worker count;
      ``fitted:A,B@N``: fitted on N workers, extrapolated with the ring formula;
    - ``paper:10gbe``: the ring of the MG-WFBP authors' simulator (:data:`PAPER_LINKS`).

    Rates are as ``--link`` writes them (``100mbit``, ``10gbit``); latencies take ``ns``, ``us``,
    ``ms`` or ``s``.

    Args:
        text: The spec.

    Raises:
        UsageError: Naming what is wrong and the accepted forms.
    """
    kind, _, rest = text.strip().partition(":")
    kind = kind.lower()
    parts = rest.split(":") if rest else []
    try:
        if kind in ("ring", "tree"):
            if not 1 <= len(parts) <= 3:
                raise UsageError(f"{kind} takes RATE[:LATENCY[:GAMMA]]")
            link = Link.from_rate(_rate(parts[0]), _latency(parts[1]) if len(parts) > 1 else None)
            if len(parts) > 2:
                link = Link(link.alpha, link.beta, _latency(parts[2]))
            return Ring(link, text) if kind == "ring" else Tree(link, text)
        if kind == "paper":
            if rest.lower() not in PAPER_LINKS:
                raise UsageError(f"paper takes one of {', '.join(PAPER_LINKS)}")
            return PaperRing(Link(*PAPER_LINKS[rest.lower()]), spec=text, network=rest.lower())
        if kind == "two-level":
            if not 3 <= len(parts) <= 5:
                raise UsageError(
                    "two-level takes G:INTRA_RATE:INTER_RATE[:INTRA_LATENCY[:INTER_LATENCY]]"
                )
            gpus = _per_node(parts[0])
            intra = Link.from_rate(
                _rate(parts[1]), _latency(parts[3]) if len(parts) > 3 else DEFAULT_INTRA_LATENCY_S
            )
            inter = Link.from_rate(_rate(parts[2]), _latency(parts[4]) if len(parts) > 4 else None)
            return HierarchicalRing(gpus, inter, intra, text)
        if kind == "hier":
            if not 2 <= len(parts) <= 4:
                raise UsageError("hier takes G:RATE[:LATENCY[:INTRA_RATE]]")
            gpus = _per_node(parts[0])
            inter = Link.from_rate(_rate(parts[1]), _latency(parts[2]) if len(parts) > 2 else None)
            intra_rate = _rate(parts[3]) if len(parts) > 3 else DEFAULT_INTRA_RATE_BPS
            intra = Link.from_rate(intra_rate, DEFAULT_INTRA_LATENCY_S)
            return HierarchicalRing(gpus, inter, intra, text)
        if kind == "osu":
            if not rest:
                raise UsageError(
                    "osu takes NAME or PATH[,PATH...] (a shipped log set, OSU logs or a folder)"
                )
            link, _ = link_from_osu([p for p in rest.split(",") if p])
            return Ring(link, text)
        if kind == "fitted":
            body, _, on = rest.partition("@")
            numbers = body.split(",")
            if len(numbers) != 2:
                raise UsageError("fitted takes A,B[@N] (seconds, seconds per byte)")
            try:
                a, b = float(numbers[0]), float(numbers[1])
                fitted_on = int(on) if on else None
            except ValueError:
                raise UsageError(f"fitted takes numbers A,B[@N], got {rest!r}") from None
            if fitted_on is not None and fitted_on < 2:
                raise UsageError(f"fitted A,B@N needs N >= 2, got {fitted_on}")
            try:
                model = CostModel(a, b)
            except ValueError as error:
                raise UsageError(str(error)) from None
            return Fitted(model, fitted_on, text)
        raise UsageError(f"unknown kind {kind!r}")
    except UsageError as error:
        raise UsageError(f"--network {text!r}: {error}; accepted: {NETWORK_HELP}") from None


def _per_node(text: str) -> int:
    try:
        gpus = int(text)
    except ValueError:
        raise UsageError(f"workers per node must be an integer, got {text!r}") from None
    if gpus < 1:
        raise UsageError(f"workers per node must be >= 1, got {gpus}")
    return gpus


def _rate(text: str) -> float:
    return parse_link(text)


def _latency(text: str) -> float:
    match = _LATENCY.match(text.strip().lower())
    if match is None:
        raise UsageError(f"latency {text!r} is not a time such as 25us, 1ms")
    return float(match[1]) * _LATENCY_UNITS[match[2]]


def _rate_text(rate_bps: float) -> str:
    if not math.isfinite(rate_bps):
        return "unlimited bandwidth"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if rate_bps >= scale:
            return f"{rate_bps / scale:.3g} {unit}"
    return f"{rate_bps:.3g} bit/s"
