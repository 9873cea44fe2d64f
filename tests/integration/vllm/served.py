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


def engine_core(server: VLLMServer) -> int:
    """The pid of `server`'s engine core, a process of its group."""
    assert server.pid is not None
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            comm = (stat.parent / "comm").read_text()
        except OSError:  # it ended while we looked
            continue
        if int(fields[2]) == server.pid and comm.startswith("VLLM::EngineCor"):
            found.append(int(stat.parent.name))
    [core] = found
    return core


class Reference:
    """A float32 `transformers` forward pass of a checkpoint, loaded once for many completions."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()

    def logprobs(
        self, prompt: list[int], completion: list[int], temperature: float = 1.0
    ) -> list[float]:
        """Logprobs of `completion` after `prompt` at `temperature` (the raw logits at 0, as a
        greedy sampler reports them)."""
        import torch

        ids = torch.tensor([[*prompt, *completion]])
        with torch.no_grad():
            logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        return logp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


def hf_logprobs(
    model_dir: Path, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> list[float]:
    """Logprobs of `completion` after `prompt` from a float32 `transformers` forward pass of
    `model_dir`, at `temperature` (see `Reference.logprobs`)."""
    return Reference(model_dir).logprobs(prompt, completion, temperature)


def max_gap(a: list[float], b: list[float]) -> float:
    """The largest difference between two equally long lists of logprobs."""
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


async def metric(url: str, name: str) -> float:
    """A Prometheus metric of the server at `url`, summed over its labels."""
    async with httpx.AsyncClient(base_url=url, timeout=10, trust_env=False) as http:
        return _metric((await http.get("/metrics")).text, name)


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
