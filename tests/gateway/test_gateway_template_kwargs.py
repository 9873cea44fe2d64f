"""Chat-template keyword arguments (`reasoning_effort`, `chat_template_kwargs`) reach a real
Hugging Face tokenizer's Jinja template, directly and through the gateway."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai
import pytest

from rllm_async.backends.hf_tokenizer import HFTokenizer
from rllm_async.backends.toy_tokenizers import ByteTokenizer, CharTokenizer
from tests.gateway.test_gateway import KEY, serving
from tests.scripted import ScriptedPolicy, context

# Shows the two variables the template reads, as Qwen3's reads `enable_thinking`.
MARKER = (
    "[think={{ enable_thinking | default(true) }} effort={{ reasoning_effort | default('-') }}]"
)


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    """The tiny Qwen3 tokenizer (built offline) with the marker before its ChatML template."""
    from transformers import AutoTokenizer

    from rllm_async.models.tiny_qwen import CHAT_TEMPLATE, build_tokenizer

    out = Path(tmp_path_factory.mktemp("tiny-qwen-tok"))
    build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    tok.chat_template = MARKER + CHAT_TEMPLATE
    return HFTokenizer(tok)


class HFScriptedPolicy(ScriptedPolicy):
    """A scripted policy on a Hugging Face tokenizer."""

    def __init__(self, tok: HFTokenizer) -> None:
        super().__init__(lambda prompt: "ok")
        self.hf = tok
        self.tok = tok  # type: ignore[assignment]

    def text(self, ids: Sequence[int]) -> str:
        return self.hf.decode(ids)


def test_the_hf_tokenizer_passes_template_kwargs_to_jinja(qwen_tokenizer: HFTokenizer) -> None:
    chat = [{"role": "user", "content": "what is 1 plus 2?"}]
    plain = qwen_tokenizer.decode(qwen_tokenizer.apply_chat_template(chat))
    assert plain.startswith("[think=True effort=-]")
    ids = qwen_tokenizer.apply_chat_template(chat, enable_thinking=False, reasoning_effort="low")
    assert qwen_tokenizer.decode(ids).startswith("[think=False effort=low]")
    assert qwen_tokenizer.decode(ids).endswith(plain.removeprefix("[think=True effort=-]"))


def test_the_toy_tokenizers_take_template_kwargs_and_read_none() -> None:
    chat = [{"role": "user", "content": "q"}]
    for tok in (CharTokenizer(), ByteTokenizer()):
        assert tok.apply_chat_template(chat, enable_thinking=False) == tok.apply_chat_template(chat)


def test_the_gateway_renders_hf_templates_with_the_requests_kwargs(
    qwen_tokenizer: HFTokenizer,
) -> None:
    policy = HFScriptedPolicy(qwen_tokenizer)

    async def go() -> None:
        async with serving(policy) as gateway:
            session = gateway.session(context(policy))
            client = openai.AsyncOpenAI(base_url=gateway.session_url(session.id), api_key=KEY)
            messages: list[Any] = [{"role": "user", "content": "what is 1 plus 2?"}]
            options: dict[str, Any] = {
                "reasoning_effort": "high",
                "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
            }
            r = await client.chat.completions.create(model="policy", messages=messages, **options)
            assert r.choices[0].message.content == "ok"
            messages += [r.choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "user", "content": "and 2 plus 3?"}]
            await client.chat.completions.create(model="policy", messages=messages, **options)
            first, second = session.ctx.trajectory().steps
            assert policy.text(first.prompt_ids).startswith("[think=False effort=high]")
            assert second.info["extended"]
            assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
            # Without them, the template's defaults.
            plain = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}]
            )
            assert plain.choices[0].message.content == "ok"
            third = session.ctx.trajectory().steps[2]
            assert policy.text(third.prompt_ids).startswith("[think=True effort=-]")

    asyncio.run(go())
