"""Recorded runs shared by the planner's tests: each made once per session, and only if used."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.plan.runs import record_run


@pytest.fixture(scope="session")
def async_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_run(
        tmp_path_factory.mktemp("async"),
        "coordinator.pipeline_depth=2",
        "coordinator.max_staleness=null",
    )


@pytest.fixture(scope="session")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """W1 at a quarter of its size: 8 groups of 8 per step on 128 decode slots, 12 steps."""
    return record_run(
        tmp_path_factory.mktemp("small"),
        "train.total_steps=12",
        "train.groups_per_step=8",
        "backend.slots=128",
        "rollout.max_concurrency=128",
        "coordinator.pipeline_depth=2",
        "coordinator.max_staleness=null",
    )


@pytest.fixture(scope="session")
def sync_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_run(tmp_path_factory.mktemp("sync"), "mode=sync", "coordinator.max_staleness=0")
