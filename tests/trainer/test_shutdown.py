"""Shutdown on the real clock: fit() returns or raises promptly and leaves nothing running."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from rllm_async.health import FailureRateError
from rllm_async.trainer import UnifiedTrainer
from rllm_async.vclock import run
from tests.fakes import FakeBackend, ScriptedWorkflow, ctrl_c_raises, make_config, tasks


def leftovers() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


def trainer_for(
    tmp_path, backend: FakeBackend, workflow: ScriptedWorkflow, **cfg
) -> UnifiedTrainer:
    config = make_config(tmp_path, **cfg)
    return UnifiedTrainer(config, backend=backend, workflow=workflow, train_tasks=tasks(40))


def test_normal_end_leaves_nothing_behind(tmp_path) -> None:
    threads = threading.active_count()
    backend = FakeBackend(latency=lambda: 0.001)
    trainer = trainer_for(tmp_path, backend, ScriptedWorkflow())

    async def main() -> float:
        t0 = time.monotonic()
        await trainer.fit()
        assert leftovers() == []
        return time.monotonic() - t0

    assert run(main(), virtual=False) < 1.0
    assert backend.closed
    assert threading.active_count() == threads


@pytest.mark.parametrize(
    ("what", "error"),
    [("trainer", RuntimeError), ("workflow", FailureRateError)],
)
def test_exceptions_stop_the_run_within_3s(tmp_path, what, error) -> None:
    threads = threading.active_count()
    if what == "trainer":
        backend = FakeBackend(latency=lambda: 0.01, fb_fault=lambda n: n == 3)
        workflow = ScriptedWorkflow()
    else:
        backend = FakeBackend(latency=lambda: 0.01)
        workflow = ScriptedWorkflow(fault=lambda t, i, a: "raise")

    async def main() -> float:
        t0 = time.monotonic()
        with pytest.raises(error):
            await trainer_for(tmp_path, backend, workflow).fit()
        assert leftovers() == []
        return time.monotonic() - t0

    assert run(main(), virtual=False) < 3.0
    assert backend.closed
    assert threading.active_count() == threads


@pytest.mark.parametrize("situation", ["generating", "full_buffer"])
def test_cancellation_returns_within_1s(tmp_path, situation) -> None:
    if situation == "full_buffer":
        # The trainer never finishes a forward_backward, so the buffer fills to capacity.
        backend = FakeBackend(latency=lambda: 0.001, train_s=3600.0)
    else:
        backend = FakeBackend(latency=lambda: 10.0)
    trainer = trainer_for(tmp_path, backend, ScriptedWorkflow(), coordinator={"pipeline_depth": 1})

    async def main() -> float:
        task = asyncio.create_task(trainer.fit())
        await asyncio.sleep(0.3)
        if situation == "full_buffer":
            # The buffer holds (depth + 1) * groups_per_step groups; two groups are training.
            assert trainer.coordinator.counts.buffered == 2 * 4 - 2
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert leftovers() == []
        return time.monotonic() - t0

    assert run(main(), virtual=False) < 1.0
    assert backend.closed
    counts = trainer.coordinator.counts
    assert counts.in_flight == counts.buffered == 0 and counts.cancelled > 0


def test_keyboard_interrupt_stops_cleanly(tmp_path) -> None:
    backend = FakeBackend(latency=lambda: 0.05)
    trainer = trainer_for(tmp_path, backend, ScriptedWorkflow(), train={"total_steps": 10_000})
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    with ctrl_c_raises(), pytest.raises(KeyboardInterrupt):
        run(trainer.fit(), virtual=False)
    assert time.monotonic() - t0 < 1.5
    assert backend.closed
    assert trainer.coordinator.counts.in_flight == 0
