"""RoPE scaling (llama3, linear, dynamic, yarn) in our decoder: logits equal to transformers' on
tiny random checkpoints of each family, saved locally with real configs."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rllm_async.backends.local import LocalBackend  # noqa: E402
from rllm_async.backends.local.hf import load_checkpoint  # noqa: E402
from rllm_async.backends.local.model import load_model  # noqa: E402
from rllm_async.config import config_from_dict  # noqa: E402
from rllm_async.protocols import SamplingParams  # noqa: E402
from tests.backends.local.test_local_hf import save_tokenizer  # noqa: E402

# Small pretraining contexts, so that every scaling changes some of a 16-wide head's frequencies.
SCALINGS: dict[str, dict[str, Any]] = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
}
FAMILIES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}


def save_model(path: Path, family: str, rope: dict[str, Any] | None) -> torch.nn.Module:
    """A tiny random checkpoint of `family` with `rope` scaling, saved as transformers saves it."""
    config = FAMILIES[family](
        vocab_size=save_tokenizer(path),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rope_parameters={"rope_theta": 10000.0, **(rope or {"rope_type": "default"})},
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(path))
    return model.eval()


@pytest.mark.parametrize(
    ("family", "scaling"),
    [
        *(("llama", name) for name in SCALINGS),
        ("mistral", "linear"),
        ("qwen2", "yarn"),
        ("qwen3", "yarn"),
        ("qwen3", "llama3"),
    ],
)
def test_scaled_rope_logits_equal_transformers(tmp_path: Path, family: str, scaling: str) -> None:
    torch.manual_seed(0)
    reference = save_model(tmp_path, family, SCALINGS[scaling])
    ckpt = load_checkpoint(tmp_path)
    ours = load_model(ckpt.config, ckpt.state, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, ckpt.config.vocab_size, (2, 120))  # positions past every original
    with torch.no_grad():
        expected = reference(ids).logits
        assert torch.allclose(ours(ids), expected, atol=1e-4)
        unscaled = dataclasses.replace(ckpt.config, rope_scaling=None)
        plain = load_model(unscaled, ckpt.state, torch.device("cpu"), torch.float32)
        changed = not torch.allclose(plain(ids), expected, atol=1e-4)
    assert changed == (scaling != "dynamic"), "dynamic stretches nothing within the context"


def test_yarn_extends_the_supported_context(tmp_path: Path) -> None:
    save_model(tmp_path, "qwen2", {"rope_type": "yarn", "factor": 4.0})
    assert load_checkpoint(tmp_path).max_positions == 4 * 128
    save_model(tmp_path, "qwen2", SCALINGS["linear"])
    assert load_checkpoint(tmp_path).max_positions == 128


def test_the_sampler_samples_under_a_scaled_rope_with_transformers_logprobs(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    reference = save_model(tmp_path, "llama", SCALINGS["llama3"])
    options = {"name": "local", "model_path": str(tmp_path), "max_seq_len": 120}
    cfg = config_from_dict({"backend": options, "rollout": {"max_tokens": 40}})
    chat = [{"role": "user", "content": "abcdefghij" * 7}]  # past the original context of 64

    async def sample() -> tuple[list[int], list[tuple[list[int], list[float]]]]:
        backend = LocalBackend.from_config(cfg)
        try:
            prompt = backend.policy().tokenizer.apply_chat_template(chat)
            outs = [
                await backend.policy().generate(prompt, SamplingParams(max_tokens=40, seed=seed))
                for seed in range(4)
            ]
            return prompt, [(out.ids, out.logprobs) for out in outs]
        finally:
            await backend.close()

    prompt, samples = asyncio.run(sample())
    assert len(prompt) > 64 and sum(len(ids) for ids, _ in samples) > 20
    for completion, logprobs in samples:
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            expected = reference(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        expected = expected.gather(1, torch.tensor(completion)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)


@pytest.mark.parametrize(
    ("rope", "match"),
    [
        ({"rope_type": "longrope", "factor": 2.0}, "rope_type 'longrope' is not supported"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial rotary"),
    ],
)
def test_scalings_the_decoder_cannot_run_are_refused(
    tmp_path: Path, rope: dict[str, Any], match: str
) -> None:
    from rllm_async.backends.local.hf import model_config

    raw = {
        "model_type": "llama",
        "vocab_size": 8,
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "max_position_embeddings": 128,
        "rope_scaling": rope,
    }
    with pytest.raises(ValueError, match=match):
        model_config(raw, tmp_path)
