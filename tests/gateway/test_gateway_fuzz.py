"""Schema-driven fuzz of the gateway's HTTP API with schemathesis: bodies drawn from its own OpenAPI
document (valid ones, schemathesis' negative cases and near misses of our own), random JSON and
random bytes; no request may get a 5xx."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode

from rllm_async.gateway import Gateway
from rllm_async.gateway.openapi import openapi_document
from rllm_async.protocols import SamplingParams
from tests.scripted import ScriptedPolicy

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


class Client:
    """The running gateway, an open session on it, and an HTTP session for schemathesis' cases."""

    def __init__(self, http: httpx.Client, session: str) -> None:
        self.http = http
        self.session = session
        self.requests = requests.Session()
        self.requests.headers["Authorization"] = f"Bearer {KEY}"

    def send(self, case: Case) -> None:
        """Send a generated case as it is (body, media type and all), to the open session if the
        operation is a session's."""
        if "sid" in case.operation.path:
            case.path_parameters = {**(case.path_parameters or {}), "sid": self.session}
        response = case.call(base_url=str(self.http.base_url), session=self.requests, timeout=30)
        check(response.status_code, response.content)


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    with ServerThread() as gateway:
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=gateway.url, headers=headers, timeout=30) as http:
            session = http.post("/sessions", json={}).json()["id"]
            yield Client(http, session)


def load_schema() -> schemathesis.BaseSchema:
    """The gateway's OpenAPI document, asking for the served model (else nearly every body is a
    404)."""
    doc = copy.deepcopy(openapi_document())
    for name in (
        "ChatCompletionRequest",
        "CompletionRequest",
        "ResponseRequest",
        "MessagesRequest",
    ):
        doc["components"]["schemas"][name]["properties"]["model"] = {"const": "policy"}
    return schemathesis.openapi.from_dict(doc)


SCHEMA = load_schema()

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


def _one_field(case: Case, field: str, value: Any) -> Case:
    case.body = {**case.body, field: value}
    return case


def cases(path: str, request: str) -> st.SearchStrategy[Case]:
    """Cases of a POST operation: valid bodies, schemathesis' negative ones (each breaks the schema
    somewhere, bytes that are no JSON among them), and near misses: a valid body with one field
    set to any JSON value."""
    operation = SCHEMA[path]["POST"]
    valid = operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
    negative = operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)
    fields = sorted(openapi_document()["components"]["schemas"][request]["properties"])
    near = st.builds(_one_field, valid, st.sampled_from(fields), JUNK)
    return valid | negative | near


def check(status: int, content: bytes) -> None:
    """No 5xx; an error has the OpenAI or the Anthropic shape (both have `error.message`/`type`)."""
    assert status < 500, content[:2000]
    if status >= 400:
        error = json.loads(content)["error"]
        assert isinstance(error["message"], str) and error["type"]


@FUZZ
@given(
    case=cases("/v1/chat/completions", "ChatCompletionRequest")
    | cases("/sessions/{sid}/v1/chat/completions", "ChatCompletionRequest")
)
def test_chat_completions_never_fail_on_the_server(client: Client, case: Case) -> None:
    client.send(case)


@FUZZ
@given(case=cases("/v1/completions", "CompletionRequest"))
def test_completions_never_fail_on_the_server(client: Client, case: Case) -> None:
    client.send(case)


@FUZZ
@given(
    case=cases("/v1/responses", "ResponseRequest")
    | cases("/sessions/{sid}/v1/responses", "ResponseRequest")
)
def test_responses_never_fail_on_the_server(client: Client, case: Case) -> None:
    client.send(case)


@FUZZ
@given(
    case=cases("/v1/messages", "MessagesRequest")
    | cases("/sessions/{sid}/v1/messages", "MessagesRequest")
)
def test_messages_never_fail_on_the_server(client: Client, case: Case) -> None:
    client.send(case)


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
            "/sessions/x/reward",
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/messages",
        ]
    ),
    raw=st.binary(max_size=256)
    | st.text(max_size=64).map(str.encode)
    | JUNK.map(lambda v: json.dumps(v).encode()),
)
def test_any_route_with_any_bytes_gets_a_client_error_at_worst(
    client: Client, method: str, path: str, raw: bytes
) -> None:
    response = client.http.request(method, path, content=raw)
    check(response.status_code, response.content)
