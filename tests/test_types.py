"""The data model and RolloutContext recording."""

from __future__ import annotations

from rllm_async.protocols import SamplingParams
from rllm_async.rollout import RolloutContext
from rllm_async.types import Step, Trajectory
from rllm_async.vclock import run
from tests.fakes import FakePolicy


def test_a_later_turn_never_changes_an_earlier_steps_messages() -> None:
    policy = FakePolicy()
    ctx = RolloutContext(policy, sampling=SamplingParams(), pin=True, deadline=1e9, task_id="t")

    async def conversation() -> None:
        messages = [{"role": "user", "content": "hi"}]
        reply = await ctx.chat(messages)
        messages.append(reply)
        messages.append({"role": "user", "content": "again"})
        messages[0]["content"] = "mutated"
        await ctx.chat(messages)

    run(conversation(), virtual=True)
    steps = ctx.trajectory().steps
    assert steps[0].messages == [{"role": "user", "content": "hi"}]
    assert len(steps[1].messages) == 3 and steps[1].messages[0]["content"] == "mutated"
    ctx.close()
    assert policy.live == {}


def test_sequences_merge_token_in_token_out_turns_and_mask_environment_tokens() -> None:
    s1 = Step(prompt_ids=[1, 2], completion_ids=[3, 4], logprobs=[-0.1, -0.2], versions=[0, 0])
    # The next prompt extends the exact tokens so far with environment tokens 9, 9.
    s2 = Step(prompt_ids=[1, 2, 3, 4, 9, 9], completion_ids=[5], logprobs=[-0.3], versions=[1])
    s3 = Step(prompt_ids=[7], completion_ids=[8], logprobs=[-0.4], versions=[1])  # a fresh context
    seqs = Trajectory(steps=[s1, s2, s3]).sequences()
    assert len(seqs) == 2
    assert seqs[0].tokens == [1, 2, 3, 4, 9, 9, 5]
    assert seqs[0].loss_mask == [0, 0, 1, 1, 0, 0, 1]
    assert seqs[0].logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3]
    assert seqs[0].versions == [-1, -1, 0, 0, -1, -1, 1]
    assert seqs[1].tokens == [7, 8] and seqs[1].loss_mask == [0, 1]
    assert Trajectory(steps=[s1, s2]).min_version == 0
