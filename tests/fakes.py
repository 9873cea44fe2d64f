"""Test doubles for fault injection: a backend and workflows whose latencies and failures we script."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rllm_async.backends.toy_tokenizers import ByteTokenizer
from rllm_async.config import Config, config_from_dict
from rllm_async.protocols import Completion, SamplingParams
from rllm_async.rollout import RolloutContext
from rllm_async.workflows.base import Workflow


class FakePolicy:
    """Answers after `latency()` seconds; tracks live pinned snapshots."""

    def __init__(self, latency: Callable[[], float] = lambda: 0.0) -> None:
        self.version = 0
        self.latency = latency
        self.live: dict[int, int] = {}
        self.calls = 0
        self.priorities: list[int] = []  # SamplingParams.priority of every request

    @property
    def tokenizer(self) -> ByteTokenizer:
        return ByteTokenizer()

    def acquire(self) -> int:
        self.live[self.version] = self.live.get(self.version, 0) + 1
        return self.version

    def release(self, version: int) -> None:
        self.live[version] -= 1
        if not self.live[version]:
            del self.live[version]

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, version: int | None = None
    ) -> Completion:
        self.calls += 1
        self.priorities.append(params.priority)
        delay = self.latency()
        if delay > 0:
            await asyncio.sleep(delay)
        v = self.version if version is None else version
        n = 3
        return Completion(ids=[65] * n, logprobs=[-1.0] * n, versions=[v] * n)


class FakeBackend:
    """A backend with scripted latencies and faults; it logs what it trained."""

    virtual_clock = True

    def __init__(
        self,
        latency: Callable[[], float] = lambda: 0.0,
        train_s: float = 0.0,
        sync_s: float = 0.0,
        sync_fault: Callable[[int], str | None] = lambda v: None,  # "raise" | "hang" | None
        fb_fault: Callable[[int], bool] = lambda n: False,
    ) -> None:
        self._policy = FakePolicy(latency)
        self.train_s = train_s
        self.sync_s = sync_s
        self.sync_fault = sync_fault
        self.fb_fault = fb_fault
        self.fb_calls = 0
        self.steps: list[list[tuple[str, tuple[float, ...]]]] = [[]]
        self.staleness: list[int] = []  # policy version minus each trained group's oldest token
        self.closed = False
        self.saved_state: dict[str, Any] = {}

    def policy(self) -> FakePolicy:
        return self._policy

    async def forward_backward(self, groups: list[Any], loss: Any) -> dict[str, float]:
        self.fb_calls += 1
        if self.fb_fault(self.fb_calls):
            raise RuntimeError("injected forward_backward failure")
        if self.train_s:
            await asyncio.sleep(self.train_s)
        for g in groups:
            self.steps[-1].append((g.task_id, tuple(g.rewards)))
            self.staleness.append(self._policy.version - g.min_version)
        return {"loss": 1.0}

    async def optim_step(self) -> dict[str, float]:
        self.steps.append([])
        return {"lr": 1e-3}

    async def on_policy_updated(self, version: int) -> None:
        fault = self.sync_fault(version)
        if fault == "raise":
            raise RuntimeError(f"injected sync failure at version {version}")
        if fault == "hang":
            await asyncio.Event().wait()
        if self.sync_s:
            await asyncio.sleep(self.sync_s)
        self._policy.version = version

    async def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        (path / "state.txt").write_text(str(self._policy.version))

    async def load(self, path: Path) -> None:
        self._policy.version = int((path / "state.txt").read_text())

    async def close(self) -> None:
        self.closed = True

    @property
    def trained(self) -> list[list[tuple[str, tuple[float, ...]]]]:
        """Per optimizer step, the (task_id, rewards) of each trained group."""
        return [s for s in self.steps if s]


class ScriptedWorkflow(Workflow):
    """Generates once, then rewards by `reward(task, rollout_index, attempt)`; may raise or hang."""

    def __init__(
        self,
        reward: Callable[[dict[str, Any], int, int], float] | None = None,
        fault: Callable[[dict[str, Any], int, int], str | None] = lambda t, i, a: None,
        delay: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.reward = reward or (lambda task, i, a: float(i % 2))
        self.fault = fault
        self.delay = delay
        self.started = 0

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> float:
        self.started += 1
        what = self.fault(task, ctx.rollout_index, ctx.attempt)
        if what == "raise":
            raise ValueError(f"injected workflow failure on {task['id']}")
        if what == "hang":
            await asyncio.Event().wait()
        delay = self.delay()
        if delay > 0:
            await asyncio.sleep(delay)
        await ctx.generate([1, 2, 3])
        return self.reward(task, ctx.rollout_index, ctx.attempt)


def make_config(tmp_path: Path, **sections: Any) -> Config:
    """A small config for tests: no progress bar, run dir under tmp_path, overrides per section."""
    base: dict[str, Any] = {
        "name": "test",
        "run_dir": str(tmp_path / "runs"),
        "train": {"total_steps": 5, "groups_per_step": 4, "micro_batch_groups": 2},
        "rollout": {"group_size": 4, "timeout_s": 60.0},
        "checkpoint": {"resume": "never", "at_end": False},
        "logging": {"progress_bar": False},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return config_from_dict(base)


def tasks(n: int) -> list[dict[str, Any]]:
    return [{"id": f"t{i}", "prompt": f"task {i}"} for i in range(n)]


def seeded(seed: int) -> random.Random:
    return random.Random(seed)


@contextlib.contextmanager
def ctrl_c_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt inside, as at a terminal, also where the test process was
    started with SIGINT ignored (a shell's background job)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
