"""Local Hugging Face checkpoints load into our decoder with identical logits (needs transformers)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rllm_async.backends.hf_tokenizer import load_tokenizer  # noqa: E402
from rllm_async.backends.local import LocalBackend  # noqa: E402
from rllm_async.backends.local.hf import load_checkpoint  # noqa: E402
from rllm_async.backends.local.model import hf_weights, load_model  # noqa: E402
from rllm_async.config import ConfigError, config_from_dict  # noqa: E402
from rllm_async.protocols import SamplingParams  # noqa: E402

# No whitespace: transformers 5 may swap in the model type's own tokenizer class, whose byte-level
# pre-tokenizer does not know this toy vocabulary's raw spaces and newlines.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}:{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}"
)


def save_tokenizer(path: Path, chat_template: str | None = CHAT_TEMPLATE) -> int:
    """A character-level fast tokenizer (with a chat template unless None), built offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = ["<unk>", "<|im_start|>", "<|im_end|>", *[chr(c) for c in range(32, 127)]]
    tk = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>"
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = chat_template
    tok.save_pretrained(str(path))
    return len(chars)


def save_model(path: Path, kind: str, vocab: int) -> torch.nn.Module:
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=kind == "qwen3",
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common))
    model.save_pretrained(str(path))
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_checkpoint_logits_match_transformers(tmp_path: Path, kind: str) -> None:
    torch.manual_seed(0)
    reference = save_model(tmp_path, kind, save_tokenizer(tmp_path))
    ckpt = load_checkpoint(tmp_path)
    ours = load_model(ckpt.config, ckpt.state, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, ckpt.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.allclose(ours(ids), reference(ids).logits, atol=1e-4)


def test_fused_projections_read_and_write_under_hugging_face_names(tmp_path: Path) -> None:
    save_model(tmp_path, "qwen3", save_tokenizer(tmp_path))  # tied embeddings, q/k norms
    ckpt = load_checkpoint(tmp_path)
    ours = load_model(ckpt.config, ckpt.state, torch.device("cpu"), torch.float32)
    named = hf_weights(ours)
    assert set(named) == set(ckpt.state) - {"lm_head.weight"}  # tied: the embedding serves
    assert all(torch.equal(named[k], ckpt.state[k]) for k in named)
    ids = torch.randint(0, ckpt.config.vocab_size, (1, 6))
    with torch.no_grad():
        before = ours(ids)
        named["layers.0.self_attn.v_proj.weight"].zero_()  # a view into the fused qkv_proj
        assert not torch.allclose(ours(ids), before)


def test_weights_that_do_not_fit_are_named(tmp_path: Path) -> None:
    save_model(tmp_path, "llama", save_tokenizer(tmp_path))
    ckpt = load_checkpoint(tmp_path)
    cpu = torch.device("cpu")
    missing = {k: v for k, v in ckpt.state.items() if k != "layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing \['layers.1.mlp.up_proj.weight'\]"):
        load_model(ckpt.config, missing, cpu, torch.float32)
    resized = {**ckpt.state, "norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match=r"norm.weight has shape \(3,\)"):
        load_model(ckpt.config, resized, cpu, torch.float32)


def test_backend_samples_with_the_checkpoint_chat_template(tmp_path: Path) -> None:
    torch.manual_seed(0)
    save_model(tmp_path, "qwen2", save_tokenizer(tmp_path))
    options = {"name": "local", "model_path": str(tmp_path), "max_seq_len": 64}
    cfg = config_from_dict({"backend": options, "rollout": {"max_tokens": 8}})

    async def main() -> None:
        backend = LocalBackend.from_config(cfg)
        tok = backend.policy().tokenizer
        ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
        assert tok.decode(ids) == "user:hiassistant:"  # special tokens are skipped
        out = await backend.policy().generate(ids, SamplingParams(max_tokens=8, seed=0))
        assert 1 <= len(out.ids) <= 8 and out.versions == [0] * len(out.ids)
        await backend.close()

    asyncio.run(main())
    too_long = {**options, "max_seq_len": 512}
    with pytest.raises(ConfigError, match="max_seq_len"):
        LocalBackend.from_config(config_from_dict({"backend": too_long}))


def test_tokenizer_loads_offline_and_refuses_what_a_backend_cannot_use(tmp_path: Path) -> None:
    vocab = save_tokenizer(tmp_path / "chat")
    tok = load_tokenizer(tmp_path / "chat", setting="backend.tokenizer")
    assert (tok.eos_token, tok.eos_token_id, tok.vocab_size) == ("<|im_end|>", 2, vocab)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools)
    assert tok.decode(ids) == "user:hiassistant:"  # special tokens are skipped
    no_prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=False
    )
    assert tok.decode(no_prompt) == "user:hi"

    save_tokenizer(tmp_path / "base", chat_template=None)
    assert load_tokenizer(tmp_path / "base", setting="backend.tokenizer").encode("ab") == [68, 69]
    with pytest.raises(ConfigError, match=r"no chat template: set backend\.model_path"):
        load_tokenizer(tmp_path / "base", setting="backend.model_path", require_chat_template=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"backend\.model_path must be a directory holding"):
        load_tokenizer(tmp_path / "empty", setting="backend.model_path")
