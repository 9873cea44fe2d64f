"""`mode: sync` is `mode: async` with d=0, K=0 and pinned weights: one code path, same batches."""

from __future__ import annotations

from rllm_async.backends.sim import SimBackend, workload_config
from rllm_async.trainer import UnifiedTrainer


def trained_batches(tmp_path, mode_overrides: list[str]) -> list:
    config = workload_config(
        "W1",
        [
            f"run_dir={tmp_path}",
            "name=" + "-".join(mode_overrides).replace("=", "_").replace(".", "_"),
            "logging.progress_bar=false",
            "checkpoint.resume=never",
            "train.total_steps=50",
            "train.groups_per_step=4",
            "rollout.group_size=4",
            "rollout.max_concurrency=32",
            *mode_overrides,
        ],
    )
    trainer = UnifiedTrainer(config)
    records = trainer.run()
    assert len(records) == 50
    backend = trainer.backend
    assert isinstance(backend, SimBackend)
    return backend.trained


def test_sync_and_async_d0_k0_pin_train_identical_batches(tmp_path) -> None:
    sync = trained_batches(tmp_path, ["mode=sync"])
    async_d0 = trained_batches(
        tmp_path,
        [
            "mode=async",
            "coordinator.pipeline_depth=0",
            "coordinator.max_staleness=0",
            "coordinator.weight_update=pin",
        ],
    )
    assert len(sync) == 50
    assert sync == async_d0
    # And the comparison has teeth: d=1 trains different (staler) batches.
    async_d1 = trained_batches(
        tmp_path, ["mode=async", "coordinator.pipeline_depth=1", "coordinator.max_staleness=1"]
    )
    assert async_d1 != sync
    assert max(group[5] for step in sync for group in step) == 49


def test_faulty_workload_w4_trains_through_faults(tmp_path) -> None:
    config = workload_config(
        "W4",
        [
            f"run_dir={tmp_path}",
            "logging.progress_bar=false",
            "checkpoint.resume=never",
            "train.total_steps=12",
            "rollout.timeout_s=300",  # so that injected hangs are reclaimed within the run
            "backend.sync_fail_every=5",
            "coordinator.pipeline_depth=2",
            "coordinator.max_staleness=4",
        ],
    )
    trainer = UnifiedTrainer(config)
    records = trainer.run()
    assert len(records) == 12
    backend = trainer.backend
    assert isinstance(backend, SimBackend)
    assert backend.sync_failures == 2  # versions 5 and 10, each retried
    assert sum(r.get("rollout/errors", 0) for r in records) > 0
    assert sum(r.get("rollout/timeouts", 0) for r in records) > 0  # injected hangs reclaimed
    assert backend.policy().snapshots == {}
