"""Checkpoints and resume: a resumed run equals the run never stopped, bit for bit on CPU.

Each multi-rank test trains several tiny runs inside one job (one process group), so the cost of
starting ranks is paid once: for every case a run goes to the end, its folder is copied and cut
back to an earlier checkpoint, and the copy is resumed; the two runs' final checkpoints must hold
the same tensors, numbers and random-generator states, rank by rank.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import signal
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from interlace import launch
from interlace.comm.tuning import PlanTrials
from interlace.distenv import DistContext, init_distributed
from interlace.dp.iteration import ProfiledPasses
from interlace.dp.lifecycle import Lifecycle
from interlace.errors import UsageError
from interlace.runlog import read_metrics
from interlace.train import (
    TrainConfig,
    TrainResult,
    train_data_parallel,
    train_pipeline,
    train_rank,
)
from interlace.train.checkpoint import (
    KEEP,
    Position,
    SaveEvery,
    latest_checkpoint,
    load_checkpoint,
    read_header,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

#: Columns of metrics.csv that measure time, not training.
_TIMING = ("samples_per_s", "epoch_s")


def _tiny(**changes: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "model": "mlp",
        "data": "digits",
        "epochs": 2,
        "batch_size": 16,
        "max_steps_per_epoch": 4,
        "warmup_epochs": 0.5,
        "progress": False,
    }
    base.update(changes)
    return TrainConfig(**base)


def _cut_back(run: Path, copy: Path, step: int) -> None:
    """Copy ``run`` to ``copy`` and drop its checkpoints after ``step``."""
    shutil.copytree(run, copy)
    for path in (copy / "checkpoints").iterdir():
        if int(path.stem.split("-")[1]) > step:
            path.unlink()


def _run_and_resume(cases: list[tuple[str, TrainConfig, int]], root: str) -> list[Any]:
    """One rank: for every case, train to the end, cut a copy back to ``step``, resume it."""
    context = init_distributed()
    results = []
    for name, config, step in cases:
        train = train_pipeline if config.parallel == "pipeline" else train_data_parallel
        full, resumed = Path(root, name, "full"), Path(root, name, "resumed")
        try:
            first = train(config, context, str(full))
            if context.is_main:
                _cut_back(full, resumed, step)
            dist.barrier()
            second = train(config, context, str(resumed), True)
        except Exception as error:
            raise RuntimeError(f"case {name!r} failed") from error
        results.append((first, second))
    dist.destroy_process_group()
    return results


def _assert_same(a: Any, b: Any, where: str) -> None:
    """Equal structure, equal numbers, tensors equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{index}]")
    else:
        both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
        assert a == b or both_nan, f"{where}: {a!r} != {b!r}"


def _check_exact(root: Path, name: str, pair: tuple[TrainResult, TrainResult]) -> None:
    full, resumed = pair
    assert resumed.final_train_loss == full.final_train_loss
    assert resumed.final_test_accuracy == full.final_test_accuracy
    a = read_header(latest_checkpoint(root / name / "full") or Path(), lazy=False)
    b = read_header(latest_checkpoint(root / name / "resumed") or Path(), lazy=False)
    assert a["position"] == b["position"]
    _assert_same(a["ranks"], b["ranks"], name)
    rows_a = read_metrics(root / name / "full" / "metrics.csv")
    rows_b = read_metrics(root / name / "resumed" / "metrics.csv")
    assert [row["epoch"] for row in rows_b] == [1.0, 2.0]
    for row_a, row_b in zip(rows_a, rows_b, strict=True):
        assert {k: v for k, v in row_a.items() if k not in _TIMING} == {
            k: v for k, v in row_b.items() if k not in _TIMING
        }


#: Data-parallel runs cut back and resumed: (name, config, the step to resume from).
DATA_PARALLEL_CASES = [
    # SGD, resumed in the middle of epoch 2 (step 6 of 8; the plan still being measured).
    ("sgd-mid-epoch", _tiny(save_every="3"), 6),
    # Buckets fixed up front: the checkpoint carries the plan; resumed at an epoch's start.
    ("sgd-fixed-plan", _tiny(save_every="1ep", deterministic=True), 4),
    # K-FAC decomposing every 2nd step: factors and decompositions cross the cut.
    ("kfac", _tiny(save_every="3", optimizer="kfac", kfac_inv_update_steps=2), 6),
    # The language model: AdamW, clipping and bf16 autocast, resumed in the middle of epoch 2.
    (
        "lm-adamw",
        _tiny(
            model="gpt",
            data="pydoc-topics",
            seq_len=16,
            batch_size=4,
            optimizer="adamw",
            lr=1e-3,
            warmup_steps=2,
            clip_grad_norm=1.0,
            precision="bf16",
            save_every="3",
        ),
        6,
    ),
]
SCHEDULES = ("gpipe", "1f1b", "pipedream", "spectrain", "naive")
#: Pipelined runs, one per schedule, resumed at the start of epoch 2.
PIPELINE_CASES = [
    (
        schedule,
        _tiny(
            parallel="pipeline",
            schedule=schedule,
            microbatches=2,
            partition_by="params",
            max_steps_per_epoch=3,
            save_every="1ep",
        ),
        3,
    )
    for schedule in SCHEDULES
]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[Any]]]:
    """Every case of both lists run, cut back and resumed in one 2-rank job (starting ranks
    costs more than a case): the runs' folder and each case's results by rank."""
    root = tmp_path_factory.mktemp("resumed")
    cases = DATA_PARALLEL_CASES + PIPELINE_CASES
    result = launch.run(_run_and_resume, 2, args=(cases, str(root)), timeout=400).check()
    by_case = {
        name: [result.values[rank][index] for rank in range(2)]
        for index, (name, _, _) in enumerate(cases)
    }
    return root, by_case


@pytest.mark.slow
@pytest.mark.timeout(460)  # the first sets up the shared launch
def test_resumed_data_parallel_runs_equal_the_uninterrupted_ones(
    resumed: tuple[Path, dict[str, list[Any]]],
) -> None:
    tmp_path, by_case = resumed
    for name, _, _ in DATA_PARALLEL_CASES:
        for rank in range(2):
            _check_exact(tmp_path, name, by_case[name][rank])
    fixed = read_header(latest_checkpoint(tmp_path / "sgd-fixed-plan" / "resumed") or Path())
    # The plan travelled with the checkpoint: both ranks hold it, and it is the fixed one.
    plans = [rank["plan"] for rank in fixed["ranks"]]
    assert plans[0] is not None and plans[0] == plans[1]
    assert plans[0]["plan"]["strategy"] == "fixed"
    kfac = read_header(latest_checkpoint(tmp_path / "kfac" / "full") or Path())
    assert kfac["ranks"][0]["kfac"]["steps"] == 8


@pytest.mark.slow
@pytest.mark.timeout(460)  # it may be the first to ask for the shared launch
def test_resumed_pipelines_equal_the_uninterrupted_ones(
    resumed: tuple[Path, dict[str, list[Any]]],
) -> None:
    tmp_path, by_case = resumed
    for schedule in SCHEDULES:
        for rank in range(2):
            _check_exact(tmp_path, schedule, by_case[schedule][rank])
    header = read_header(latest_checkpoint(tmp_path / "gpipe" / "full") or Path())
    # Each stage saved its own weights.
    stages = [rank["stage"]["stage"] for rank in header["ranks"]]
    assert stages == [0, 1]


#: Replicated pipelines (2 stages x 2 replicas on 4 ranks, a model with BatchNorm), resumed at
#: the start of epoch 2: a synchronous and an asynchronous schedule.
REPLICATED_CASES = [
    (
        f"replicated-{schedule}",
        _tiny(
            model="resnet20",
            parallel="pipeline",
            schedule=schedule,
            stages=2,
            strategy="fixed",
            microbatches=2,
            partition_by="params",
            max_steps_per_epoch=3,
            save_every="1ep",
        ),
        3,
    )
    for schedule in ("gpipe", "spectrain")
]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resumed_replicated_pipelines_equal_the_uninterrupted_ones(tmp_path: Path) -> None:
    cases = REPLICATED_CASES
    result = launch.run(_run_and_resume, 4, args=(cases, str(tmp_path)), timeout=280).check()
    for index, (name, _, _) in enumerate(cases):
        for rank in range(4):
            _check_exact(tmp_path, name, result.values[rank][index])
        header = read_header(latest_checkpoint(tmp_path / name / "full") or Path())
        # Replica 0 saved each stage (ranks 0 and 1); replica 1 (ranks 2 and 3) points at them.
        ranks = header["ranks"]
        assert [rank["stage"]["stage"] for rank in ranks[:2]] == [0, 1]
        assert [rank.get("same_as") for rank in ranks] == [None, None, 0, 1]
        assert all("stage" not in rank for rank in ranks[2:])


#: The DataParallel steps a rank took that plan: planning, profiled passes, trial iterations.
_PLANNING: Counter[str] = Counter()
#: Where the measured-plan run saves (the end of epoch 2): its plan is final well before.
_SAVED_AT = 60


def _counted(what: str, method: Any) -> Any:
    def counting(self: object, *args: Any, **kwargs: Any) -> Any:
        _PLANNING[what] += 1
        return method(self, *args, **kwargs)

    return counting


def _resume_a_measured_plan(config: TrainConfig, root: str) -> tuple[Any, ...]:
    """One rank: train with a measured plan, then resume the run's epoch-2 checkpoint twice,
    keeping the saved plan and with ``replan``; what each run did to plan."""
    Lifecycle.try_candidates = _counted("plans", Lifecycle.try_candidates)  # type: ignore[method-assign]
    PlanTrials.record = _counted("trial iterations", PlanTrials.record)  # type: ignore[method-assign]
    ProfiledPasses.add = _counted("profiled passes", ProfiledPasses.add)  # type: ignore[method-assign]
    context = init_distributed()
    full = Path(root, "full")
    whole = train_data_parallel(config, context, str(full))
    first = dict(_PLANNING)
    resumed = {}
    for name, replan in (("kept", False), ("replanned", True)):
        if context.is_main:
            _cut_back(full, Path(root, name), _SAVED_AT)
        dist.barrier()
        _PLANNING.clear()
        run = train_data_parallel(
            replace(config, replan=replan), context, str(Path(root, name)), True
        )
        resumed[name] = (run.final_train_loss, dict(_PLANNING))
    dist.destroy_process_group()
    return whole.final_train_loss, first, resumed


@pytest.mark.slow
def test_a_resumed_run_keeps_its_measured_plan_unless_asked_to_replan(tmp_path: Path) -> None:
    # Measured, not --deterministic: the plan is profiled and tried during epoch 1.
    config = _tiny(epochs=3, max_steps_per_epoch=30, save_every="2ep")
    result = launch.run(_resume_a_measured_plan, 2, args=(config, str(tmp_path)), timeout=240)
    saved = read_header(tmp_path / "full" / "checkpoints" / f"step-{_SAVED_AT:08d}.pt")
    # The plan was final when the checkpoint was saved, on both ranks.
    plans = [rank["plan"] for rank in saved["ranks"]]
    assert plans[0] is not None and plans[0] == plans[1]
    for whole_loss, first, resumed in result.check().values:
        assert first["plans"] == 1 and first["profiled passes"] > 0
        assert first["trial iterations"] > 0
        kept_loss, kept = resumed["kept"]
        assert kept == {}, "the resumed run profiled or tried plans"
        assert kept_loss == whole_loss
        _, replanned = resumed["replanned"]
        assert replanned["plans"] == 1 and replanned["profiled passes"] > 0
        assert replanned["trial iterations"] > 0


_SAVES: list[int] = []


def _dies_in_second_save(obj: object, handle: Any, *args: Any, **kwargs: Any) -> None:
    # torch.save also pickles tensors for collectives (into memory); count the checkpoint files.
    if ".step-" in str(getattr(handle, "name", "")):
        _SAVES.append(1)
    if len(_SAVES) == 2:
        # Half a file on disk, then the process is gone, as with a SIGKILL mid-write.
        handle.write(b"PK\x03\x04 half a checkpoint")
        handle.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    _REAL_SAVE(obj, handle, *args, **kwargs)


_REAL_SAVE = torch.save


def _train_killed_in_second_save(config: TrainConfig, run_dir: str) -> None:
    if os.environ.get("RANK") == "0":
        torch.save = _dies_in_second_save
    train_rank(config, run_dir)


def _resume_and_run_whole(config: TrainConfig, killed: str, whole: str) -> tuple[Any, Any]:
    context = init_distributed()
    resumed = train_data_parallel(config, context, killed, True)
    reference = train_data_parallel(config, context, whole)
    dist.destroy_process_group()
    return resumed, reference


@pytest.mark.slow
def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    config = _tiny(save_every="3")
    killed = tmp_path / "killed"
    result = launch.run(_train_killed_in_second_save, 2, args=(config, str(killed)), timeout=240)
    assert result.returncode != 0 and result.failed_rank == 0
    folder = killed / "checkpoints"
    # The half-written file is a temporary one; the latest checkpoint is still the first save.
    assert [p.name for p in folder.glob("step-*.pt")] == ["step-00000003.pt"]
    assert len(list(folder.glob(".step-00000006.pt.*.tmp"))) == 1
    assert latest_checkpoint(killed) == folder / "step-00000003.pt"

    whole = tmp_path / "whole"
    values = launch.run(
        _resume_and_run_whole, 2, args=(config, str(killed), str(whole)), timeout=240
    ).check()
    for resumed, reference in values.values:
        assert resumed.final_train_loss == reference.final_train_loss
    a = read_header(latest_checkpoint(killed) or Path())
    b = read_header(latest_checkpoint(whole) or Path())
    _assert_same(a["ranks"], b["ranks"], "killed then resumed")
    # The dead save's temporary file was swept by a later save.
    assert not list(folder.glob(".step-*.tmp"))


# ----------------------------------------------------------------- one process, no job


def _alone() -> DistContext:
    return DistContext(0, 1, 0, torch.device("cpu"), "gloo")


def test_save_every_takes_steps_or_epochs() -> None:
    assert SaveEvery.parse("500") == SaveEvery(500, epochs=False)
    assert SaveEvery.parse("2ep") == SaveEvery(2, epochs=True)
    assert SaveEvery.parse("3 epochs") == SaveEvery(3, epochs=True)
    every_two = SaveEvery.parse("2")
    assert [every_two.after_step(n) for n in (1, 2, 3, 4)] == [False, True, False, True]
    assert not every_two.after_epoch(2)
    assert SaveEvery.parse("2ep").after_epoch(4) and not SaveEvery.parse("2ep").after_step(4)
    for bad in ("0", "-1", "ep", "2 steps", "1.5"):
        with pytest.raises(UsageError, match="--save-every"):
            SaveEvery.parse(bad)


def test_pipeline_runs_save_in_epochs_only() -> None:
    with pytest.raises(UsageError, match="--save-every in epochs"):
        TrainConfig(parallel="pipeline", save_every="100").validate()
    TrainConfig(parallel="pipeline", save_every="1ep").validate()


def test_checkpoints_round_trip_and_only_the_latest_are_kept(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0).reshape(2, 3), "nested": [1, (2.5, "x")], "none": None}
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, _alone(), Position(1, step, step), {"seed": 0}, state)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [f"step-{step:08d}.pt" for step in (2, 4, 6)][-KEEP:]
    loaded = load_checkpoint(tmp_path, _alone())
    assert loaded.position == Position(1, 6, 6)
    _assert_same(loaded.state, state, "state")


def test_an_unreadable_checkpoint_is_refused_clearly(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, _alone(), Position(1, 1, 1), {}, {"w": torch.ones(3)})
    path = latest_checkpoint(tmp_path)
    assert path is not None
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(UsageError, match=r"cannot be read.*remove it"):
        load_checkpoint(tmp_path, _alone())
    with pytest.raises(UsageError, match="holds no checkpoint"):
        load_checkpoint(tmp_path / "elsewhere", _alone())


def test_a_checkpoint_of_another_job_size_is_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, _alone(), Position(1, 1, 1), {}, {})
    path = latest_checkpoint(tmp_path)
    assert path is not None
    payload = torch.load(path, weights_only=True)
    payload["world_size"] = 4
    torch.save(payload, path)
    with pytest.raises(UsageError, match="saved by 4 rank"):
        load_checkpoint(tmp_path, _alone())


def test_random_generators_come_back_exactly() -> None:
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    saved = rng_state()

    def draw() -> tuple[list[float], float, float]:
        return torch.rand(4).tolist(), random.random(), float(np.random.rand())

    first = draw()
    set_rng_state(saved)
    assert draw() == first
