"""A tiny random Qwen3 checkpoint with a locally trained byte-level BPE tokenizer, built offline.

Real Hugging Face files (config.json, safetensors, tokenizer.json, a ChatML chat template that
renders tools the Qwen/Hermes way), so that vLLM, `transformers` and the local backend all load
it; the weights are random, so it is for plumbing and speed, not for quality. Deterministic: the
same arguments give the same files.

    python -m rllm_async.models.tiny_qwen OUT_DIR [--hidden 256] [--layers 2] [--tie]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# ChatML, with tools listed in the system turn and calls as `<tool_call>` JSON blocks (the syntax
# `rllm_async.rollout.tool_calls` parses). An assistant turn renders as its text, its calls and
# `<|im_end|>`: what the model generated, so turn k+1's prompt extends turn k's tokens.
CHAT_TEMPLATE = """\
{%- if tools or messages[0].role == 'system' %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% if tools %}{{ '\\n\\n' }}{% endif %}{% endif %}
{%- if tools %}# Tools

You may call functions. Their signatures, within <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one with a JSON object within <tool_call></tool_call>:
<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>
{%- endif %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% if not loop.first %}<|im_start|>system
{{ m.content }}<|im_end|>
{% endif %}
{%- elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}{% set f = call.function or call %}<tool_call>\
{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Single tokens, as in Qwen's vocabulary, but not special: decoded text keeps them for the parser.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
WORDS = "the a one two three plus minus times equals answer question what is think step result"


def _corpus() -> list[str]:
    """Deterministic training text: arithmetic questions and word sequences."""
    lines = [f"what is {a} plus {b}? the answer is {a + b}." for a in range(30) for b in range(30)]
    words = WORDS.split()
    lines += [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(200)]
    lines += ['<tool_call>{"name": "calc", "arguments": {"expr": "3*4"}}</tool_call>'] * 20
    return lines


def build_tokenizer(out_dir: Path, vocab_size: int = 1024) -> int:
    """Train a byte-level BPE tokenizer with the chat template, save it in `out_dir`; its size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return len(fast)


def build_tiny_qwen(
    out_dir: Path,
    *,
    hidden: int = 256,
    layers: int = 2,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """Write a random Qwen3 (`hidden` wide, `layers` deep, float32) and its tokenizer to `out_dir`.

    Heads are 64 wide (`hidden // 64` query heads, half as many key/value heads), the MLP twice
    `hidden`. Untied embeddings by default: vLLM reloads tied ones incorrectly.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if hidden % 128:
        raise ValueError(f"hidden={hidden} must be a multiple of 128 (64-wide heads, GQA 2:1)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out_dir)
    ids = {
        t["content"]: t["id"]
        for t in json.loads((out_dir / "tokenizer.json").read_text())["added_tokens"]
    }
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=None,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tie", action="store_true", help="tie the output layer to the embeddings")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.monotonic()
    out = build_tiny_qwen(
        args.out_dir,
        hidden=args.hidden,
        layers=args.layers,
        tie_word_embeddings=args.tie,
        seed=args.seed,
    )
    print(f"built {out} in {time.monotonic() - start:.1f}s")


if __name__ == "__main__":
    main()
