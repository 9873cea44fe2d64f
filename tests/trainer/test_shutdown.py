"""Shutdown: fit() returns or raises promptly and leaves nothing running.

On the virtual clock, so that "promptly" means that nothing waits on a timer (a generation, a
timeout) however slowly the machine runs: the durations below are virtual seconds."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

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
        t0 = asyncio.get_running_loop().time()
        await trainer.fit()
        assert leftovers() == []
        return asyncio.get_running_loop().time() - t0

    assert run(main(), virtual=True) < 1.0
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
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(error):
            await trainer_for(tmp_path, backend, workflow).fit()
        assert leftovers() == []
        return asyncio.get_running_loop().time() - t0

    assert run(main(), virtual=True) < 3.0
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
        t0 = asyncio.get_running_loop().time()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert leftovers() == []
        return asyncio.get_running_loop().time() - t0

    assert run(main(), virtual=True) < 1.0
    assert backend.closed
    counts = trainer.coordinator.counts
    assert counts.in_flight == counts.buffered == 0 and counts.cancelled > 0


def test_keyboard_interrupt_stops_cleanly(tmp_path) -> None:
    backend = FakeBackend(latency=lambda: 0.05)
    trainer = trainer_for(tmp_path, backend, ScriptedWorkflow(), train={"total_steps": 10_000})
    loops: list[asyncio.AbstractEventLoop] = []

    async def main() -> None:
        loops.append(asyncio.get_running_loop())
        loops[0].call_later(0.5, os.kill, os.getpid(), signal.SIGINT)
        await trainer.fit()

    with ctrl_c_raises(), pytest.raises(KeyboardInterrupt):
        run(main(), virtual=True)
    # The closed loop's clock: the signal at 0.5 s, then under 1 s to stop, run()'s clean-up too.
    assert loops[0].time() < 1.5
    assert backend.closed
    assert trainer.coordinator.counts.in_flight == 0
