"""`SandboxPool`: sandboxes kept ready and reused between runs and episodes, with each run's time
bounded by its episode's deadline."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

from rllm_async.sandbox.error import SandboxError
from rllm_async.sandbox.isolation import resolve
from rllm_async.sandbox.limits import SandboxLimits
from rllm_async.sandbox.result import SandboxResult
from rllm_async.sandbox.sandbox import Sandbox


class SandboxPool:
    """Up to `size` sandboxes running code at once; a run waits for a free one.

    A sandbox is made when a run finds none free and fewer than `size` exist, and is kept for
    the runs that follow: each keeps its next launcher started, so a run in a pool that is warm
    starts at once. Runs never share anything: each is a new process tree with a new, empty
    private directory. A sandbox whose run failed (`SandboxError`) is closed, not reused.
    """

    def __init__(
        self,
        size: int = 4,
        limits: SandboxLimits | None = None,
        isolation: str = "auto",
        margin_s: float = 0.5,
        root_dir: str | None = None,
        python: str | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("size must be at least 1")
        self.size = size
        self.limits = limits or SandboxLimits()
        self.isolation = resolve(isolation)
        self.margin_s = margin_s
        self._args = {"root_dir": root_dir, "python": python}
        self._idle: list[Sandbox] = []
        self._all: list[Sandbox] = []
        self._free = asyncio.Condition()
        self._counts: Counter[str] = Counter()
        self._closed = False

    async def start(self) -> None:
        """Make all `size` sandboxes and start their launchers now, rather than on first use."""
        while len(self._all) < self.size:
            sandbox = self._make()
            self._idle.append(sandbox)
            await sandbox.start()

    def wall_s(self, timeout_s: float | None = None, time_left_s: float | None = None) -> float:
        """A run's wall-time limit: the smallest of `limits.wall_s`, the caller's `timeout_s`,
        and `time_left_s` (what the episode has left: `ctx.time_left`) minus `margin_s`, so that
        the run ends, killed and cleaned up, before the episode's deadline."""
        wall = self.limits.wall_s
        if timeout_s is not None:
            wall = min(wall, timeout_s)
        if time_left_s is not None:
            wall = min(wall, time_left_s - self.margin_s)
        return wall

    async def run(
        self, code: str, timeout_s: float | None = None, time_left_s: float | None = None
    ) -> SandboxResult:
        """Run `code` in a free sandbox for at most `wall_s(timeout_s, time_left_s)` seconds."""
        wall = self.wall_s(timeout_s, time_left_s)
        sandbox = await self._acquire()
        failed = False
        try:
            self._counts["runs"] += 1
            if sandbox.runs:
                self._counts["reused"] += 1
            result = await sandbox.run(code, wall)
        except SandboxError:
            failed = True
            self._counts["sandbox_errors"] += 1
            raise
        finally:
            await self._release(sandbox, failed)
        if result.limit is not None:
            self._counts[f"limit/{result.limit}"] += 1
        return result

    def metrics(self) -> dict[str, float]:
        """Counts since the last call (`runs`, `reused`, `sandbox_errors`, `limit/<name>`), the
        sandboxes made, and 1.0 under `isolation/<name>` for the isolation in force."""
        out = {k: float(v) for k, v in self._counts.items()}
        self._counts.clear()
        out["sandboxes"] = float(len(self._all))
        out[f"isolation/{self.isolation}"] = 1.0
        return out

    async def close(self) -> None:
        """Close every sandbox; runs in flight end with SandboxError."""
        self._closed = True
        sandboxes, self._all, self._idle = self._all, [], []
        for sandbox in sandboxes:
            with contextlib.suppress(Exception):
                await sandbox.close()

    async def __aenter__(self) -> SandboxPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _make(self) -> Sandbox:
        sandbox = Sandbox(self.limits, self.isolation, **self._args)
        self._all.append(sandbox)
        return sandbox

    async def _acquire(self) -> Sandbox:
        async with self._free:
            while True:
                if self._closed:
                    raise SandboxError("the sandbox pool is closed")
                if self._idle:
                    return self._idle.pop()
                if len(self._all) < self.size:
                    return self._make()
                await self._free.wait()

    async def _release(self, sandbox: Sandbox, failed: bool) -> None:
        if failed or self._closed:
            if sandbox in self._all:
                self._all.remove(sandbox)
            await sandbox.close()
        else:
            self._idle.append(sandbox)
        async with self._free:
            self._free.notify()
