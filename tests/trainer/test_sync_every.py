"""`coordinator.sync_every`: the engine gets new weights every N optimizer steps, versions still
count optimizer steps, and every trained token's staleness stays within the bound."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from rllm_async.backends.sim import SimBackend, workload_config
from rllm_async.config import ConfigError, load_config
from rllm_async.trainer import UnifiedTrainer
from rllm_async.vclock import run
from tests.fakes import FakeBackend, ScriptedWorkflow, make_config, tasks


class SyncCountingBackend(FakeBackend):
    """Logs every weight sync and, per trained token, the trainer's version minus the token's."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.synced: list[int] = []
        self.token_staleness: list[int] = []
        self.token_versions: set[int] = set()
        self.trainer_version: Callable[[], int] = lambda: 0

    async def forward_backward(self, groups: list[Any], loss: Any) -> dict[str, float]:
        now = self.trainer_version()
        for g in groups:
            for traj in g.trajectories:
                for step in traj.steps:
                    self.token_staleness.extend(now - v for v in step.versions)
                    self.token_versions.update(step.versions)
        return await super().forward_backward(groups, loss)

    async def on_policy_updated(self, version: int) -> None:
        await super().on_policy_updated(version)
        self.synced.append(version)


def train(tmp_path, n: int, depth: int, weight_update: str = "pin", steps: int = 12):
    backend = SyncCountingBackend(latency=lambda: 0.5, train_s=0.3)
    cfg = make_config(
        tmp_path,
        name=f"n{n}-d{depth}-{weight_update}",
        train={"total_steps": steps},
        coordinator={
            "sync_every": n,
            "pipeline_depth": depth,
            "max_staleness": depth + n - 1,
            "weight_update": weight_update,
        },
    )
    trainer = UnifiedTrainer(
        cfg, backend=backend, workflow=ScriptedWorkflow(), train_tasks=tasks(40)
    )
    backend.trainer_version = lambda: trainer.coordinator.version
    records = run(trainer.fit(), virtual=True)
    return trainer, backend, records


@pytest.mark.parametrize(("n", "depth"), [(1, 0), (3, 0), (4, 1), (3, 2)])
def test_the_engine_gets_every_nth_version_and_staleness_stays_bounded(tmp_path, n, depth) -> None:
    trainer, backend, records = train(tmp_path, n, depth)
    assert backend.synced == list(range(n, 13, n)), "exactly total_steps / N weight syncs"
    assert [r["step"] for r in records] == list(range(1, 13))
    assert [r["policy_version"] for r in records] == list(range(1, 13)), "versions count steps"
    assert trainer.coordinator.version == 12
    bound = depth + n - 1
    assert backend.token_staleness and max(backend.token_staleness) <= bound
    assert max(r["staleness/max"] for r in records) <= bound
    # Tokens carry the version of the weights that sampled them: only pushed versions appear.
    assert backend.token_versions <= {0, *backend.synced}
    assert sum(r.get("groups/dropped_stale", 0) for r in records) == 0
    # Samples really lag the trainer by up to N - 1 steps when the engine is synced less often.
    assert max(backend.token_staleness) >= n - 1


def test_latest_weights_with_sync_every_keep_per_token_versions(tmp_path) -> None:
    _, backend, records = train(tmp_path, 2, 1, weight_update="latest")
    assert backend.synced == [2, 4, 6, 8, 10, 12]
    assert max(backend.token_staleness) <= 2
    assert len(records) == 12


def test_the_last_step_always_reaches_the_engine(tmp_path) -> None:
    _, backend, _ = train(tmp_path, 5, 0, steps=12)
    assert backend.synced == [5, 10, 12]


def test_sync_warmup_steps_sync_every_step(tmp_path) -> None:
    backend = SyncCountingBackend()
    cfg = make_config(
        tmp_path,
        train={"total_steps": 9},
        coordinator={"sync_every": 3, "max_staleness": 3, "sync_warmup_steps": 2},
    )
    trainer = UnifiedTrainer(
        cfg, backend=backend, workflow=ScriptedWorkflow(), train_tasks=tasks(40)
    )
    run(trainer.fit(), virtual=True)
    assert backend.synced == [1, 2, 3, 6, 9]


def test_the_sim_backend_samples_only_synced_versions(tmp_path) -> None:
    config = workload_config(
        "W1",
        [
            f"run_dir={tmp_path}",
            "logging.progress_bar=false",
            "checkpoint.resume=never",
            "train.total_steps=12",
            "train.groups_per_step=4",
            "rollout.group_size=4",
            "coordinator.pipeline_depth=1",
            "coordinator.sync_every=4",
            "coordinator.max_staleness=4",
        ],
    )
    trainer = UnifiedTrainer(config)
    records = trainer.run()
    backend = trainer.backend
    assert isinstance(backend, SimBackend)
    assert len(records) == 12 and backend.version == 12
    min_versions = [g[-1] for step in backend.trained for g in step]
    assert min_versions and all(v % 4 == 0 for v in min_versions)
    assert max(r["staleness/max"] for r in records) <= 4


def test_max_staleness_must_allow_sync_every_minus_one() -> None:
    with pytest.raises(ConfigError, match=r"max_staleness \(2\).*sync_every \(4\) - 1"):
        load_config(
            None,
            [
                "coordinator.sync_every=4",
                "coordinator.pipeline_depth=0",
                "coordinator.max_staleness=2",
            ],
        )
    ok = load_config(None, ["coordinator.sync_every=4", "coordinator.max_staleness=4"])
    assert ok.coordinator.sync_every == 4


def test_sync_mode_refuses_sync_every_above_one() -> None:
    with pytest.raises(ConfigError, match=r"mode: sync.*sync_every is 2.*max_staleness: 1"):
        load_config(None, ["mode=sync", "coordinator.sync_every=2"])
    assert load_config(None, ["mode=sync", "coordinator.sync_every=1"]).coordinator.sync_every == 1
