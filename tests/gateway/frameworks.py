"""What the agent-framework tests share: a `calc` tool, its typed answer, a scripted reply that
drives a tool loop to that answer, and the openai-agents `Agent` built on them."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel

from rllm_async.rollout.tool_parsers import HermesParser

RESULT = "RESULT-42"  # what the calc tool returns; seeing it in the prompt ends the loop
FINAL = '{"answer": 42}'


class Answer(BaseModel):
    answer: int


def calc(expr: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expr: the expression, e.g. 6*7
    """
    return RESULT


def reply(prompt: str) -> str:
    """Call `calc` until its result is in the prompt, then answer (as JSON, or through the tool a
    forced call names: `final_answer`, or a structured-output function)."""
    done = RESULT in prompt
    if prompt.endswith(HermesParser().forced_prefix(None)):
        if done:
            return 'final_answer", "arguments": {"answer": "42"}}</tool_call>'
        return 'calc", "arguments": {"expr": "6*7"}}</tool_call>'
    if m := re.search(r'"name": "(\w+)", "arguments": $', prompt):
        args = {"expr": "6*7"} if m.group(1) == "calc" else {"answer": 42}
        return json.dumps(args) + "}</tool_call>"
    if not done and '"name": "calc"' in prompt:
        return '<tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>'
    return FINAL


def calc_agent(model: Any) -> Any:
    """An openai-agents `Agent` on `model` (its Responses or chat-completions model) with `calc`
    as its function tool and an `Answer` as its typed output; tracing off (nothing to upload)."""
    import agents

    agents.set_tracing_disabled(True)
    return agents.Agent(
        name="calc",
        instructions="Use the tool.",
        tools=[agents.function_tool(calc)],
        model=model,
        output_type=Answer,
    )
