"""A Hugging Face tokenizer behind the `Tokenizer` protocol, for every backend that loads one."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rllm_async.config import ConfigError


class HFTokenizer:
    """Adapts a `transformers` tokenizer to the `Tokenizer` protocol."""

    def __init__(self, tok: Any, *, model_type: str | None = None) -> None:
        self._tok = tok
        # What the reply parser detects the model family from (`rollout.reply_parser`).
        self.model_type = model_type
        template = getattr(tok, "chat_template", None)
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.eos_token_id: int = int(tok.eos_token_id)
        # The eos as text: a sampler stopping at strings needs it among them (see TinkerPolicy).
        self.eos_token: str = str(tok.eos_token)

    @property
    def vocab_size(self) -> int:
        """Token ids are below this (the gateway checks token-id prompts against it)."""
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def tokenizer_json(self) -> str:
        """The fast tokenizer as `tokenizer.json` text, added tokens included (what the grammar
        engine reads each token's bytes from: `rllm_async.grammar`)."""
        backend = copy.copy(self._tok.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return str(backend.to_str())

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """`template_kwargs` go to the Jinja template as variables (`transformers` passes them on)."""
        # return_dict=False: transformers 5 returns a BatchEncoding by default, 4.x a list.
        ids = self._tok.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **template_kwargs,
        )
        return [int(i) for i in ids]

    def parse_response(
        self, text: str, prompt_ids: Sequence[int], tools: list[dict[str, Any]] | None
    ) -> dict[str, Any] | None:
        """The reply as a message, parsed by the checkpoint's own `response_template` (transformers'
        `parse_response`); None when the tokenizer ships none."""
        if getattr(self._tok, "response_template", None) is None:
            return None
        prefix = self._tok.decode(list(prompt_ids), skip_special_tokens=False)
        return dict(self._tok.parse_response(text, prefix=prefix, tools=tools))


def load_tokenizer(
    source: str | Path, *, setting: str, require_chat_template: bool = False
) -> HFTokenizer:
    """The tokenizer in directory `source` (read offline, never the hub), else hub model `source`.

    `setting` is the config key the errors tell the user to change. `require_chat_template`
    refuses a tokenizer without one at load time rather than at the first chat of a rollout.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(
            f"{setting} needs the `transformers` package: pip install transformers"
        ) from e
    local = Path(source).expanduser()
    try:
        tok: Any = (
            AutoTokenizer.from_pretrained(str(local), local_files_only=True)
            if local.is_dir()
            else AutoTokenizer.from_pretrained(str(source))
        )
    except (OSError, ValueError) as e:
        fix = (
            f"{setting} must be a directory holding tokenizer.json"
            if local.is_dir()
            else f"set {setting} to a local directory holding tokenizer.json (or to a Hugging "
            "Face model name)"
        )
        raise ConfigError(f"cannot load the tokenizer '{source}' ({e}): {fix}") from None
    if require_chat_template and not getattr(tok, "chat_template", None):
        raise ConfigError(
            f"the tokenizer '{source}' has no chat template: set {setting} to an instruct model"
        )
    if tok.eos_token_id is None:
        raise ConfigError(
            f"the tokenizer '{source}' defines no eos token: set {setting} to one that does"
        )
    return HFTokenizer(tok, model_type=_model_type(local / "config.json"))


def _model_type(config_json: Path) -> str | None:
    """`model_type` from a checkpoint's config.json, when there is one beside the tokenizer."""
    try:
        value = json.loads(config_json.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
