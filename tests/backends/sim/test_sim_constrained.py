"""Constrained decoding on the sim backend: replies satisfy their constraint, logprobs are the
masked distribution's, draws are deterministic per seed, and masks cost virtual time."""

from __future__ import annotations

import asyncio
import json
import math
import re

import jsonschema
import pytest

from rllm_async import grammar, vclock
from rllm_async.backends.sim import SimOptions, SimPolicy
from rllm_async.protocols import Completion, SamplingParams
from rllm_async.rollout import RolloutContext
from rllm_async.rollout.tool_parsers import HermesParser

EOS = 256  # ByteTokenizer's end of sequence
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["rain", "sun"]}, "maxItems": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
FORCED_CALL = (
    'start: "get_weather\\", \\"arguments\\": " '
    f"%json{json.dumps(grammar.embedded_schema(SCHEMA))} "
    '"}</tool_call>"'
)


def sample(
    policy: SimPolicy, structured: str, n: int = 20, seed: int | None = None, max_tokens: int = 256
) -> list[Completion]:
    params = SamplingParams(max_tokens=max_tokens, structured=structured, seed=seed)

    async def main() -> list[Completion]:
        return list(await asyncio.gather(*(policy.generate([1], params) for _ in range(n))))

    return vclock.run(main(), virtual=True)


def text(out: Completion) -> str:
    assert out.finish_reason == "stop" and out.ids[-1] == EOS
    return bytes(out.ids[:-1]).decode()


def test_json_schema_replies_validate_and_use_our_json_whitespace() -> None:
    policy = SimPolicy(SimOptions())
    assert policy.constrains_decoding
    for out in sample(policy, json.dumps({"json": SCHEMA})):
        value = json.loads(text(out))
        jsonschema.validate(value, SCHEMA)
        assert text(out) == json.dumps(value, ensure_ascii=False)
        assert len(out.ids) == len(out.logprobs) == len(out.versions)


def test_a_forced_hermes_call_parses_into_one_valid_call() -> None:
    opening = HermesParser().forced_prefix(None)
    for out in sample(SimPolicy(SimOptions()), json.dumps({"grammar": FORCED_CALL})):
        reply = HermesParser().parse(opening + text(out), {"get_weather": SCHEMA})
        assert reply.errors == [] and reply.content == ""
        [call] = reply.tool_calls
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)


def test_regex_and_json_object_constraints_hold() -> None:
    policy = SimPolicy(SimOptions(latency="zero"))
    for out in sample(policy, json.dumps({"regex": r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"})):
        assert re.fullmatch(r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)", text(out))
    for out in sample(policy, json.dumps({"json_object": True})):
        assert isinstance(json.loads(text(out)), dict)


def test_logprobs_are_the_masked_distributions_and_forced_tokens_have_zero() -> None:
    """Each logprob is log(weight / allowed weights) under the mask the grammar replays over the
    reply's tokens; where one token is allowed it is exactly 0."""
    structured = json.dumps({"grammar": FORCED_CALL})
    policy = SimPolicy(SimOptions(latency="zero"))
    sampler = policy._constrained_sampler()
    forced = 0
    for out in sample(policy, structured, n=5):
        allowed = grammar.allowed(sampler.grammars.sequence_masks(structured, out.ids), EOS + 1)
        for row, token, logprob in zip(allowed, out.ids, out.logprobs, strict=True):
            ids = row.nonzero().flatten().tolist()
            total = sum(sampler.weights[t] for t in ids)
            assert token in ids
            assert logprob == pytest.approx(math.log(sampler.weights[token] / total), abs=1e-12)
            if len(ids) == 1:
                forced += 1
                assert logprob == 0.0
    assert forced > 5 * len("get_weather")  # the call's fixed text is forced byte by byte


def test_draws_are_deterministic_per_seed_and_per_request_order() -> None:
    structured = json.dumps({"json": SCHEMA})

    def ids(seed: int | None) -> list[list[int]]:
        return [out.ids for out in sample(SimPolicy(SimOptions()), structured, n=4, seed=seed)]

    assert ids(None) == ids(None)
    assert len({tuple(x) for x in ids(None)}) > 1  # each request its own draw
    seeded = ids(7)
    assert seeded == ids(7) and len({tuple(x) for x in seeded}) == 1 and seeded != ids(8)


def test_a_reply_cut_by_max_tokens_finishes_with_length() -> None:
    [out] = sample(SimPolicy(SimOptions()), json.dumps({"json": SCHEMA}), n=1, max_tokens=5)
    assert out.finish_reason == "length" and len(out.ids) == 5 and EOS not in out.ids


def test_each_constrained_token_adds_its_mask_time() -> None:
    """Alone on the engine a sequence decodes at rmax / (1 + n_half) = 100 tok/s; its masks add
    mask_s per token after it."""
    structured = json.dumps({"json": SCHEMA})

    def timed(mask_s: float) -> tuple[float, int]:
        policy = SimPolicy(SimOptions(rmax=200, n_half=1, mask_s=mask_s))
        params = SamplingParams(max_tokens=256, structured=structured, seed=3)

        async def main() -> tuple[float, int]:
            out = await policy.generate([1], params)
            return asyncio.get_running_loop().time(), len(out.ids)

        return vclock.run(main(), virtual=True)

    (free, n), (charged, m) = timed(0.0), timed(0.01)
    assert n == m and free == pytest.approx(n / 100, abs=1e-9)
    assert charged == pytest.approx(n / 100 + n * 0.01, abs=1e-9)
    assert SimOptions().mask_s == 60e-6


def test_a_constraint_that_does_not_compile_is_refused() -> None:
    with pytest.raises(grammar.ConstraintError):
        sample(SimPolicy(SimOptions()), json.dumps({"grammar": "start: nope"}), n=1)


def test_the_rollout_context_records_the_constraint_with_the_tokens() -> None:
    policy = SimPolicy(SimOptions(latency="zero"))
    structured = json.dumps({"json_object": True})
    ctx = RolloutContext(
        policy,
        sampling=SamplingParams(max_tokens=64, structured=structured),
        pin=False,
        deadline=math.inf,
        task_id="t",
    )

    async def main() -> None:
        await ctx.generate([1, 2])

    vclock.run(main(), virtual=True)
    [step] = ctx.trajectory().steps
    assert step.info["structured"] == structured
    assert isinstance(json.loads(bytes(step.completion_ids[:-1]).decode()), dict)
