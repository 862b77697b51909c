"""The pipeline runtime on real ranks against references computed in one process.

* Transparency: GPipe and synchronous 1F1B give the unpipelined model's gradients on the same
  mini-batch (1e-6 relative, float64), on 2 and 4 stages, with activations of changing shapes.
* Asynchronous schedules: the weights after a stream of mini-batches equal a sequential
  reference that applies each policy's rule by hand (which version of the weights each pass
  uses, SGD momentum written out, SpecTrain's prediction by the paper's formula).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.func import functional_call

from interlace.errors import RankFailedError, UsageError
from interlace.pipeline.runtime import PipelineStage
from interlace.testing import run_ranks, run_scenarios

# The multi-rank tests share a launch per job size (the ``two_ranks`` and ``four_ranks``
# fixtures, each set up in the time of the first test that asks for it).
pytestmark = pytest.mark.timeout(460)

BATCH = 16
CLASSES = 3


def _stages(num_stages: int) -> list[nn.Module]:
    """A small conv net cut into stages whose outputs change shape (4-D, then 2-D)."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh()),  # [B, 3, 5, 5]
        nn.Sequential(nn.Conv2d(3, 2, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten()),  # [B, 18]
        nn.Sequential(nn.Linear(18, 10), nn.Tanh()),
        nn.Linear(10, CLASSES),
    ]
    blocks = [b.double() for b in blocks]
    if num_stages == 4:
        return blocks
    assert num_stages == 2
    return [nn.Sequential(*blocks[:2]), nn.Sequential(*blocks[2:])]


def _data(count: int) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, 1, 5, 5, generator=generator, dtype=torch.float64),
            torch.randint(0, CLASSES, (BATCH,), generator=generator),
        )
        for _ in range(count)
    ]


def _runner(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    num_stages: int,
    schedule: str,
    **options: Any,
) -> PipelineStage:
    """This rank's stage (rank = stage) with the tests' loss."""
    return PipelineStage(
        module,
        optimizer,
        stage=dist.get_rank(),
        num_stages=num_stages,
        schedule=schedule,
        loss_fn=nn.functional.cross_entropy,
        **options,
    )


class _RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it was handed at every step."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.seen: list[list[Tensor]] = []

    def step(self, closure: Any = None) -> Any:
        params = [p for group in self.param_groups for p in group["params"]]
        self.seen.append([p.grad.detach().clone() for p in params if p.grad is not None])
        return super().step(closure)


def _sync_rank(schedule: str, num_stages: int, microbatches: int) -> list[Tensor]:
    stage = dist.get_rank()
    module = _stages(num_stages)[stage]
    optimizer = _RecordingSGD(module.parameters(), lr=0.1)
    runner = _runner(module, optimizer, num_stages, schedule, microbatches=microbatches)
    data = _data(1) if stage in (0, num_stages - 1) else None
    result = runner.run(data, 1)
    assert result.updates == 1
    return optimizer.seen[0]


SYNC_CASES = [("gpipe", 4), ("1f1b", 4), ("gpipe", 3), ("1f1b", 3)]


def _sync_cases_rank(num_stages: int) -> list[list[Tensor]]:
    """Every case of SYNC_CASES in one launch (spawning ranks costs more than the cases)."""
    return [_sync_rank(schedule, num_stages, micro) for schedule, micro in SYNC_CASES]


@pytest.mark.parametrize("num_stages", [2, 4])
def test_synchronous_schedules_give_the_unpipelined_gradients(
    num_stages: int, request: pytest.FixtureRequest
) -> None:
    per_stage = _shared(request, num_stages)["sync"]
    model = nn.Sequential(*_stages(num_stages))
    inputs, targets = _data(1)[0]
    nn.functional.cross_entropy(model(inputs), targets).backward()
    expected = [p.grad for p in model.parameters()]
    for case, (schedule, micro) in enumerate(SYNC_CASES):
        got = [g for stage in per_stage for g in stage[case]]
        assert len(got) == len(expected), (schedule, micro)
        for g, e in zip(got, expected, strict=True):
            assert e is not None
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-12, msg=f"{schedule} x{micro}")


LR, MOMENTUM = 0.05, 0.9


def _async_rank(
    schedule: str,
    num_stages: int,
    count: int,
    spectrain_backward: str = "recompute",
    chunks: int = 1,
) -> list[Tensor]:
    stage = dist.get_rank()
    module = _stages(num_stages)[stage]
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    runner = _runner(
        module,
        optimizer,
        num_stages,
        schedule,
        spectrain_backward=spectrain_backward,
        chunks=chunks,
    )
    data = _data(count) if stage in (0, num_stages - 1) else None
    result = runner.run(data, count)
    assert result.updates == count
    return [p.detach().clone() for p in module.parameters()]


def _reference(
    schedule: str, num_stages: int, count: int, spectrain_backward: str = "recompute"
) -> list[Tensor]:
    """The asynchronous pipeline's arithmetic, one mini-batch at a time in one process.

    Stage k runs batch b's forward after max(0, b - (N - k - 1)) updates and its backward after
    b updates. History keeps every version of every stage's weights and momentum buffers.
    """
    stages = _stages(num_stages)
    names = [[n for n, _ in s.named_parameters()] for s in stages]
    weights = [[{n: p.detach().clone() for n, p in s.named_parameters()}] for s in stages]
    buffers: list[list[dict[str, Tensor] | None]] = [[None] for _ in stages]

    def version_weights(k: int, version: int, ahead: int) -> dict[str, Tensor]:
        w, v = weights[k][version], buffers[k][version]
        if v is None or ahead == 0:
            return {n: t.clone() for n, t in w.items()}
        return {n: w[n] - ahead * LR * v[n] for n in w}

    for b, (inputs, targets) in enumerate(_data(count)):
        saved_inputs, forward_versions = [], []
        x = inputs
        for k, module in enumerate(stages):
            v_f = max(0, b - (num_stages - k - 1))
            ahead = (k // 2 + num_stages - k - 1) if schedule == "spectrain" else 0
            forward_versions.append(v_f)
            saved_inputs.append(x.detach())
            with torch.no_grad():
                x = functional_call(module, version_weights(k, v_f, ahead), (x,))
        grad: Tensor | None = None
        grads: list[dict[str, Tensor]] = [{} for _ in stages]
        for k in reversed(range(num_stages)):
            if schedule == "pipedream":
                w = version_weights(k, forward_versions[k], 0)
            elif schedule == "spectrain" and spectrain_backward == "reuse":
                # The forward's prediction, made from the forward's version of the weights.
                w = version_weights(k, forward_versions[k], k // 2 + num_stages - k - 1)
            else:
                ahead = k // 2 if schedule == "spectrain" else 0
                w = version_weights(k, b, ahead)
            leaves = {n: t.requires_grad_(True) for n, t in w.items()}
            x_in = saved_inputs[k].clone().requires_grad_(k > 0)
            out = functional_call(stages[k], leaves, (x_in,))
            if k == num_stages - 1:
                nn.functional.cross_entropy(out, targets).backward()
            else:
                out.backward(grad)
            grads[k] = {n: leaves[n].grad for n in names[k]}  # type: ignore[misc]
            grad = x_in.grad
        for k in range(num_stages):
            old_w, old_v = weights[k][b], buffers[k][b]
            new_v = {
                n: grads[k][n] if old_v is None else MOMENTUM * old_v[n] + grads[k][n]
                for n in names[k]
            }
            weights[k].append({n: old_w[n] - LR * new_v[n] for n in names[k]})
            buffers[k].append(new_v)
    return [t for k in range(num_stages) for t in weights[k][count].values()]


# (schedule, SpecTrain's backward, chunks): a mini-batch streamed in pieces (3 cuts the 16
# samples unevenly, 6/5/5) makes the same update as one piece, for every policy.
ASYNC_CASES = (
    ("naive", "recompute", 1),
    ("pipedream", "recompute", 1),
    ("spectrain", "recompute", 1),
    ("spectrain", "reuse", 1),
    ("naive", "recompute", 3),
    ("pipedream", "recompute", 2),
    ("spectrain", "recompute", 3),
    ("spectrain", "reuse", 2),
)


#: Mini-batches each asynchronous case trains.
ASYNC_COUNT = 7


def _async_cases_rank(num_stages: int, count: int) -> list[list[Tensor]]:
    return [
        _async_rank(schedule, num_stages, count, how, chunks)
        for schedule, how, chunks in ASYNC_CASES
    ]


@pytest.mark.parametrize("num_stages", [2, 4])
def test_asynchronous_schedules_match_a_sequential_reference(
    num_stages: int, request: pytest.FixtureRequest
) -> None:
    count = ASYNC_COUNT
    per_stage = _shared(request, num_stages)["async"]
    for case, (schedule, how, chunks) in enumerate(ASYNC_CASES):
        got = [t for stage in per_stage for t in stage[case]]
        expected = _reference(schedule, num_stages, count, how)
        assert len(got) == len(expected), schedule
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(
                g, e, rtol=1e-9, atol=1e-12, msg=f"{schedule} {how} chunks={chunks}"
            )


def test_policies_really_differ() -> None:
    """The reference itself tells the three policies apart (the test above is not vacuous)."""
    naive, stash, spec = (_reference(s, 4, 7) for s in ("naive", "pipedream", "spectrain"))
    reuse = _reference("spectrain", 4, 7, "reuse")
    for other in (stash, spec, reuse):
        assert max(float((a - b).abs().max()) for a, b in zip(naive, other, strict=True)) > 1e-6
    assert max(float((a - b).abs().max()) for a, b in zip(spec, reuse, strict=True)) > 1e-9


def _eval_rank(num_stages: int) -> tuple[int, int, float]:
    stage = dist.get_rank()
    module = _stages(num_stages)[stage]
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    runner = _runner(module, optimizer, num_stages, "1f1b")
    result = runner.evaluate(_data(3), 3)
    return result.correct, result.total, result.mean_loss


def test_evaluate_counts_correct_predictions_on_every_rank(
    four_ranks: dict[str, list[Any]],
) -> None:
    results = four_ranks["evaluate"]
    model = nn.Sequential(*_stages(4))
    with torch.no_grad():
        correct = sum(int((model(x).argmax(-1) == y).sum()) for x, y in _data(3))
        loss = sum(float(nn.functional.cross_entropy(model(x), y)) for x, y in _data(3)) / 3
    assert [r[:2] for r in results] == [(correct, 3 * BATCH)] * 4
    for result in results:
        assert result[2] == pytest.approx(loss, rel=1e-9)


class _FailsOnThirdCall(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("stage 1 lost its accelerator")
        out: Tensor = self.inner(x)
        return out


def _dying_rank(num_stages: int) -> None:
    """Stage 1 dies in the middle of the stream, while its neighbours wait on messages."""
    stage = dist.get_rank()
    module = _stages(num_stages)[stage]
    if stage == 1:
        module = _FailsOnThirdCall(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    runner = _runner(module, optimizer, num_stages, "spectrain")
    runner.run(_data(8) if stage in (0, num_stages - 1) else None, 8)


def test_a_dead_stage_is_named_not_a_hang() -> None:
    with pytest.raises(RankFailedError, match="rank 1") as failure:
        run_ranks(_dying_rank, 4, 4, timeout=60)
    assert "lost its accelerator" in str(failure.value)


def test_bad_configuration_is_a_clear_error() -> None:
    module = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(module.parameters())
    with pytest.raises(ValueError, match="SGD with momentum"):
        PipelineStage(module, optimizer, stage=0, num_stages=2, schedule="spectrain")
    sgd = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="unknown schedule"):
        PipelineStage(module, sgd, stage=0, num_stages=2, schedule="interleaved")
    with pytest.raises(ValueError, match="needs a loss_fn"):
        PipelineStage(module, sgd, stage=1, num_stages=2, schedule="gpipe")
    with pytest.raises(ValueError, match="asynchronous schedules"):
        PipelineStage(module, sgd, stage=0, num_stages=2, schedule="gpipe", chunks=2)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        PipelineStage(module, sgd, stage=0, num_stages=2, schedule="naive", chunks=0)


def _one_stage(seed: int) -> PipelineStage:
    torch.manual_seed(seed)
    module = nn.Sequential(*_stages(4))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    return PipelineStage(
        module,
        optimizer,
        stage=0,
        num_stages=1,
        schedule="spectrain",
        loss_fn=nn.functional.cross_entropy,
    )


def test_a_stage_restored_from_its_state_dict_trains_on_identically() -> None:
    # One stage is the whole pipeline, so no process group is needed.
    data = _data(6)
    trained = _one_stage(0)
    trained.run(data[:3], 3)
    saved = trained.state_dict()
    restored = _one_stage(1)  # other weights, no momentum yet
    restored.load_state_dict(saved)
    trained.run(data[3:], 3)
    restored.run(data[3:], 3)
    for a, b in zip(trained.module.parameters(), restored.module.parameters(), strict=True):
        assert torch.equal(a, b)
    momentum = [trained.optimizer.state[p]["momentum_buffer"] for p in trained.module.parameters()]
    again = [restored.optimizer.state[p]["momentum_buffer"] for p in restored.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(momentum, again, strict=True))


def test_a_stage_refuses_another_stages_state() -> None:
    saved = _one_stage(0).state_dict()
    saved["stage"] = 1
    saved["num_stages"] = 2
    with pytest.raises(UsageError, match="stage 1 of 2"):
        _one_stage(0).load_state_dict(saved)


#: case -> (rank 0's keyword arguments, rank 1's) for a 2-stage pipeline.
MISMATCHES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "microbatches": (
        {"schedule": "gpipe", "microbatches": 2},
        {"schedule": "gpipe", "microbatches": 4},
    ),
    "schedule": ({"schedule": "gpipe"}, {"schedule": "1f1b"}),
    "chunks": ({"schedule": "naive", "chunks": 1}, {"schedule": "naive", "chunks": 2}),
}

#: case -> what the error must say on both ranks.
MISMATCH_ERRORS = {
    "microbatches": "PipelineStage settings differ between ranks: microbatches is 2 on rank 0 "
    "but 4 on rank 1; pass the same value on every rank",
    "schedule": "schedule is 'gpipe' on rank 0 but '1f1b' on rank 1",
    "chunks": "chunks is 1 on rank 0 but 2 on rank 1",
}


def _mismatch_rank(num_stages: int) -> dict[str, Any]:
    """Build each mismatched pipeline; the errors, then a matching one's training step."""
    stage = dist.get_rank()
    errors: dict[str, str] = {}
    for case, settings in MISMATCHES.items():
        module = _stages(num_stages)[stage]
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        try:
            _runner(module, optimizer, num_stages, **settings[stage])
        except UsageError as error:
            errors[case] = str(error)
    # The refused stages left no message behind: a matching pipeline trains.
    module = _stages(num_stages)[stage]
    runner = _runner(module, torch.optim.SGD(module.parameters(), lr=0.1), num_stages, "1f1b")
    result = runner.run(_data(1) if stage in (0, num_stages - 1) else None, 1)
    return {"errors": errors, "updates": result.updates}


def test_stages_that_disagree_get_one_clear_error_naming_the_setting(
    two_ranks: dict[str, list[Any]],
) -> None:
    outcome = two_ranks["mismatch"]
    for rank in (0, 1):
        errors = outcome[rank]["errors"]
        assert set(errors) == set(MISMATCHES), errors
        for case, needle in MISMATCH_ERRORS.items():
            assert needle in errors[case]
        assert outcome[rank]["updates"] == 1


def _misplaced_rank(_: None) -> str:
    module = _stages(2)[0]
    try:
        PipelineStage(
            module,
            torch.optim.SGD(module.parameters(), lr=0.1),
            stage=0,  # on both ranks
            num_stages=2,
            schedule="gpipe",
            loss_fn=nn.functional.cross_entropy,
        )
    except UsageError as error:
        return str(error)
    return ""


def test_a_stage_given_to_the_wrong_rank_is_named(two_ranks: dict[str, list[Any]]) -> None:
    outcome = two_ranks["misplaced"]
    assert outcome[0] == ""
    assert "rank 1 was given stage 0, which ranks=[0, 1] puts on rank 0" in outcome[1]


def test_a_pipeline_of_several_stages_needs_a_process_group() -> None:
    module = nn.Linear(2, 2)
    sgd = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(UsageError, match="needs a process group"):
        PipelineStage(module, sgd, stage=0, num_stages=2, schedule="gpipe")


def _scenarios(num_stages: int) -> dict[str, Callable[[], Any]]:
    """The scenarios above for a job of ``num_stages`` ranks, by name. The misplaced stage
    comes last: rank 0 then holds a stage that rank 1 refused."""
    scenarios: dict[str, Callable[[], Any]] = {
        "sync": lambda: _sync_cases_rank(num_stages),
        "async": lambda: _async_cases_rank(num_stages, ASYNC_COUNT),
    }
    if num_stages == 4:
        scenarios["evaluate"] = lambda: _eval_rank(4)
    else:
        scenarios["mismatch"] = lambda: _mismatch_rank(2)
        scenarios["misplaced"] = lambda: _misplaced_rank(None)
    return scenarios


def _every_scenario(num_stages: int) -> dict[str, Any]:
    """Each scenario's result on this rank; a failure names its scenario."""
    return run_scenarios(_scenarios(num_stages))


def _launch(num_stages: int) -> dict[str, list[Any]]:
    """Every scenario's results by rank, from one launch: starting ranks costs more than the
    scenarios do."""
    per_rank = run_ranks(_every_scenario, num_stages, num_stages, timeout=300)
    return {name: [results[name] for results in per_rank] for name in per_rank[0]}


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list[Any]]:
    return _launch(2)


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, list[Any]]:
    return _launch(4)


def _shared(request: pytest.FixtureRequest, num_stages: int) -> dict[str, list[Any]]:
    """The shared launch of ``num_stages`` ranks."""
    results: dict[str, list[Any]] = request.getfixturevalue(
        "two_ranks" if num_stages == 2 else "four_ranks"
    )
    return results
