"""run_python as a MultiTurnWorkflow tool: the model's program runs in a sandbox and its output is
the tool's answer; what the code does is the model's, a broken sandbox raises SandboxError."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from rllm_async.infra import InfraError
from rllm_async.sandbox import SandboxError, SandboxLimits
from rllm_async.sandbox.isolation import namespaces_work
from rllm_async.types import Termination
from rllm_async.workflows import MultiTurnWorkflow, PythonTool, Tool
from tests.sandbox.conftest import rlimits_python
from tests.scripted import ScriptedPolicy, context

if namespaces_work() is None:
    ISOLATION, PYTHON = "namespaces", None
elif rlimits_python() is not None:
    ISOLATION, PYTHON = "rlimits", rlimits_python()
else:  # pragma: no cover - a root trainer with no interpreter open to other users
    pytest.skip("no isolation this machine allows", allow_module_level=True)

LIMITS = {"wall_s": 20.0, "cpu_s": 2.0, "memory_bytes": 256 * 2**20, "processes": 16}


def coder(code: str) -> Callable[[str], str]:
    """Calls run_python with `code` once, then answers with what the tool said."""

    def reply(prompt: str) -> str:
        if "<|tool|>" not in prompt:
            call = {"name": "run_python", "arguments": {"code": code}}
            return f"<tool_call>{json.dumps(call)}</tool_call>"
        return prompt.rsplit("<|tool|>", 1)[1].split("<|end|>")[0].strip()

    return reply


def answer_is(task: dict[str, Any], messages: list[dict[str, Any]]) -> tuple[float, bool]:
    ok = messages[-1]["content"] == task["answer"]
    return float(ok), ok


def workflow(**tool: Any) -> MultiTurnWorkflow:
    spec = {"cls": "rllm_async.workflows.PythonTool", "isolation": ISOLATION, "python": PYTHON}
    return MultiTurnWorkflow(answer_is, tools=[{**spec, "limits": LIMITS, **tool}], max_turns=3)


def test_the_model_runs_code_and_answers_with_its_output() -> None:
    wf = workflow(pool_size=1)
    policy = ScriptedPolicy(coder("print(6 * 7)"))

    async def main() -> Any:
        await wf.start(policy)
        try:
            return await wf.run({"prompt": "6*7?", "answer": "42"}, context(policy))
        finally:
            metrics = wf.step_metrics()
            await wf.close()
            assert metrics["tool/run_python/runs"] == 1
            assert metrics[f"tool/run_python/isolation/{ISOLATION}"] == 1.0

    episode = asyncio.run(main())
    assert episode.termination is Termination.DONE and episode.is_correct
    assert episode.metrics["tool_calls"] == 1


def test_the_codes_own_failures_are_the_tools_answer() -> None:
    wf = workflow(pool_size=1)
    policy = ScriptedPolicy(coder("while True: pass"))

    async def main() -> Any:
        try:
            return await wf.run({"prompt": "loop", "answer": "x"}, context(policy))
        finally:
            await wf.close()

    episode = asyncio.run(main())
    assert episode.termination is Termination.DONE
    tool_turn = policy.text(policy.calls[1][0]).rsplit("<|tool|>", 1)[1]
    assert "[cpu limit exceeded]" in tool_turn


def test_a_broken_sandbox_marks_the_rollout_infra_failed() -> None:
    """A sandbox that cannot start is an infrastructure failure (`SandboxError` is an
    `InfraError`): the rollout is marked, not scored as the model's."""
    assert issubclass(SandboxError, InfraError)
    wf = workflow(pool_size=1, python="/nonexistent/python3")
    ctx = context(ScriptedPolicy(coder("print(1)")))

    async def main() -> Any:
        try:
            return await wf.run({"prompt": "p", "answer": "1"}, ctx)
        finally:
            await wf.close()

    episode = asyncio.run(main())
    assert episode.termination == Termination.ERROR
    assert ctx.infra_failure is not None and "SandboxError" in ctx.infra_failure


def test_a_call_gets_no_more_than_its_timeout_less_the_margin() -> None:
    tool = Tool.of({"cls": "rllm_async.workflows.PythonTool", "isolation": ISOLATION,
                    "python": PYTHON, "limits": SandboxLimits(wall_s=30.0), "margin_s": 0.5})  # fmt: skip
    assert isinstance(tool, PythonTool) and tool.isolation == ISOLATION

    async def main() -> list[str]:
        try:
            return [
                await tool.call({"code": "print(1)"}, timeout_s=0.4),
                await tool.call({"code": "import time; time.sleep(60)"}, timeout_s=2.5),
                await tool.call({"source": "print(1)"}, timeout_s=10.0),
            ]
        finally:
            await tool.close()

    no_time, slept, bad_args = asyncio.run(main())
    assert no_time.startswith("error: run_python: no time left")
    assert slept == "[wall limit exceeded]"  # ended by the sandbox's own limit, 2 s
    assert bad_args.startswith("error: run_python takes one argument")
