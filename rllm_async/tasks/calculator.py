"""Calculator: multiply two numbers with the help of a `calc` tool, in at most a few turns.

The same agent three ways (configs in examples/calculator/): `MultiTurnWorkflow` with `calc`, the
hand-written workflow class `CalculatorAgent`, and `openai_agent`, a plain `openai`-client loop
trained through the gateway with `OpenAIAgentWorkflow`. The warm start mixes transcripts that use
the tool with ones that guess the product, so RL has a choice to learn: call the tool. The reward
gives partial credit along the way to the answer (a well-formed call, then the right expression,
then the right answer), so that groups differ from the first step on; only a right call followed
by the right answer earns the top reward.
"""

from __future__ import annotations

import json
import random
from typing import Any

from rllm_async.rollout import RolloutContext
from rllm_async.types import Episode, Termination
from rllm_async.workflows.base import Workflow
from rllm_async.workflows.multi_turn import Tool

MAX_TURNS = 3
MAX_EXPR_CHARS = 32
CALL_REWARD = 0.2  # the conversation calls `calc` in the tool-call syntax
EXPRESSION_REWARD = 0.3  # and one of its calls computes the product asked for
ANSWER_REWARD = 0.5  # the final answer states the product


def calc(expr: str) -> str:
    """a*b"""
    parts = str(expr).replace(" ", "").split("*")
    if len(expr) > MAX_EXPR_CHARS or len(parts) != 2 or not all(p.isdigit() for p in parts):
        return "error: write a product of two integers like 12*34"
    return str(int(parts[0]) * int(parts[1]))


def calc_tool() -> Tool:
    """`calc` with its JSON schema."""
    schema = {"type": "object", "properties": {"expr": {"type": "string"}}}
    return Tool(calc, schema)


CALC_SCHEMA = calc_tool().schema


def generator(n: int = 1000, seed: int = 0, low: int = 10, high: int = 99) -> list[dict[str, Any]]:
    """`n` products of two numbers in [low, high], the same for the same arguments."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        tasks.append({"id": f"calc-{seed}-{i}", "prompt": f"{a}*{b}=?", "answer": str(a * b)})
    return tasks


def reward(task: dict[str, Any], messages: list[dict[str, Any]]) -> tuple[float, bool]:
    """(reward, is_correct): CALL_REWARD for a call of `calc`, EXPRESSION_REWARD more when a call
    computes the product, ANSWER_REWARD more when the last message states it; correct when it
    does. A right guess without the tool earns ANSWER_REWARD only: the top reward needs the tool."""
    results = [calc_result(call) for m in messages for call in m.get("tool_calls") or ()]
    last = messages[-1] if messages else {}
    answered = (
        last.get("role") == "assistant" and str(last.get("content") or "").strip() == task["answer"]
    )
    score = (
        CALL_REWARD * any(r is not None for r in results)
        + EXPRESSION_REWARD * (task["answer"] in results)
        + ANSWER_REWARD * answered
    )
    return round(score, 6), answered


def calc_result(call: Any) -> str | None:
    """What an OpenAI-style tool call of `calc` returns; None for a call of anything else."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or fn.get("name") != "calc":
        return None
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return calc(str(arguments.get("expr", "")))


def tool_call_text(expr: str) -> str:
    """A call of `calc` in the documented tool-call syntax."""
    body = json.dumps({"name": "calc", "arguments": {"expr": expr}})
    return f"<tool_call>{body}</tool_call>"


def warm_start_examples(
    n: int = 2000, seed: int = 1, tool_share: float = 0.5, low: int = 10, high: int = 99
) -> list[dict[str, Any]]:
    """Chat transcripts of `generator`'s products: `tool_share` of them call `calc` then answer,
    the rest guess a product near the right one (usually wrong). One example per assistant turn."""
    rng = random.Random(f"warm-{seed}")
    examples = []
    for task in generator(n=n, seed=seed, low=low, high=high):
        user = {"role": "user", "content": task["prompt"]}
        # What the character template renders for `tools=[CALC_SCHEMA]`.
        tools = {"role": "system", "content": "Tools: " + json.dumps([CALC_SCHEMA])}
        if rng.random() < tool_share:
            expr = task["prompt"].removesuffix("=?")
            call = {"role": "assistant", "content": tool_call_text(expr)}
            result = {"role": "tool", "content": calc(expr)}
            examples.append({"messages": [tools, user, call]})
            examples.append(
                {
                    "messages": [
                        tools,
                        user,
                        call,
                        result,
                        {"role": "assistant", "content": task["answer"]},
                    ]
                }
            )
        else:
            guess = int(task["answer"]) + rng.choice([-1, 1]) * rng.randint(0, 50)
            examples.append(
                {"messages": [tools, user, {"role": "assistant", "content": str(guess)}]}
            )
    return examples


class CalculatorAgent(Workflow):
    """The calculator agent as a hand-written workflow: chat, run the tool calls, repeat."""

    def __init__(self, max_turns: int = MAX_TURNS) -> None:
        self.max_turns = max_turns
        self.tool = calc_tool()

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
        stats = {"turns": 0.0, "tool_calls": 0.0, "tool_errors": 0.0}  # as MultiTurnWorkflow's
        termination = Termination.MAX_TURNS
        for _ in range(self.max_turns):
            turn = await ctx.chat_turn(messages, tools=[self.tool.schema])
            messages.append(turn.message)
            calls = turn.message.get("tool_calls", [])
            stats["turns"] += 1
            stats["tool_calls"] += len(calls)
            stats["tool_errors"] += len(turn.tool_call_errors)
            if not calls and not turn.tool_call_errors:
                termination = Termination.DONE
                break
            for call in calls:
                args = json.loads(call["function"]["arguments"])
                result = await self.tool.call(args, timeout_s=5.0)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            for error in turn.tool_call_errors:
                messages.append({"role": "tool", "content": f"error: {error}"})
        score, correct = reward(task, messages)
        ctx.set_reward(score)
        episode = ctx.build_episode(None)
        episode.is_correct, episode.termination = correct, termination
        episode.metrics.update(stats)
        return episode


async def openai_agent(base_url: str, api_key: str, task: dict[str, Any]) -> tuple[float, bool]:
    """The same agent as a plain `openai` client loop (for `OpenAIAgentWorkflow`), on the
    workflow's shared HTTP client."""
    from rllm_async.workflows.openai_agent import openai_client

    client = openai_client(base_url, api_key, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": task["prompt"]}]
    tools: list[Any] = [CALC_SCHEMA]
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=tools, max_tokens=96
        )
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            fn = getattr(call, "function", None)  # custom (non-function) calls have none
            try:
                result = calc(**json.loads(fn.arguments)) if fn else "error: not a function"
            except (ValueError, TypeError) as e:
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return reward(task, messages)
