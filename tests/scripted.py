"""Policies for chat tests: one that replies with scripted text, and one that records what a real
policy was asked and produced (to compare with what the workflow or the gateway recorded)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from rllm_async.backends.toy_tokenizers import CharTokenizer
from rllm_async.protocols import Completion, PolicyClient, SamplingParams, Tokenizer
from rllm_async.rollout import Pause, RolloutContext


class ScriptedPolicy:
    """Replies `reply(prompt)` (ending with the EOS) on the character tokenizer; the prompt is
    shown with its special tokens (`<|tool|>42<|end|>`)."""

    def __init__(
        self,
        reply: Callable[[str], str],
        *,
        max_context_tokens: int = 4096,
        delay_s: float = 0.0,
    ) -> None:
        self.tok = CharTokenizer()
        self.reply = reply
        self.max_context_tokens = max_context_tokens
        self.delay_s = delay_s
        self.version = 0
        self.calls: list[tuple[list[int], list[int]]] = []

    @property
    def tokenizer(self) -> Tokenizer:
        return self.tok

    def text(self, ids: list[int]) -> str:
        """Tokens as text, special tokens included."""
        return "".join(self.tok.vocab[i] for i in ids)

    def acquire(self) -> int:
        return self.version

    def release(self, version: int) -> None:
        return None

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, version: int | None = None
    ) -> Completion:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        text = self.reply(self.text(prompt_ids))
        ids = self.tok.encode(text)[: params.max_tokens]
        finish = "length" if len(ids) == params.max_tokens else "stop"
        if finish == "stop":
            ids.append(self.tok.eos_token_id)
        self.calls.append((list(prompt_ids), ids))
        v = self.version if version is None else version
        return Completion(ids, [-0.5] * len(ids), [v] * len(ids), finish)


class RecordingPolicy:
    """Wraps a policy and keeps every (prompt, completion) it was asked for and produced."""

    def __init__(self, inner: PolicyClient) -> None:
        self.inner = inner
        self.calls: list[tuple[list[int], Completion]] = []
        self.max_context_tokens = getattr(inner, "max_context_tokens", None)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.inner.tokenizer

    def acquire(self) -> int:
        return self.inner.acquire()

    def release(self, version: int) -> None:
        self.inner.release(version)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, version: int | None = None
    ) -> Completion:
        out = await self.inner.generate(prompt_ids, params, version=version)
        self.calls.append((list(prompt_ids), out))
        return out


def context(
    policy: Any,
    *,
    deadline: float = 1e9,
    pause: Pause | None = None,
    **sampling: Any,
) -> RolloutContext:
    """A RolloutContext on `policy`, its calls waiting out `pause` (by default never on)."""
    return RolloutContext(
        policy,
        sampling=SamplingParams(**{"max_tokens": 128, **sampling}),
        pin=True,
        pause=pause,
        deadline=deadline,
        task_id="t",
    )
