"""The grammar of a forced tool call, per family (`ToolParser.forced_grammar`): it accepts the call
as its family writes it, token by token on a tokenizer with the family's special tokens, refuses
malformed arguments, and whatever it lets a sampler draw parses into one schema-valid call."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from rllm_async.grammar import Grammars, allowed
from rllm_async.rollout.reply_parser import reply_parser
from rllm_async.rollout.tool_calls import tool_schemas
from rllm_async.rollout.tool_parsers import TOOL_PARSERS, ToolParser
from tests.rollout.test_tool_call_families import FAMILIES, Family, family_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "expr": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "mode": {"enum": ["fast", "exact"]},
    },
    "required": ["expr", "n"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "calc", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "calculate", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "noop"}},  # no parameters: any object
]
EMPTY = {"type": "object", "properties": {}, "additionalProperties": False}
# A sampler drawing uniformly would write an unbounded object for `noop`: bounded tools.
BOUNDED = [*TOOLS[:2], {"type": "function", "function": {"name": "ping", "parameters": EMPTY}}]
ARGS = {"expr": "6*7", "n": 3}
# What each family writes after a forced call's opening (`forced_prefix("calc")`).
WELL_FORMED = {
    "hermes": '{"expr": "6*7", "n": 3}}</tool_call>',
    "llama3_json": '{"expr": "6*7", "n": 3}}',
    "mistral": '{"expr": "6*7", "n": 3}}]',
    "qwen3_coder": "<parameter=expr>\n6*7\n</parameter>\n<parameter=n>\n3\n</parameter>\n"
    "</function>\n</tool_call>",
    "deepseek_v3": '{"expr": "6*7", "n": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "harmony": '{"expr": "6*7", "n": 3}<|call|>',
}
MALFORMED = {
    "hermes": ['{"expr": 6}}</tool_call>', '{"expr": "6*7"}}</tool_call>', '{"n": 3, "x": 1}'],
    "llama3_json": ['{"expr": "6*7", "n": "3"}}', "{'expr': '6*7'}"],
    "mistral": ['{"expr": "6*7", "n": 3}}}', '{"expr": "6*7", "n": -1}}]'],
    "qwen3_coder": [
        "<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>",  # expr is required
        "<parameter=expr>\n6*7\n</parameter>\n<parameter=n>\nthree\n</parameter>\n",
        "<parameter=expr>\n6</tool_call>",
    ],
    "deepseek_v3": ['{"expr": "6*7", "n": 3}<｜tool▁call▁end｜>', '{"expr": "6*7", "n": 300}'],
    "harmony": ['{"expr": "6*7", "n": 3, "more": 1}<|call|>', '{"expr": "6*7"}<|call|>'],
}


class ByteView:
    """A family's character-level HF tokenizer as the grammar engine reads it: each id's bytes and
    which ids are special (llguidance cannot read its `Fuse` decoder from tokenizer.json)."""

    def __init__(self, family: Family) -> None:
        self.hf = family_tokenizer(family)
        vocab = self.hf._tok.get_vocab()
        by_id = {i: t for t, i in vocab.items()}
        self.vocab_size = self.hf.vocab_size
        self.tokens = [by_id[i].encode() for i in range(self.vocab_size)]
        self.special_ids = [vocab[t] for t in family.special]
        self.eos_token_id = self.hf.eos_token_id
        self.stop_ids = [self.eos_token_id, *(vocab[s] for s in family.stops)]
        self.chat_template = self.hf.chat_template
        self.model_type = None

    def token_bytes(self) -> list[bytes]:
        return self.tokens

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(ids)


FAMILY_VIEWS: dict[str, ByteView] = {}


def view(name: str) -> ByteView:
    """The tokenizer of family `name` (the first row of that name in the conformance table)."""
    if name not in FAMILY_VIEWS:
        FAMILY_VIEWS[name] = ByteView(next(f for f in FAMILIES if f.name == name))
    return FAMILY_VIEWS[name]


def constraint(
    tok: Any, parser: ToolParser, name: str | None, tools: list[dict[str, Any]] = TOOLS
) -> tuple[Grammars, str]:
    """The grammar engine of `tok` and the forced call's constraint, as a rollout's context makes
    it (`RolloutContext.tool_call_constraint`)."""
    lark = parser.forced_grammar(name, tool_schemas(tools), parser.grammar_tokens(tok.encode))
    stops = getattr(tok, "stop_ids", [tok.eos_token_id])
    return Grammars(tok, tok.vocab_size, stops), json.dumps({"grammar": lark})


def accepts(grammars: Grammars, structured: str, ids: Sequence[int]) -> bool:
    matcher = grammars.matcher(structured)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def parsed(
    tok: Any,
    parser: ToolParser,
    name: str | None,
    ids: Sequence[int],
    tools: list[dict[str, Any]] = TOOLS,
) -> Any:
    """The reply of forced prefix + `ids`, read as the gateway does."""
    reader = reply_parser(tok, parser.name, "none")
    return reader.read(tok, [], ids, prefix=parser.forced_prefix(name), tools=tools)


@pytest.mark.parametrize("family", list(WELL_FORMED))
def test_the_grammar_accepts_a_well_formed_call_and_refuses_malformed_arguments(
    family: str,
) -> None:
    tok, parser = view(family), TOOL_PARSERS[family]
    grammars, structured = constraint(tok, parser, "calc")
    ids = tok.encode(WELL_FORMED[family])
    assert accepts(grammars, structured, ids)
    reply = parsed(tok, parser, "calc", ids)
    assert [c["function"]["name"] for c in reply.tool_calls] == ["calc"]
    assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == ARGS
    for bad in MALFORMED[family]:
        assert not accepts(grammars, structured, tok.encode(bad)), bad


@pytest.mark.parametrize("family", list(WELL_FORMED))
def test_any_tool_the_grammar_names_then_its_arguments(family: str) -> None:
    tok, parser = view(family), TOOL_PARSERS[family]
    grammars, structured = constraint(tok, parser, None)
    for name, ok in (("calc", True), ("calculate", True), ("nope", False), ("cal", False)):
        ids = tok.encode(name + parser.between + WELL_FORMED[family])
        assert accepts(grammars, structured, ids) == ok, name
    # A tool without parameters takes any object.
    grammars, structured = constraint(tok, parser, "noop")
    for args in ("{}", '{"a": [1]}'):
        text = WELL_FORMED[family].replace('{"expr": "6*7", "n": 3}', args)
        if family == "qwen3_coder":
            text = "</function>\n</tool_call>"
        assert accepts(grammars, structured, tok.encode(text)), text


def random_reply(grammars: Grammars, structured: str, rng: random.Random, budget: int) -> list[int]:
    """Tokens drawn uniformly among those the grammar allows until it is complete (a sampler's
    view; the sampler then draws the stop token, the only one allowed)."""
    matcher = grammars.matcher(structured)
    mask = grammars.new_bitmask(1)
    ids: list[int] = []
    while not matcher.is_stopped() and len(ids) < budget:
        grammars.fill(matcher, mask, 0)
        choices = allowed(mask[0], grammars.vocab_size).nonzero().flatten().tolist()
        token = rng.choice(choices)
        ids.append(token)
        assert matcher.consume_token(token)
    assert matcher.is_accepting(), "the grammar did not complete within the budget"
    return ids


@pytest.mark.parametrize("family", list(WELL_FORMED))
@pytest.mark.parametrize("name", ["calc", None])
def test_whatever_the_grammar_allows_parses_into_one_valid_call(
    family: str, name: str | None
) -> None:
    tok, parser = view(family), TOOL_PARSERS[family]
    grammars, structured = constraint(tok, parser, name, BOUNDED)
    rng = random.Random(0)
    schemas = tool_schemas(BOUNDED)
    for _ in range(20):
        ids = random_reply(grammars, structured, rng, budget=400)
        reply = parsed(tok, parser, name, ids, BOUNDED)
        [call] = reply.tool_calls
        assert not reply.errors and (name is None or call["function"]["name"] == name)
        fn = call["function"]
        jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])


def test_a_hugging_face_bpe_tokenizer_writes_the_closing_as_its_single_token(
    tmp_path: Path,
) -> None:
    """The tiny Qwen tokenizer (BPE, read from its tokenizer.json): `</tool_call>` is one plain
    token, which the grammar's literal accepts, as it accepts the call's arguments as merged."""
    from transformers import AutoTokenizer

    from rllm_async.backends.hf_tokenizer import HFTokenizer
    from rllm_async.models.tiny_qwen import build_tokenizer

    build_tokenizer(tmp_path)
    tok = HFTokenizer(AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True))
    parser = TOOL_PARSERS["hermes"]
    grammars, structured = constraint(tok, parser, "calc")
    ids = tok.encode(WELL_FORMED["hermes"])
    assert tok.encode("</tool_call>") == [ids[-1]]
    assert accepts(grammars, structured, ids)
    reply = parsed(tok, parser, "calc", ids)
    assert [json.loads(c["function"]["arguments"]) for c in reply.tool_calls] == [ARGS]
    assert not accepts(grammars, structured, tok.encode('{"expr": 6}}</tool_call>'))
