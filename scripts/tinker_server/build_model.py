"""Build a tiny random-weight Qwen3 checkpoint and a byte-level BPE tokenizer, all offline.

Runs inside the SkyRL venv (it needs torch, transformers and tokenizers):
    .venv-skyrl/bin/python scripts/tinker_server/build_model.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = "the a one two three plus minus times equals answer question what is think step result"


def _corpus() -> list[str]:
    """Deterministic training text: arithmetic chat lines and word sequences."""
    lines = [f"what is {a} plus {b}? the answer is {a + b}." for a in range(30) for b in range(30)]
    words = WORDS.split()
    lines += [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(200)]
    return lines


def build_tokenizer(out: Path, vocab_size: int) -> int:
    """Train and save a byte-level BPE tokenizer with a ChatML template; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(fast)


def build_model(out: Path, vocab: int, eos_id: int, pad_id: int) -> None:
    """Save a randomly initialised two-layer Qwen3 (hidden size 64) as safetensors."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        dtype="float32",
    )
    Qwen3ForCausalLM(config).save_pretrained(out, safe_serialization=True)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out, vocab_size=512)
    special = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in special}
    build_model(out, vocab, eos_id=ids["<|im_end|>"], pad_id=ids["<|endoftext|>"])
    print(f"built {out} (vocab {vocab})")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
