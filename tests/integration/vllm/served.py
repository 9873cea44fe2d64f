"""What the vLLM tests share: how their servers are made, and a reference forward pass."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from rllm_async.engines.vllm import VLLMServer

CONTEXT = 1024


def make_server(model: Path, log_dir: Path, index: int, **kwargs: Any) -> VLLMServer:
    """A float32 server for `model`, so that its logprobs match a float32 forward closely."""
    return VLLMServer(
        model,
        log_path=log_dir / f"vllm-{index}.log",
        dtype="float32",
        max_model_len=CONTEXT,
        **kwargs,
    )


def hf_logprobs(
    model_dir: Path, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> list[float]:
    """Logprobs of `completion` after `prompt` from a float32 `transformers` forward pass, at
    `temperature` (the raw logits at 0, as a greedy sampler reports them)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[*prompt, *completion]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


def _metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples (over its labels) in a /metrics answer."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def wait_generating(url: str, tokens: int, timeout_s: float = 60.0) -> None:
    """Wait until the server's engine has sampled `tokens` more tokens, by its own /metrics: on a
    loaded machine the HTTP front end hands requests to the engine seconds late, and a sync
    before that finds nothing in flight."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        start = _metric((await http.get("/metrics")).text, "vllm:generation_tokens_total")
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    text = (await http.get("/metrics")).text
                except httpx.TransportError:  # a keep-alive connection closed under us: again
                    continue
                if _metric(text, "vllm:generation_tokens_total") - start >= tokens:
                    return
                await asyncio.sleep(0.05)
