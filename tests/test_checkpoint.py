"""The checkpoint module: atomic save, keep_last, the newest complete checkpoint, load, and which
checkpoint `checkpoint.resume` and the command line's `--checkpoint` name."""

from __future__ import annotations

import pytest

from rllm_async import checkpoint
from rllm_async.checkpoint import CheckpointState
from rllm_async.config import ConfigError
from rllm_async.vclock import run
from tests.fakes import FakeBackend


def save(run_dir, backend, version, keep_last=None):
    state = CheckpointState(version, {"position": version})
    return run(checkpoint.save(run_dir, backend, version, lambda: state, keep_last), virtual=True)


def test_save_then_load_round_trips_and_publishes_the_version(tmp_path) -> None:
    backend = FakeBackend()
    backend.policy().version = 3
    path = save(tmp_path, backend, 3)
    assert path == tmp_path / "checkpoints" / "step_3"
    assert checkpoint.read_state(path) == CheckpointState(3, {"position": 3})
    assert not list((tmp_path / "checkpoints").glob(".*")), "no temporary directory is left"

    fresh = FakeBackend()
    state = run(checkpoint.load(path, fresh), virtual=True)
    assert state.version == 3 and fresh.policy().version == 3


def test_the_state_is_taken_after_the_backend_wrote_its_own(tmp_path) -> None:
    order: list[str] = []

    class Recording(FakeBackend):
        async def save(self, path):
            order.append("backend")
            await super().save(path)

    def state() -> CheckpointState:
        order.append("state")
        return CheckpointState(1, {})

    run(checkpoint.save(tmp_path, Recording(), 1, state, None), virtual=True)
    assert order == ["backend", "state"]


def test_keep_last_and_the_newest_complete_checkpoint(tmp_path) -> None:
    backend = FakeBackend()
    assert checkpoint.latest(tmp_path) is None
    for version in (2, 10, 4):
        save(tmp_path, backend, version)
    (tmp_path / "checkpoints" / "step_99").mkdir()  # incomplete: no trainer state
    assert checkpoint.latest(tmp_path) == tmp_path / "checkpoints" / "step_10"
    save(tmp_path, backend, 12, keep_last=2)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_10", "step_12"]


def test_resume_path(tmp_path) -> None:
    assert checkpoint.resume_path("never", tmp_path) is None
    assert checkpoint.resume_path("auto", tmp_path) is None
    path = save(tmp_path, FakeBackend(), 1)
    assert checkpoint.resume_path("auto", tmp_path) == path
    assert checkpoint.resume_path(str(path), tmp_path) == path
    with pytest.raises(ConfigError, match=r"checkpoint.resume: .* is not a checkpoint directory"):
        checkpoint.resume_path(str(tmp_path / "nowhere"), tmp_path)


def test_resolve_takes_a_run_directory_or_a_checkpoint(tmp_path) -> None:
    (tmp_path / "config.yaml").write_text("name: x\n")
    with pytest.raises(ConfigError, match="has no complete checkpoint"):
        checkpoint.resolve(tmp_path, "--checkpoint")
    path = save(tmp_path, FakeBackend(), 5)
    assert checkpoint.resolve(tmp_path, "--checkpoint") == path
    assert checkpoint.resolve(path, "--checkpoint") == path
    with pytest.raises(ConfigError, match=r"--checkpoint .*: not a checkpoint directory"):
        checkpoint.resolve(tmp_path / "checkpoints", "--checkpoint")
