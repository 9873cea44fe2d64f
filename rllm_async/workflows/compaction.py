"""When the built-in multi-turn workflows compact a conversation, and how (`RolloutContext.compact`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rllm_async.rollout import RolloutContext


@dataclass(frozen=True, slots=True)
class Compaction:
    """Compact a conversation whose next prompt would have more than `budget_tokens` tokens."""

    budget_tokens: int
    prompt: str
    max_tokens: int | None
    summary_template: str

    @classmethod
    def of(
        cls,
        budget_tokens: int | None,
        prompt: str,
        max_tokens: int | None,
        summary_template: str,
    ) -> Compaction | None:
        """The workflow args' compaction, or None when `budget_tokens` (`compact_at`) is unset."""
        if budget_tokens is None:
            return None
        if budget_tokens < 1:
            raise ValueError("compact_at must be a positive number of tokens")
        if "{summary}" not in summary_template:
            raise ValueError("summary_template must contain {summary}")
        return cls(budget_tokens, prompt, max_tokens, summary_template)

    async def apply(
        self,
        ctx: RolloutContext,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """`messages`, or (the same list no longer) the conversation to go on from."""
        sampling: dict[str, Any] = {}
        if self.max_tokens is not None:
            sampling["max_tokens"] = self.max_tokens
        return await ctx.compact(
            messages,
            budget_tokens=self.budget_tokens,
            tools=tools,
            prompt=self.prompt,
            summary_template=self.summary_template,
            **sampling,
        )
