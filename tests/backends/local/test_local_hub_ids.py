"""`backend.model_path` as a Hub id: read from the local Hugging Face cache, never downloaded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rllm_async.backends.local import LocalBackend  # noqa: E402
from rllm_async.backends.local.hf import load_checkpoint  # noqa: E402
from rllm_async.config import config_from_dict  # noqa: E402
from rllm_async.protocols import SamplingParams  # noqa: E402
from tests.backends.local.test_local_hf import save_model, save_tokenizer  # noqa: E402


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, with the Hub out of reach."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_a_cached_hub_id_loads_from_its_snapshot(hub_cache: Path, monkeypatch) -> None:
    torch.manual_seed(0)
    repo = hub_cache / "models--tiny-org--Tiny-Qwen2.5-0.1B"
    snapshot = repo / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    reference = save_model(snapshot, "qwen2", save_tokenizer(snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("ab" * 20)
    monkeypatch.chdir(hub_cache.parent)  # no directory of that name here

    ckpt = load_checkpoint(Path("tiny-org/Tiny-Qwen2.5-0.1B"))
    ids = torch.randint(0, ckpt.config.vocab_size, (1, 8))
    backend_options = {"model_path": "tiny-org/Tiny-Qwen2.5-0.1B", "max_seq_len": 64}
    cfg = config_from_dict({"backend": backend_options, "rollout": {"max_tokens": 4}})

    async def sample() -> list[int]:
        backend = LocalBackend.from_config(cfg)
        try:
            out = await backend.policy().generate(ids[0].tolist(), SamplingParams(max_tokens=4))
            return out.ids
        finally:
            await backend.close()

    assert asyncio.run(sample())
    assert torch.equal(ckpt.state["embed_tokens.weight"], reference.model.embed_tokens.weight)


def test_an_uncached_hub_id_says_how_to_get_it(hub_cache: Path) -> None:
    with pytest.raises(ValueError, match=r"hf download Qwen/Qwen2\.5-0\.5B-Instruct") as e:
        load_checkpoint(Path("Qwen/Qwen2.5-0.5B-Instruct"))
    assert "nothing is downloaded" in str(e.value) and str(hub_cache) in str(e.value)
