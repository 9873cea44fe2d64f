"""Checkpoints: `checkpoints/step_<N>/` holds `backend/` (weights, optimizer) and `trainer_state.json`
(the policy version and the task source's position). The only code that reads or writes the format."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rllm_async.config import ConfigError
from rllm_async.protocols import Backend

_STATE = "trainer_state.json"


@dataclass(frozen=True, slots=True)
class CheckpointState:
    """What a checkpoint holds besides the backend's state."""

    version: int
    source: dict[str, Any]  # `TaskSource.state(pending)`: the data position and pending tasks


def step_path(run_dir: Path, step: int | str) -> Path:
    """Where the checkpoint of `step` of a run lives: `checkpoints/step_<step>/`."""
    return run_dir / "checkpoints" / f"step_{step}"


def step_of(path: Path) -> int:
    """The step of the checkpoint directory at `path`."""
    return int(path.name.removeprefix("step_"))


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is a complete checkpoint directory."""
    return (path / _STATE).exists()


def checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.name.startswith("step_") and p.name[5:].isdigit() and is_checkpoint(p)
    ]
    return sorted(found, key=step_of)


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    found = checkpoints(run_dir)
    return found[-1] if found else None


def read_state(path: Path) -> CheckpointState:
    """The trainer state of the checkpoint at `path`."""
    state = json.loads((path / _STATE).read_text())
    return CheckpointState(version=int(state["version"]), source=state["source"])


async def save(
    run_dir: Path,
    backend: Backend,
    version: int,
    state: Callable[[], CheckpointState],
    keep_last: int | None,
) -> Path:
    """Write `checkpoints/step_<version>/` atomically (into a temporary name, then renamed) and
    delete all but the newest `keep_last` checkpoints. `state` is taken once the backend's state
    is written, so that it holds the data's position as of then."""
    final = step_path(run_dir, version)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    await backend.save(tmp / "backend")
    taken = state()
    (tmp / _STATE).write_text(json.dumps({"version": taken.version, "source": taken.source}))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep_last is not None:
        for old in checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old)
    return final


async def load(path: Path, backend: Backend) -> CheckpointState:
    """Load the checkpoint at `path` into `backend` and publish its weights as its version."""
    state = read_state(path)
    await backend.load(path / "backend")
    await backend.on_policy_updated(state.version)
    return state


def resume_path(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint `checkpoint.resume` names: `never`, `auto` (the run's newest) or a path."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest(run_dir)
    path = Path(resume)
    if not is_checkpoint(path):
        raise ConfigError(
            f"checkpoint.resume: {path} is not a checkpoint directory (no {_STATE}); "
            "use auto, never, or a runs/<name>/checkpoints/step_<N> directory"
        )
    return path


def resolve(path: Path, option: str) -> Path:
    """The checkpoint a command-line `option` names: a run directory (its newest checkpoint) or a
    checkpoint directory."""
    if (path / "config.yaml").exists() and not is_checkpoint(path):
        found = latest(path)
        if found is None:
            raise ConfigError(f"{path} has no complete checkpoint under checkpoints/")
        return found
    if not is_checkpoint(path):
        raise ConfigError(
            f"{option} {path}: not a checkpoint directory (no {_STATE}); "
            "give runs/<name> or runs/<name>/checkpoints/step_<N>"
        )
    return path
