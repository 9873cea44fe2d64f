"""Trajectory trees: `ctx.spawn` and `ctx.fork` record branches of a rollout, each with its own
exact tokens and a link to the step it came from; the buffer groups and normalizes them by role,
with the episode's reward as their credit unless the workflow gives a role its own."""

from __future__ import annotations

import asyncio

import pytest

from rllm_async.types import Episode, StepRef
from tests.scripted import RecordingPolicy, ScriptedPolicy, context
from tests.test_buffer import dispatch, setup


def _reply(prompt: str) -> str:
    return f"r{len(prompt) % 7}"


async def _orchestrate(ctx, role_reward: float | None = None) -> None:  # type: ignore[no-untyped-def]
    """An orchestrator that plans, hands two questions to `solver` subagents (two turns each),
    and forks its own conversation to try a second answer."""
    chat = [{"role": "user", "content": "plan"}]
    plan = await ctx.chat(chat)
    chat.append(plan)
    solvers = [ctx.spawn("solver") for _ in range(2)]

    async def solve(sub, q: str) -> None:  # type: ignore[no-untyped-def]
        msgs = [{"role": "user", "content": q}]
        msgs.append(await sub.chat(msgs))
        msgs.append({"role": "user", "content": "check"})
        await sub.chat(msgs)
        if role_reward is not None:
            sub.set_reward(role_reward)

    await asyncio.gather(*(solve(s, q) for s, q in zip(solvers, ["q1", "q22"], strict=True)))
    branch = ctx.fork()
    await ctx.chat([*chat, {"role": "user", "content": "answer"}])
    await branch.chat([*chat, {"role": "user", "content": "other answer"}])


def test_a_tree_records_every_node_with_its_exact_tokens_and_parent_links() -> None:
    policy = RecordingPolicy(ScriptedPolicy(_reply))
    ctx = context(policy)
    asyncio.run(_orchestrate(ctx))
    episode = ctx.build_episode(1.0)

    nodes = {t.node_id: t for t in episode.trajectories}
    assert list(nodes) == ["default", "default/solver.0", "default/solver.1", "default/default.2"]
    root, s0, s1, fork = nodes.values()
    assert [t.name for t in nodes.values()] == ["default", "solver", "solver", "default"]
    assert root.parent is None
    assert s0.parent == s1.parent == StepRef("default", 0, "spawn")
    assert fork.parent == StepRef("default", 0, "fork")
    assert [len(t.steps) for t in nodes.values()] == [2, 2, 2, 1]

    # Every node's steps are exactly the calls the policy answered, each once.
    recorded = sorted((s.prompt_ids, s.completion_ids) for t in nodes.values() for s in t.steps)
    sampled = sorted((p, out.ids) for p, out in policy.calls)
    assert recorded == sampled and len(sampled) == 7
    for t in nodes.values():
        for s in t.steps:
            assert s.logprobs == [-0.5] * len(s.completion_ids)
            assert s.versions == [0] * len(s.completion_ids)

    # The fork continues the parent's exact tokens: its prompt extends the plan's prompt and
    # completion, which its training sequence masks out (they are the parent's to train).
    plan = root.steps[0]
    head = plan.prompt_ids + plan.completion_ids
    assert fork.steps[0].prompt_ids[: len(head)] == head and fork.steps[0].info["extended"]
    [seq] = fork.sequences()
    assert seq.loss_mask == [0] * len(fork.steps[0].prompt_ids) + [1] * len(
        fork.steps[0].completion_ids
    )
    # A subagent's conversation is its own: one sequence whose sampled tokens are its replies.
    for sub in (s0, s1):
        [seq] = sub.sequences()
        sampled_tokens = [tok for tok, m in zip(seq.tokens, seq.loss_mask, strict=True) if m]
        assert sampled_tokens == sub.steps[0].completion_ids + sub.steps[1].completion_ids
        assert sub.steps[1].info["extended"]

    # Credit: the episode's reward for every branch (none gave its own).
    assert episode.reward == 1.0
    assert [t.reward for t in nodes.values()] == [1.0] * 4


def test_a_branch_that_made_no_call_is_left_out_and_its_own_reward_replaces_the_episodes() -> None:
    ctx = context(ScriptedPolicy(_reply))
    asyncio.run(_orchestrate(ctx, role_reward=0.25))
    ctx.spawn("idle")
    ctx.fork()  # never calls either
    episode = ctx.build_episode(1.0)
    assert [t.name for t in episode.trajectories] == ["default", "solver", "solver", "default"]
    assert [t.reward for t in episode.trajectories] == [1.0, 0.25, 0.25, 1.0]


def test_step_rewards_add_to_a_branchs_credit_and_a_branch_builds_its_own_episode() -> None:
    ctx = context(ScriptedPolicy(_reply))

    async def go() -> Episode:
        await ctx.chat([{"role": "user", "content": "hi"}])
        sub = ctx.spawn("critic")
        await sub.chat([{"role": "user", "content": "judge"}])
        sub.set_step_reward(0.5)
        alone = sub.build_episode(None)  # the branch's own view; changes nothing
        assert alone.trajectories[0].node_id == "default/critic.0" and alone.reward == 0.5
        with pytest.raises(ValueError, match="own trajectory"):
            sub.trajectory("other")
        return ctx.build_episode(2.0)

    episode = asyncio.run(go())
    assert episode.reward == 2.0
    assert [t.reward for t in episode.trajectories] == [2.0, 2.5]


def _group(rewards: list[float], role_rewards: list[float | None]) -> dict[str, list[float]]:
    """Advantages by role of one dispatch of len(rewards) rollouts of `_orchestrate`."""

    async def go() -> dict[str, list[float]]:
        coord, buffer = setup(group_size=len(rewards), min_group_size=len(rewards))
        d = dispatch(coord, buffer, 0)
        for i, (reward, own) in enumerate(zip(rewards, role_rewards, strict=True)):
            ctx = context(ScriptedPolicy(_reply))
            await _orchestrate(ctx, own)
            buffer.add(d.id, i, ctx.build_episode(reward))
        await buffer.complete(d.id)
        ready = await buffer.get()
        assert ready is not None
        return {g.name: [round(a, 6) for a in g.advantages] for g in ready.groups}

    return asyncio.run(go())


def test_advantages_are_grouped_and_centred_per_role_with_the_episode_reward_by_default() -> None:
    adv = _group([1.0, 0.0, 0.5], [None, None, None])
    # Each role's trajectories across the group: default (root and fork) and solver (two each).
    assert adv == {
        "default": [0.5, 0.5, -0.5, -0.5, 0.0, 0.0],
        "solver": [0.5, 0.5, -0.5, -0.5, 0.0, 0.0],
    }


def test_a_roles_own_reward_is_its_credit() -> None:
    adv = _group([1.0, 0.0, 0.5], [0.0, 1.0, 0.5])  # the solvers' rewards disagree with the episode
    assert adv["default"] == [0.5, 0.5, -0.5, -0.5, 0.0, 0.0]
    assert adv["solver"] == [-0.5, -0.5, 0.5, 0.5, 0.0, 0.0]
