"""Context compaction: past a token budget the policy summarizes the conversation, the summary is
a trained step, and the conversation before and after are separate exact token sequences."""

from __future__ import annotations

import asyncio
from typing import Any

from rllm_async.rollout.chat import render, template_messages
from rllm_async.types import Episode, TrajectoryGroup
from rllm_async.workflows import EnvWorkflow, MultiTurnWorkflow
from tests.scripted import RecordingPolicy, ScriptedPolicy, context

SUMMARIZE = "the summary only"  # the end of the summary request (COMPACT_PROMPT)


def _conversation() -> list[dict[str, Any]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count"}]


def test_compaction_summarizes_past_the_budget_and_each_side_is_exact() -> None:
    policy = RecordingPolicy(
        ScriptedPolicy(lambda p: "SUMMARY" if SUMMARIZE in p[-60:] else "12345")
    )
    ctx = context(policy)
    tok = policy.tokenizer

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        msgs = _conversation()
        for i in range(3):
            reply = await ctx.chat(msgs)
            msgs += [reply, {"role": "user", "content": f"again {i}"}]
        same = await ctx.compact(msgs, budget_tokens=10_000)
        assert same is msgs and len(policy.calls) == 3  # under the budget: nothing asked
        after = await ctx.compact(msgs, budget_tokens=40, max_tokens=16)
        await ctx.chat(after)
        return msgs, after

    _, after = asyncio.run(go())
    assert after == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "count"},
        {"role": "user", "content": "A summary of the conversation so far:\nSUMMARY"},
    ]
    steps = ctx.trajectory().steps
    assert len(steps) == 5
    summary, resumed = steps[3], steps[4]
    assert summary.info["compaction"]["budget"] == 40
    assert summary.info["extended"]  # the request extends the conversation's exact tokens
    prev = steps[2]
    assert summary.prompt_ids[: len(prev.prompt_ids) + len(prev.completion_ids)] == (
        prev.prompt_ids + prev.completion_ids
    )
    # After: a fresh rendering of the opening turns and the summary, not an extension.
    assert not resumed.info["extended"]
    assert resumed.prompt_ids == render(tok, template_messages(after), None, None)
    # Every step is a call the policy answered, token for token.
    assert [(s.prompt_ids, s.completion_ids) for s in steps] == [
        (p, out.ids) for p, out in policy.calls
    ]
    # Two training sequences: the conversation up to and with the summary, then the rest.
    first, second = ctx.trajectory().sequences()
    assert first.tokens == summary.prompt_ids + summary.completion_ids
    trained = [t for t, m in zip(first.tokens, first.loss_mask, strict=True) if m]
    assert trained == [t for s in steps[:4] for t in s.completion_ids]
    assert second.tokens == resumed.prompt_ids + resumed.completion_ids
    assert second.loss_mask == [0] * len(resumed.prompt_ids) + [1] * len(resumed.completion_ids)


class Count:
    """Says `next` for 6 turns; each reply earns the share of its digits."""

    def reset(self, task: dict[str, Any]) -> str:
        self.turns = 0
        return "count"

    def step(self, action: str) -> tuple[str, float, bool]:
        self.turns += 1
        return "next", sum(c.isdigit() for c in action) / 30, self.turns >= 6


def test_env_workflow_compacts_and_the_summary_trains_with_the_episodes_advantage() -> None:
    policy = ScriptedPolicy(lambda p: "SUM" if SUMMARIZE in p[-60:] else "123")
    workflow = EnvWorkflow(Count, max_turns=6, compact_at=40, compact_max_tokens=8)
    episodes: list[Episode] = []
    for _ in range(2):
        ctx = context(policy)
        episodes.append(asyncio.run(workflow.run({"id": "t"}, ctx)))
    ep = episodes[0]
    steps = ep.trajectories[0].steps
    summaries = [s for s in steps if "compaction" in s.info]
    assert ep.metrics["compactions"] == len(summaries) >= 1
    assert ep.metrics["turns"] == 6 and ep.termination == "done"
    assert ep.reward == 6 * 3 / 30
    group = TrajectoryGroup("t", "default", [e.trajectories[0] for e in episodes], [0.5, -0.5])
    trained = list(group.training_sequences())
    for summary in summaries:
        hits = [
            (seq, adv)
            for seq, adv in trained
            if _contains(seq.tokens, summary.prompt_ids + summary.completion_ids)
        ]
        assert hits, "the summary is in a training sequence"
        seq, adv = hits[0]
        start = len(summary.prompt_ids)
        assert seq.loss_mask[start : start + len(summary.completion_ids)] == [1] * len(
            summary.completion_ids
        )
        assert adv == 0.5


def _contains(tokens: list[int], prefix: list[int]) -> bool:
    return tokens[: len(prefix)] == prefix


def test_multi_turn_workflow_scores_the_whole_conversation_after_compacting() -> None:
    seen: list[list[dict[str, Any]]] = []

    def reward(task: dict[str, Any], messages: list[dict[str, Any]]) -> float:
        seen.append(messages)
        return 1.0

    def echo(x: str) -> str:
        return "ok"

    call = '<tool_call>{"name": "echo", "arguments": {"x": "a"}}</tool_call>'
    policy = ScriptedPolicy(lambda p: "SUM" if SUMMARIZE in p[-60:] else call)
    tools = [
        {"fn": echo, "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}
    ]
    workflow = MultiTurnWorkflow(reward, tools=tools, max_turns=5, compact_at=200)
    ep = asyncio.run(workflow.run({"id": "t", "prompt": "go"}, context(policy)))
    assert ep.metrics["compactions"] >= 1 and ep.metrics["turns"] == 5
    [messages] = seen
    # Every turn, none of the summary requests: the opening, then 5 calls and their results.
    assert len(messages) == 1 + 5 * 2
    assert not any("Summarize" in str(m.get("content")) for m in messages)
