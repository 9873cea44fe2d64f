"""The transformers fallback of the local backend: tiny random Gemma 2 and 3, Phi-3 and
mixture-of-experts checkpoints (real transformers configs, saved locally) sample with exact
logprobs, train, resume and export like our own decoder's models; the start-up log names the path
that runs."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rllm_async.backends.local import LocalBackend  # noqa: E402
from rllm_async.backends.local.model import Transformer  # noqa: E402
from rllm_async.backends.local.transformers_model import (  # noqa: E402
    TransformersModel,
    max_positions,
)
from rllm_async.config import Config, ConfigError, config_from_dict  # noqa: E402
from rllm_async.protocols import SamplingParams  # noqa: E402
from rllm_async.types import Step, Trajectory, TrajectoryGroup  # noqa: E402
from tests.backends.local.test_local_backend import resume_round_trip  # noqa: E402
from tests.backends.local.test_local_hf import save_tokenizer  # noqa: E402
from tests.digits import digits_config, train  # noqa: E402

SHAPE = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES: dict[str, tuple[Any, dict[str, Any]]] = {
    # A sliding window shorter than the completions, and soft-capped logits.
    "gemma2": ("Gemma2Config", {"head_dim": 8, "sliding_window": 8}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 8, "sliding_window": 8}),
    "phi3": ("Phi3Config", {}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
        },
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8},
    ),
    "llama": ("LlamaConfig", {}),  # one our decoder implements
}
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random checkpoint per family, with a character tokenizer and a chat template."""
    paths = {}
    for family, (config_class, extra) in FAMILIES.items():
        path = tmp_path_factory.mktemp(family)
        config = getattr(transformers, config_class)(
            vocab_size=save_tokenizer(path), **SHAPE, **extra
        )
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
        paths[family] = path
    return paths


def make_config(path: Path, backend: dict[str, Any] | None = None, **sections: Any) -> Config:
    return config_from_dict(
        {
            "backend": {
                "name": "local",
                "model_path": str(path),
                "max_seq_len": 64,
                **(backend or {}),
            },
            "rollout": {"max_tokens": 16, "temperature": TEMPERATURE},
            "optim": {"lr": 0.01},
            "train": {"total_steps": 10, "groups_per_step": 2, "micro_batch_groups": 1},
            **sections,
        }
    )


def transformers_logprobs(
    path: Path,
    prompt: list[int],
    completion: list[int],
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list[float]:
    """The completion's logprobs under transformers' own full forward pass of the checkpoint."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).to(device, dtype).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt + completion], device=device)
        logits = model(ids).logits[0].float().cpu()
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


async def sample_group(backend: LocalBackend, text: str, n: int = 3) -> TrajectoryGroup:
    """`n` concurrent samples of one prompt (one prefill, copied into each slot)."""
    policy = backend.policy()
    prompt = policy.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=12, seed=i) for i in range(n)]
    outs = await asyncio.gather(*(policy.generate(prompt, p) for p in params))
    trajs = [
        Trajectory(steps=[Step(prompt, o.ids, o.logprobs, o.versions)], reward=float(i == 0))
        for i, o in enumerate(outs)
    ]
    mean = sum(t.reward for t in trajs) / n
    return TrajectoryGroup(text, "default", trajs, [t.reward - mean for t in trajs])


def params(backend: LocalBackend) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in backend.learner.model.parameters()])


@pytest.mark.parametrize(
    "family", ["gemma2", "gemma3_text", "phi3", "qwen2_moe", "qwen3_moe", "mixtral"]
)
def test_sampler_logprobs_equal_a_full_forward_pass_of_transformers(
    checkpoints: dict[str, Path], family: str
) -> None:
    path = checkpoints[family]

    async def main() -> None:
        backend = LocalBackend.from_config(make_config(path))
        assert isinstance(backend.learner.model, TransformersModel)
        group = await sample_group(backend, "hello there")
        policy = backend.policy()
        again = await policy.generate(
            group.trajectories[1].steps[0].prompt_ids,
            SamplingParams(temperature=TEMPERATURE, max_tokens=12, seed=1),
        )
        stopped = await policy.generate(
            group.trajectories[0].steps[0].prompt_ids,
            SamplingParams(temperature=TEMPERATURE, max_tokens=12, seed=0, stop=("e",)),
        )
        await backend.close()
        for traj in group.trajectories:
            step = traj.steps[0]
            assert 1 <= len(step.completion_ids) <= 12
            assert len(step.completion_ids) == 12 or step.completion_ids[-1] == 2  # EOS stops
            expected = transformers_logprobs(path, step.prompt_ids, step.completion_ids)
            assert step.logprobs == pytest.approx(expected, abs=1e-4)
        assert again.ids == group.trajectories[1].steps[0].completion_ids  # seeded
        first = group.trajectories[0].steps[0].completion_ids
        text = policy.tokenizer.decode(first)
        if "e" in text:  # a stop string ends the completion where it appears
            assert policy.tokenizer.decode(stopped.ids).endswith("e")
            assert len(stopped.ids) <= len(first)
        else:
            assert stopped.ids == first

    asyncio.run(main())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-4), ("bfloat16", 0.1)])
@pytest.mark.parametrize("family", ["gemma2", "qwen2_moe"])
def test_on_a_gpu_the_sampler_logprobs_equal_transformers_and_a_step_trains(
    checkpoints: dict[str, Path], family: str, dtype: str, atol: float
) -> None:
    path = checkpoints[family]
    cfg = make_config(path, {"device": "cuda", "dtype": dtype})

    async def main() -> tuple[TrajectoryGroup, dict[str, float], torch.Tensor]:
        backend = LocalBackend.from_config(cfg)
        group = await sample_group(backend, "hello there")
        before = params(backend)
        metrics = await backend.forward_backward([group], cfg.algorithm.loss)
        await backend.optim_step()
        change = (params(backend) - before).abs().max()
        await backend.close()
        return group, metrics, change

    group, metrics, change = asyncio.run(main())
    for traj in group.trajectories:
        step = traj.steps[0]
        expected = transformers_logprobs(
            path, step.prompt_ids, step.completion_ids, "cuda", getattr(torch, dtype)
        )
        assert step.logprobs == pytest.approx(expected, abs=atol)
    if dtype == "float32":
        assert metrics["loss/sampler_kl"] < 1e-6
    assert 0 < float(change) < 1  # the step moved the weights, and not wildly


@pytest.mark.parametrize("family", ["gemma2", "qwen2_moe"])
def test_a_step_trains_on_policy_and_the_sampler_gets_the_new_weights(
    checkpoints: dict[str, Path], family: str
) -> None:
    path = checkpoints[family]
    cfg = make_config(path, algorithm={"loss": {"kl_coef": 0.05}})

    async def main() -> None:
        backend = LocalBackend.from_config(cfg)
        pinned = backend.policy().acquire()  # an episode that keeps the starting weights
        groups = [await sample_group(backend, "ab"), await sample_group(backend, "abcd")]
        before = params(backend)
        metrics = await backend.forward_backward(groups, cfg.algorithm.loss)
        assert metrics["loss/sampler_kl"] < 1e-8  # the trainer's logprobs are the sampler's
        assert metrics["loss/kl_ref"] == pytest.approx(0.0, abs=1e-8)  # still the reference weights
        await backend.optim_step()
        assert not torch.allclose(params(backend), before)
        await backend.on_policy_updated(1)
        group = await sample_group(backend, "ab")
        assert all(
            t.steps[0].versions == [1] * len(t.steps[0].versions) for t in group.trajectories
        )
        # New samples are on-policy for the updated weights; the reference stayed behind.
        metrics = await backend.forward_backward([group], cfg.algorithm.loss)
        assert metrics["loss/sampler_kl"] < 1e-8
        assert metrics["loss/kl_ref"] > 0
        # The pinned episode still samples from the checkpoint's own weights.
        prompt = group.trajectories[0].steps[0].prompt_ids
        params_ = SamplingParams(temperature=TEMPERATURE, max_tokens=12, seed=5)
        old = await backend.policy().generate(prompt, params_, version=pinned)
        assert old.versions == [0] * len(old.ids)
        expected = transformers_logprobs(path, prompt, old.ids)
        assert old.logprobs == pytest.approx(expected, abs=1e-4)
        backend.policy().release(pinned)
        await backend.close()

    asyncio.run(main())


def test_micro_batches_give_the_same_update_as_one_batch(checkpoints: dict[str, Path]) -> None:
    cfg = make_config(checkpoints["phi3"])

    async def main() -> None:
        split, whole = LocalBackend.from_config(cfg), LocalBackend.from_config(cfg)
        groups = [await sample_group(split, "ab"), await sample_group(split, "abcdef")]
        for g in groups:
            await split.forward_backward([g], cfg.algorithm.loss)
        await whole.forward_backward(groups, cfg.algorithm.loss)
        s, w = await split.optim_step(), await whole.optim_step()
        assert s["optim/num_tokens"] == w["optim/num_tokens"]
        assert s["optim/grad_norm"] == pytest.approx(w["optim/grad_norm"], rel=1e-5)
        # Rows padded to other widths: float noise of about 1e-6 in the AdamW step.
        assert torch.allclose(params(split), params(whole), atol=1e-5)
        for b in (split, whole):
            await b.close()

    asyncio.run(main())


def test_resume_gives_the_same_next_step(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    async def sample(backend: LocalBackend) -> list[TrajectoryGroup]:
        return [await sample_group(backend, "ab")]

    resume_round_trip(make_config(checkpoints["phi3"]), sample, tmp_path / "ckpt")


def test_export_is_a_checkpoint_transformers_loads(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    cfg = make_config(checkpoints["gemma2"])

    async def main() -> LocalBackend:
        backend = LocalBackend.from_config(cfg)
        await backend.forward_backward([await sample_group(backend, "ab")], cfg.algorithm.loss)
        await backend.optim_step()
        await backend.save(tmp_path / "ckpt")
        await backend.close()
        return backend

    backend = asyncio.run(main())
    LocalBackend.export(cfg, tmp_path / "ckpt", tmp_path / "out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.randint(3, 98, (2, 20))
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, backend.learner.model(ids), atol=1e-5)
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()


def test_the_start_up_log_names_the_path_and_why(
    checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="rllm_async.backends.local.backend")
    for family, backend_opts, expected in [
        ("gemma2", {}, TransformersModel),
        ("llama", {}, Transformer),
        ("llama", {"model_impl": "transformers"}, TransformersModel),
    ]:
        caplog.clear()
        backend = LocalBackend.from_config(make_config(checkpoints[family], backend_opts))
        assert isinstance(backend.learner.model, expected)
        asyncio.run(backend.close())
        (record,) = caplog.records
        line = record.getMessage()
        # The fallback warns: it is slower, and the default log level shows warnings only.
        assert record.levelno == (logging.INFO if expected is Transformer else logging.WARNING)
        if expected is Transformer:
            assert "native decoder: model_type 'llama' is one our decoder implements" in line
        elif family == "gemma2":
            assert "transformers fallback" in line and "model_type 'gemma2'" in line
        else:
            assert "transformers fallback" in line and "backend.model_impl: transformers" in line


def test_forced_transformers_samples_what_our_decoder_samples(
    checkpoints: dict[str, Path],
) -> None:
    async def sample(impl: str) -> TrajectoryGroup:
        backend = LocalBackend.from_config(make_config(checkpoints["llama"], {"model_impl": impl}))
        group = await sample_group(backend, "hello")
        await backend.close()
        return group

    native, fallback = asyncio.run(sample("native")), asyncio.run(sample("transformers"))
    for a, b in zip(native.trajectories, fallback.trajectories, strict=True):
        assert a.steps[0].completion_ids == b.steps[0].completion_ids
        assert a.steps[0].logprobs == pytest.approx(b.steps[0].logprobs, abs=1e-4)


@pytest.mark.parametrize(
    ("family", "backend", "match"),
    [
        ("gemma2", {"model_impl": "native"}, "model_type 'gemma2'.*model_impl: auto"),
        ("gemma2", {"lora": {"rank": 4}}, "backend.lora.*transformers fallback"),
        ("mixtral", {"learner": "process"}, "backend.learner: process.*transformers fallback"),
        ("phi3", {"rollout": "vllm"}, "rollout: vllm.*transformers fallback"),
        ("llama", {"model_impl": "transformers", "lora": {"rank": 4}}, "backend.lora"),
        (None, {"model_impl": "transformers"}, "needs a backend.model_path"),
        ("gemma2", {"max_seq_len": 256}, r"max_seq_len \(256\) exceeds .* \(128\)"),
    ],
)
def test_refuses_what_the_path_cannot_do(
    checkpoints: dict[str, Path], family: str | None, backend: dict[str, Any], match: str
) -> None:
    if family is None:
        cfg = config_from_dict({"backend": {"name": "local", **backend}})
    else:
        # weight_update: latest, which rollout: vllm needs in async mode
        cfg = make_config(checkpoints[family], backend, coordinator={"weight_update": "latest"})
    with pytest.raises(ConfigError, match=match):
        LocalBackend.from_config(cfg)


def answers(n: int) -> list[dict[str, Any]]:
    """Warm-start transcripts: every question is answered `42`."""
    return [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "42"}]}
        for i in range(n)
    ]


def test_a_warm_start_fine_tunes_the_fallback_model(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    warm = {
        "examples": f"{__name__}:answers",
        "args": {"n": 32},
        "steps": 30,
        "batch_size": 8,
        "lr": 1e-2,
        "cache_dir": str(tmp_path),
    }
    cfg = make_config(checkpoints["phi3"], {"warm_start": warm})

    async def main() -> None:
        backend = LocalBackend.from_config(cfg)
        policy = backend.policy()
        prompt = policy.tokenizer.apply_chat_template([{"role": "user", "content": "q7"}])
        out = await policy.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4))
        await backend.close()
        assert policy.tokenizer.decode(out.ids) == "42"  # then EOS

    asyncio.run(main())


def test_length_dependent_rope_limits_max_seq_len_to_the_original_context() -> None:
    longrope = {"type": "longrope", "short_factor": [1.0], "long_factor": [4.0]}
    phi3_128k = {
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_scaling": longrope,
    }
    assert max_positions(phi3_128k) == 4096
    assert max_positions({**phi3_128k, "rope_scaling": None}) == 131072


def test_grpo_raises_a_trivial_reward(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    backend = {"model_path": str(checkpoints["qwen2_moe"]), "max_seq_len": 40}
    config = digits_config(
        tmp_path, "fallback", backend, total_steps=20, groups_per_step=4, lr=1e-2
    )
    records = train(config, n_tasks=100)
    rewards = [r["rollout/reward/mean"] for r in records if "rollout/reward/mean" in r]
    start, end = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert end > start + 0.3, (start, end)
