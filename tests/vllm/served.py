"""What the vLLM tests share: how their servers are made, and a reference forward pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
