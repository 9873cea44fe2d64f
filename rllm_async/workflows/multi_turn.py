"""MultiTurnWorkflow: chat with tools (python callables with JSON schemas) for up to `max_turns`."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rllm_async.infra import infra_failure, is_infra_error
from rllm_async.protocols import PolicyClient
from rllm_async.rollout import COMPACT_PROMPT, SUMMARY_TEMPLATE, ContextLengthError, RolloutContext
from rllm_async.types import Episode, Termination
from rllm_async.workflows.base import Workflow
from rllm_async.workflows.callables import load, maybe_await, score
from rllm_async.workflows.compaction import Compaction
from rllm_async.workflows.prompt import task_messages

RewardFn = Callable[[dict[str, Any], list[dict[str, Any]]], "float | tuple[float, bool]"]


@dataclass
class Tool:
    """A python callable (sync or async) the model may call, and the JSON schema of its arguments.

    `name` defaults to the function's name and `description` to its docstring's first line.
    """

    fn: Callable[..., Any]
    parameters: dict[str, Any]
    name: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or self.fn.__name__
        self.description = self.description or (inspect.getdoc(self.fn) or "").split("\n")[0]

    @classmethod
    def of(cls, spec: Tool | dict[str, Any]) -> Tool:
        """A Tool from itself or from config: `{fn: "pkg.mod:func", parameters: {...}, ...}`,
        or `{cls: "pkg.mod:SomeTool", ...}`, a Tool class made with the other keys."""
        if isinstance(spec, Tool):
            return spec
        spec = dict(spec)
        if "cls" in spec:
            tool = load(spec.pop("cls"), "workflow.args.tools[].cls")(**spec)
            if not isinstance(tool, Tool):
                raise TypeError(f"workflow.args.tools[].cls made {tool!r}, not a Tool")
            return tool
        fn = load(spec.pop("fn"), "workflow.args.tools[].fn")
        return cls(fn=fn, **spec)

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool schema the chat template shows the model."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    async def call(self, arguments: dict[str, Any], timeout_s: float) -> str:
        """The tool's result as text; a failure or a timeout becomes an error text for the model,
        never a raise, except an infrastructure failure (`rllm_async.infra.InfraError` or a
        registered type): not the model's doing, it is raised."""
        try:
            async with asyncio.timeout(timeout_s):
                result = await maybe_await(self.fn(**arguments))
        except TimeoutError:
            return f"error: {self.name} timed out after {timeout_s:.3g}s"
        except Exception as e:
            if is_infra_error(e):
                raise
            return f"error: {type(e).__name__}: {e}"
        return result if isinstance(result, str) else json.dumps(result, default=str)

    async def start(self) -> None:
        """Start what the tool's calls share (a sandbox pool); the workflow's `start` calls it."""
        return None

    async def close(self) -> None:
        """Release what `start` or the calls started; the workflow's `close` calls it."""
        return None

    def metrics(self) -> dict[str, float]:
        """The tool's own figures since the last call (the workflow reports them per step)."""
        return {}


class MultiTurnWorkflow(Workflow):
    """Ask the task's prompt, run the tools the model calls, and feed their results back, until the
    model answers without a tool call or `max_turns` model calls were made.

    Malformed tool calls, and tools that raise, are answered with a `tool` message naming the
    error (never raised): the model's doing, scored by the reward. A tool whose infrastructure
    failed (it raised `rllm_async.infra.InfraError`, e.g. `SandboxError` from `PythonTool`) ends the conversation
    instead: the rollout is marked infra-failed (`ctx.mark_infra_failed`), never scored or trained.
    `reward_fn(task, messages)` scores the whole conversation (the final answer is
    `messages[-1]["content"]`) and returns a reward or `(reward, is_correct)`.

    With `compact_at` (a token budget), a conversation whose next prompt would be longer is
    compacted first (`RolloutContext.compact`): the policy summarizes it when asked
    `compact_prompt` (in at most `compact_max_tokens` tokens), the summary is trained as a step of
    the episode, and the model goes on from the opening turns and the summary. `reward_fn` still
    gets the whole conversation (every turn before and after, without the summary requests).
    """

    def __init__(
        self,
        reward_fn: str | RewardFn,
        tools: list[Tool | dict[str, Any]] | None = None,
        max_turns: int = 4,
        prompt_key: str = "prompt",
        system_prompt: str | None = None,
        tool_timeout_s: float = 30.0,
        deadline_grace_s: float = 1.0,
        compact_at: int | None = None,
        compact_prompt: str = COMPACT_PROMPT,
        compact_max_tokens: int | None = None,
        summary_template: str = SUMMARY_TEMPLATE,
    ) -> None:
        if max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        self.compaction = Compaction.of(
            compact_at, compact_prompt, compact_max_tokens, summary_template
        )
        self.reward_fn: RewardFn = load(reward_fn, "workflow.args.reward_fn")
        self.tools = {t.name: t for t in map(Tool.of, tools or [])}
        self.schemas = [t.schema for t in self.tools.values()] or None
        self.max_turns = max_turns
        self.prompt_key = prompt_key
        self.system_prompt = system_prompt
        self.tool_timeout_s = tool_timeout_s
        self.deadline_grace_s = deadline_grace_s

    async def start(self, policy: PolicyClient) -> None:
        for tool in self.tools.values():
            await tool.start()

    async def close(self) -> None:
        for tool in self.tools.values():
            await tool.close()

    def step_metrics(self) -> dict[str, float]:
        """Each tool's own figures, as `tool/<name>/<key>`."""
        return {
            f"tool/{name}/{key}": value
            for name, tool in self.tools.items()
            for key, value in tool.metrics().items()
        }

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        messages = task_messages(task, self.prompt_key, self.system_prompt)
        stats = {"turns": 0.0, "tool_calls": 0.0, "tool_errors": 0.0}
        termination = Termination.MAX_TURNS
        try:
            # Stop `deadline_grace_s` before the episode's deadline, so that the conversation is
            # scored and trained as a TIMEOUT rather than cancelled by the trainer.
            async with ctx.timeout(self.deadline_grace_s):
                termination = await self._converse(messages, ctx, stats)
        except TimeoutError:
            termination = Termination.TIMEOUT
        except ContextLengthError:
            termination = Termination.TRUNCATED
        if ctx.infra_failure is not None:  # not scored: the runner leaves the rollout out
            episode = ctx.build_episode(None)
            episode.termination, episode.error = Termination.ERROR, ctx.infra_failure
            episode.metrics.update(stats)
            return episode
        reward, correct = score(self.reward_fn, task, messages)
        ctx.set_reward(reward)
        episode = ctx.build_episode(None)
        episode.is_correct = correct
        episode.termination = termination
        episode.metrics.update(stats)
        return episode

    async def _converse(
        self, messages: list[dict[str, Any]], ctx: RolloutContext, stats: dict[str, float]
    ) -> Termination:
        view = messages  # what the model sees: `messages` until a compaction
        for _ in range(self.max_turns):
            if self.compaction is not None:
                compacted = await self.compaction.apply(ctx, view, self.schemas)
                if compacted is not view:
                    stats["compactions"] = stats.get("compactions", 0.0) + 1
                    view = compacted
            turn = await ctx.chat_turn(view, tools=self.schemas)
            stats["turns"] += 1
            new = [turn.message]
            calls = turn.message.get("tool_calls", [])
            if not calls and not turn.tool_call_errors:
                _extend(messages, view, new)
                return Termination.DONE
            stats["tool_calls"] += len(calls)
            stats["tool_errors"] += len(turn.tool_call_errors)
            time_left = max(0.0, ctx.time_left - self.deadline_grace_s)
            timeout = min(self.tool_timeout_s, time_left)
            results = await asyncio.gather(
                *(self._run_call(c, timeout) for c in calls), return_exceptions=True
            )
            for c, result in zip(calls, results, strict=True):
                if isinstance(result, BaseException):
                    cause = infra_failure(result)
                    if cause is None:
                        raise result
                    name = c["function"]["name"]
                    ctx.mark_infra_failed(f"tool {name}: {type(cause).__name__}: {cause}")
            if ctx.infra_failure is not None:
                return Termination.ERROR
            new.extend(r for r in results if isinstance(r, dict))
            new.extend({"role": "tool", "content": f"error: {e}"} for e in turn.tool_call_errors)
            _extend(messages, view, new)
        return Termination.MAX_TURNS

    async def _run_call(self, call: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        fn = call["function"]
        content = await self.tools[fn["name"]].call(json.loads(fn["arguments"]), timeout_s)
        return {"role": "tool", "tool_call_id": call["id"], "content": content}


def _extend(messages: list[dict[str, Any]], view: list[dict[str, Any]], new: list[Any]) -> None:
    """Add a turn's messages to the whole conversation and, once compacted, to the model's view."""
    messages.extend(new)
    if view is not messages:
        view.extend(new)
