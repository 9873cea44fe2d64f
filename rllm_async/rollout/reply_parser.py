"""What a reply says: its text, its reasoning and its tool calls, read in the policy's model family.

The family comes from the checkpoint (the tokenizer's `model_type` and its chat template's
markers) unless config names it (`rollout.tool_parser`, `rollout.reasoning_parser`). A tokenizer
that ships its own response parser (transformers' `parse_response`, from a `response_template`)
reads the reply first; when it finds nothing well-formed to return, the family's parser reads it.
Reasoning leaves `content` for `reasoning` only: the recorded tokens keep it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from rllm_async.protocols import Tokenizer
from rllm_async.rollout.chat import cut_at_stop
from rllm_async.rollout.tool_calls import (
    ParsedReply,
    Tools,
    checked_call,
    openai_call,
    tool_schemas,
)
from rllm_async.rollout.tool_parsers import TOOL_PARSERS, ToolParser

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Each reasoning parser's block markers: Qwen3/DeepSeek `<think>`, Mistral's Magistral `[THINK]`.
REASONING_MARKERS: dict[str, tuple[str, str]] = {
    "think": (THINK_OPEN, THINK_CLOSE),
    "mistral_think": ("[THINK]", "[/THINK]"),
}
REASONING_PARSERS = (*REASONING_MARKERS, "none")

# (tool parser, model_type values, chat-template markers), most specific markers first.
_FAMILIES: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("harmony", ("gpt_oss",), ("<|channel|>",)),
    ("deepseek_v3", ("deepseek_v3", "deepseek_v32"), ("tool▁calls▁begin",)),
    ("qwen3_coder", ("qwen3_5", "qwen3_5_moe"), ("<function=",)),
    ("mistral", ("mistral", "mistral3", "mixtral", "ministral"), ("[TOOL_CALLS]",)),
    ("llama3_json", ("llama",), ("<|python_tag|>", "ipython")),
    ("hermes", ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next"), ("<tool_call>",)),
)


def detect_family(tok: Tokenizer) -> tuple[str, str]:
    """The tool and reasoning parsers of a tokenizer's checkpoint: a chat-template marker, else
    its `model_type`; `hermes` without reasoning when neither says."""
    model_type = getattr(tok, "model_type", None)
    template = getattr(tok, "chat_template", None)
    template = template if isinstance(template, str) else ""
    tool = next((name for name, _, marks in _FAMILIES if any(m in template for m in marks)), None)
    tool = tool or next((name for name, types, _ in _FAMILIES if model_type in types), "hermes")
    if tool == "harmony":  # its reasoning is a channel, which its tool parser reads
        return tool, "none"
    closes = (name for name, (_, close) in REASONING_MARKERS.items() if close in template)
    return tool, next(closes, "none")


@dataclass(frozen=True, slots=True)
class ReplyParser:
    """How one tokenizer's replies are read: the family's tool parser, and the markers of its
    reasoning block (None: no reasoning is split out)."""

    tool: ToolParser
    reasoning: tuple[str, str] | None
    markers: dict[int, str]  # token id -> text of each special token a parser reads

    def read(
        self,
        tok: Tokenizer,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        *,
        prefix: str = "",
        stop: Sequence[str] | str = (),
        tools: Sequence[dict[str, Any]] | None = None,
        id_prefix: str = "call",
    ) -> ParsedReply:
        """The reply of `completion_ids` (after the forced `prefix`), cut at `stop`; with `tools`,
        its calls to them. Never raises on what the model wrote."""
        text = prefix + cut_at_stop(self.decode(tok, completion_ids), stop)
        schemas = tool_schemas(tools)
        native = getattr(tok, "parse_response", None)
        if native is not None and (tools or self.reasoning):
            with contextlib.suppress(Exception):  # a tokenizer's own parser may raise on anything
                parsed = _from_native(native(text, prompt_ids, tools), schemas, id_prefix)
                if parsed is not None:
                    return parsed
        reasoning = None
        if self.reasoning is not None:
            opened = self.decode(tok, prompt_ids[-16:]).rstrip().endswith(self.reasoning[0])
            reasoning, text = split_reasoning(text, opened=opened, markers=self.reasoning)
        if not (tools or self.tool.structured):
            return ParsedReply(text, reasoning=reasoning)
        parsed = self.tool.parse(text, schemas, id_prefix=id_prefix)
        parsed.reasoning = parsed.reasoning if reasoning is None else reasoning
        return parsed

    def decode(self, tok: Tokenizer, ids: Sequence[int]) -> str:
        """`ids` as text, keeping the special tokens the parsers read (`[TOOL_CALLS]`, ...)."""
        if not any(i in self.markers for i in ids):
            return tok.decode(ids)
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self.markers:
                parts += [tok.decode(run), self.markers[i]]
                run = []
            else:
                run.append(i)
        return "".join([*parts, tok.decode(run)])


def reply_parser(
    tok: Tokenizer, tool_parser: str = "auto", reasoning_parser: str = "auto"
) -> ReplyParser:
    """The reply parser of `tok`'s policy; `auto` detects the family from the checkpoint."""
    return _reply_parser(cast(Hashable, tok), tool_parser, reasoning_parser)


@functools.lru_cache(maxsize=16)
def _reply_parser(tok: Any, tool_parser: str, reasoning_parser: str) -> ReplyParser:
    tool_name, reasoning_name = detect_family(tok)
    tool = TOOL_PARSERS[tool_name if tool_parser == "auto" else tool_parser]
    reasoning = REASONING_MARKERS.get(
        reasoning_name if reasoning_parser == "auto" else reasoning_parser
    )
    markers: dict[int, str] = {}
    for text in (*tool.markers, *(reasoning or ())):
        ids = tok.encode(text)
        if len(ids) == 1:
            markers[ids[0]] = text
    return ReplyParser(tool, reasoning, markers)


def split_reasoning(
    text: str, *, opened: bool, markers: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)
) -> tuple[str | None, str]:
    """`(reasoning, content)` of a reply with a reasoning block between `markers`; `opened` when
    the prompt opened it. A block cut before its closing marker is all reasoning."""
    open_, close = markers
    before = ""
    if not opened:
        start = text.find(open_)
        if start < 0:
            return None, text
        before, text = text[:start], text[start + len(open_) :]
    end = text.find(close)
    if end < 0:
        return text.strip(), before
    return text[:end].strip(), before + text[end + len(close) :].lstrip()


def _from_native(message: Any, tools: Tools, id_prefix: str) -> ParsedReply | None:
    """A tokenizer's parsed message as a ParsedReply; None when it has a call we would refuse."""
    if not isinstance(message, dict):
        return None
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call) if isinstance(call, dict) else {}
        checked = checked_call(fn.get("name"), fn.get("arguments"), tools)
        if isinstance(checked, str):
            return None
        calls.append(openai_call(*checked, id_prefix=id_prefix))
    content = message.get("content")
    reasoning = message.get("reasoning_content")
    return ParsedReply(
        content if isinstance(content, str) else "",
        calls,
        reasoning=reasoning if isinstance(reasoning, str) else None,
    )
