"""Schema-driven fuzz of the gateway's HTTP API: bodies drawn from its own OpenAPI document (valid
ones and near misses), random JSON and random bytes; no request may get a 5xx."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rllm_async.backends.base import SamplingParams
from rllm_async.gateway import Gateway
from rllm_async.gateway.openapi import openapi_document
from tests.scripted import ScriptedPolicy

from_schema = pytest.importorskip("hypothesis_jsonschema").from_schema

KEY = "fuzz"
FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    database=None,
)


class ServerThread:
    """A gateway on 127.0.0.1 in its own thread and event loop, for synchronous clients."""

    def __init__(self) -> None:
        self.policy = ScriptedPolicy(
            lambda p: '<tool_call>{"name": "f", "arguments": {}}</tool_call> x',
            max_context_tokens=512,
        )
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.gateway: Gateway | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self.ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self.gateway = Gateway(
            self.policy,
            api_key=KEY,
            open_sessions=True,
            sampling=SamplingParams(max_tokens=16),
            max_body_bytes=2**16,
        )
        await self.gateway.start()

    def __enter__(self) -> Gateway:
        self.thread.start()
        self.ready.wait(30)
        assert self.gateway is not None
        return self.gateway

    def __exit__(self, *exc: object) -> None:
        assert self.gateway is not None
        asyncio.run_coroutine_threadsafe(self.gateway.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with ServerThread() as gateway:
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=gateway.url, headers=headers, timeout=30) as client:
            session = client.post("/sessions", json={}).json()["id"]
            client.headers["x-test-session"] = session
            yield client


def schema(name: str) -> dict[str, Any]:
    """One request schema, asking for the served model (else nearly every body is a 404), with the
    document's components so that its `$ref`s resolve."""
    doc = openapi_document()
    body = doc["components"]["schemas"][name]
    properties = {**body["properties"], "model": {"const": "policy"}}
    return {**body, "properties": properties, "components": doc["components"]}


JUNK = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)


def bodies(name: str) -> st.SearchStrategy[dict[str, Any]]:
    """Valid bodies of a request schema, and near misses: one field set to any JSON value."""
    valid = from_schema(schema(name))
    fields = sorted(schema(name)["properties"])
    near = st.tuples(valid, st.sampled_from(fields), JUNK).map(lambda t: {**t[0], t[1]: t[2]})
    return valid | near


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["type"]


PATHS = ["/v1/chat/completions", "/sessions/{session}/v1/chat/completions"]


@FUZZ
@given(
    body=bodies("ChatCompletionRequest"),
    where=st.sampled_from(PATHS),
)
def test_chat_completions_never_fail_on_the_server(
    http: httpx.Client, body: dict[str, Any], where: str
) -> None:
    path = where.format(session=http.headers["x-test-session"])
    check(http.post(path, json=body))


@FUZZ
@given(body=bodies("CompletionRequest"))
def test_completions_never_fail_on_the_server(http: httpx.Client, body: dict[str, Any]) -> None:
    check(http.post("/v1/completions", json=body))


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "DELETE", "PUT"]),
    path=st.sampled_from(
        [
            "/health",
            "/v1/models",
            "/sessions",
            "/sessions/x",
            "/sessions/x/v1/models",
            "/v1/completions",
        ]
    ),
    raw=st.binary(max_size=256) | st.text(max_size=64).map(str.encode),
)
def test_any_route_with_any_bytes_gets_a_client_error_at_worst(
    http: httpx.Client, method: str, path: str, raw: bytes
) -> None:
    check(http.request(method, path, content=raw))
