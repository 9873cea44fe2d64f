"""Every answer the gateway sends in a test, checked against the `openai` and `anthropic` packages'
own types: an ASGI wrapper around the gateway's app that validates each 200 body, and each event of
a stream, by route, and keeps what failed for the test to report."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as ASGIMessage


class ModelList(BaseModel):
    """`GET /v1/models`, as the `openai` client pages it."""

    object: Literal["list"]
    data: list[Model]


# Route (the path after any `/sessions/{id}`) -> (type of a JSON body, type of a stream's events).
ROUTES: dict[str, tuple[TypeAdapter[Any], TypeAdapter[Any] | None]] = {
    "/v1/chat/completions": (TypeAdapter(ChatCompletion), TypeAdapter(ChatCompletionChunk)),
    "/v1/completions": (TypeAdapter(Completion), TypeAdapter(Completion)),
    "/v1/responses": (TypeAdapter(Response), TypeAdapter(ResponseStreamEvent)),
    "/v1/messages": (TypeAdapter(Message), TypeAdapter(RawMessageStreamEvent)),
    "/v1/messages/count_tokens": (TypeAdapter(MessageTokensCount), None),
    "/v1/models": (TypeAdapter(ModelList), None),
}


class Validating:
    """`app`, with every 200 answer on a route of `ROUTES` validated; `failures` lists the invalid
    ones (route, what, why)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.failures: list[str] = []
        self.checked = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        parts = path.split("/", 3)  # "", "sessions", its id, the route
        route = "/" + parts[3] if parts[1:2] == ["sessions"] and len(parts) == 4 else path
        types = ROUTES.get(route) if scope["type"] == "http" else None
        if types is None:
            await self.app(scope, receive, send)
            return
        status, streamed, body = 0, False, bytearray()

        async def sending(message: ASGIMessage) -> None:
            nonlocal status, streamed
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = dict(message.get("headers", []))
                streamed = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                body.extend(message.get("body", b""))
                if not message.get("more_body", False) and status == 200:
                    self._check(path, types, bytes(body), streamed)
            await send(message)

        await self.app(scope, receive, sending)

    def _check(
        self,
        path: str,
        types: tuple[TypeAdapter[Any], TypeAdapter[Any] | None],
        body: bytes,
        streamed: bool,
    ) -> None:
        whole, event = types
        if streamed and event is None:
            self.failures.append(f"{path}: a stream where a JSON body is due")
            return
        items = list(_events(body)) if streamed else [body.decode()]
        if not items:
            self.failures.append(f"{path}: an empty stream")
        for item in items:
            self.checked += 1
            try:
                (event if event is not None and streamed else whole).validate_json(item)
            except (ValidationError, ValueError) as e:
                self.failures.append(f"{path}: {item[:300]!r}: {e}")


def _events(body: bytes) -> Iterator[str]:
    """The `data:` of each Server-Sent Event but the closing `[DONE]`."""
    for block in body.decode().split("\n\n"):
        data = [line[5:].strip() for line in block.splitlines() if line.startswith("data:")]
        if data and data != ["[DONE]"]:
            yield "\n".join(data)


def check(validating: Validating) -> None:
    """Fail on any invalid answer the gateway sent."""
    assert not validating.failures, "invalid answers:\n" + "\n".join(validating.failures)
