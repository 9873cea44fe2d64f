"""Token-in/token-out of a tool conversation on the vLLM engine, under a reasoning template that
re-renders history (the Qwen3-like row of tests/rollout/test_tool_call_families.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rllm_async.backends.hf_tokenizer import HFTokenizer
from rllm_async.engines.vllm import VLLMPolicy, VLLMServer
from rllm_async.protocols import SamplingParams
from rllm_async.rollout import RolloutContext
from rllm_async.rollout.tool_parsers import HermesParser
from tests.rollout.test_tool_call_families import CALC, HERMES_CALL, chatml
from tests.scripted import RecordingPolicy


def test_tool_turns_on_vllm_extend_the_sampled_tokens(
    servers: list[VLLMServer], tiny_qwen: Path
) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_qwen))
    hf.chat_template = chatml(HERMES_CALL, think=True)
    engine = VLLMPolicy([servers[0].url], HFTokenizer(hf), max_context_tokens=1024)
    policy = RecordingPolicy(engine)

    ctx = RolloutContext(
        policy,
        sampling=SamplingParams(max_tokens=16, temperature=1.0),
        pin=False,
        deadline=float("inf"),
        task_id="t",
    )

    async def go() -> None:
        async with engine:
            messages: list[dict[str, Any]] = [{"role": "user", "content": "what is 6 times 7?"}]
            # The random model completes a forced call (the opening is prompt, not trained).
            first = await ctx.chat_turn(
                messages, tools=[CALC], prefix=HermesParser().forced_prefix("calc")
            )
            messages += [first.message, {"role": "tool", "tool_call_id": "c", "content": "42"}]
            second = await ctx.chat_turn(messages, tools=[CALC])
            messages += [second.message, {"role": "user", "content": "thanks"}]
            third = await ctx.chat_turn(messages, tools=[CALC])
            assert second.extended and third.extended

    asyncio.run(go())
    calls = [(prompt, out.ids) for prompt, out in policy.calls]
    assert [(s.prompt_ids, s.completion_ids) for s in ctx.trajectory().steps] == calls
    [seq] = ctx.trajectory().sequences()
    assert seq.tokens == calls[-1][0] + calls[-1][1]  # one sequence: what vLLM saw and sampled
    trained = [t for t, m in zip(seq.tokens, seq.loss_mask, strict=True) if m]
    assert trained == [t for _, ids in calls for t in ids]
    logprobs = [lp for lp, m in zip(seq.logprobs, seq.loss_mask, strict=True) if m]
    assert logprobs == [lp for _, out in policy.calls for lp in out.logprobs]
