"""`rllm-async serve`: the gateway alone, answering with a run's checkpoint or a fresh policy;
with `--train`, the gateway of an online run that trains on the episodes its clients reward."""

from __future__ import annotations

import json
from pathlib import Path

from rllm_async.backends import get_backend_factory
from rllm_async.callbacks import Callback
from rllm_async.checkpoint import load as load_checkpoint
from rllm_async.config import BackendConfig, Config, ConfigError, config_from_dict
from rllm_async.gateway.server import Gateway
from rllm_async.protocols import SamplingParams
from rllm_async.runner import configured_parser
from rllm_async.trainer import UnifiedTrainer
from rllm_async.workflows.online import OnlineWorkflow, slots

# An online run's dispatched group waits this long for its episodes unless `rollout.timeout_s` is
# set: a rollout's deadline is the time between a dispatch and the rewards of a whole group.
ONLINE_WAIT_S = 86_400.0

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
            constraints=config.rollout.constraints,
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


def online_trainer(
    config: Config, *, host: str, port: int, api_key: str | None, model: str
) -> UnifiedTrainer:
    """A trainer of `config` whose rollouts are the episodes that clients of the gateway at
    `host:port` run and reward (`OnlineWorkflow`); it prints the gateway's URL once serving.
    Unless `rollout.timeout_s` is set, a dispatched group waits `ONLINE_WAIT_S` for its episodes."""
    for split in ("train", "eval"):
        if getattr(config.data, split) is not None:
            raise ConfigError(
                f"data.{split} is set, but online training takes its episodes from the gateway's "
                f"clients: remove data.{split}"
            )
    if "timeout_s" not in config.rollout.model_fields_set:
        data = config.model_dump(mode="json", exclude_unset=True)
        config = config_from_dict(
            {**data, "rollout": {**data.get("rollout", {}), "timeout_s": ONLINE_WAIT_S}}
        )
    ro, on = config.rollout, config.online
    workflow = OnlineWorkflow(
        group_size=ro.group_size,
        sampling=SamplingParams(
            temperature=ro.temperature, top_p=ro.top_p, max_tokens=ro.max_tokens
        ),
        group_by=on.group_by,
        session_ttl_s=on.session_ttl_s,
        group_ttl_s=on.group_ttl_s,
        host=host,
        port=port,
        api_key=api_key,
        model=model,
        tool_parser=ro.tool_parser,
        reasoning_parser=ro.reasoning_parser,
        constraints=ro.constraints,
    )
    announce = _Announce(workflow, model)
    return UnifiedTrainer(config, workflow=workflow, train_tasks=slots(), callbacks=[announce])


class _Announce(Callback):
    """Prints the gateway's URL as one JSON line when training starts (as `serve` does)."""

    def __init__(self, workflow: OnlineWorkflow, model: str) -> None:
        self.workflow, self.model = workflow, model

    def on_train_start(self, step: int) -> None:
        assert self.workflow.gateway is not None
        url = self.workflow.gateway.url
        print(json.dumps({"url": url, "model": self.model, "version": step}), flush=True)
