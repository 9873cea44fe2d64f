"""The vLLM client and engine against scripted HTTP servers: a connection that breaks before its
answer, a weight sync whose prefix-cache reset fails, a server that never answers, the engine's
timeout options, and a dead server's recovery."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from http import HTTPStatus
from pathlib import Path
from typing import Any

import llguidance
import pytest
import torch

from rllm_async.backends.local.backend import LocalOptions
from rllm_async.backends.toy_tokenizers import CharTokenizer
from rllm_async.engines.vllm import VLLMPolicy, VLLMServerError, write_weights
from rllm_async.engines.vllm.client import structured_outputs
from rllm_async.engines.vllm.engine import VLLMEngine, VLLMOptions
from rllm_async.grammar import embedded_schema, grammar_text
from rllm_async.protocols import SamplingParams
from tests.engines.vllm.tiny_engine import start_engine

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
HANG = object()  # a route that accepts the request and never answers
# An `HTTPStatus` answer is that status with a null body (`health=HTTPStatus.SERVICE_UNAVAILABLE`).
DROP = object()  # a route that closes the connection unanswered, as a dying server does

Route = Callable[[str], Any]  # query string -> JSON answer, HANG, or an awaitable of either


def answers(**overrides: Any) -> Route:
    """Answers per route name (`generate`, `pause`, `health`, ...): a JSON value, HANG, DROP, an
    `HTTPStatus`, or a function of the query string; unnamed routes answer `{"success": true}`."""

    def route(path_and_query: str) -> Any:
        path, _, query = path_and_query.partition("?")
        answer = overrides.get(
            path.rsplit("/", 1)[-1], ANSWER if path.endswith("/generate") else {"success": True}
        )
        return answer(query) if callable(answer) else answer

    return route


@asynccontextmanager
async def server(
    route: Route, bodies: list[Any] | None = None
) -> AsyncIterator[tuple[str, list[str]]]:
    """An HTTP/1.1 server on 127.0.0.1 answering each request (POST or GET) by `route`; yields its URL and the
    paths (with query strings) it was sent, in order; the JSON bodies go to `bodies`."""
    seen: list[str] = []
    handlers: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        this = asyncio.current_task()
        assert this is not None
        handlers.add(this)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target = head.split(b" ")[1].decode()
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                raw = await reader.readexactly(length)
                seen.append(target)
                if bodies is not None and raw:
                    bodies.append(json.loads(raw))
                answer = route(target)
                if asyncio.iscoroutine(answer):
                    answer = await answer
                if answer is HANG:
                    await asyncio.Event().wait()
                if answer is DROP:
                    return
                status = answer if isinstance(answer, HTTPStatus) else HTTPStatus.OK
                body = json.dumps(None if isinstance(answer, HTTPStatus) else answer).encode()
                writer.write(
                    f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode()
                    + b"content-type: application/json\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client left, or the server closes
        finally:
            handlers.discard(this)
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    async with srv:
        yield f"http://127.0.0.1:{port}", seen
        # Closing, the server drops its connections, hanging ones included, as a server that
        # shuts down does: Python 3.12+ waits for them all to close.
        srv.close()
        for handler in handlers:
            handler.cancel()


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    return write_weights({"model.embed_tokens.weight": torch.zeros(4, 2)}, tmp_path / "w")


async def _slow(answer: Any, seconds: float) -> Any:
    await asyncio.sleep(seconds)
    return answer


def dropping(n: int) -> Route:
    """A generate route that closes the first `n` requests' connections unanswered (as a server
    closing an idle keep-alive connection does) and answers the rest."""
    left = n

    def route(query: str) -> Any:
        nonlocal left
        if left:
            left -= 1
            return DROP
        return ANSWER

    return route


def test_a_connection_that_breaks_before_its_answer_is_tried_once_more() -> None:
    async def go() -> None:
        async with (
            server(answers(generate=dropping(1))) as (url, seen),
            VLLMPolicy([url], CharTokenizer(), max_context_tokens=64) as policy,
        ):
            out = await policy.generate([1, 2, 3], SamplingParams(max_tokens=4))
        assert (out.ids, out.logprobs, out.versions) == ([7, 8], [-0.5, -0.25], [0, 0])
        assert seen.count("/inference/v1/generate") == 2

    asyncio.run(go())


def test_a_second_break_is_reported_naming_the_server() -> None:
    async def go() -> None:
        async with (
            server(answers(generate=dropping(2))) as (url, seen),
            VLLMPolicy([url], CharTokenizer(), max_context_tokens=64) as policy,
        ):
            with pytest.raises(VLLMServerError, match=rf"connection to .*{url} broke"):
                await policy.generate([1, 2, 3], SamplingParams(max_tokens=4))
        assert seen.count("/inference/v1/generate") == 2

    asyncio.run(go())


def test_a_server_gone_after_the_break_is_reported_as_broken() -> None:
    async def go() -> None:
        async with server(answers(generate=dropping(1))) as (url, _):
            policy = VLLMPolicy([url], CharTokenizer(), max_context_tokens=64)
            await policy.open()
        # The server is gone: the first try breaks on a kept-alive connection or cannot connect.
        with pytest.raises(VLLMServerError, match=rf"(connection to|cannot connect to) .*{url}"):
            await policy.generate([1, 2, 3], SamplingParams(max_tokens=4))
        await policy.close()

    asyncio.run(go())


def test_a_failed_prefix_cache_reset_fails_the_sync_and_generation_resumes(
    weights: Path,
) -> None:
    """Both resets refuse: the sync raises naming the server, resumes it, and keeps the old
    version; a generate sent while the sync ran is answered afterwards."""
    route = answers(
        pause=lambda _: _slow({}, 0.3),  # the generate below is queued behind the sync
        reset_prefix_cache={"success": False},
    )

    async def go() -> None:
        async with (
            server(route) as (url, seen),
            VLLMPolicy([url], CharTokenizer(), max_context_tokens=64) as policy,
        ):
            sync = asyncio.create_task(policy.update_weights(weights, 1))
            async with asyncio.timeout(60):  # only catches a hang
                while not any(p.startswith("/pause") for p in seen):
                    await asyncio.sleep(0.01)
            queued = asyncio.create_task(policy.generate([1, 2], SamplingParams(max_tokens=4)))
            with pytest.raises(VLLMServerError, match=rf"{url}/reset_prefix_cache refused"):
                await sync
            out = await asyncio.wait_for(queued, 5)
            assert (out.ids, out.versions) == ([7, 8], [0, 0])
            assert policy.version == 0
            resets = [p for p in seen if p.startswith("/reset_prefix_cache")]
            assert resets == [
                "/reset_prefix_cache",
                "/reset_prefix_cache?reset_running_requests=true",
            ]
            assert "/resume" in seen and seen.index("/resume") < seen.index(
                "/inference/v1/generate"
            )
            paths = [p.partition("?")[0] for p in seen]
            assert "/update_weight_version" not in paths[paths.index("/pause") :]

    asyncio.run(go())


def test_a_reset_that_succeeds_the_second_time_completes_the_sync(weights: Path) -> None:
    route = answers(reset_prefix_cache=lambda query: {"success": "reset_running_requests" in query})

    async def go() -> None:
        async with (
            server(route) as (url, seen),
            VLLMPolicy([url], CharTokenizer(), max_context_tokens=64) as policy,
        ):
            sync = await policy.update_weights(weights, 1)
            assert sync.version == policy.version == 1
            assert seen[-2:] == ["/update_weight_version", "/resume"]

    asyncio.run(go())


def test_a_server_that_never_answers_times_out_naming_it() -> None:
    async def go() -> None:
        async with server(answers(generate=HANG)) as (url, _):
            policy = VLLMPolicy([url], CharTokenizer(), max_context_tokens=64, read_timeout_s=0.5)
            async with policy:
                start = time.monotonic()
                with pytest.raises(
                    VLLMServerError,
                    match=rf"vLLM server at {url} timed out: no answer to /inference/v1/generate "
                    r"within 0.5s \(read_timeout_s\)",
                ):
                    await policy.generate([1, 2], SamplingParams(max_tokens=4))
                # Ended by read_timeout_s: long before any other timeout (connect: 30 s).
                assert 0.5 <= time.monotonic() - start < 20.0
                assert policy.in_flight() == {url: 0}

    asyncio.run(go())


def test_a_sync_call_that_never_answers_times_out_and_resumes(weights: Path) -> None:
    async def go() -> None:
        async with (
            server(answers(collective_rpc=HANG)) as (url, seen),
            VLLMPolicy([url], CharTokenizer(), max_context_tokens=64, sync_timeout_s=0.5) as policy,
        ):
            start = time.monotonic()
            with pytest.raises(VLLMServerError, match=rf"{url} timed out.*\(sync_timeout_s\)"):
                await policy.update_weights(weights, 1)
            # Ended by sync_timeout_s: long before any other timeout (connect: 30 s).
            assert time.monotonic() - start < 20.0
            assert seen[-1] == "/resume" and policy.version == 0

    asyncio.run(go())


def test_a_sync_call_in_flight_fails_once_its_server_says_it_is_unhealthy(weights: Path) -> None:
    """vLLM never answers a control call that was in flight when its engine died, while `/health`
    answers 503: the sync fails then, naming that, not after its timeout (600 s here)."""

    async def go() -> None:
        route = answers(pause=HANG, health=HTTPStatus.SERVICE_UNAVAILABLE)
        async with (
            server(route) as (url, seen),
            VLLMPolicy([url], CharTokenizer(), max_context_tokens=64, sync_timeout_s=600) as policy,
        ):
            with pytest.raises(
                VLLMServerError,
                match=rf"{url} answered /health with HTTP 503 while /pause was in flight",
            ):
                await asyncio.wait_for(policy.update_weights(weights, 1), 60)  # only a hang
            assert "/health" in seen and policy.version == 0

    asyncio.run(go())


def test_a_slow_sync_call_on_a_healthy_server_is_waited_for(weights: Path) -> None:
    """`/health` is checked while a control call runs long, and a healthy answer lets it run."""

    async def go() -> None:
        route = answers(pause=lambda _: _slow({"success": True}, 2.5))
        async with (
            server(route) as (url, seen),
            VLLMPolicy([url], CharTokenizer(), max_context_tokens=64) as policy,
        ):
            await policy.update_weights(weights, 1)
            assert policy.version == 1
            assert seen.index("/health") < seen.index("/collective_rpc")  # during /pause

    asyncio.run(go())


def test_the_timeouts_are_engine_options_with_their_defaults() -> None:
    opts = VLLMOptions()
    assert (opts.read_timeout_s, opts.sync_timeout_s) == (600.0, 60.0)
    parsed = LocalOptions.model_validate({"vllm": {"read_timeout_s": 5, "sync_timeout_s": 2}})
    assert (parsed.vllm.read_timeout_s, parsed.vllm.sync_timeout_s) == (5.0, 2.0)
    with pytest.raises(ValueError):
        VLLMOptions(read_timeout_s=0)


def test_the_engine_gives_its_client_the_timeouts(tmp_path: Path) -> None:
    """An engine on a user's server (`urls`): its start-up reload lands there, and its client
    stops waiting for an answer after `read_timeout_s`."""

    async def run_engine(url: str) -> VLLMEngine:
        opts = VLLMOptions(urls=[url], read_timeout_s=0.5, weights_dir=str(tmp_path / "shm"))
        return await asyncio.to_thread(start_engine, opts, tmp_path)

    async def go() -> None:
        async with server(answers(generate=HANG)) as (url, seen):
            engine = await run_engine(url)
            try:
                assert engine.policy.urls == [url]
                assert "/collective_rpc" in seen and seen[-1] == "/resume"
                start = time.monotonic()
                with pytest.raises(VLLMServerError, match=rf"{url} timed out.*within 0.5s"):
                    await engine.policy.generate([1, 2], SamplingParams(max_tokens=4))
                # Ended by read_timeout_s: long before any other timeout (connect: 30 s).
                assert time.monotonic() - start < 20.0
            finally:
                await engine.policy.close()
                engine.stop()

    asyncio.run(go())


def test_a_dead_server_is_recovered_and_requests_meanwhile_wait_for_it() -> None:
    """The request that finds the server dead fails (to be retried as any failed rollout); one
    sent during the recovery waits, then goes to the URL the recovery gave."""
    calls: list[str] = []

    async def go() -> None:
        async with (
            server(answers(generate=DROP)) as (dead, _),
            server(answers()) as (replacement, seen),
        ):

            async def recover(url: str) -> str:
                calls.append(url)
                await asyncio.sleep(0.3)
                return replacement

            async with VLLMPolicy(
                [dead], CharTokenizer(), max_context_tokens=64, recover=recover
            ) as policy:
                params = SamplingParams(max_tokens=4)
                with pytest.raises(VLLMServerError, match=rf"connection to .*{dead} broke"):
                    await policy.generate([1, 2], params)
                out = await asyncio.wait_for(policy.generate([1, 2], params), 5)
                assert out.ids == [7, 8] and seen.count("/inference/v1/generate") == 1
                assert calls == [dead] and policy.urls == [replacement]
                assert await policy.settle() == []

    asyncio.run(go())


def test_a_server_its_recovery_gives_up_on_fails_every_later_request_at_once() -> None:
    async def go() -> None:
        async with server(answers(generate=DROP)) as (dead, _):

            async def recover(url: str) -> str:
                raise VLLMServerError(f"the vLLM server at {url} died after 1 restart(s)")

            async with VLLMPolicy(
                [dead], CharTokenizer(), max_context_tokens=64, recover=recover
            ) as policy:
                params = SamplingParams(max_tokens=4)
                with pytest.raises(VLLMServerError, match="broke"):
                    await policy.generate([1, 2], params)
                [gone] = await policy.settle()
                assert "died after 1 restart" in str(gone)
                with pytest.raises(VLLMServerError, match="died after 1 restart"):
                    await asyncio.wait_for(policy.generate([1, 2], params), 1)

    asyncio.run(go())


def test_calls_in_flight_on_a_server_given_up_on_fail_at_once() -> None:
    """A server that hangs one request and breaks the next: once its recovery gives up, the
    hanging request fails with the recovery's error instead of waiting for its timeout."""
    script = iter([HANG, DROP, DROP])

    async def go() -> None:
        async with server(answers(generate=lambda _: next(script))) as (url, seen):

            async def recover(url: str) -> str:
                raise VLLMServerError(f"the vLLM server at {url} died after 1 restart(s)")

            async with VLLMPolicy(
                [url], CharTokenizer(), max_context_tokens=64, recover=recover
            ) as policy:
                params = SamplingParams(max_tokens=4)
                hanging = asyncio.create_task(policy.generate([1, 2], params))
                async with asyncio.timeout(60):  # only catches a hang
                    while "/inference/v1/generate" not in seen:  # held: the next is dropped
                        await asyncio.sleep(0.01)
                with pytest.raises(VLLMServerError, match="broke"):
                    await policy.generate([1, 2], params)
                with pytest.raises(VLLMServerError, match="died after 1 restart"):
                    await asyncio.wait_for(hanging, 2)
                assert policy.in_flight() == {url: 0}

    asyncio.run(go())


def test_a_constrained_request_cut_short_by_a_sync_starts_its_reply_over() -> None:
    """vLLM would start the grammar afresh after the tokens sent again: the client sends the
    prompt alone, and keeps none of the cut reply's tokens."""
    cut = {
        "choices": [
            {
                "token_ids": [5, 6, 5],
                "logprobs": {"content": [{"logprob": -1.0}] * 3},
                "weight_versions": [{"version": "0", "start": 0, "end": 3}],
                "finish_reason": "abort",
            }
        ]
    }
    replies = iter([cut, ANSWER])
    bodies: list[Any] = []
    rule = json.dumps({"json_object": True})

    async def go() -> Any:
        async with (
            server(answers(generate=lambda q: next(replies)), bodies) as (url, _),
            VLLMPolicy([url], CharTokenizer(), max_context_tokens=64) as policy,
        ):
            return await policy.generate([1, 2, 3], SamplingParams(max_tokens=8, structured=rule))

    out = asyncio.run(go())
    sent = [b for b in bodies if "token_ids" in b]
    assert [b["token_ids"] for b in sent] == [[1, 2, 3], [1, 2, 3]]
    assert [b["sampling_params"]["max_tokens"] for b in sent] == [8, 8]
    sent_rule = {"json": embedded_schema({"type": "object"})}
    assert all(b["sampling_params"]["structured_outputs"] == sent_rule for b in sent)
    assert (out.ids, out.logprobs) == ([7, 8], [-0.5, -0.25])


def test_json_constraints_carry_the_local_samplers_json_options() -> None:
    """vLLM's guidance backend compiles a schema with flexible whitespace unless the schema says
    otherwise: the client adds our options, so both engines compile the same grammar."""
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    for rule, sent in [
        ({"json": schema}, {"json": embedded_schema(schema)}),
        ({"json_object": True}, {"json": embedded_schema({"type": "object"})}),
        ({"regex": "[ab]+"}, {"regex": "[ab]+"}),
        ({"grammar": 'start: "x"'}, {"grammar": 'start: "x"'}),
    ]:
        assert structured_outputs(json.dumps(rule)) == sent
    sent_schema = structured_outputs(json.dumps({"json": schema}))["json"]
    vllm_side = llguidance.LLMatcher.grammar_from_json_schema(
        sent_schema, defaults={"whitespace_flexible": True}
    )
    assert vllm_side == grammar_text(json.dumps({"json": schema}))
