"""`rllm-async serve`: the gateway alone, answering with a run's checkpoint or a fresh policy."""

from __future__ import annotations

import json
from pathlib import Path

from rllm_async.backends import get_backend_factory
from rllm_async.backends.base import SamplingParams
from rllm_async.checkpoint import load as load_checkpoint
from rllm_async.config import BackendConfig, Config, ConfigError
from rllm_async.gateway.server import Gateway
from rllm_async.runner import configured_parser

# `serve`'s context when the config sets no `backend.max_seq_len` (training's default, 256 tokens,
# is too short for an agent's first request); a checkpoint with a shorter one keeps its own.
SERVE_CONTEXT_TOKENS = 4096


async def serve(
    config: Config,
    *,
    checkpoint: Path | None,
    host: str,
    port: int,
    api_key: str | None,
    model: str,
    export_path: Path | None,
) -> None:
    """Serve until SIGINT/SIGTERM; open sessions are exported (when asked) and closed at the end."""
    factory = get_backend_factory(config.backend.name)
    if getattr(factory, "virtual_clock", False):
        raise ConfigError(f"backend {config.backend.name} runs on a virtual clock and cannot serve")
    backend = factory.from_config(full_context(config))
    try:
        if checkpoint is not None:
            await load_checkpoint(checkpoint, backend)
        sampling = SamplingParams(
            temperature=config.rollout.temperature,
            top_p=config.rollout.top_p,
            max_tokens=config.rollout.max_tokens,
        )
        policy = backend.policy()
        gateway = Gateway(
            policy,
            model=model,
            api_key=api_key,
            sampling=sampling,
            open_sessions=True,
            export_path=export_path,
            parser=configured_parser(config, policy),
        )
        await gateway.start(host, port, embedded=False)
        print(json.dumps({"url": gateway.url, "model": model, "checkpoint": str(checkpoint)}))
        try:
            await gateway.wait()
        finally:
            await gateway.stop()
    finally:
        await backend.close()


def full_context(config: Config) -> Config:
    """`config` with the local policy's whole context (`SERVE_CONTEXT_TOKENS`, or its checkpoint's
    own limit when smaller) unless `backend.max_seq_len` is set."""
    options = config.backend.options
    if config.backend.name != "local" or "max_seq_len" in options:
        return config
    limit = SERVE_CONTEXT_TOKENS
    if options.get("model_path"):
        checkpoint = Path(options["model_path"]).expanduser() / "config.json"
        if checkpoint.is_file():
            hf = json.loads(checkpoint.read_text())
            for key in ("max_position_embeddings", "sliding_window"):
                if isinstance(hf.get(key), int):
                    limit = min(limit, hf[key])
    backend = BackendConfig.model_validate({**config.backend.model_dump(), "max_seq_len": limit})
    return config.model_copy(update={"backend": backend})
