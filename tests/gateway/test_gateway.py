"""The gateway on a real uvicorn server on 127.0.0.1, driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from rllm_async.backends.local import LocalBackend
from rllm_async.config import config_from_dict
from rllm_async.gateway import Gateway
from rllm_async.protocols import SamplingParams
from tests.gateway.validation import Validating, check
from tests.scripted import RecordingPolicy, ScriptedPolicy, context

KEY = "test-key"
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "evaluate a product",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
    },
}
TOOL_REPLY = 'ok <tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>'


def local_backend(max_seq_len: int = 96) -> LocalBackend:
    cfg = config_from_dict(
        {
            "backend": {"name": "local", "model": "tiny", "max_seq_len": max_seq_len},
            "rollout": {"max_tokens": 8},
        }
    )
    return LocalBackend.from_config(cfg)


@asynccontextmanager
async def serving(policy: Any, **options: Any) -> AsyncIterator[Gateway]:
    """A gateway on 127.0.0.1 whose every 200 answer (body, or each event of a stream) must
    validate as the `openai` / `anthropic` packages' type for its route, or the test fails."""
    options = {"sampling": SamplingParams(max_tokens=128), "api_key": KEY, **options}
    gateway = Gateway(policy, open_sessions=True, **options)
    gateway.app = validating = Validating(gateway.app)  # type: ignore[assignment]
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.stop()
    check(validating)


async def open_session(gateway: Gateway) -> tuple[str, str]:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as http:
        r = await http.post(f"{gateway.url}/sessions", json={})
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["base_url"]


def test_recorded_tokens_equal_what_the_policy_produced() -> None:
    backend = local_backend()
    policy = RecordingPolicy(backend.policy())

    async def go() -> None:
        async with serving(policy) as gateway:
            sid, base_url = await open_session(gateway)
            client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY)
            assert [m.id for m in (await client.models.list()).data] == ["policy"]
            messages: list[Any] = [{"role": "user", "content": "hi"}]
            r = await client.chat.completions.create(
                model="policy", messages=messages, logprobs=True, n=2, max_tokens=6
            )
            assert len(r.choices) == 2 and r.usage is not None
            for choice in r.choices:
                assert choice.logprobs is not None and choice.logprobs.content is not None
            messages += [
                r.choices[1].message.model_dump(exclude_none=True),
                {"role": "user", "content": "more"},
            ]
            r2 = await client.chat.completions.create(model="policy", messages=messages)
            assert r2.system_fingerprint == "policy-v0"
            records = gateway.sessions.get(sid).records()["trajectories"]["default"]
        # Server-side records are exactly the sampler's tokens, logprobs and versions.
        assert len(records) == len(policy.calls) == 3
        by_tokens = {(tuple(p), tuple(c.ids)): c for p, c in policy.calls}
        for rec in records:
            out = by_tokens[(tuple(rec["prompt_ids"]), tuple(rec["completion_ids"]))]
            assert rec["logprobs"] == out.logprobs and rec["versions"] == out.versions
        reported = [[lp.logprob for lp in c.logprobs.content] for c in r.choices]  # type: ignore[union-attr]
        assert sorted(reported) == sorted(rec["logprobs"] for rec in records[:2])
        # The third call continued choice 1 token-in/token-out.
        first = next(rec for rec in records[:2] if rec["logprobs"] == reported[1])
        third = records[2]
        assert third["info"]["extended"]
        assert third["prompt_ids"][: len(first["prompt_ids"]) + len(first["completion_ids"])] == (
            first["prompt_ids"] + first["completion_ids"]
        )

    try:
        asyncio.run(go())
    finally:
        asyncio.run(backend.close())


def test_tools_streaming_and_text_completions() -> None:
    policy = ScriptedPolicy(lambda prompt: TOOL_REPLY if "<|tool|>" not in prompt else "42")

    async def go() -> None:
        async with serving(policy) as gateway:
            sid, base_url = await open_session(gateway)
            client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY)
            messages: list[Any] = [{"role": "user", "content": "6*7?"}]
            r = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALC]
            )
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content == "ok"
            [tc] = choice.message.tool_calls or []
            assert tc.function.name == "calc" and json.loads(tc.function.arguments) == {
                "expr": "6*7"
            }
            # The same call streamed: the chunks add up to the same message.
            stream = await client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=[CALC],
                stream=True,
                stream_options={"include_usage": True},
            )
            content, calls, finish, usage = "", [], None, None
            async for chunk in stream:
                usage = chunk.usage or usage
                for c in chunk.choices:
                    content += c.delta.content or ""
                    calls += c.delta.tool_calls or []
                    finish = c.finish_reason or finish
            assert content == "ok" and finish == "tool_calls" and usage is not None
            assert calls[0].function.name == "calc"
            messages += [choice.message.model_dump(exclude_none=True)]
            messages += [{"role": "tool", "tool_call_id": tc.id, "content": "42"}]
            r2 = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALC]
            )
            assert r2.choices[0].message.content == "42" and r2.choices[0].finish_reason == "stop"
            steps = gateway.sessions.get(sid).ctx.trajectory().steps
            assert [s.info["extended"] for s in steps] == [False, False, True]
            # Text completions, plain and streamed.
            c = await client.completions.create(
                model="policy", prompt="x", max_tokens=4, logprobs=0
            )
            assert c.choices[0].text == "ok <" and c.choices[0].finish_reason == "length"
            assert (
                c.choices[0].logprobs is not None
                and len(c.choices[0].logprobs.token_logprobs or []) == 4
            )
            text = ""
            async for chunk in await client.completions.create(
                model="policy", prompt="x", stream=True
            ):
                text += chunk.choices[0].text
            assert text == TOOL_REPLY

    asyncio.run(go())


def test_a_malformed_tool_call_comes_back_as_text() -> None:
    policy = ScriptedPolicy(lambda prompt: '<tool_call>{"name": "calc", oops}</tool_call>')

    async def go() -> None:
        async with serving(policy) as gateway:
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY)
            r = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "q"}], tools=[CALC]
            )
            assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
            assert r.choices[0].message.content == '<tool_call>{"name": "calc", oops}</tool_call>'

    asyncio.run(go())


CHAT = {"model": "policy", "messages": [{"role": "user", "content": "q"}]}
ERRORS: list[tuple[str, str, Any, dict[str, str], int, str | None]] = [
    # (method, path, body, headers, status, code)
    ("POST", "/v1/chat/completions", b"{not json", {}, 400, "invalid_json"),
    ("POST", "/v1/chat/completions", b"\xff\xfe\x00", {}, 400, "invalid_json"),
    ("POST", "/v1/chat/completions", [1, 2], {}, 400, "invalid_json"),
    ("POST", "/v1/chat/completions", b"[" * 100_000, {}, 400, "invalid_json"),
    ("POST", "/v1/chat/completions", {**CHAT, "bogus": 1}, {}, 400, "invalid_parameter"),
    ("POST", "/v1/chat/completions", {**CHAT, "temperature": 9}, {}, 400, "invalid_parameter"),
    ("POST", "/v1/chat/completions", {**CHAT, "n": 0}, {}, 400, "invalid_parameter"),
    ("POST", "/v1/chat/completions", {**CHAT, "top_logprobs": 3}, {}, 400, "invalid_parameter"),
    ("POST", "/v1/chat/completions", {**CHAT, "messages": []}, {}, 400, "invalid_parameter"),
    (
        "POST",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "robot"}]},
        {},
        400,
        "invalid_parameter",
    ),
    ("POST", "/v1/chat/completions", {**CHAT, "model": "gpt-4"}, {}, 404, "model_not_found"),
    (
        "POST",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "x" * 500}]},
        {},
        400,
        "context_length_exceeded",
    ),
    ("POST", "/v1/chat/completions", b" " * (5 * 2**20), {}, 413, "body_too_large"),
    ("POST", "/v1/completions", {"model": "policy", "prompt": [10**9]}, {}, 400, None),
    (
        "POST",
        "/v1/completions",
        {"model": "policy", "prompt": "x", "echo": True},
        {},
        400,
        "invalid_parameter",
    ),
    ("POST", "/sessions/nope/v1/chat/completions", CHAT, {}, 404, "session_not_found"),
    ("GET", "/sessions/nope/v1/models", None, {}, 404, "session_not_found"),
    ("DELETE", "/sessions/nope", None, {}, 404, "session_not_found"),
    (
        "POST",
        "/v1/chat/completions",
        CHAT,
        {"Authorization": "Bearer wrong"},
        401,
        "invalid_api_key",
    ),
    ("GET", "/v1/nothing", None, {}, 404, None),
    ("GET", "/v1/chat/completions", None, {}, 405, None),
]


def test_bad_requests_get_openai_errors_and_the_server_carries_on() -> None:
    policy = ScriptedPolicy(lambda prompt: "fine", max_context_tokens=128)

    async def go() -> None:
        async with serving(policy) as gateway:
            async with httpx.AsyncClient(
                base_url=gateway.url, headers={"Authorization": f"Bearer {KEY}"}
            ) as http:
                for method, path, body, headers, status, code in ERRORS:
                    content = (
                        body
                        if isinstance(body, bytes)
                        else None
                        if body is None
                        else json.dumps(body).encode()
                    )
                    r = await http.request(method, path, content=content, headers=headers)
                    assert r.status_code == status, (
                        path,
                        body if not isinstance(body, bytes) else body[:20],
                        r.text,
                    )
                    error = r.json()["error"]
                    assert error["message"] and error["type"]
                    if code is not None:
                        assert error["code"] == code, (path, r.text)
                # A session of a rollout keeps the trainer's temperature.
                ctx = context(policy, temperature=1.0)
                session = gateway.session(ctx)
                r = await http.post(
                    f"/sessions/{session.id}/v1/chat/completions", json={**CHAT, "temperature": 0.5}
                )
                assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
            # The official client maps them to its exceptions, and the server still answers.
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0)
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(
                    model="nope", messages=[{"role": "user", "content": "q"}]
                )
            with pytest.raises(openai.BadRequestError, match="context"):
                await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "y" * 300}]
                )
            r = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "q"}]
            )
            assert r.choices[0].message.content == "fine"

    asyncio.run(go())


def test_sessions_are_exported_then_freed(tmp_path: Path) -> None:
    export = tmp_path / "sessions.jsonl"
    policy = ScriptedPolicy(lambda prompt: "a")

    async def go() -> None:
        async with serving(policy, export_path=export) as gateway:
            sid, base_url = await open_session(gateway)
            client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY)
            await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "q"}]
            )
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as http:
                record = (await http.get(f"{gateway.url}/sessions/{sid}")).json()
                assert (await http.delete(f"{gateway.url}/sessions/{sid}")).status_code == 200
                assert (await http.get(f"{gateway.url}/sessions/{sid}")).status_code == 404
            assert len(gateway.sessions) == 0
            [line] = export.read_text().splitlines()
            assert json.loads(line) == record

    asyncio.run(go())


def test_closing_a_session_cancels_its_calls_in_flight() -> None:
    policy = ScriptedPolicy(lambda prompt: "slow", delay_s=30.0)

    async def go() -> None:
        async with serving(policy) as gateway:
            session = gateway.session(context(policy))
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as http:
                call = asyncio.create_task(
                    http.post(
                        f"{gateway.session_url(session.id)}/chat/completions", json=CHAT, timeout=60
                    )
                )
                while not session.calls:
                    await asyncio.sleep(0.01)
                gateway.sessions.close(session.id)
                r = await asyncio.wait_for(call, 10)
            assert r.status_code == 409 and r.json()["error"]["code"] == "session_closed"

    asyncio.run(go())


def test_serve_command_answers_and_stops_on_sigint(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "rllm_async.cli",
        "serve",
        "--port",
        "0",
        "--export",
        str(tmp_path / "s.jsonl"),
        "backend.max_seq_len=64",
        "rollout.max_tokens=4",
    ]
    root = str(Path(__file__).parents[2])  # this checkout, whatever is installed
    env = {**os.environ, "RLLM_ASYNC_API_KEY": KEY, "PYTHONPATH": root}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        url = json.loads(proc.stdout.readline())["url"]
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        headers = {"Authorization": f"Bearer {KEY}"}
        session = httpx.post(f"{url}/sessions", json={}, headers=headers).json()
        client = openai.OpenAI(base_url=session["base_url"], api_key=KEY)
        r = client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "q"}]
        )
        assert r.usage is not None and r.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    [line] = (tmp_path / "s.jsonl").read_text().splitlines()  # exported when the server stopped
    assert len(json.loads(line)["trajectories"]["default"]) == 1


def test_the_example_openai_agent_solves_a_task_through_a_session() -> None:
    from rllm_async.tasks import calculator

    [task] = calculator.generator(n=1)
    expr = task["prompt"].removesuffix("=?")
    policy = ScriptedPolicy(
        lambda prompt: task["answer"] if "<|tool|>" in prompt else calculator.tool_call_text(expr)
    )

    async def go() -> tuple[float, bool]:
        async with serving(policy) as gateway:
            session = gateway.session(context(policy))
            result = await calculator.openai_agent(gateway.session_url(session.id), KEY, task)
            steps = session.ctx.trajectory().steps
            assert len(steps) == 2 and steps[1].info["extended"]
            return result

    assert asyncio.run(go()) == (1.0, True)


def test_serve_defaults_to_the_policys_whole_context(tmp_path: Path) -> None:
    from rllm_async.config import load_config
    from rllm_async.serve import SERVE_CONTEXT_TOKENS, full_context

    config = full_context(load_config(None, []))
    backend = LocalBackend.from_config(config)
    try:
        assert backend.policy().max_context_tokens == SERVE_CONTEXT_TOKENS
    finally:
        asyncio.run(backend.close())
    # A checkpoint with a shorter context keeps it; a configured max_seq_len wins.
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    short = full_context(load_config(None, [f"backend.model_path={tmp_path}"]))
    assert short.backend.options["max_seq_len"] == 1024
    given = full_context(load_config(None, ["backend.max_seq_len=64"]))
    assert given.backend.options["max_seq_len"] == 64


def test_one_client_serves_every_session_by_header_or_api_key() -> None:
    policy = ScriptedPolicy(lambda prompt: "a")

    async def go() -> None:
        async with serving(policy) as gateway:
            a, b = gateway.session(context(policy)), gateway.session(context(policy))
            async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY) as client:
                # The gateway's key and a header naming the session.
                await client.chat.completions.create(**CHAT, extra_headers={"X-Session-Id": a.id})
                # The session's own key, on the same HTTP client.
                keyed = client.with_options(api_key=b.key)
                await keyed.chat.completions.create(**CHAT)
                await keyed.chat.completions.create(**CHAT)
                # No session named: answered, recorded nowhere.
                await client.chat.completions.create(**CHAT)
                with pytest.raises(openai.PermissionDeniedError):
                    await keyed.chat.completions.create(
                        **CHAT, extra_headers={"X-Session-Id": a.id}
                    )
                gateway.sessions.close(b.id)
                with pytest.raises(openai.AuthenticationError):  # a closed session's key
                    await keyed.chat.completions.create(**CHAT)
            assert len(a.ctx.trajectory().steps) == 1 and len(b.ctx.trajectory().steps) == 2
            # A standalone session comes with its key.
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as http:
                opened = (await http.post(f"{gateway.url}/sessions", json={})).json()
            async with openai.AsyncOpenAI(
                base_url=f"{gateway.url}/v1", api_key=opened["api_key"]
            ) as client:
                await client.chat.completions.create(**CHAT)
            assert gateway.sessions.get(opened["id"]).calls == 1

    asyncio.run(go())


def test_an_ended_sessions_key_is_refused_on_a_gateway_without_a_key() -> None:
    policy = ScriptedPolicy(lambda prompt: "a")
    message = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "q"}]}

    async def go() -> None:
        async with serving(policy, api_key=None) as gateway:
            gateway.sessions.remember = 2
            ended = [gateway.session(context(policy)) for _ in range(3)]
            async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
                for s in ended:
                    r = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(s.key))
                    assert r.status_code == 200, r.text
                    gateway.sessions.close(s.id)
                for s in ended[1:]:
                    r = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(s.key))
                    assert r.status_code == 401, r.text
                    assert r.json()["error"]["code"] == "invalid_api_key"
                    assert s.id in r.json()["error"]["message"]
                    r = await http.post("/v1/messages", json=message, headers={"x-api-key": s.key})
                    assert r.status_code == 401, r.text
                    assert r.json()["error"]["type"] == "authentication_error"
                # Memory is bounded: the oldest ended key is forgotten (a plain keyless call).
                r = await http.post("/v1/chat/completions", json=CHAT, headers=bearer(ended[0].key))
                assert r.status_code == 200
                # Without a key, or with any other, the keyless gateway answers.
                assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200
            async with openai.AsyncOpenAI(
                base_url=f"{gateway.url}/v1", api_key=ended[2].key, max_retries=0
            ) as client:
                with pytest.raises(openai.AuthenticationError):
                    await client.chat.completions.create(**CHAT)
        assert [len(s.ctx.trajectory().steps) for s in ended] == [1, 1, 1]

    asyncio.run(go())


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_validating_wrapper_catches_invalid_answers() -> None:
    """`serving` validates every answer; an invalid body or stream event is reported."""
    answers = {
        "/v1/chat/completions": (b'{"id": "x", "object": "chat.completion"}', "application/json"),
        "/sessions/s/v1/messages": (
            b'event: message_stop\ndata: {"type": "message_stop"}\n\n'
            b'event: ping\ndata: {"type": "nope"}\n\n',
            "text/event-stream",
        ),
        "/v1/models": (b'{"object": "list", "data": []}', "application/json"),
    }

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body, kind = answers[scope["path"]]
        headers = [(b"content-type", kind.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    validating = Validating(app)

    async def go() -> None:
        transport = httpx.ASGITransport(app=validating)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            for path in answers:
                await http.post(path)

    asyncio.run(go())
    assert validating.checked == 4
    assert [f.split(":")[0] for f in validating.failures] == [
        "/v1/chat/completions",
        "/sessions/s/v1/messages",
    ]
    with pytest.raises(AssertionError, match="invalid answers"):
        check(validating)
