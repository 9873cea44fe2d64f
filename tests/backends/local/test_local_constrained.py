"""Constrained decoding on the local sampler: every reply follows its grammar, free neighbours are
untouched, and the recorded logprobs are the masked distribution's, which the learner reproduces."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import pytest
import torch

from rllm_async.backends.local import LocalBackend
from rllm_async.backends.local.model import Transformer
from rllm_async.config import config_from_dict
from rllm_async.grammar import ConstraintError, apply_bitmask
from rllm_async.protocols import Completion, SamplingParams
from rllm_async.types import Step, Trajectory, TrajectoryGroup

# Bounded, so that a random model's reply always ends inside max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
JSON_SCHEMA = json.dumps({"json": SCHEMA})


def make_backend(**sections: Any) -> LocalBackend:
    cfg = config_from_dict(
        {
            "backend": {"name": "local", "max_seq_len": 160, "max_batch": 64},
            "rollout": {"max_tokens": 100},
            **sections,
        }
    )
    return LocalBackend.from_config(cfg)


def prompt(backend: LocalBackend, text: str) -> list[int]:
    return backend.policy().tokenizer.apply_chat_template([{"role": "user", "content": text}])


def masked_forward_logprobs(
    backend: LocalBackend, structured: str, prompt_ids: list[int], out: Completion, temp: float
) -> torch.Tensor:
    """Logprobs of a completion from one uncached forward pass, each position's logits masked by
    the grammar's mask before that token."""
    model = backend.store.get(0)[1]
    assert isinstance(model, Transformer)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out.ids])).float()[0, len(prompt_ids) - 1 : -1]
    masks = backend.sampler.grammars().sequence_masks(structured, out.ids)
    logp = torch.log_softmax(apply_bitmask(logits / temp, masks), dim=-1)
    return logp.gather(-1, torch.tensor(out.ids).unsqueeze(-1)).squeeze(-1)


def test_fifty_constrained_replies_all_validate_and_match_masked_logprobs() -> None:
    async def main() -> None:
        backend = make_backend()
        policy, tok = backend.policy(), backend.policy().tokenizer
        p = prompt(backend, "weather in Paris?")
        object_only = json.dumps({"json_object": True})
        schema_params = SamplingParams(temperature=1.0, max_tokens=100, structured=JSON_SCHEMA)
        object_params = SamplingParams(temperature=0.7, max_tokens=100, structured=object_only)
        outs = await asyncio.gather(
            *(policy.generate(p, schema_params.updated(seed=i)) for i in range(50)),
            *(policy.generate(p, object_params.updated(seed=i)) for i in range(10)),
        )
        assert backend.sampler.peak_batch > 1  # constrained requests decode together
        for out in outs[:50]:
            assert out.finish_reason == "stop"
            assert out.ids[-1] == tok.eos_token_id  # the grammar ended, then only the stop token
            jsonschema.validate(json.loads(tok.decode(out.ids)), SCHEMA)
        assert len({tuple(o.ids) for o in outs[:50]}) > 10  # sampled, not one forced string
        for out in outs[50:]:
            # A random model may open an object it never closes inside max_tokens (strings and
            # keys are unbounded), but every reply that ends is a JSON object.
            if out.finish_reason == "stop":
                assert isinstance(json.loads(tok.decode(out.ids)), dict)
            else:
                assert out.finish_reason == "length"
        for out, (structured, temp) in [
            (outs[0], (JSON_SCHEMA, 1.0)),
            (outs[1], (JSON_SCHEMA, 1.0)),
            (outs[50], (object_only, 0.7)),
        ]:
            expected = masked_forward_logprobs(backend, structured, p, out, temp)
            assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)
        # A token the grammar forces (one allowed) has probability 1 under the mask.
        assert outs[0].logprobs[0] == pytest.approx(0.0, abs=1e-6)  # the opening "{"
        await backend.close()

    asyncio.run(main())


def test_greedy_constrained_decoding_takes_the_best_allowed_token() -> None:
    async def main() -> None:
        backend = make_backend()
        policy, tok = backend.policy(), backend.policy().tokenizer
        p = prompt(backend, "weather?")
        greedy = SamplingParams(temperature=0.0, max_tokens=100, structured=JSON_SCHEMA)
        out = await policy.generate(p, greedy)
        jsonschema.validate(json.loads(tok.decode(out.ids)), SCHEMA)
        expected = masked_forward_logprobs(backend, JSON_SCHEMA, p, out, 1.0)
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)
        model = backend.store.get(0)[1]
        with torch.no_grad():
            logits = model(torch.tensor([p + out.ids])).float()[0, len(p) - 1 : -1]
        masks = backend.sampler.grammars().sequence_masks(JSON_SCHEMA, out.ids)
        assert apply_bitmask(logits, masks).argmax(-1).tolist() == out.ids
        await backend.close()

    asyncio.run(main())


def test_free_requests_sample_the_same_beside_constrained_ones() -> None:
    async def main() -> None:
        backend = make_backend()
        policy = backend.policy()
        free = [SamplingParams(temperature=1.0, max_tokens=30, seed=100 + i) for i in range(4)]
        prompts = [prompt(backend, f"free {i}") for i in range(4)]
        alone = [await policy.generate(p, sp) for p, sp in zip(prompts, free, strict=True)]
        constrained = SamplingParams(max_tokens=100, structured=JSON_SCHEMA)
        crowd = await asyncio.gather(
            *(policy.generate(p, sp) for p, sp in zip(prompts, free, strict=True)),
            *(policy.generate(prompt(backend, "json"), constrained) for _ in range(12)),
        )
        assert backend.sampler.peak_batch > len(free)
        for a, b in zip(alone, crowd[: len(free)], strict=True):
            assert a.ids == b.ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
        await backend.close()

    asyncio.run(main())


def test_a_bad_constraint_fails_its_request_alone_with_a_clear_error() -> None:
    async def main() -> None:
        backend = make_backend()
        policy = backend.policy()
        p = prompt(backend, "hi")
        free = policy.generate(p, SamplingParams(max_tokens=8, seed=1))
        bad = policy.generate(p, SamplingParams(structured='{"grammar": "start: nowhere"}'))
        out, error = await asyncio.gather(free, bad, return_exceptions=True)
        assert isinstance(out, Completion) and out.ids
        assert isinstance(error, ConstraintError) and "nowhere" in str(error)
        with pytest.raises(ConstraintError, match="unknown constraint"):
            await policy.generate(p, SamplingParams(structured='{"xml": true}'))
        await backend.close()

    asyncio.run(main())


@pytest.mark.parametrize("learner", ["thread", "process"])
def test_the_learner_scores_constrained_tokens_under_the_same_masks(learner: str) -> None:
    """The first step's importance weight is 1 and the sampler KL 0: the learner replays each
    constrained span's grammar over its tokens and renormalizes over what it allowed."""

    async def main() -> None:
        backend = make_backend(
            backend={"name": "local", "max_seq_len": 160, "learner": learner},
            rollout={"max_tokens": 100, "temperature": 0.8},
            train={"total_steps": 4, "groups_per_step": 1},
        )
        policy, tok = backend.policy(), backend.policy().tokenizer
        first = prompt(backend, "weather?")
        params = SamplingParams(temperature=0.8, max_tokens=60, structured=JSON_SCHEMA)
        trajectories = []
        for seed in range(4):
            # Two turns: a constrained reply, a tool's answer, then a free reply.
            a = await policy.generate(first, params.updated(seed=seed))
            second = first + a.ids + tok.encode("tool: 21C")
            b = await policy.generate(second, SamplingParams(temperature=0.8, max_tokens=12))
            steps = [
                Step(first, a.ids, a.logprobs, a.versions, info={"structured": JSON_SCHEMA}),
                Step(second, b.ids, b.logprobs, b.versions),
            ]
            trajectories.append(Trajectory(steps=steps))
        [sequence] = trajectories[0].sequences()  # one sequence; only its first reply constrained
        end = len(first) + len(trajectories[0].steps[0].completion_ids)
        assert sequence.constraints == [(len(first), end, JSON_SCHEMA)]
        group = TrajectoryGroup("t", "default", trajectories, [1.0, -1.0, 0.5, -0.5])
        m = await backend.forward_backward([group], backend_loss())
        assert m["loss/sampler_kl"] < 1e-8
        assert m["loss/is_weight_min"] == pytest.approx(1.0, abs=1e-4)
        assert m["loss/is_weight_max"] == pytest.approx(1.0, abs=1e-4)
        # Without the masks the same tokens score differently: the replay is what lines them up.
        for trajectory in trajectories:
            trajectory.steps[0].info.clear()
        unmasked = await backend.forward_backward([group], backend_loss())
        assert unmasked["loss/sampler_kl"] > 1e-4
        await backend.close()

    asyncio.run(main())


def backend_loss() -> Any:
    return config_from_dict({}).algorithm.loss
