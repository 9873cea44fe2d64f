"""`PythonTool`: `run_python(code)`, a tool that runs the model's code in a sandbox pool."""

from __future__ import annotations

import asyncio
from typing import Any

from rllm_async.sandbox import SandboxLimits, SandboxPool
from rllm_async.workflows.multi_turn import Tool

PARAMETERS = {
    "type": "object",
    "properties": {"code": {"type": "string", "description": "A Python program; print results."}},
    "required": ["code"],
}


class PythonTool(Tool):
    """Run the model's Python program in a sandbox (docs/sandbox.md) and answer with its output.

    What the code does, however it ends (an exception, a non-zero exit, a limit it ran into), is
    the tool's answer, which the model reads. A failure of the sandbox itself raises
    `SandboxError` out of the workflow: an infrastructure failure, not the model's.

    A run's time is the smallest of `limits.wall_s` and the call's timeout (the workflow's
    `tool_timeout_s`, at most what the episode has left) less `margin_s`, so that it is killed
    and cleaned up before the call's deadline. Config: `tools: [{cls:
    rllm_async.workflows.PythonTool, pool_size: 4, limits: {wall_s: 5}}]`.
    """

    def __init__(
        self,
        pool: SandboxPool | None = None,
        limits: SandboxLimits | dict[str, Any] | None = None,
        pool_size: int = 4,
        isolation: str = "auto",
        python: str | None = None,
        margin_s: float = 0.5,
        name: str = "run_python",
        description: str = "Run a Python program in a sandbox and return what it prints.",
    ) -> None:
        if isinstance(limits, dict):
            limits = SandboxLimits(**limits)
        self.pool = pool or SandboxPool(pool_size, limits, isolation, margin_s, python=python)
        self.margin_s = margin_s
        super().__init__(fn=self._run, parameters=PARAMETERS, name=name, description=description)

    @property
    def isolation(self) -> str:
        """The isolation the code runs under: `namespaces` or `rlimits`."""
        return self.pool.isolation

    async def _run(self, code: str) -> str:
        return (await self.pool.run(code)).to_text()

    async def call(self, arguments: dict[str, Any], timeout_s: float) -> str:
        """The program's output as text; raises SandboxError when the sandbox fails."""
        code = arguments.get("code")
        if not isinstance(code, str) or set(arguments) - {"code"}:
            return f"error: {self.name} takes one argument, code (a string)"
        wall = timeout_s - self.margin_s
        if wall <= 0:
            return f"error: {self.name}: no time left in this episode to run code"
        # The pool's own bound ends the run first; this one only guards a stuck start.
        try:
            async with asyncio.timeout(timeout_s):
                result = await self.pool.run(code, timeout_s=wall)
        except TimeoutError:
            return f"error: {self.name} timed out after {timeout_s:.3g}s"
        return result.to_text()

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()

    def metrics(self) -> dict[str, float]:
        return self.pool.metrics()
