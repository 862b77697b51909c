"""Checkpoints of a training run: every rank's state in one ``torch.save`` file, written atomically.

Rank 0 gathers the ranks' states and writes ``checkpoints/step-<N>.pt`` in the run folder through
a temporary file and a rename, so a run killed while saving leaves the previous checkpoint as the
latest; resuming scatters each rank its own state back (see docs/training.md). A rank whose
state equals another's (a replica of a pipeline stage) saves only its own keys and
:data:`SAME_AS` that rank, and resumes with both.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from interlace.distenv import DistContext
from interlace.errors import UsageError

#: The run folder's subfolder that holds the checkpoints.
CHECKPOINT_DIR = "checkpoints"
#: Complete checkpoints kept; older ones are removed after each save.
KEEP = 2
#: Written into every checkpoint, and checked on load.
FORMAT = "interlace-train-checkpoint"
VERSION = 1

#: The key of a rank's saved state that names the rank whose state it shares; its own keys
#: (its random generators) are laid over that rank's on resume.
SAME_AS = "same_as"

_NAME = re.compile(r"^step-(\d+)\.pt$")
_EPOCHS = re.compile(r"^(\d+)\s*ep(?:och|ochs)?$")


@dataclass(frozen=True)
class SaveEvery:
    """How often a run saves: every ``count`` optimizer steps or every ``count`` epochs.

    Args:
        count: steps or epochs between saves (>= 1).
        epochs: True for epochs, False for steps.
    """

    count: int
    epochs: bool

    @classmethod
    def parse(cls, text: str) -> SaveEvery:
        """``--save-every``: ``N`` (optimizer steps) or ``Nep`` (epochs).

        Args:
            text: e.g. ``"500"`` or ``"2ep"``.

        Raises:
            UsageError: for anything else, or a count below 1.
        """
        cleaned = text.strip().lower()
        match = _EPOCHS.match(cleaned)
        digits = match.group(1) if match else cleaned
        if not digits.isdigit() or int(digits) < 1:
            raise UsageError(
                f"--save-every takes a number of steps (e.g. 500) or of epochs (e.g. 2ep), "
                f">= 1; got {text!r}"
            )
        return cls(int(digits), match is not None)

    def after_step(self, global_step: int) -> bool:
        """Whether to save once ``global_step`` optimizer steps are done."""
        return not self.epochs and global_step % self.count == 0

    def after_epoch(self, epoch: int) -> bool:
        """Whether to save once epoch ``epoch`` (from 1) is done and scored."""
        return self.epochs and epoch % self.count == 0


@dataclass(frozen=True)
class Position:
    """Where in the data a checkpoint was taken.

    Args:
        epoch: the epoch in progress, from 1 (``epochs + 1`` once the run is over).
        step: batches of that epoch already trained on.
        global_step: optimizer steps done since the start of the run.
    """

    epoch: int
    step: int
    global_step: int


@dataclass(frozen=True)
class Resumed:
    """This rank's part of a loaded checkpoint.

    Args:
        path: the checkpoint file.
        position: where the run stopped.
        state: this rank's state, as it was saved.
    """

    path: Path
    position: Position
    state: dict[str, Any]


def checkpoint_dir(run_dir: str | Path) -> Path:
    """The folder of ``run_dir``'s checkpoints.

    Args:
        run_dir: a run folder.
    """
    return Path(run_dir) / CHECKPOINT_DIR


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint of ``run_dir`` with the most steps, or None.

    Temporary files of a save that never finished are not checkpoints and are skipped.

    Args:
        run_dir: a run folder.
    """
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return max(found)[1] if found else None


def read_header(path: Path, *, lazy: bool = True) -> dict[str, Any]:
    """A checkpoint's contents, checked: ``config``, ``world_size``, ``position``, ``ranks``.

    Args:
        path: the checkpoint file.
        lazy: map the tensors from the file instead of reading them (to look at the header);
            never for tensors that training will update in place.

    Raises:
        UsageError: when the file is not a readable interlace checkpoint.
    """
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=lazy)
    except Exception as error:  # any failure to read means the same to a user
        raise UsageError(
            f"checkpoint {path} cannot be read ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'no detail'}); remove it to resume "
            "from the one before"
        ) from None
    if not isinstance(loaded, dict) or loaded.get("format") != FORMAT:
        raise UsageError(f"{path} is not an interlace training checkpoint")
    if loaded.get("version") != VERSION:
        raise UsageError(
            f"checkpoint {path} has format version {loaded.get('version')}; this interlace "
            f"reads version {VERSION}"
        )
    return loaded


def save_checkpoint(
    run_dir: str | Path | None,
    context: DistContext,
    position: Position,
    config: dict[str, Any],
    state: dict[str, Any],
) -> Path | None:
    """Save every rank's ``state`` into one file on rank 0; collective.

    Each rank's state travels to rank 0 (on the CPU); rank 0 writes them through a temporary
    file, flushed to disk, renamed over ``checkpoints/step-<N>.pt``, and then removes all but
    the :data:`KEEP` latest checkpoints.

    Args:
        run_dir: the run folder (rank 0's; ignored elsewhere).
        context: this rank's place in the job.
        position: where in the data the run is.
        config: the run's config as plain data.
        state: this rank's state (tensors, numbers, strings, lists and dicts).

    Returns:
        The checkpoint on rank 0, None elsewhere.
    """
    local = _to_cpu(state)
    gathered: list[Any] | None = [None] * context.world_size if context.is_main else None
    if context.world_size > 1:
        dist.gather_object(local, gathered, dst=0)
    elif gathered is not None:
        gathered[0] = local
    if not context.is_main:
        return None
    assert run_dir is not None and gathered is not None
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"step-{position.global_step:08d}.pt"
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": context.world_size,
        "position": {
            "epoch": position.epoch,
            "step": position.step,
            "global_step": position.global_step,
        },
        "config": config,
        "ranks": gathered,
    }
    _write_atomically(payload, target)
    _prune(folder, keep=KEEP)
    return target


def load_checkpoint(run_dir: str | Path, context: DistContext) -> Resumed:
    """This rank's state from ``run_dir``'s latest checkpoint; collective.

    Rank 0 reads the file and sends each rank its own part, so only rank 0 needs to see the run
    folder.

    Args:
        run_dir: the run folder (rank 0's).
        context: this rank's place in the job.

    Raises:
        UsageError: on every rank, when there is no checkpoint, it cannot be read, or it was
            saved by a job of another size.
    """
    parts: list[Any] | None = None
    if context.is_main:
        found = latest_checkpoint(run_dir)
        try:
            if found is None:
                raise UsageError(
                    f"{run_dir} holds no checkpoint (runs save them with --save-every)"
                )
            path = found
            loaded = read_header(path, lazy=False)
            if loaded["world_size"] != context.world_size:
                raise UsageError(
                    f"checkpoint {path} was saved by {loaded['world_size']} rank(s); resume it "
                    f"with as many (-n {loaded['world_size']}), not {context.world_size}"
                )
            parts = [
                (str(path), loaded["position"], _own_state(loaded["ranks"], rank))
                for rank in range(context.world_size)
            ]
        except UsageError as error:
            parts = [str(error)] * context.world_size
    received: list[Any] = [None]
    if context.world_size > 1:
        dist.scatter_object_list(received, parts, src=0)
    else:
        assert parts is not None
        received[0] = parts[0]
    mine = received[0]
    if isinstance(mine, str):
        raise UsageError(mine)
    where, position, state = mine
    return Resumed(Path(where), Position(**position), state)


def _own_state(ranks: list[Any], rank: int) -> Any:
    """``rank``'s saved state, with the state of the rank it is :data:`SAME_AS` under its own."""
    state = ranks[rank]
    if not (isinstance(state, dict) and SAME_AS in state):
        return state
    own = {key: value for key, value in state.items() if key != SAME_AS}
    return {**ranks[state[SAME_AS]], **own}


def rng_state() -> dict[str, Any]:
    """This process's random generators: torch's (CPU and every GPU), Python's and NumPy's."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "python": random.getstate(),
        "numpy": [
            str(kind),
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            pos,
            has_gauss,
            cached,
        ],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned.

    Args:
        state: the generators' states.
    """
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(
        (kind, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached))
    )


def _write_atomically(payload: dict[str, Any], target: Path) -> None:
    """``torch.save`` into a temporary file beside ``target``, synced, then renamed over it."""
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with temporary.open("wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    # The rename itself reaches the disk only with its folder.
    descriptor = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _prune(folder: Path, keep: int) -> None:
    """Remove all but the ``keep`` latest checkpoints, and temporary files of dead saves."""
    found = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name)))
    for _, path in found[:-keep]:
        path.unlink(missing_ok=True)
    for path in folder.glob(".step-*.tmp"):
        pid = path.name.rsplit(".", 2)[-2]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it copied to the CPU (containers rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_to_cpu(item) for item in value)
    return value


def describe_position(position: Position) -> str:
    """Where a checkpoint stands, in words.

    Args:
        position: the checkpoint's position.
    """
    if position.step == 0:
        return f"start of epoch {position.epoch}, {position.global_step} steps done"
    return (
        f"epoch {position.epoch} after {position.step} of its steps, "
        f"{position.global_step} steps done"
    )
