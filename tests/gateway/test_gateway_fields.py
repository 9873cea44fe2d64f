"""The gateway's chat-completion request fields, one by one, through a real server on 127.0.0.1 and
the official `openai` client; every body and chunk validated against the `openai` package's types."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, get_type_hints

import anthropic
import httpx
import openai
import pytest
from anthropic.types.message_count_tokens_params import MessageCountTokensParams
from anthropic.types.message_create_params import MessageCreateParamsBase
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.chat.completion_create_params import CompletionCreateParamsBase
from openai.types.responses.response_create_params import ResponseCreateParamsBase
from pydantic import BaseModel, ValidationError

from rllm_async.backends.toy_tokenizers import CharTokenizer
from rllm_async.gateway.errors import invalid
from rllm_async.gateway.protocol import ChatCompletionRequest
from rllm_async.gateway.protocol_anthropic import CountTokensRequest, MessagesRequest
from rllm_async.gateway.protocol_responses import ResponseRequest
from rllm_async.rollout.tool_parsers import HermesParser
from tests.gateway.test_gateway import CALC, KEY, serving
from tests.scripted import ScriptedPolicy, context

CHAT: dict[str, Any] = {"model": "policy", "messages": [{"role": "user", "content": "6*7?"}]}
NAMED = {"type": "function", "function": {"name": "calc"}}


def forcing_policy() -> ScriptedPolicy:
    """Completes a forced call's opening, calls `calc` when free to choose, answers after a tool."""

    def reply(prompt: str) -> str:
        if prompt.endswith(HermesParser().forced_prefix("calc")):
            return '{"expr": "6*7"}}</tool_call>'
        if prompt.endswith(HermesParser().forced_prefix(None)):
            return 'calc", "arguments": {"expr": "6*7"}}</tool_call>'
        return "42" if "<|tool|>" in prompt else "I think it is 42"

    return ScriptedPolicy(reply)


async def post(gateway: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as http:
        return await http.post(f"{gateway.url}{path}", json=body, timeout=30)


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_tool_call_opens_in_the_prompt_and_is_not_trained(choice: Any) -> None:
    policy = forcing_policy()

    async def go() -> None:
        async with serving(policy, constraints="check") as gateway:
            session = gateway.session(context(policy))
            client = openai.AsyncOpenAI(base_url=gateway.session_url(session.id), api_key=KEY)
            messages: list[Any] = [{"role": "user", "content": "6*7?"}]
            r = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALC], tool_choice=choice
            )
            [tc] = r.choices[0].message.tool_calls or []
            assert r.choices[0].finish_reason == "tool_calls"
            assert tc.function.name == "calc" and json.loads(tc.function.arguments) == {
                "expr": "6*7"
            }
            step = session.ctx.trajectory().steps[0]
            prefix = HermesParser().forced_prefix("calc" if choice == NAMED else None)
            # The forced opening is prompt (loss-masked); the model sampled only the rest.
            assert policy.text(step.prompt_ids).endswith(prefix)
            assert not policy.text(step.completion_ids).startswith("<tool_call>")
            assert step.info["forced_prefix"] == prefix
            # Checked only (`constraints: check`): opened in the prompt, sampled freely.
            assert step.info["tool_choice"] == {
                "forced": choice == "required" or "calc",
                "enforced": False,
            }
            # The agent's next turn extends prompt + completion exactly.
            messages += [r.choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "tool", "tool_call_id": tc.id, "content": "42"}]
            r2 = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALC]
            )
            assert r2.choices[0].message.content == "42"
            second = session.ctx.trajectory().steps[1]
            assert second.info["extended"]
            whole = step.prompt_ids + step.completion_ids
            assert second.prompt_ids[: len(whole)] == whole

    asyncio.run(go())


def test_tool_call_ids_are_unique_outside_sessions_too() -> None:
    policy = ScriptedPolicy(
        lambda p: '<tool_call>{"name": "calc", "arguments": {}}</tool_call>' * 2
    )

    async def go() -> None:
        async with serving(policy) as gateway:
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY)
            ids = []
            for _ in range(3):
                r = await client.chat.completions.create(**CHAT, tools=[CALC])
                ids += [c.id for c in r.choices[0].message.tool_calls or []]
            assert len(ids) == 6 and len(set(ids)) == 6
            # parallel_tool_calls=false: only the first call comes back (as vLLM does).
            r = await client.chat.completions.create(
                **CHAT, tools=[CALC], parallel_tool_calls=False
            )
            assert len(r.choices[0].message.tool_calls or []) == 1

    asyncio.run(go())


TWO_CALLS = (
    'ok <tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>'
    '<tool_call>{"name": "calc", "arguments": {"expr": "1+1"}}</tool_call> done'
)


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_without_parallel_calls_the_first_call_is_recorded_and_extended(api: str) -> None:
    """The reply is cut after its first call: the calls after it are neither returned nor trained,
    and the next turn extends the kept tokens, so the tool loop is one training sequence."""
    policy = ScriptedPolicy(lambda p: "42" if "<|tool|>" in p else TWO_CALLS)

    async def go() -> None:
        async with serving(policy) as gateway:
            session = gateway.session(context(policy, max_tokens=256))
            url, key = f"{gateway.url}/v1", session.key
            if api == "chat":
                client = openai.AsyncOpenAI(base_url=url, api_key=key)
                messages: list[Any] = [{"role": "user", "content": "6*7?"}]
                r = await client.chat.completions.create(
                    model="policy", messages=messages, tools=[CALC], parallel_tool_calls=False
                )
                message = r.choices[0].message
                [call] = message.tool_calls or []
                assert message.content == "ok"
                messages += [message.model_dump(exclude_none=True)]
                messages += [{"role": "tool", "tool_call_id": call.id, "content": "42"}]
                await client.chat.completions.create(
                    model="policy", messages=messages, tools=[CALC], parallel_tool_calls=False
                )
            elif api == "responses":
                client = openai.AsyncOpenAI(base_url=url, api_key=key)
                tool = {"type": "function", **CALC["function"]}
                items: list[Any] = [{"role": "user", "content": "6*7?"}]
                resp = await client.responses.create(
                    model="policy", input=items, tools=[tool], parallel_tool_calls=False
                )
                [fc] = [o for o in resp.output if o.type == "function_call"]
                items += [o.model_dump(exclude_none=True) for o in resp.output]
                items += [{"type": "function_call_output", "call_id": fc.call_id, "output": "42"}]
                await client.responses.create(
                    model="policy", input=items, tools=[tool], parallel_tool_calls=False
                )
            else:
                claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=key)
                tool = {"name": "calc", "input_schema": CALC["function"]["parameters"]}
                choice: Any = {"type": "auto", "disable_parallel_tool_use": True}
                chat: list[Any] = [{"role": "user", "content": "6*7?"}]
                m = await claude.messages.create(
                    model="policy", max_tokens=256, messages=chat, tools=[tool], tool_choice=choice
                )
                [use] = [b for b in m.content if b.type == "tool_use"]
                chat += [{"role": "assistant", "content": [b.model_dump() for b in m.content]}]
                chat += [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": use.id, "content": "42"}
                        ],
                    }
                ]
                await claude.messages.create(
                    model="policy", max_tokens=256, messages=chat, tools=[tool], tool_choice=choice
                )
        first, second = session.ctx.trajectory().steps
        kept = policy.text(first.completion_ids)
        assert kept == TWO_CALLS[: TWO_CALLS.index("</tool_call>") + len("</tool_call>")]
        assert len(first.logprobs) == len(first.versions) == len(first.completion_ids)
        assert first.info["dropped_tool_calls"] == 1
        assert second.info["extended"]
        # The turn is closed by a prompt token (not trained), then the tool's answer.
        gap = policy.text(second.prompt_ids[len(first.prompt_ids) + len(first.completion_ids) :])
        assert gap.startswith(policy.text([policy.tok.eos_token_id])) and "42" in gap
        [sequence] = session.ctx.trajectory().sequences()
        assert sum(sequence.loss_mask) == len(first.completion_ids) + len(second.completion_ids)
        assert "1+1" not in policy.text(sequence.tokens)

    asyncio.run(go())


def test_response_format_is_checked_and_the_verdict_reported() -> None:
    replies = iter(['{"answer": 42}', '{"answer": "x"}', "not json", "[1]"])
    policy = ScriptedPolicy(lambda p: next(replies))
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "strict": True, "schema": schema}}

    async def go() -> None:
        async with serving(policy, constraints="check") as gateway:
            session = gateway.session(context(policy))
            path = f"/sessions/{session.id}/v1/chat/completions"
            verdicts = []
            for body in (fmt, fmt, {"type": "json_object"}, {"type": "json_object"}):
                r = await post(gateway, path, {**CHAT, "response_format": body})
                assert r.status_code == 200, r.text
                ChatCompletion.model_validate(r.json())
                verdicts.append(r.headers["x-response-format"])
                assert r.headers["x-response-format-enforcement"] == "checked"
            assert verdicts == ["valid", "invalid", "invalid", "invalid"]
            errors = [s.info["response_format"]["error"] for s in session.ctx.trajectory().steps]
            assert errors[0] is None and "schema 'out'" in errors[1]
            assert "not JSON" in errors[2] and errors[3] == "not a JSON object"

    asyncio.run(go())


class ConstrainingPolicy(ScriptedPolicy):
    """A scripted policy whose engine says it constrains decoding: it keeps each call's constraint."""

    constrains_decoding = True

    def __init__(self, reply: str) -> None:
        super().__init__(lambda p: reply)
        self.constraints: list[str | None] = []

    async def generate(self, prompt_ids, params, *, version=None):  # type: ignore[no-untyped-def]
        self.constraints.append(params.structured)
        return await super().generate(prompt_ids, params, version=version)


def test_response_format_is_sent_to_an_engine_that_constrains_decoding() -> None:
    policy = ConstrainingPolicy('{"answer": 42}')
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    text_format = {"format": {"type": "json_schema", "name": "out", "schema": schema}}

    async def go() -> None:
        async with serving(policy) as gateway:
            session = gateway.session(context(policy))
            base = f"/sessions/{session.id}/v1"
            for path, body in (
                ("/chat/completions", {**CHAT, "response_format": fmt}),
                ("/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}),
                ("/chat/completions", CHAT),
                ("/responses", {"model": CHAT["model"], "input": "hi", "text": text_format}),
            ):
                r = await post(gateway, base + path, body)
                assert r.status_code == 200, r.text
            steps = session.ctx.trajectory().steps
            assert policy.constraints == [
                json.dumps({"json": schema}),
                json.dumps({"json_object": True}),
                None,
                json.dumps({"json": schema}),
            ]
            infos = [s.info.get("response_format") for s in steps]
            assert [i and i["enforced"] for i in infos] == [True, True, None, True]
            assert steps[0].info["structured"] == json.dumps({"json": schema})

    asyncio.run(go())


def test_a_constraint_is_refused_where_the_engine_cannot_enforce_it() -> None:
    policy = ScriptedPolicy(lambda p: "{}")
    ctx = context(policy)
    with pytest.raises(ValueError, match="cannot constrain decoding"):
        asyncio.run(ctx.generate([1, 2], structured=json.dumps({"json_object": True})))


ACCEPTED: list[dict[str, Any]] = [
    {"stream_options": {"include_usage": True, "include_obfuscation": True}, "stream": True},
    {"prompt_cache_key": "k", "prompt_cache_retention": "24h", "safety_identifier": "u1"},
    {"verbosity": "low", "modalities": ["text"], "user": "u", "metadata": {"a": "b"}},
    {"store": False, "service_tier": "auto", "logit_bias": {}, "parallel_tool_calls": True},
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}}],
            }
        ]
    },
    {"response_format": {"type": "text"}, "tool_choice": "none", "tools": [CALC]},
    {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
]

REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"logit_bias": {"50": 10}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"top_logprobs": 2, "logprobs": True}, "top_logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [CALC]},
        "tool_choice",
    ),
    ({"tool_choice": {"type": "allowed_tools"}, "tools": [CALC]}, "tool_choice.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "q", "x": 1}]}]},
        "messages.0.content.0.x",
    ),
]


def test_each_field_is_implemented_accepted_or_refused_with_its_param() -> None:
    policy = ScriptedPolicy(lambda p: "fine")

    async def go() -> None:
        async with serving(policy) as gateway:
            for extra in ACCEPTED:
                r = await post(gateway, "/v1/chat/completions", {**CHAT, **extra})
                assert r.status_code == 200, (extra, r.text)
                if extra.get("stream"):
                    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
                    assert events[-1] == "[DONE]"
                    chunks = [ChatCompletionChunk.model_validate_json(e) for e in events[:-1]]
                    assert chunks[-1].usage is not None
                else:
                    assert ChatCompletion.model_validate(r.json()).choices[0].message.content
            for extra, param in REFUSED:
                r = await post(gateway, "/v1/chat/completions", {**CHAT, **extra})
                assert r.status_code == 400, (extra, r.text)
                assert r.json()["error"]["param"] == param, (extra, r.text)
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY)
            r = await client.chat.completions.create(**CHAT, max_completion_tokens=2)
            assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == "fi"

    asyncio.run(go())


class KwargsTokenizer(CharTokenizer):
    """A character tokenizer whose template takes arguments: they show as a system turn."""

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        shown = (
            [{"role": "system", "content": json.dumps(kwargs, sort_keys=True)}] if kwargs else []
        )
        return super().apply_chat_template(
            [*shown, *messages], tools=tools, add_generation_prompt=add_generation_prompt
        )


def test_reasoning_effort_and_chat_template_kwargs_reach_the_template() -> None:
    policy = ScriptedPolicy(lambda p: "ok")
    policy.tok = KwargsTokenizer()

    async def go() -> None:
        async with serving(policy) as gateway:
            session = gateway.session(context(policy))
            client = openai.AsyncOpenAI(base_url=gateway.session_url(session.id), api_key=KEY)
            messages: list[Any] = [{"role": "user", "content": "q"}]
            options: dict[str, Any] = {
                "reasoning_effort": "low",
                "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
            }
            r = await client.chat.completions.create(model="policy", messages=messages, **options)
            messages += [r.choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "user", "content": "again"}]
            await client.chat.completions.create(model="policy", messages=messages, **options)
            first, second = session.ctx.trajectory().steps
            assert policy.text(first.prompt_ids).startswith(
                '<|system|>{"enable_thinking": false, "reasoning_effort": "low"}<|end|>'
            )
            assert second.info["extended"]

    asyncio.run(go())


# The sections of docs/gateway.md that name each API's request fields.
DOCS = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"
API_FIELDS = [
    (CompletionCreateParamsBase, ChatCompletionRequest, CHAT, "## Request fields"),
    (
        ResponseCreateParamsBase,
        ResponseRequest,
        {"model": "policy", "input": "q"},
        "## The Responses API",
    ),
    (
        MessageCreateParamsBase,
        MessagesRequest,
        {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "q"}]},
        "## The Anthropic Messages API",
    ),
    (
        MessageCountTokensParams,
        CountTokensRequest,
        {"model": "policy", "messages": [{"role": "user", "content": "q"}]},
        "## The Anthropic Messages API",
    ),
]


@pytest.mark.parametrize(("params", "model", "minimal", "section"), API_FIELDS)
def test_every_field_of_the_clients_params_is_decided_and_documented(
    params: type, model: type[BaseModel], minimal: dict[str, Any], section: str
) -> None:
    """A field a new `openai` or `anthropic` release adds is caught here: it must be accepted by the
    request model or refused naming the field, and named in the API's section of the docs."""
    fields = sorted(get_type_hints(params))
    text = DOCS.read_text().split(section, 1)[1].split("\n## ", 1)[0]
    named = [f for f in fields if any(f"`{f}{end}" in text for end in "`:.")]
    assert sorted(set(fields) - set(named)) == []
    for name in fields:
        if name in model.model_fields:
            continue
        with pytest.raises(ValidationError) as e:
            model.model_validate({**minimal, name: "x"})
        assert [err["loc"][0] for err in e.value.errors()] == [name], name
        assert invalid(e.value).param == name
