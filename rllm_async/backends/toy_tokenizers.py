"""Tokenizers that need no files: characters for the built-in models, bytes for the simulator."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SPECIALS = ("<pad>", "<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))
ROLES = ("system", "user", "assistant", "tool")


class CharTokenizer:
    """One id per printable ASCII character; roles and end-of-turn are single special ids.

    Chat format: `<|user|>text<|end|><|assistant|>`; a reply ends with `<|end|>` (the EOS), so
    the rendered history of turn k+1 extends the exact tokens of turn k plus its completion. An
    assistant turn's tool calls follow its text as `<tool_call>{"name": ..., "arguments": ...}
    </tool_call>` blocks (see `rllm_async.rollout.tool_calls`).
    """

    def __init__(self) -> None:
        self.vocab: list[str] = [*SPECIALS, *CHARS]
        self._ids = {tok: i for i, tok in enumerate(self.vocab)}
        self.unk_token_id = self._ids["<unk>"]
        self.eos_token_id = self._ids["<|end|>"]
        self.eos_token_ids: tuple[int, ...] = (self.eos_token_id,)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        """Characters to ids; characters outside printable ASCII become `<unk>`."""
        return [self._ids.get(ch, self.unk_token_id) for ch in text]

    @property
    def special_ids(self) -> range:
        return range(len(SPECIALS))

    def token_bytes(self) -> list[bytes]:
        """Each id's text as bytes (the grammar engine's view of the vocabulary)."""
        return [token.encode() for token in self.vocab]

    def decode(self, ids: Sequence[int]) -> str:
        """Ids to text, skipping special tokens (so a reply decodes without its `<|end|>`)."""
        n = len(SPECIALS)
        return "".join(self.vocab[i] for i in ids if n <= i < len(self.vocab))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render a chat; `tools` become a system turn listing their JSON schemas. The template
        reads no variables: `template_kwargs` change nothing (as in a Jinja template that does not
        name them)."""
        turns = list(messages)
        if tools:
            turns.insert(0, {"role": "system", "content": "Tools: " + json.dumps(tools)})
        ids: list[int] = []
        for msg in turns:
            role = msg.get("role")
            if role not in ROLES:
                raise ValueError(f"unknown chat role {role!r}: use one of {', '.join(ROLES)}")
            ids.append(self._ids[f"<|{role}|>"])
            ids.extend(self.encode(_text(msg.get("content")) + _tool_calls(msg.get("tool_calls"))))
            ids.append(self.eos_token_id)
        if add_generation_prompt:
            ids.append(self._ids["<|assistant|>"])
        return ids


# `CharTokenizer.apply_chat_template` as a Jinja chat template, for the Hugging Face form of the
# tokenizer (`char_hf_tokenizer`): the same ids for the same chat, tools and tool calls included.
CHAR_CHAT_TEMPLATE = (
    "{%- set turns = messages %}"
    "{%- if tools %}{%- set turns = [{'role': 'system', 'content': 'Tools: ' + (tools | tojson)}]"
    " + messages %}{%- endif %}"
    "{%- for m in turns %}"
    "{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown chat role ' + m.role | string"
    " + ': use one of system, user, assistant, tool') }}"
    "{%- endif %}"
    "{{- '<|' + m.role + '|>' }}"
    "{%- if m.content is string %}{{- m.content }}"
    "{%- elif m.content is iterable %}{%- for p in m.content %}"
    "{%- if p is mapping %}{{- p.text | default('') | string }}{%- endif %}{%- endfor %}"
    "{%- elif m.content %}{{- m.content | string }}{%- endif %}"
    "{%- for call in m.tool_calls or [] %}{%- set f = call.function or call %}"
    "{{- '<tool_call>{\"name\": ' + (f.name | tojson) + ', \"arguments\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}"
    "{%- else %}{{- (f.arguments if f.arguments is defined else {}) | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)


def char_hf_tokenizer() -> PreTrainedTokenizerFast:
    """`CharTokenizer` as a Hugging Face tokenizer (a `tokenizers` word-level model over single
    characters, same ids, same chat template), so that a model trained with it exports.

    One difference: text that spells a special token (`<|end|>`) encodes as that token here, as
    characters in `CharTokenizer`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = CharTokenizer()
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(chars.vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|end|>",
        chat_template=CHAR_CHAT_TEMPLATE,
    )


def _text(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def _tool_calls(calls: Any) -> str:
    """Tool calls as the model writes them; arguments given as a JSON string are kept verbatim."""
    out = []
    for call in calls or ():
        fn = call.get("function", call) if isinstance(call, dict) else {}
        arguments = fn.get("arguments", {})
        args = arguments if isinstance(arguments, str) else json.dumps(arguments)
        out.append(
            f'<tool_call>{{"name": {json.dumps(fn.get("name"))}, "arguments": {args}}}</tool_call>'
        )
    return "".join(out)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255 plus an end-of-sequence id: enough for a model-free policy."""

    eos_token_id = 256
    special_ids = (256,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes (the grammar engine's view of the vocabulary)."""
        return [bytes([i]) for i in range(256)] + [b"<eos>"]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode(errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """A plain rendering that reads no template variables (`template_kwargs` change nothing)."""
        text = f"<tools>{json.dumps(tools)}\n" if tools else ""
        text += "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))
