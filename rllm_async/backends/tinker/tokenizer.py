"""The policy's tokenizer, loaded with `transformers` (a dependency of the tinker SDK)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rllm_async.config import ConfigError


class HFTokenizer:
    """Adapts a Hugging Face tokenizer to the `Tokenizer` protocol."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.eos_token_id: int = tok.eos_token_id
        self.eos_token: str = tok.eos_token

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        ids = self._tok.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        return [int(i) for i in ids]


def load_tokenizer(name_or_path: str) -> HFTokenizer:
    """From a local directory (never the hub), or else by hub name."""
    from transformers import AutoTokenizer

    local = Path(name_or_path).expanduser()
    try:
        if local.is_dir():
            tok = AutoTokenizer.from_pretrained(str(local), local_files_only=True)
        else:
            tok = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cannot load the tokenizer '{name_or_path}' ({e}): set backend.tokenizer to a local "
            "directory holding tokenizer.json (or to a Hugging Face model name)"
        ) from None
    if tok.eos_token_id is None:
        raise ConfigError(
            f"the tokenizer '{name_or_path}' has no eos token: set backend.tokenizer to one that has"
        )
    return HFTokenizer(tok)
