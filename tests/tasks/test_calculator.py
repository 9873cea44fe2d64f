"""The calculator task: its partial-credit reward and its tool (the agent's learning run is in
tests/e2e/test_calculator_learning.py)."""

from __future__ import annotations

import json
from typing import Any

from rllm_async.tasks import calculator


def call(expr: Any, name: str = "calc") -> dict[str, Any]:
    arguments = json.dumps({"expr": expr})
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}


def chat(*turns: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "12*34=?"}, *turns]


TASK = {"prompt": "12*34=?", "answer": "408"}
CALLED = {"role": "assistant", "content": "", "tool_calls": [call("12*34")]}
RESULT = {"role": "tool", "content": "408"}


def test_reward_climbs_from_a_call_to_the_right_expression_to_the_right_answer() -> None:
    wrong_call = {"role": "assistant", "content": "", "tool_calls": [call("12*35")]}
    answer = {"role": "assistant", "content": "408"}
    assert calculator.reward(TASK, chat({"role": "assistant", "content": "400"})) == (0.0, False)
    assert calculator.reward(TASK, chat(wrong_call, RESULT)) == (0.2, False)
    assert calculator.reward(TASK, chat(CALLED, RESULT)) == (0.5, False)
    assert calculator.reward(TASK, chat(CALLED, RESULT, answer)) == (1.0, True)
    # A right guess is correct, but only the tool earns the top reward.
    assert calculator.reward(TASK, chat(answer)) == (0.5, True)


def test_reward_gives_nothing_for_calls_of_other_tools_or_with_bad_arguments() -> None:
    bad = {"id": "c", "type": "function", "function": {"name": "calc", "arguments": "{not json"}}
    cases = [([call("12*34", name="other")], 0.0), ([bad], 0.0), ([call(["12*34"])], 0.2)]
    for calls, expected in cases:  # the last: a well-formed call with a wrong argument
        messages = chat({"role": "assistant", "content": "", "tool_calls": calls})
        assert calculator.reward(TASK, messages) == (expected, False)
    assert calculator.calc_result(call("__import__('os')")).startswith("error")
