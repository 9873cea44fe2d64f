"""Server-Sent Events: a finished reply sent as the stream its API defines."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

from starlette.responses import StreamingResponse


def data_stream(
    chunks: list[dict[str, Any]], headers: dict[str, str] | None = None
) -> StreamingResponse:
    """OpenAI's chat and text completion chunks: `data:` lines, then `data: [DONE]`."""
    frames = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks]
    return event_stream([*frames, "data: [DONE]\n\n"], headers)


def typed_stream(events: Iterable[Any], headers: dict[str, str] | None = None) -> StreamingResponse:
    """Typed events (pydantic models of the Responses or Anthropic API): `event: <type>` and the
    event's JSON, no `[DONE]`."""
    frames = [f"event: {e.type}\ndata: {e.model_dump_json(exclude_unset=True)}\n\n" for e in events]
    return event_stream(frames, headers)


def event_stream(frames: list[str], headers: dict[str, str] | None = None) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        for frame in frames:
            yield frame

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", **(headers or {})},
    )
