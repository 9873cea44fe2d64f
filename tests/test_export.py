"""`rllm-async export`: a local-backend checkpoint -> Hugging Face files -> transformers, with the
same tokens and the same logprobs as our decoder (float32, max abs difference 1e-4)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from rllm_async.backends.local.backend import CHECKPOINT_FILE
from rllm_async.backends.local.model import Transformer, build_model, preset_config
from rllm_async.backends.toy_tokenizers import CharTokenizer, char_hf_tokenizer
from rllm_async.cli import main
from rllm_async.config import ConfigError, config_from_dict
from rllm_async.export import export_run
from rllm_async.trainer import UnifiedTrainer

transformers = pytest.importorskip("transformers")  # a dev dependency: CI always has it

TOLERANCE = 1e-4
CHATS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?\n ok"}], None),
    (
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "function": {"name": "calc", "arguments": '{"e": "1+2"}'}}
                ],
            },
            {"role": "tool", "content": "3"},
        ],
        [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}],
    ),
    (
        [
            {
                "role": "assistant",
                "content": "x",
                "tool_calls": [{"name": "f", "arguments": {"a": 1}}],
            }
        ],
        None,
    ),
]


def coin(task: dict[str, Any], text: str) -> float:
    """A reward that varies within a group, so that every group trains."""
    return float(len(text) % 2)


def trained_run(tmp_path: Path, **backend: Any) -> Path:
    """A run of one optimizer step at a large learning rate, checkpointed at the end."""
    config = config_from_dict(
        {
            "name": "exported",
            "run_dir": str(tmp_path),
            "backend": {"name": "local", "max_seq_len": 64, **backend},
            "workflow": {"args": {"reward_fn": f"{__name__}:coin"}},
            "data": {
                "train": {"generator": "rllm_async.tasks.countdown:generator", "args": {"n": 8}}
            },
            "rollout": {"group_size": 4, "max_tokens": 8, "temperature": 0.7},
            "train": {"total_steps": 1, "groups_per_step": 2},
            "algorithm": {"filter_zero_variance": False},
            "optim": {"lr": 0.05},
            "logging": {"progress_bar": False, "jsonl": False},
        }
    )
    UnifiedTrainer(config).run()
    return config.run_path


def our_model(run_dir: Path, cfg: Any) -> Transformer:
    """Our decoder with the newest checkpoint's weights."""
    (ckpt,) = (run_dir / "checkpoints").glob("step_*")
    model = Transformer(cfg)
    state = torch.load(ckpt / "backend" / CHECKPOINT_FILE, weights_only=True)["model"]
    model.load_state_dict(state)
    return model.eval()


def max_logprob_gap(ours: Transformer, out: Path, ids: list[int]) -> float:
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tokens = torch.tensor([ids])
    with torch.no_grad():
        a = torch.log_softmax(ours(tokens).float(), dim=-1)
        b = torch.log_softmax(theirs.eval()(tokens).logits.float(), dim=-1)
    return float((a - b).abs().max())


def test_char_tokenizer_as_hugging_face_gives_the_same_ids() -> None:
    ours, theirs = CharTokenizer(), char_hf_tokenizer()
    text = "hello  world\n\t12+3 <a> é"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    assert theirs.decode([*ours.encode(text), ours.eos_token_id], skip_special_tokens=True) == (
        ours.decode(ours.encode(text))
    )
    for messages, tools in CHATS:
        for generation_prompt in (True, False):
            expected = ours.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt
            )
            got = theirs.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=generation_prompt,
                tokenize=True,
                return_dict=False,
            )
            assert list(got) == expected
    with pytest.raises(Exception, match="unknown chat role bot"):
        theirs.apply_chat_template([{"role": "bot", "content": "x"}], tokenize=False)


def test_default_model_exports_and_transformers_gives_our_logprobs(tmp_path) -> None:
    run_dir = trained_run(tmp_path)
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == CharTokenizer().eos_token_id
    assert generation["temperature"] == 0.7
    cfg = preset_config("tiny", CharTokenizer().vocab_size)
    ours = our_model(run_dir, cfg)
    # The trained weights are exported, not the initial ones.
    assert not torch.equal(ours.embed_tokens.weight, build_model(cfg, 0).embed_tokens.weight)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    messages = [{"role": "user", "content": "Use 3 5 7 to make 22."}]
    ids = list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    assert ids == CharTokenizer().apply_chat_template(messages)
    assert max_logprob_gap(ours, out, [*ids, *CharTokenizer().encode("3*5+7")]) < TOLERANCE


def test_hugging_face_model_exports_with_its_tokenizer(tmp_path) -> None:
    from rllm_async.backends.local.hf import load_checkpoint
    from rllm_async.models.tiny_qwen import build_tiny_qwen

    source = build_tiny_qwen(tmp_path / "tiny-qwen", hidden=128, tie_word_embeddings=True)
    run_dir = trained_run(tmp_path, model_path=str(source))
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--checkpoint", "1", "--out", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    ckpt = load_checkpoint(source)
    ours = our_model(run_dir, ckpt.config)
    ids = ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "what is 2 plus 3?"}])
    assert (
        max_logprob_gap(ours, out, [*ids, *ckpt.tokenizer.encode("the answer is 5.")]) < TOLERANCE
    )


def test_export_stops_where_the_sampler_stops_without_a_source_generation_config(
    tmp_path,
) -> None:
    """A checkpoint with no generation_config.json (as a GGUF's is): the export's names the
    sampler's stop token, so that a default `generate` ends the turn there."""
    from rllm_async.backends.local.hf import load_checkpoint
    from rllm_async.models.tiny_qwen import build_tiny_qwen

    source = build_tiny_qwen(tmp_path / "tiny-qwen", hidden=128)
    (source / "generation_config.json").unlink()
    run_dir = trained_run(tmp_path, model_path=str(source))
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    (stop,) = load_checkpoint(source).stop_ids
    generation = transformers.GenerationConfig.from_pretrained(str(out))
    assert generation.eos_token_id == stop
    assert stop == transformers.AutoTokenizer.from_pretrained(str(out)).convert_tokens_to_ids(
        "<|im_end|>"
    )
    assert (
        generation.pad_token_id == json.loads((source / "config.json").read_text())["pad_token_id"]
    )
    assert generation.temperature == 0.7 and generation.do_sample


def test_export_refuses_what_it_cannot_write(tmp_path) -> None:
    with pytest.raises(ConfigError, match="has no config"):
        export_run(tmp_path, tmp_path / "out")
    for name, route in (("verl", "verl.model_merger"), ("tinker", "build_hf_model")):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "config.yaml").write_text(f"backend: {{name: {name}}}\n")
        with pytest.raises(ConfigError, match=route):
            export_run(run_dir, tmp_path / "out")
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.yaml").write_text("backend: {name: local}\n")
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        export_run(local, tmp_path / "out")
    with pytest.raises(ConfigError, match="no complete checkpoint of step 3"):
        export_run(local, tmp_path / "out", "3")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "kept.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        export_run(local, tmp_path / "full")
    assert (tmp_path / "full" / "kept.txt").read_text() == "mine"
