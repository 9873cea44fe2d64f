"""GRPO where the reward needs valid JSON: with the reply sampled under the schema, every episode
parses from the first step, and the reward rises on the content (digits in the answer), not on
the format, which the untrained model could not have written (without the constraint, none of
its first replies parse)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema

from rllm_async import SingleTurnWorkflow, UnifiedTrainer
from rllm_async.backends.local import LocalBackend
from rllm_async.protocols import SamplingParams
from tests.digits import digit_fraction, digits_config, mean_reward

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "minLength": 8, "maxLength": 8}},
    "required": ["answer"],
    "additionalProperties": False,
}


def run(tmp_path: Any, name: str, json_schema: dict[str, Any] | None) -> tuple[list, list[str]]:
    """The step records of 30 async GRPO steps rewarding digits in the JSON answer, and every
    reply the reward saw."""
    replies: list[str] = []

    def answer_digits(task: dict[str, Any], text: str) -> float:
        replies.append(text)
        try:
            value = json.loads(text)
            jsonschema.validate(value, SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return 0.0
        return digit_fraction(task, value["answer"])

    config = digits_config(tmp_path, name, {"model": "tiny", "max_seq_len": 64})
    config.rollout.max_tokens = 32  # {"answer": "12345678"} and the stop token: 24
    workflow = SingleTurnWorkflow(reward_fn=answer_digits, json_schema=json_schema)
    tasks = [{"id": str(i), "prompt": f"n={i}"} for i in range(200)]
    records = UnifiedTrainer(config, workflow=workflow, train_tasks=tasks).run()
    return records, replies


def parses(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_every_episode_parses_and_the_content_reward_rises(tmp_path) -> None:
    records, replies = run(tmp_path, "constrained", SCHEMA)
    assert len(replies) >= 30 * 8 * 8
    assert all(parses(r) for r in replies), [r for r in replies if not parses(r)][:3]
    start, end = mean_reward(records[:3]), mean_reward(records[-5:])
    assert start < 0.3
    assert end > start + 0.3, (start, end)


def test_without_the_constraint_the_untrained_model_writes_no_json(tmp_path) -> None:
    """The control for the claim above: the format is the constraint's doing, not the model's."""
    config = digits_config(tmp_path, "free", {"model": "tiny", "max_seq_len": 64})

    async def replies() -> list[str]:
        backend = LocalBackend.from_config(config)
        policy = backend.policy()
        tok = policy.tokenizer
        outs = await asyncio.gather(
            *(
                policy.generate(
                    tok.apply_chat_template([{"role": "user", "content": f"n={i}"}]),
                    SamplingParams(temperature=1.0, max_tokens=32, seed=i),
                )
                for i in range(64)
            )
        )
        await backend.close()
        return [tok.decode(o.ids) for o in outs]

    texts = asyncio.run(replies())
    assert len(texts) == 64 and not any(parses(t) for t in texts)
