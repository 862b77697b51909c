"""The stages x replicas layout against torch's DeviceMesh convention, written out here."""

from __future__ import annotations

import pytest

from interlace.errors import UsageError
from interlace.pipeline.layout import MESH_DIM_NAMES, PipelineLayout, averaging_points
from interlace.pipeline.schedule import SCHEDULE_TYPES, Op


def test_mesh_is_arange_reshaped_replicas_by_stages() -> None:
    layout = PipelineLayout.for_world(8, stages=4)
    assert (layout.stages, layout.replicas, layout.world_size) == (4, 2, 8)
    assert layout.mesh() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert MESH_DIM_NAMES == ("dp", "pp")


def test_stage_groups_and_pipelines() -> None:
    layout = PipelineLayout(stages=2, replicas=4)
    assert layout.pipeline_ranks(1) == [2, 3]
    assert layout.stage_ranks(0) == [0, 2, 4, 6]
    assert [layout.stage_of(r) for r in range(8)] == [0, 1] * 4
    assert [layout.replica_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(layout.rank_of(layout.stage_of(r), layout.replica_of(r)) == r for r in range(8))


def test_nodes() -> None:
    layout = PipelineLayout(stages=4, replicas=4, gpus_per_node=8)
    assert not layout.crosses_nodes(layout.pipeline_ranks(1))
    assert layout.nodes_spanned(layout.stage_ranks(0)) == 2
    assert PipelineLayout(stages=2, replicas=2).nodes_spanned([0, 1, 2, 3]) == 1


def test_describe_names_every_group() -> None:
    text = PipelineLayout(stages=2, replicas=2).describe()
    assert "2 stages x 2 replicas" in text
    assert "stage 0 [0, 2]; stage 1 [1, 3]" in text


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: PipelineLayout.for_world(6, stages=4), "divides the ranks: 1, 2, 3, 6"),
        (lambda: PipelineLayout(stages=0), "at least 1 stage"),
        (lambda: PipelineLayout.from_mesh((2, 3), 8), "holds 6 ranks but the job has 8"),
        (lambda: PipelineLayout.from_mesh((8,), 8), "two dimensions"),
        (lambda: PipelineLayout(stages=2, replicas=2).stage_of(4), "outside"),
    ],
)
def test_bad_layouts_are_one_line(call: object, message: str) -> None:
    with pytest.raises(UsageError, match=message) as info:
        call()  # type: ignore[operator]
    assert "\n" not in str(info.value)


def test_spread_and_same_node() -> None:
    layout = PipelineLayout(stages=2, replicas=8, gpus_per_node=4)
    assert layout.spread(layout.stage_ranks(0)) == (4, 2)  # ranks 0, 2 | 4, 6 | ...
    assert layout.same_node(2, 3) and not layout.same_node(3, 4)
    assert PipelineLayout(stages=2, replicas=2).spread([0, 1, 2, 3]) == (1, 4)


@pytest.mark.parametrize("name", sorted(SCHEDULE_TYPES))
def test_each_update_averages_after_the_last_backward_before_it(name: str) -> None:
    program = SCHEDULE_TYPES[name](3, 4).program(1, pieces=2)
    points = averaging_points(program)
    updates = [i for i, a in enumerate(program) if a.op is Op.UPDATE]
    assert [p.update for p in points] == updates
    for point in points:
        assert program[point.backward].op is Op.BACKWARD
        between = program[point.backward + 1 : point.update]
        assert all(a.op is not Op.BACKWARD for a in between)
    # One update per mini-batch: after the whole step (synchronous) or each mini-batch.
    assert len(points) == (1 if SCHEDULE_TYPES[name].synchronous else 4)
