"""`rllm-async serve`: the gateway alone, answering with a run's checkpoint or a fresh policy."""

from __future__ import annotations

import json
from pathlib import Path

from rllm_async.backends import get_backend_factory
from rllm_async.backends.base import SamplingParams
from rllm_async.checkpoint import load as load_checkpoint
from rllm_async.config import Config, ConfigError
from rllm_async.gateway.server import Gateway


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
    backend = factory.from_config(config)
    try:
        if checkpoint is not None:
            await load_checkpoint(checkpoint, backend)
        sampling = SamplingParams(
            temperature=config.rollout.temperature,
            top_p=config.rollout.top_p,
            max_tokens=config.rollout.max_tokens,
        )
        gateway = Gateway(
            backend.policy(),
            model=model,
            api_key=api_key,
            sampling=sampling,
            open_sessions=True,
            export_path=export_path,
        )
        await gateway.start(host, port, embedded=False)
        print(json.dumps({"url": gateway.url, "model": model, "checkpoint": str(checkpoint)}))
        try:
            await gateway.wait()
        finally:
            await gateway.stop()
    finally:
        await backend.close()
