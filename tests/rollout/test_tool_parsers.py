"""Each family's tool-call syntax, reasoning, and the family's detection from the checkpoint."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rllm_async.backends.toy_tokenizers import CharTokenizer
from rllm_async.rollout.reply_parser import (
    REASONING_PARSERS,
    detect_family,
    reply_parser,
    split_reasoning,
)
from rllm_async.rollout.tool_parsers import TOOL_PARSERS

TOOLS = {
    "calc": {"type": "object", "properties": {"expr": {"type": "string"}}},
    "add": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
}
D = TOOL_PARSERS["deepseek_v3"]
CALLS = {
    "hermes": 'ok <tool_call>{"name": "calc", "arguments": {"expr": "3*4"}}</tool_call>'
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
    "llama3_json": 'ok <|python_tag|>{"name": "calc", "parameters": {"expr": "3*4"}}; '
    '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    "mistral": 'ok [TOOL_CALLS][{"name": "calc", "arguments": {"expr": "3*4"}}, '
    '{"name": "add", "arguments": {"a": 1, "b": 2}}]',
    "qwen3_coder": "ok <tool_call>\n<function=calc>\n<parameter=expr>\n3*4\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
    "<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>",
    "deepseek_v3": f"ok {D.BEGIN}{D.CALL}function{D.SEP}calc\n```json\n"  # type: ignore[attr-defined]
    f'{{"expr": "3*4"}}\n```{D.CALL_END}{D.CALL}add{D.SEP}{{"a": 1, "b": 2}}'  # type: ignore[attr-defined]
    f"{D.CALL_END}{D.END}",  # type: ignore[attr-defined]
    "harmony": "<|channel|>analysis<|message|>use tools<|end|><|start|>assistant<|channel|>final"
    "<|message|>ok<|end|><|start|>assistant<|channel|>commentary to=functions.calc <|constrain|>json"
    '<|message|>{"expr": "3*4"}<|call|><|start|>assistant to=functions.add<|channel|>commentary '
    'json<|message|>{"a": 1, "b": 2}<|call|>',
}


@pytest.mark.parametrize("family", sorted(CALLS))
def test_each_family_reads_its_calls_into_openai_tool_calls(family: str) -> None:
    parsed = TOOL_PARSERS[family].parse(CALLS[family], TOOLS, id_prefix="c")
    assert parsed.errors == [] and parsed.content == "ok"
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls
    ]
    assert calls == [("calc", {"expr": "3*4"}), ("add", {"a": 1, "b": 2})]
    assert all(c["id"].startswith("c_") and c["type"] == "function" for c in parsed.tool_calls)


def test_mistral_v11_names_each_call_before_its_arguments() -> None:
    text = '[TOOL_CALLS]calc[ARGS]{"expr": "1"}[TOOL_CALLS]add[ARGS] {"a": 1, "b": 2}'
    parsed = TOOL_PARSERS["mistral"].parse(text, TOOLS)
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["calc", "add"]


@pytest.mark.parametrize(
    ("family", "text", "error"),
    [
        ("hermes", '<tool_call>{"name": "calc"', "unterminated"),
        ("hermes", "<tool_call>__import__('os').system('x')</tool_call>", "not valid JSON"),
        ("llama3_json", '{"name": "calc", "parameters": {"expr": ', "not valid JSON"),
        ("llama3_json", '<|python_tag|>{"name": "rm", "parameters": {}}', "unknown tool 'rm'"),
        ("mistral", '[TOOL_CALLS][{"name": "calc", "arguments": [1]}]', "must be a JSON object"),
        ("mistral", "[TOOL_CALLS]calc[ARGS]{oops", "not valid JSON"),
        ("qwen3_coder", "<tool_call><function=calc>x</tool_call>", "<function=name>"),
        ("qwen3_coder", "<tool_call>\n<function=rm>\n</function>\n</tool_call>", "unknown tool"),
        ("deepseek_v3", f"{D.BEGIN}{D.CALL}calc{D.SEP}{{x{D.CALL_END}{D.END}", "not valid JSON"),  # type: ignore[attr-defined]
        ("deepseek_v3", f"{D.BEGIN}{D.CALL}calc", "unterminated"),  # type: ignore[attr-defined]
        ("harmony", "<|channel|>commentary to=functions.calc<|message|>{x<|call|>", "not valid"),
    ],
)
def test_malformed_calls_stay_in_the_text_with_an_error(family: str, text: str, error: str) -> None:
    parsed = TOOL_PARSERS[family].parse(text, TOOLS)
    assert parsed.tool_calls == []
    assert len(parsed.errors) == 1 and error in parsed.errors[0]
    assert parsed.content.strip() and parsed.content in text  # the block stays visible


def test_plain_json_is_content_for_llama_unless_it_opens_a_call() -> None:
    parser = TOOL_PARSERS["llama3_json"]
    assert parser.parse('{"answer": 42}', TOOLS).content == '{"answer": 42}'
    assert parser.parse("The answer is 4.", TOOLS).errors == []


def test_qwen3_coder_types_parameters_by_their_schema() -> None:
    text = "<tool_call>\n<function=calc>\n<parameter=expr>\n12\n</parameter>\n</function>\n</tool_call>"
    [call] = TOOL_PARSERS["qwen3_coder"].parse(text, TOOLS).tool_calls
    assert json.loads(call["function"]["arguments"]) == {"expr": "12"}  # a string stays a string


@pytest.mark.parametrize("name", [None, "calc"])
@pytest.mark.parametrize("family", sorted(CALLS))
def test_a_forced_opening_completed_by_the_model_parses(family: str, name: str | None) -> None:
    rest = {
        "hermes": '"expr": "1"}}</tool_call>',
        "llama3_json": '"expr": "1"}}',
        "mistral": '"expr": "1"}}]',
        "qwen3_coder": "<parameter=expr>\n1\n</parameter>\n</function>\n</tool_call>",
        "deepseek_v3": '{"expr": "1"}\n```' + D.CALL_END + D.END,  # type: ignore[attr-defined]
        "harmony": '{"expr": "1"}<|call|>',
    }[family]
    parser = TOOL_PARSERS[family]
    opened = parser.forced_prefix("calc")
    if name is None:  # the model writes the name itself
        opened = parser.forced_prefix(None) + opened[len(parser.forced_prefix(None)) :]
    if family in ("hermes", "llama3_json", "mistral"):
        rest = "{" + rest
    [call] = parser.parse(opened + rest, TOOLS).tool_calls
    assert call["function"]["name"] == "calc"


@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        ("<think>\nhm\n</think>\n\nHi", False, ("hm", "Hi")),
        ("hm</think>Hi", True, ("hm", "Hi")),
        ("<think>cut by max_tokens", False, ("cut by max_tokens", "")),
        ("Hi", False, (None, "Hi")),
    ],
)
def test_think_blocks_split_into_reasoning(text: str, opened: bool, expected: Any) -> None:
    assert split_reasoning(text, opened=opened) == expected


def test_mistral_think_blocks_split_into_reasoning_and_its_calls_still_parse() -> None:
    tok = Checkpoint("mistral", "[TOOL_CALLS] {{ '[THINK]' }} [/THINK]")
    parser = reply_parser(tok)
    assert parser.reasoning == ("[THINK]", "[/THINK]")
    text = "[THINK]3*4 needs the tool[/THINK]" + CALLS["mistral"]
    tools = [
        {"type": "function", "function": {"name": n, "parameters": s}} for n, s in TOOLS.items()
    ]
    reply = parser.read(tok, [], tok.encode(text), tools=tools)
    assert reply.reasoning == "3*4 needs the tool" and reply.content == "ok"
    assert [c["function"]["name"] for c in reply.tool_calls] == ["calc", "add"]
    # `<think>` means nothing to this family: it stays in the content.
    plain = parser.read(tok, [], tok.encode("<think>x</think>Hi"))
    assert plain.reasoning is None and plain.content == "<think>x</think>Hi"


class Checkpoint(CharTokenizer):
    def __init__(self, model_type: str | None = None, chat_template: str | None = None) -> None:
        super().__init__()
        self.model_type, self.chat_template = model_type, chat_template


@pytest.mark.parametrize(
    ("model_type", "template", "family"),
    [
        (None, None, ("hermes", "none")),
        ("qwen3", "<tool_call> {{ '<think>' }} </think>", ("hermes", "think")),
        ("qwen3_moe", "<tool_call>\n<function={{ name }}>", ("qwen3_coder", "none")),
        ("llama", "{{ '<|python_tag|>' }}", ("llama3_json", "none")),
        ("mistral", "", ("mistral", "none")),
        ("mistral", "[TOOL_CALLS] [/THINK]", ("mistral", "mistral_think")),
        (None, "[TOOL_CALLS]", ("mistral", "none")),
        ("deepseek_v3", "<｜tool▁calls▁begin｜> </think>", ("deepseek_v3", "think")),
        ("gpt_oss", "<|channel|>analysis", ("harmony", "none")),
    ],
)
def test_the_family_is_detected_from_the_checkpoint(
    model_type: str | None, template: str | None, family: tuple[str, str]
) -> None:
    assert detect_family(Checkpoint(model_type, template)) == family


def test_config_names_a_family_over_detection() -> None:
    tok = Checkpoint("qwen3", "<tool_call> </think>")
    parser = reply_parser(tok, "llama3_json", "none")
    assert parser.tool.name == "llama3_json" and parser.reasoning is None


def test_the_tokenizers_own_parser_is_used_and_its_refused_calls_fall_back() -> None:
    class Native(CharTokenizer):
        def parse_response(self, text: str, prompt_ids: Any, tools: Any) -> dict[str, Any]:
            name = "calc" if "good" in text else "rm"
            call = {"type": "function", "function": {"name": name, "arguments": {"expr": "1"}}}
            return {"role": "assistant", "content": "native", "tool_calls": [call]}

    tok = Native()
    parser = reply_parser(tok)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": TOOLS["calc"]}}]
    good = parser.read(tok, [], tok.encode("good"), tools=tools)
    assert good.content == "native" and good.tool_calls[0]["function"]["name"] == "calc"
    bad = parser.read(tok, [], tok.encode("bad"), tools=tools)  # our parser reads it instead
    assert bad.content == "bad" and bad.tool_calls == []


def test_the_config_names_every_parser() -> None:
    from typing import get_args

    from rllm_async.config import RolloutConfig

    fields = RolloutConfig.model_fields
    assert set(get_args(fields["tool_parser"].annotation)) == {"auto", *TOOL_PARSERS}
    assert set(get_args(fields["reasoning_parser"].annotation)) == {"auto", *REASONING_PARSERS}


def test_llama_text_after_its_calls_stays_content() -> None:
    text = '{"name": "calc", "parameters": {"expr": "1"}} I will wait.'
    parsed = TOOL_PARSERS["llama3_json"].parse(text, TOOLS)
    assert parsed.errors == [] and parsed.content == "I will wait."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["calc"]
