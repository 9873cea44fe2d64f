"""Grammar-constrained decoding on a real vLLM server (structured outputs on llguidance): a forced
Hermes tool call and a JSON schema hold in every reply, the tokens sampled are the ones the local
sampler's masks allow, and the logprobs returned are those of the masked, renormalized distribution.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import torch
from served import CONTEXT, Reference

from rllm_async import grammar
from rllm_async.backends.hf_tokenizer import load_tokenizer
from rllm_async.engines.vllm import VLLMPolicy, VLLMServer
from rllm_async.protocols import Completion, SamplingParams
from rllm_async.rollout.tool_parsers import HermesParser

N = 50  # requests per constraint, sent together (about 3 s on two CPU cores)
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
# What the model has written when a call is forced: the prompt ends inside the call's opening.
OPENING = HermesParser().forced_prefix(None)  # '<tool_call>{"name": "'
# The rest of a call to get_weather. `</tool_call>` is an added token of Qwen-like vocabularies,
# which llguidance holds as special: the grammar names it as a token (unquoted), for a quoted
# "</tool_call>" would be allowed by the mask and then refused by the matcher.
FORCED_CALL = (
    'start: "get_weather\\", \\"arguments\\": " '
    f"%json{json.dumps(grammar.embedded_schema(SCHEMA))} "
    '"}" </tool_call>'
)


def sample_all(
    server: VLLMServer, model: Path, prefix: str, structured: str
) -> tuple[list[int], list[Completion]]:
    """`N` constrained completions of one chat prompt (followed by `prefix`), sent together."""
    tok = load_tokenizer(model, setting="model")
    prompt = tok.apply_chat_template([{"role": "user", "content": "weather in Oslo?"}])
    prompt += tok.encode(prefix)
    params = SamplingParams(max_tokens=64, temperature=1.0, structured=structured)

    async def go() -> list[Completion]:
        async with VLLMPolicy([server.url], tok, max_context_tokens=CONTEXT) as policy:
            return await asyncio.gather(*(policy.generate(prompt, params) for _ in range(N)))

    return prompt, asyncio.run(go())


def masks_of(model: Path, structured: str, out: Completion) -> torch.Tensor:
    """The local sampler's masks before each token of `out` [tokens, vocab] (booleans)."""
    tok = load_tokenizer(model, setting="model")
    vocab = tok.vocab_size
    grammars = grammar.Grammars(tok, vocab, [tok.eos_token_id])
    return grammar.allowed(grammars.sequence_masks(structured, out.ids), vocab)


def check_masked_logprobs(
    model: Path, prompt: list[int], structured: str, outs: list[Completion]
) -> None:
    """Every token is one the local sampler's mask allows; a forced token (one allowed) has
    logprob 0; and a few replies' logprobs are a float32 forward pass's, masked and renormalized."""
    forced = 0
    for out in outs:
        allowed = masks_of(model, structured, out)
        assert allowed[torch.arange(len(out.ids)), out.ids].all()
        only = allowed.sum(-1) == 1
        forced += int(only.sum())
        assert all(
            abs(lp) < 1e-4 for lp, one in zip(out.logprobs, only.tolist(), strict=True) if one
        )
    assert forced >= len(outs)  # the end of sequence at least, after the grammar ends
    reference = Reference(model)
    for out in outs[:3]:
        ids = torch.tensor([[*prompt, *out.ids]])
        with torch.no_grad():
            logits = reference.model(ids).logits[0, len(prompt) - 1 : -1].float()
        allowed = masks_of(model, structured, out)
        picked = torch.tensor(out.ids).unsqueeze(-1)
        masked = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), -1)
        unmasked = torch.log_softmax(logits, -1)
        served = torch.tensor(out.logprobs)
        assert (served - masked.gather(-1, picked).squeeze(-1)).abs().max() < 1e-3
        assert (served - unmasked.gather(-1, picked).squeeze(-1)).abs().max() > 0.1


def test_a_forced_hermes_call_parses_and_validates_in_every_reply(
    servers: list[VLLMServer], tiny_qwen: Path
) -> None:
    structured = json.dumps({"grammar": FORCED_CALL})
    prompt, outs = sample_all(servers[0], tiny_qwen, OPENING, structured)
    tok = load_tokenizer(tiny_qwen, setting="model")
    for out in outs:
        assert out.finish_reason == "stop" and out.ids[-1] == tok.eos_token_id
        reply = HermesParser().parse(OPENING + tok.decode(out.ids), {"get_weather": SCHEMA})
        assert reply.errors == [] and reply.content == ""
        [call] = reply.tool_calls
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
    check_masked_logprobs(tiny_qwen, prompt, structured, outs)


def test_a_json_schema_holds_in_every_reply_as_the_local_sampler_writes_json(
    servers: list[VLLMServer], tiny_qwen: Path
) -> None:
    structured = json.dumps({"json": SCHEMA})
    prompt, outs = sample_all(servers[0], tiny_qwen, "", structured)
    tok = load_tokenizer(tiny_qwen, setting="model")
    for out in outs:
        text = tok.decode(out.ids)
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA)
        assert text == json.dumps(value)  # our whitespace (grammar.JSON_OPTIONS), not vLLM's
    check_masked_logprobs(tiny_qwen, prompt, structured, outs)


def test_the_hermes_parsers_own_grammar_forces_a_call_to_any_tool(
    servers: list[VLLMServer], tiny_qwen: Path
) -> None:
    """What the gateway sends for `tool_choice: required` (`HermesParser.forced_grammar`, its
    markers named by token id) holds on vLLM's guidance backend too."""
    tok = load_tokenizer(tiny_qwen, setting="model")
    zone = {"zone": {"enum": ["UTC", "CET"]}}
    bounded = {
        "type": "object",
        "properties": zone,
        "required": ["zone"],
        "additionalProperties": False,
    }
    tools = {"get_weather": SCHEMA, "get_time": bounded}  # bounded: every call ends in max_tokens
    parser = HermesParser()
    rules = parser.forced_grammar(None, tools, parser.grammar_tokens(tok.encode))
    structured = json.dumps({"grammar": rules})
    prompt, outs = sample_all(servers[0], tiny_qwen, OPENING, structured)
    for out in outs:
        assert out.finish_reason == "stop" and out.ids[-1] == tok.eos_token_id
        reply = parser.parse(OPENING + tok.decode(out.ids), tools)
        assert reply.errors == [] and reply.content == ""
        [call] = reply.tool_calls
        name = call["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), tools[name])
    check_masked_logprobs(tiny_qwen, prompt, structured, outs)
