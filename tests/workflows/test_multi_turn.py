"""Built-in multi-turn workflows: tools, malformed calls, max_turns, deadlines, env loops, TITO."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from rllm_async.tasks import guess
from rllm_async.types import Termination
from rllm_async.vclock import run
from rllm_async.workflows import EnvWorkflow, MultiTurnWorkflow, Tool
from tests.scripted import ScriptedPolicy, context


def calc(expr: str) -> str:
    """Multiply two integers written as 'a*b'."""
    a, b = expr.split("*")
    return str(int(a) * int(b))


CALC = Tool(calc, {"type": "object", "properties": {"expr": {"type": "string"}}})


def final_answer(task: dict[str, Any], messages: list[dict[str, Any]]) -> tuple[float, bool]:
    ok = messages[-1]["role"] == "assistant" and messages[-1]["content"] == task["answer"]
    return float(ok), ok


def call(expr: str) -> str:
    return json.dumps({"name": "calc", "arguments": {"expr": expr}}).join(
        ("<tool_call>", "</tool_call>")
    )


def agent(prompt: str) -> str:
    """Calls the tool once, answers with its result; sends a malformed call first on 'broken'."""
    if "broken" in prompt and "error:" not in prompt:
        return "<tool_call>{not json}</tool_call>"
    last = prompt.rsplit("<|end|>", 2)[-2]
    if "<|tool|>" not in last or "error:" in last:
        return call("6*7")
    return prompt.rsplit("<|tool|>", 1)[1].split("<|end|>")[0]


def test_tool_loop_runs_the_tool_and_scores_the_answer() -> None:
    policy = ScriptedPolicy(agent)
    ctx = context(policy)
    wf = MultiTurnWorkflow(reward_fn=final_answer, tools=[CALC], max_turns=3)
    episode = run(wf.run({"prompt": "6*7?", "answer": "42"}, ctx), virtual=True)
    assert episode.termination is Termination.DONE
    assert episode.reward == 1.0 and episode.is_correct
    assert episode.metrics["turns"] == 2 and episode.metrics["tool_calls"] == 1
    # Token-in/token-out: one training sequence; the mask is on exactly the sampled tokens.
    [seq] = episode.trajectories[0].sequences()
    (p1, c1), (p2, c2) = policy.calls
    assert seq.tokens == p2 + c2 and p2[: len(p1) + len(c1)] == p1 + c1
    sampled = set(range(len(p1), len(p1) + len(c1))) | set(range(len(p2), len(p2) + len(c2)))
    assert {i for i, m in enumerate(seq.loss_mask) if m} == sampled
    assert "42" in policy.tok.decode(seq.tokens[len(p1) + len(c1) : len(p2)])  # the tool's tokens


def test_a_malformed_tool_call_is_answered_with_an_error_and_the_loop_goes_on() -> None:
    policy = ScriptedPolicy(agent)
    wf = MultiTurnWorkflow(reward_fn=final_answer, tools=[CALC], max_turns=4)
    episode = run(wf.run({"prompt": "broken 6*7?", "answer": "42"}, context(policy)), virtual=True)
    assert episode.metrics["tool_errors"] == 1
    assert episode.is_correct and episode.termination is Termination.DONE
    error_turn = policy.text(policy.calls[1][0]).rsplit("<|tool|>", 1)[1]
    assert error_turn.startswith("error: tool call is not valid JSON")


def test_max_turns_ends_a_conversation_that_keeps_calling_tools() -> None:
    policy = ScriptedPolicy(lambda prompt: call("1*1"))
    wf = MultiTurnWorkflow(reward_fn=final_answer, tools=[CALC], max_turns=3)
    episode = run(wf.run({"prompt": "loop", "answer": "x"}, context(policy)), virtual=True)
    assert episode.termination is Termination.MAX_TURNS and len(policy.calls) == 3
    assert episode.reward == 0.0


def test_tool_failures_and_timeouts_become_tool_messages() -> None:
    async def slow(expr: str) -> str:
        await asyncio.sleep(10)
        return "late"

    def boom(expr: str) -> str:
        raise ZeroDivisionError("no")

    schema = {"type": "object"}
    assert run(Tool(slow, schema).call({"expr": "1"}, 0.5), virtual=True).endswith(
        "timed out after 0.5s"
    )
    assert (
        run(Tool(boom, schema).call({"expr": "1"}, 1.0), virtual=True)
        == "error: ZeroDivisionError: no"
    )
    assert run(Tool(boom, schema).call({"nope": 1}, 1.0), virtual=True).startswith(
        "error: TypeError"
    )


def test_the_episode_deadline_ends_the_conversation_as_a_timeout() -> None:
    policy = ScriptedPolicy(lambda prompt: call("1*1"), delay_s=1.0)

    async def go() -> Any:
        loop = asyncio.get_running_loop()
        ctx = context(policy, deadline=loop.time() + 3.5)
        wf = MultiTurnWorkflow(reward_fn=final_answer, tools=[CALC], max_turns=50)
        return await wf.run({"prompt": "p", "answer": "x"}, ctx)

    episode = run(go(), virtual=True)
    assert episode.termination is Termination.TIMEOUT
    assert 1 <= len(episode.trajectories[0].steps) <= 3


def test_a_conversation_over_the_context_is_truncated() -> None:
    policy = ScriptedPolicy(lambda prompt: call("1*1"), max_context_tokens=200)
    wf = MultiTurnWorkflow(reward_fn=final_answer, tools=[CALC], max_turns=50)
    episode = run(wf.run({"prompt": "p", "answer": "x"}, context(policy)), virtual=True)
    assert episode.termination is Termination.TRUNCATED
    assert all(len(p) < 200 for p, _ in policy.calls)


def bisect(prompt: str) -> str:
    low, high = prompt.rsplit(" ", 1)[1].split("<|end|>")[0].split("-")
    return str((int(low) + int(high)) // 2)


def test_env_loop_sums_step_rewards_into_the_trajectory_reward() -> None:
    policy = ScriptedPolicy(bisect)
    wf = EnvWorkflow(env=guess.GuessEnv, max_turns=4)
    episode = run(wf.run({"id": "g", "secret": 11, "high": 15}, context(policy)), virtual=True)
    # 8 -> higher 9-15, 12 -> lower 9-11, 10 -> higher 11-11, 11 -> correct
    assert episode.termination is Termination.DONE and episode.is_correct
    assert [s.reward for s in episode.trajectories[0].steps] == [-0.15, -0.15, -0.15, 1.0]
    assert episode.reward == pytest.approx(1.0 - 3 * guess.GUESS_COST)
    assert len(episode.trajectories[0].sequences()) == 1


def test_env_loop_stops_at_max_turns_and_accepts_async_envs() -> None:
    policy = ScriptedPolicy(lambda prompt: "1")
    wf = EnvWorkflow(env=guess.GuessEnv, env_args={"latency_s": 0.05}, max_turns=2)
    episode = run(wf.run({"id": "g", "secret": 9}, context(policy)), virtual=True)
    assert episode.termination is Termination.MAX_TURNS and not episode.is_correct
    assert episode.reward == pytest.approx(-2 * guess.GUESS_COST)


def test_guess_env_rejects_non_numbers_and_bisection_beats_random_play() -> None:
    env = guess.GuessEnv()
    env.reset({"secret": 3, "high": 15})
    obs, reward, done = run(env.step("eight"), virtual=True)
    assert obs == "invalid 1-15" and reward == -guess.GUESS_COST and not done
    rng = random.Random(1)
    tasks = guess.generator(n=400, seed=0)
    solved = sum(
        m[-1]["content"] == str(t["secret"]) for t in tasks for m in [guess.random_play(t, rng, 4)]
    )
    assert 0.45 < solved / 400 < 0.75  # random play fails often within 4 turns; bisection never
    examples = guess.warm_start_examples(n=50)
    assert all(e["messages"][-1]["role"] == "assistant" for e in examples)


def test_example_configs_build_their_workflows_and_data() -> None:
    from pathlib import Path

    from rllm_async.config import load_config
    from rllm_async.data import load_tasks
    from rllm_async.runner import build_workflow

    root = Path(__file__).parents[2] / "examples"
    for path in [*root.glob("guess/*.yaml"), *root.glob("calculator/*.yaml")]:
        config = load_config(path)
        build_workflow(config)
        assert config.data.train is not None and load_tasks(config.data.train, "train")


def test_calculator_agent_calls_the_tool_then_answers() -> None:
    from rllm_async.tasks import calculator

    def model(prompt: str) -> str:
        last = prompt.rsplit("<|end|>", 2)[-2]
        if "<|tool|>" in last:
            return last.split("<|tool|>")[1]
        return calculator.tool_call_text(last.split("<|user|>")[1].removesuffix("=?"))

    [task] = calculator.generator(n=1)
    policy = ScriptedPolicy(model)
    episode = run(calculator.CalculatorAgent().run(task, context(policy)), virtual=True)
    assert episode.is_correct and episode.reward == 1.0 and len(policy.calls) == 2
    assert calculator.calc("12*34") == "408" and calculator.calc("__import__('os')").startswith(
        "error"
    )
    # The warm start renders tools exactly as the template does for tools=[CALC_SCHEMA].
    example = calculator.warm_start_examples(n=4, tool_share=1.0)[0]["messages"]
    rendered = policy.tok.apply_chat_template(example[1:-1], tools=[calculator.CALC_SCHEMA])
    assert rendered == policy.tok.apply_chat_template(example[:-1])
