"""Ranks as pipeline stages x data-parallel replicas: who holds which stage, who averages with whom.

Pure arithmetic shared by the runtime (its process groups) and the simulator and planner (which
links a message crosses), so both see one layout. torch's 2D ``DeviceMesh`` convention: the mesh
is ``arange(N).reshape(replicas, stages)`` with dimensions ``("dp", "pp")``, so a pipeline's
stages sit on neighbouring ranks (inside a node) and a stage's replicas are ``stages`` ranks apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from interlace.errors import UsageError
from interlace.pipeline.schedule import Action, Op

__all__ = ["MESH_DIM_NAMES", "AveragePoint", "PipelineLayout", "averaging_points"]

#: The mesh's dimension names, outer first, as torchtitan names them.
MESH_DIM_NAMES = ("dp", "pp")


@dataclass(frozen=True)
class PipelineLayout:
    """``stages`` x ``replicas`` ranks: rank ``r`` holds stage ``r % stages`` of replica
    ``r // stages``.

    Args:
        stages: Pipeline stages (ranks per pipeline).
        replicas: Copies of the pipeline whose stages average their gradients.
        gpus_per_node: Ranks per node, to tell links inside a node from links between nodes;
            None for one flat network.
    """

    stages: int
    replicas: int = 1
    gpus_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise UsageError(f"a pipeline needs at least 1 stage, got stages={self.stages}")
        if self.replicas < 1:
            raise UsageError(f"a pipeline needs at least 1 replica, got replicas={self.replicas}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise UsageError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")

    @classmethod
    def for_world(
        cls, world_size: int, stages: int, gpus_per_node: int | None = None
    ) -> PipelineLayout:
        """The layout of ``world_size`` ranks cut into pipelines of ``stages`` stages.

        Args:
            world_size: All ranks of the job.
            stages: Stages per pipeline; must divide ``world_size``.
            gpus_per_node: As for the class.

        Raises:
            UsageError: When ``stages`` does not divide ``world_size``.
        """
        if stages < 1 or world_size < 1:
            raise UsageError(f"need stages >= 1 and ranks >= 1, got {stages} and {world_size}")
        if world_size % stages:
            valid = [s for s in range(1, world_size + 1) if world_size % s == 0]
            raise UsageError(
                f"{world_size} ranks cannot be cut into pipelines of {stages} stages; "
                f"use a number of stages that divides the ranks: {', '.join(map(str, valid))}"
            )
        return cls(stages, world_size // stages, gpus_per_node)

    @classmethod
    def from_mesh(cls, shape: tuple[int, ...], world_size: int) -> PipelineLayout:
        """The layout of a ``(replicas, stages)`` mesh, checked against the ranks there are.

        Args:
            shape: The mesh's shape, data-parallel dimension first (``MESH_DIM_NAMES``).
            world_size: The ranks of the job.

        Raises:
            UsageError: When the shape is not two-dimensional or does not cover the ranks.
        """
        if len(shape) != 2:
            raise UsageError(
                f"a pipeline mesh has two dimensions {MESH_DIM_NAMES}, got shape {tuple(shape)}"
            )
        replicas, stages = shape
        if replicas * stages != world_size:
            raise UsageError(
                f"a mesh of shape {tuple(shape)} holds {replicas * stages} ranks but the job has "
                f"{world_size}; make replicas x stages equal the ranks"
            )
        return cls(stages, replicas)

    @property
    def world_size(self) -> int:
        """All ranks: stages x replicas."""
        return self.stages * self.replicas

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise UsageError(f"rank {rank} is outside the layout's {self.world_size} ranks")

    def stage_of(self, rank: int) -> int:
        """The stage ``rank`` holds."""
        self._check(rank)
        return rank % self.stages

    def replica_of(self, rank: int) -> int:
        """The pipeline replica ``rank`` belongs to."""
        self._check(rank)
        return rank // self.stages

    def rank_of(self, stage: int, replica: int) -> int:
        """The rank that holds ``stage`` of ``replica``."""
        if not (0 <= stage < self.stages and 0 <= replica < self.replicas):
            raise UsageError(
                f"stage {stage} of replica {replica} is outside {self.stages} stages x "
                f"{self.replicas} replicas"
            )
        return replica * self.stages + stage

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The ranks of one pipeline, stage 0 first (its point-to-point group)."""
        return [self.rank_of(stage, replica) for stage in range(self.stages)]

    def stage_ranks(self, stage: int) -> list[int]:
        """The ranks that hold ``stage`` in every replica (its gradient-averaging group)."""
        return [self.rank_of(stage, replica) for replica in range(self.replicas)]

    def mesh(self) -> list[list[int]]:
        """The ranks as a ``(replicas, stages)`` grid: a ``DeviceMesh`` for ``MESH_DIM_NAMES``."""
        return [self.pipeline_ranks(replica) for replica in range(self.replicas)]

    def node_of(self, rank: int) -> int:
        """The node ``rank`` sits on (0 on a flat network)."""
        self._check(rank)
        return 0 if self.gpus_per_node is None else rank // self.gpus_per_node

    def crosses_nodes(self, ranks: list[int]) -> bool:
        """Whether a group of ranks spans more than one node."""
        return len({self.node_of(rank) for rank in ranks}) > 1

    def nodes_spanned(self, ranks: list[int]) -> int:
        """How many nodes a group of ranks spans."""
        return len({self.node_of(rank) for rank in ranks})

    def spread(self, ranks: list[int]) -> tuple[int, int]:
        """``(nodes, per_node)``: the nodes a group spans and the most of its ranks on one.

        Args:
            ranks: The group.
        """
        counts: dict[int, int] = {}
        for rank in ranks:
            node = self.node_of(rank)
            counts[node] = counts.get(node, 0) + 1
        return len(counts), max(counts.values(), default=0)

    def same_node(self, first: int, second: int) -> bool:
        """Whether two ranks share a node (always, on a flat network)."""
        return self.node_of(first) == self.node_of(second)

    def describe(self) -> str:
        """The layout in a few lines, printed at the start of a run."""
        where = "" if self.gpus_per_node is None else f", {self.gpus_per_node} ranks per node"
        lines = [f"pipeline layout: {self.stages} stages x {self.replicas} replicas{where}"]
        for replica in range(self.replicas):
            ranks = self.pipeline_ranks(replica)
            lines.append(f"  replica {replica}: stages 0..{self.stages - 1} on ranks {ranks}")
        if self.replicas > 1:
            groups = "; ".join(
                f"stage {stage} {self.stage_ranks(stage)}" for stage in range(self.stages)
            )
            lines.append(f"  gradients averaged over: {groups}")
        return "\n".join(lines)


@dataclass(frozen=True)
class AveragePoint:
    """Where a replicated stage averages its gradients over its replicas in one program.

    The all-reduce's buckets start as the launching backward makes their gradients (the
    earlier backwards since the last update only accumulate), and the update waits for all of
    them: the stage updates where the single-replica schedule does, with averaged gradients.

    Args:
        backward: Index in the program of the backward that completes the gradients.
        update: Index of the update that applies them.
    """

    backward: int
    update: int


def averaging_points(program: Sequence[Action]) -> tuple[AveragePoint, ...]:
    """Every update of a stage's lowered program and the backward that launches its average:
    the last backward before it (the rule the runtime runs and the simulator prices).

    Args:
        program: A stage's program (:meth:`~interlace.pipeline.schedule.Schedule.program`).

    Raises:
        ValueError: For an update with no backward since the one before.
    """
    points = []
    last: int | None = None
    for index, action in enumerate(program):
        if action.op is Op.BACKWARD:
            last = index
        elif action.op is Op.UPDATE:
            if last is None:
                raise ValueError(f"update at {index} follows no backward since the last update")
            points.append(AveragePoint(last, index))
            last = None
    return tuple(points)
