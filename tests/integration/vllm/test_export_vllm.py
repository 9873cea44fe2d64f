"""A model exported by `rllm-async export` is served by a real vLLM server: its chat endpoint
answers with the exported chat template, and its logprobs are our decoder's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rllm_async.backends.hf_tokenizer import load_tokenizer
from rllm_async.backends.local.hf import load_checkpoint
from rllm_async.backends.local.model import Transformer, preset_config
from rllm_async.backends.toy_tokenizers import CharTokenizer
from rllm_async.cli import main
from rllm_async.engines.vllm import VLLMPolicy, VLLMServer
from rllm_async.engines.vllm.server import SERVED_NAME
from rllm_async.protocols import Completion, SamplingParams, Tokenizer
from tests.test_export import our_model, trained_run

CONTEXT = 64  # the runs' backend.max_seq_len, which the export declares as its context
# Float32 serving against a float32 forward (tests/integration/vllm/test_generate.py).
TOLERANCE = 1e-3
CHAT = [{"role": "user", "content": "2+3?"}]


def served(out: Path, log: Path, prompt: list[int]) -> tuple[dict[str, Any], Completion]:
    """A chat completion and a token-level completion of `prompt` from a server of `out`."""

    async def go() -> tuple[dict[str, Any], Completion]:
        async with VLLMServer(out, log_path=log, dtype="float32", max_model_len=CONTEXT) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                chat = await http.post(
                    "/v1/chat/completions",
                    json={
                        "model": SERVED_NAME,
                        "messages": CHAT,
                        "max_tokens": 8,
                        "temperature": 0,
                    },
                )
                chat.raise_for_status()
            tok = load_tokenizer(out, setting="model")
            async with VLLMPolicy([server.url], tok, max_context_tokens=CONTEXT) as policy:
                params = SamplingParams(temperature=1.0, max_tokens=12, seed=5)
                return chat.json(), await policy.generate(prompt, params)

    return asyncio.run(go())


def our_logprobs(model: Transformer, prompt: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt, *completion]]))[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


@pytest.mark.parametrize("source", ["preset", "tiny-qwen"])
def test_vllm_serves_an_export_with_our_logprobs(tmp_path: Path, source: str) -> None:
    if source == "preset":
        # `small`: the `tiny` preset's 16-wide heads are refused by vLLM's CPU attention, which
        # runs head sizes 32, 64, 80, ... (vllm/v1/attention/backends/cpu_attn.py).
        run_dir = trained_run(tmp_path, model="small")
        tokenizer: Tokenizer = CharTokenizer()
        cfg = preset_config("small", CharTokenizer().vocab_size)
    else:
        from rllm_async.models.tiny_qwen import build_tiny_qwen

        checkpoint = load_checkpoint(build_tiny_qwen(tmp_path / "tiny-qwen"))
        run_dir = trained_run(tmp_path, model_path=str(tmp_path / "tiny-qwen"))
        tokenizer, cfg = checkpoint.tokenizer, checkpoint.config
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "3 5 -> 8"}])
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    chat, completion = served(out, tmp_path / "vllm.log", prompt)
    assert isinstance(chat["choices"][0]["message"]["content"], str)
    # The server rendered the chat with the exported template: the tokens our tokenizer gives.
    assert chat["usage"]["prompt_tokens"] == len(tokenizer.apply_chat_template(CHAT))
    expected = our_logprobs(our_model(run_dir, cfg), prompt, completion.ids)
    gap = max(abs(a - b) for a, b in zip(completion.logprobs, expected, strict=True))
    assert gap < TOLERANCE, gap
