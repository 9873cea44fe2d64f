"""The vLLM client against a fault-injecting HTTP server: a connection that breaks before its
answer is tried once more, and a server that is gone is reported as such."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from rllm_async.backends.base import SamplingParams
from rllm_async.backends.toy_tokenizers import CharTokenizer
from rllm_async.engines.vllm import VLLMPolicy
from rllm_async.engines.vllm.errors import VLLMServerError

ANSWER = {
    "choices": [
        {
            "token_ids": [7, 8],
            "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]},
            "weight_versions": [{"version": "0", "start": 0, "end": 2}],
            "finish_reason": "stop",
        }
    ]
}


@asynccontextmanager
async def server(drop: int) -> AsyncIterator[tuple[str, list[str]]]:
    """An HTTP/1.1 server that closes the first `drop` generate requests' connections unanswered
    (as a server closing an idle keep-alive connection does) and answers the rest."""
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal drop
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ")[1].decode()
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                seen.append(path)
                if path.endswith("/generate") and drop:
                    drop -= 1
                    return
                body = json.dumps(ANSWER if path.endswith("/generate") else {}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    async with srv:
        yield f"http://127.0.0.1:{port}", seen


def test_a_connection_that_breaks_before_its_answer_is_tried_once_more() -> None:
    async def go() -> None:
        async with (
            server(drop=1) as (url, seen),
            VLLMPolicy([url], CharTokenizer(), max_context_tokens=64) as policy,
        ):
            out = await policy.generate([1, 2, 3], SamplingParams(max_tokens=4))
        assert (out.ids, out.logprobs, out.versions) == ([7, 8], [-0.5, -0.25], [0, 0])
        assert seen.count("/inference/v1/generate") == 2

    asyncio.run(go())


def test_a_second_break_is_reported_naming_the_server() -> None:
    async def go() -> None:
        async with (
            server(drop=2) as (url, seen),
            VLLMPolicy([url], CharTokenizer(), max_context_tokens=64) as policy,
        ):
            with pytest.raises(VLLMServerError, match=rf"connection to .*{url} broke"):
                await policy.generate([1, 2, 3], SamplingParams(max_tokens=4))
        assert seen.count("/inference/v1/generate") == 2

    asyncio.run(go())


def test_a_server_gone_after_the_break_is_reported_as_broken() -> None:
    async def go() -> None:
        async with server(drop=1) as (url, _):
            policy = VLLMPolicy([url], CharTokenizer(), max_context_tokens=64)
            await policy.open()
        # The server is gone: the first try breaks on a kept-alive connection or cannot connect.
        with pytest.raises(VLLMServerError, match=rf"(connection to|cannot connect to) .*{url}"):
            await policy.generate([1, 2, 3], SamplingParams(max_tokens=4))
        await policy.close()

    asyncio.run(go())
