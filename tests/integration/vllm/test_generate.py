"""Token-in/token-out sampling on a real vLLM server: logprobs, sampling options, errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from served import CONTEXT, hf_logprobs, metric

from rllm_async.backends.hf_tokenizer import load_tokenizer
from rllm_async.engines.vllm import VLLMPolicy, VLLMServer, VLLMServerError
from rllm_async.protocols import Completion, SamplingParams
from rllm_async.rollout import RolloutContext

# Served in float32: the server's logprobs of its own tokens match a float32 `transformers`
# forward pass to this (measured differences are ~1e-5; bf16 serving is within 0.005-0.02).
TOLERANCE = 1e-3


def sample(
    server: VLLMServer, model: Path, params: SamplingParams, n: int = 1
) -> tuple[list[int], list[Completion]]:
    """`n` completions of one chat prompt from `server`."""
    tok = load_tokenizer(model, setting="model")
    prompt = tok.apply_chat_template([{"role": "user", "content": "what is 3 plus 4?"}])

    async def go() -> list[Completion]:
        async with VLLMPolicy([server.url], tok, max_context_tokens=CONTEXT) as policy:
            return await asyncio.gather(*(policy.generate(prompt, params) for _ in range(n)))

    return prompt, asyncio.run(go())


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_a_transformers_forward(
    servers: list[VLLMServer], tiny_qwen: Path, temperature: float
) -> None:
    prompt, (out,) = sample(
        servers[0], tiny_qwen, SamplingParams(temperature=temperature, max_tokens=24, seed=7)
    )
    assert len(out.ids) == len(out.logprobs) == len(out.versions) == 24
    assert out.versions == [0] * 24 and out.finish_reason == "length"
    expected = hf_logprobs(tiny_qwen, prompt, out.ids, temperature)
    assert max(abs(a - b) for a, b in zip(out.logprobs, expected, strict=True)) < TOLERANCE


def test_greedy_and_seeds_are_reproducible(servers: list[VLLMServer], tiny_qwen: Path) -> None:
    _, greedy = sample(servers[0], tiny_qwen, SamplingParams(temperature=0.0, max_tokens=16), 2)
    assert greedy[0].ids == greedy[1].ids
    _, same = sample(servers[0], tiny_qwen, SamplingParams(max_tokens=16, seed=3), 2)
    assert same[0].ids == same[1].ids
    _, other = sample(servers[0], tiny_qwen, SamplingParams(max_tokens=16, seed=4))
    assert other[0].ids != same[0].ids


def test_a_tiny_top_p_keeps_only_the_likeliest_token(
    servers: list[VLLMServer], tiny_qwen: Path
) -> None:
    _, greedy = sample(servers[0], tiny_qwen, SamplingParams(temperature=0.0, max_tokens=16))
    _, nucleus = sample(servers[0], tiny_qwen, SamplingParams(top_p=1e-6, max_tokens=16, seed=1))
    assert nucleus[0].ids == greedy[0].ids
    # Renormalized over a one-token nucleus (vLLM's processed logprobs).
    assert all(abs(lp) < 1e-4 for lp in nucleus[0].logprobs)


def test_stop_strings_end_on_the_token_that_completes_them(
    servers: list[VLLMServer], tiny_qwen: Path
) -> None:
    tok = load_tokenizer(tiny_qwen, setting="model")
    _, (greedy,) = sample(servers[0], tiny_qwen, SamplingParams(temperature=0.0, max_tokens=64))
    # A later token that decodes to whole words (not a byte of a multi-byte character).
    words = (tok.decode([t]) for t in greedy.ids[3:])
    stop = next(w for w in words if w.strip() and w.isascii() and w.isprintable())
    _, (out,) = sample(
        servers[0], tiny_qwen, SamplingParams(temperature=0.0, max_tokens=64, stop=(stop,))
    )
    assert out.finish_reason == "stop"
    assert out.ids == greedy.ids[: len(out.ids)]  # the same tokens, cut where the stop appears
    assert stop in tok.decode(out.ids) and stop not in tok.decode(out.ids[:-1])


def test_max_tokens_is_clamped_to_the_context(servers: list[VLLMServer], tiny_qwen: Path) -> None:
    tok = load_tokenizer(tiny_qwen, setting="model")

    async def go() -> None:
        async with VLLMPolicy([servers[0].url], tok, max_context_tokens=CONTEXT) as policy:
            out = await policy.generate([5] * (CONTEXT - 3), SamplingParams(max_tokens=50))
            assert len(out.ids) == 3 and out.finish_reason == "length"
            with pytest.raises(ValueError, match="leaves no room"):
                await policy.generate([5] * CONTEXT, SamplingParams(max_tokens=5))

    asyncio.run(go())


def test_a_refused_request_names_the_server_and_the_status(
    servers: list[VLLMServer], tiny_qwen: Path
) -> None:
    tok = load_tokenizer(tiny_qwen, setting="model")

    async def go() -> None:
        async with VLLMPolicy([servers[0].url], tok, max_context_tokens=CONTEXT) as policy:
            with pytest.raises(VLLMServerError, match=rf"{servers[0].url}.*HTTP 400"):
                await policy.generate([10**6], SamplingParams(max_tokens=4))

    asyncio.run(go())


def test_requests_spread_over_servers(servers: list[VLLMServer], tiny_qwen: Path) -> None:
    tok = load_tokenizer(tiny_qwen, setting="model")

    async def go() -> dict[str, int]:
        urls = [s.url for s in servers]
        async with VLLMPolicy(urls, tok, max_context_tokens=CONTEXT) as policy:
            params = SamplingParams(max_tokens=32)
            outs = await asyncio.gather(*(policy.generate([5, 6, 7], params) for _ in range(16)))
            assert all(o.ids and set(o.versions) == {0} for o in outs)
            assert policy.in_flight() == dict.fromkeys(urls, 0)
            return policy.requests_sent()

    assert asyncio.run(go()) == {s.url: 8 for s in servers}


async def settled_tokens(url: str) -> float:
    """The server's count of generated tokens once nothing runs and it stays put for 0.5 s."""
    async with asyncio.timeout(15):
        while True:
            before = await metric(url, "vllm:generation_tokens_total")
            await asyncio.sleep(0.5)
            running = await metric(url, "vllm:num_requests_running")
            if running == 0 and await metric(url, "vllm:generation_tokens_total") == before:
                return before


def test_an_episode_deadline_cuts_a_long_completion_and_the_server_drops_it(
    servers: list[VLLMServer], tiny_qwen: Path
) -> None:
    """A rollout whose deadline is 0.5 s away asks for a completion of ~1000 tokens (greedy on
    this prompt never ends early): TimeoutError at the deadline, nothing left in flight in the
    client, and the server aborts the request (its connection closed) instead of decoding on:
    its running requests drop to 0 and its token count stops well short of the completion."""
    tok = load_tokenizer(tiny_qwen, setting="model")
    url = servers[0].url
    params = SamplingParams(temperature=0.0, max_tokens=CONTEXT)

    async def go() -> None:
        async with VLLMPolicy([url], tok, max_context_tokens=CONTEXT) as policy:
            prompt = tok.apply_chat_template([{"role": "user", "content": "what is 3 plus 4?"}])
            # What it decodes without a deadline (this also warms the server up).
            full = await policy.generate(prompt, params)
            assert full.finish_reason == "length" and len(full.ids) == CONTEXT - len(prompt)
            loop = asyncio.get_running_loop()
            ctx = RolloutContext(
                policy,
                sampling=params,
                pin=False,
                deadline=loop.time() + 0.5,
                task_id="t",
            )
            tokens = await settled_tokens(url)  # the counter lags behind the answers
            start = loop.time()
            with pytest.raises(TimeoutError):
                async with ctx.timeout():
                    await ctx.generate(prompt)
            # Promptly, on a machine whose two cores the servers keep busy (0.5-3 s measured).
            assert loop.time() - start < 5.0
            assert policy.in_flight() == {url: 0}
            # The server stops decoding: its token count settles well short of the completion.
            decoded = await settled_tokens(url) - tokens
            assert decoded < len(full.ids) - 100, (decoded, len(full.ids))

    asyncio.run(go())


def test_a_structured_outputs_constraint_shapes_the_tokens_and_their_logprobs(
    servers: list[VLLMServer], tiny_qwen: Path
) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    rule = json.dumps({"json": schema, "disable_any_whitespace": True})
    tok = load_tokenizer(tiny_qwen, setting="model")
    _, outs = sample(
        servers[0], tiny_qwen, SamplingParams(max_tokens=32, seed=5, structured=rule), 4
    )
    for out in outs:
        assert out.finish_reason == "stop", tok.decode(out.ids)
        assert json.loads(tok.decode(out.ids)) in ({"answer": "yes"}, {"answer": "no"})
        # Drawn from the constrained distribution: the forced tokens had probability one.
        assert max(out.logprobs) > -1e-3
    _, (free,) = sample(servers[0], tiny_qwen, SamplingParams(max_tokens=32, seed=5))
    assert free.ids != outs[0].ids  # the random model does not write this by itself
