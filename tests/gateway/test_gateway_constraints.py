"""Forced tool calls and JSON response formats: sampled under their grammar where the policy's
engine constrains decoding (`constraints: enforce`, the default), refused where it cannot, and
only checked with `constraints: check`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from rllm_async.config import ConfigError, config_from_dict
from rllm_async.gateway import Gateway
from rllm_async.rollout.tool_parsers import HermesParser
from tests.gateway.test_gateway import CALC, serving
from tests.gateway.test_gateway_fields import CHAT, ConstrainingPolicy, post
from tests.scripted import ScriptedPolicy, context

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA}}
FORCED: list[tuple[str, dict[str, Any], str]] = [
    ("/chat/completions", {**CHAT, "tools": [CALC], "tool_choice": "required"}, "tool_choice"),
    ("/chat/completions", {**CHAT, "response_format": JSON_SCHEMA}, "response_format"),
    (
        "/responses",
        {"model": "policy", "input": "hi", "text": {"format": {"type": "json_object"}}},
        "text.format",
    ),
    (
        "/responses",
        {"model": "policy", "input": "hi", "tools": [{**CALC["function"], "type": "function"}]}
        | {"tool_choice": "required"},
        "tool_choice",
    ),
    (
        "/messages",
        {
            "model": "policy",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "calc", "input_schema": CALC["function"]["parameters"]}],
            "tool_choice": {"type": "any"},
        },
        "tool_choice",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), FORCED)
def test_enforcing_over_an_engine_that_cannot_constrain_is_refused(
    path: str, body: dict[str, Any], param: str
) -> None:
    policy = ScriptedPolicy(lambda p: "{}")

    async def go() -> None:
        async with serving(policy) as gateway:
            r = await post(gateway, "/v1" + path, body)
            assert r.status_code == 400, r.text
            text = r.text
            assert "cannot constrain decoding" in text and "rollout.constraints: check" in text
            assert "backend.rollout: vllm" in text and param in text
            # Only checked: answered, as before.
            gateway.constraints = "check"
            r = await post(gateway, "/v1" + path, body)
            assert r.status_code == 200, r.text

    asyncio.run(go())


def test_a_forced_call_is_sampled_under_its_grammar() -> None:
    policy = ConstrainingPolicy('{"expr": "6*7"}}</tool_call>')

    async def go() -> None:
        async with serving(policy) as gateway:
            session = gateway.session(context(policy))
            base = f"/sessions/{session.id}/v1/chat/completions"
            named = {"type": "function", "function": {"name": "calc"}}
            body = {**CHAT, "tools": [CALC], "tool_choice": named, "response_format": JSON_SCHEMA}
            r = await post(gateway, base, body)
            assert r.status_code == 200, r.text
            [call] = r.json()["choices"][0]["message"]["tool_calls"]
            assert json.loads(call["function"]["arguments"]) == {"expr": "6*7"}
            assert r.headers["x-tool-choice-enforcement"] == "enforced"
            # The call's grammar, not the response format's, constrained the reply.
            assert r.headers["x-response-format-enforcement"] == "checked"
            [grammar] = policy.constraints
            lark = json.loads(grammar or "{}")["grammar"]
            assert lark == HermesParser().forced_grammar(
                "calc", {"calc": CALC["function"]["parameters"]}
            )
            step = session.ctx.trajectory().steps[0]
            assert step.info["tool_choice"] == {"forced": "calc", "enforced": True}
            assert step.info["structured"] == grammar

    asyncio.run(go())


def test_the_switch_is_validated() -> None:
    with pytest.raises(ValueError, match=r"enforce .* or check"):
        Gateway(ScriptedPolicy(lambda p: ""), constraints="strict")
    with pytest.raises(ConfigError, match="constraints"):
        config_from_dict({"rollout": {"constraints": "strict"}})
