"""The GPU recipes (examples/gpu/) load and pass every check that needs no GPU, vLLM or verl.

What. Each config goes through `load_config`, then its backend's own validation as far as a CPU
machine can take it: `LocalOptions` and the `rollout: vllm` refusals (`check_vllm`), `model_impl`
against a stand-in Hugging Face cache holding Qwen3-0.6B's published config.json (so our decoder's
reading of the real checkpoint's shape is checked, not just the YAML), and the verl backend's
`check_config`, which imports no verl. Then the choices docs/gpu.md explains: GRPO's
hyperparameters, Qwen3's non-thinking switch, GSM8K's columns feeding `math_reward`.

Why. The recipes cannot run here (no GPU); a renamed option, a refused combination or a broken
column mapping would otherwise surface only on a rented GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rllm_async.backends.local.backend import LocalBackend
from rllm_async.backends.local.hf import model_config, read_config
from rllm_async.backends.local.options import LocalOptions, check_vllm, device_of, model_impl
from rllm_async.backends.verl.options import check_config
from rllm_async.config import Config, ConfigError, load_config, validate_options
from rllm_async.data import load_tasks

ROOT = Path(__file__).resolve().parents[2]
GPU_EXAMPLES = ROOT / "examples" / "gpu"
NAMES = ("qwen3_0.6b_local.yaml", "qwen3_0.6b_local_vllm.yaml", "qwen3_1.7b_verl.yaml")

# Qwen/Qwen3-0.6B's config.json as published on the Hugging Face Hub.
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def load(name: str) -> Config:
    return load_config(GPU_EXAMPLES / name)


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face cache holding a snapshot of Qwen/Qwen3-0.6B's config.json (no weights)."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(QWEN3_0_6B))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return snapshot


def test_the_recipes_are_these() -> None:
    assert sorted(p.name for p in GPU_EXAMPLES.glob("*.yaml")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_grpo_choices(name: str) -> None:
    """The choices docs/gpu.md gives for GRPO at this size hold in every recipe."""
    config = load(name)
    assert config.mode == "async"
    assert config.optim.lr == pytest.approx(1e-6)  # a full fine-tune, verl's GSM8K rate
    assert config.optim.warmup_steps > 0 and config.optim.grad_clip == 1.0
    assert 8 <= config.rollout.group_size <= 16
    assert 512 <= config.rollout.max_tokens <= 1024
    # Temperature 1 and no nucleus cut: the learner's logprobs are the sampler's distribution.
    assert (config.rollout.temperature, config.rollout.top_p) == (1.0, 1.0)
    assert config.algorithm.advantage == "grpo" and config.algorithm.normalize_std
    assert config.algorithm.filter_zero_variance
    assert config.algorithm.loss.kl_coef == 0.0  # no reference model in GPU memory
    assert config.algorithm.loss.clip_high > config.algorithm.loss.clip_low
    # Rollouts may lag the learner by a step, within the hard bound.
    co = config.coordinator
    assert co.pipeline_depth == 1 and co.max_staleness is not None
    assert co.max_staleness >= co.pipeline_depth and co.weight_update == "latest"
    # GSM8K's final answers, read by math-verify, in Qwen3's non-thinking mode.
    args = config.workflow.args
    assert args["reward_fn"] == "rllm_async.rewards.math_answer:math_reward"
    assert "/no_think" in args["system_prompt"] and "\\boxed{}" in args["system_prompt"]
    for split in (config.data.train, config.data.eval):
        assert split is not None and split.hf is not None
        assert (split.hf.path, split.hf.name) == ("openai/gsm8k", "main")
        assert split.columns == {"prompt": "question", "answer": "answer"}
    assert config.data.eval is not None and config.data.eval.hf is not None
    assert config.data.eval.hf.split == "test" and not config.data.eval.shuffle


@pytest.mark.parametrize("name", NAMES)
def test_gsm8k_rows_reach_the_reward(name: str, tmp_path: Path) -> None:
    """A GSM8K row (`question`, `answer` ending in `#### n`) read through the recipe's columns:
    the prompt is the question, and a boxed reply with that number earns 1."""
    from rllm_async.rewards.math_answer import math_reward
    from rllm_async.workflows.prompt import task_messages

    rows = tmp_path / "train.jsonl"
    row = {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3+4=7\n#### 7"}
    rows.write_text(json.dumps(row) + "\n")
    config = load_config(GPU_EXAMPLES / name, ["data.train.hf=null", f"data.train.path={rows}"])
    assert config.data.train is not None
    (task,) = load_tasks(config.data.train, "train")
    messages = task_messages(task, "prompt", config.workflow.args["system_prompt"])
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"] == row["question"]
    assert math_reward(task, "3 + 4 = 7, so the answer is \\boxed{7}.") == (1.0, True)
    assert math_reward(task, "\\boxed{8}") == (0.0, False)


@pytest.mark.parametrize("name", ["qwen3_0.6b_local.yaml", "qwen3_0.6b_local_vllm.yaml"])
def test_local_recipes_validate(name: str, hub_cache: Path) -> None:
    """The local backend's options, its refusals, and our decoder on Qwen3-0.6B's real shape."""
    config = load(name)
    assert config.backend.name == "local"
    opts: LocalOptions = validate_options(LocalOptions, config.backend.options, "backend")
    assert opts.model_path == "Qwen/Qwen3-0.6B"
    assert (opts.device, opts.dtype, opts.learner) == ("cuda", "bfloat16", "thread")
    # LocalBackend's first refusal, and the cache's 32-position blocks.
    assert config.rollout.max_tokens < opts.max_seq_len and opts.max_seq_len % 32 == 0
    # The Hub id resolves from the cache, offline, to a checkpoint our decoder runs.
    impl, why = model_impl(opts)
    assert impl == "native", why
    raw = read_config(hub_cache)
    cfg = model_config(raw, hub_cache)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.hdim) == (1024, 28, 16, 8, 128)
    assert cfg.qk_norm and cfg.tie_embeddings and cfg.vocab_size == 151936
    assert opts.max_seq_len <= raw["max_position_embeddings"]
    # The recipes' memory arithmetic: 112 KiB of bfloat16 keys and values per token.
    assert cfg.n_layers * cfg.kv_heads * cfg.hdim * 2 * 2 == 112 * 1024
    if opts.rollout == "vllm":
        check_vllm(config, opts)  # latest weights, no evaluation beside training: accepted
        assert config.eval.every_steps == 0 and config.eval.at_end
        assert opts.vllm.dtype == "bfloat16" and not opts.vllm.enforce_eager
        assert LocalBackend.decode_slots(config.backend.options) == 256
        assert LocalBackend.shares_device(config.backend.options) is None
    else:
        assert config.eval.every_steps > 0 and config.eval.at_start
        assert LocalBackend.decode_slots(config.backend.options) == opts.max_batch
        assert LocalBackend.shares_device(config.backend.options) is True


def test_local_recipes_need_the_gpu_they_name() -> None:
    """What this machine cannot construct: `device: cuda` is refused where torch sees no GPU."""
    import torch

    if torch.cuda.is_available():
        assert device_of("cuda").type == "cuda"
    else:
        with pytest.raises(ConfigError, match="no GPU is visible"):
            device_of("cuda")


def test_vllm_recipe_refuses_pinned_rollouts() -> None:
    """The recipe's `latest` is not decoration: `pin` with a pipeline is refused for vLLM."""
    config = load_config(
        GPU_EXAMPLES / "qwen3_0.6b_local_vllm.yaml", ["coordinator.weight_update=pin"]
    )
    opts = validate_options(LocalOptions, config.backend.options, "backend")
    with pytest.raises(ConfigError, match="weight_update: latest"):
        check_vllm(config, opts)


def test_verl_recipe_validates() -> None:
    """The verl backend's own checks (no verl import): layout, servers, loss, staleness."""
    config = load("qwen3_1.7b_verl.yaml")
    assert config.backend.name == "verl"
    opts = check_config(config)
    assert Path(opts.model_path).name == "Qwen3-1.7B"
    assert (opts.device, opts.nodes, opts.gpus_per_node) == ("cuda", 1, 4)
    assert opts.rollout == "verl-vllm" and opts.colocated and opts.tensor_parallel_size == 1
    assert opts.fsdp.strategy == "fsdp2" and opts.fsdp.param_dtype == "bfloat16"
    assert opts.fsdp.gradient_checkpointing
    assert opts.overrides == ["rollout.gpu_memory_utilization=0.6"]  # verl's Qwen3-1.7B script's
    assert opts.attention == "flash_attention_2" and opts.remove_padding
    assert config.rollout.max_tokens < opts.max_seq_len
    # 512 rollouts per step, 128 per worker; no evaluation that would pin a version the servers
    # drop at the next sync.
    assert config.train.groups_per_step * config.rollout.group_size == 512
    assert config.eval.every_steps == 0 and config.eval.at_end
    assert opts.shares_device is True and opts.decode_slots is None


@pytest.mark.parametrize(
    ("override", "refusal"),
    [
        ("algorithm.loss.kl_coef=0.001", "no reference model"),
        ("backend.gpus_per_node=3", "tensor_parallel_size"),
        ("backend.device=cpu", "runs verl's vllm servers on GPUs"),
    ],
)
def test_verl_recipe_refusals(override: str, refusal: str) -> None:
    """Changes the recipe's comments warn about are refused before Ray or verl start."""
    overrides: list[str] = [override]
    if override == "backend.gpus_per_node=3":
        overrides.append("backend.tensor_parallel_size=2")
    config = load_config(GPU_EXAMPLES / "qwen3_1.7b_verl.yaml", overrides)
    with pytest.raises(ConfigError, match=refusal):
        check_config(config)
