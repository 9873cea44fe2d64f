"""TinkerBackend: LoRA training and sampling on a Tinker server through the `tinker` SDK."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from pathlib import Path
from typing import Any, ClassVar

from rllm_async.algorithms.losses import LossStats
from rllm_async.algorithms.schedule import learning_rate
from rllm_async.backends.hf_tokenizer import load_tokenizer
from rllm_async.backends.tinker import sdk
from rllm_async.backends.tinker.data import Example, StepNormalizer, examples, loss_stats
from rllm_async.backends.tinker.options import (
    LOSS_FNS,
    TinkerOptions,
    check_config,
    check_loss,
    loss_fn_config,
)
from rllm_async.backends.tinker.policy import TinkerPolicy
from rllm_async.config import Config, ConfigError, LossConfig
from rllm_async.types import TrajectoryGroup

CHECKPOINT_FILE = "tinker.json"


class TinkerBackend:
    """Trains a LoRA adapter on a Tinker server; samplers are weight snapshots, one per version.

    The server connection opens on the first async call. `forward_backward` submits its request and
    returns once the previous one is done, so one micro-batch is always queued behind the running
    one (`pipeline_requests: false` awaits each instead); `optim_step` waits for all of them and
    reports the step's loss metrics. Without server snapshots, `optim_step` first lets the sample
    calls in flight finish and holds new ones until the next `on_policy_updated` (see TinkerPolicy).
    """

    options: ClassVar[type[TinkerOptions]] = TinkerOptions
    virtual_clock: ClassVar[bool] = False

    def __init__(self, config: Config, options: TinkerOptions, base_url: str) -> None:
        self.config = config
        self.opts = options
        self.base_url = base_url
        self._timeout = options.request_timeout_s
        tokenizer = load_tokenizer(
            options.tokenizer or options.base_model, setting="backend.tokenizer"
        )
        self._policy = TinkerPolicy(tokenizer, self._start, self._timeout, options.server_snapshots)
        self._normalizer = StepNormalizer(
            config.train.groups_per_update, options.server_loss_reduction
        )
        self._stats = LossStats()
        self._pending: list[tuple[Any, list[Example], LossConfig]] = []
        self._step = 0
        self._service: Any = None
        self._training: Any = None
        self._lock = asyncio.Lock()

    @classmethod
    def from_config(cls, config: Config) -> TinkerBackend:
        """Validate options, refuse what Tinker cannot do, check the key and that the server answers."""
        options = check_config(config)
        sdk.require_credentials(options.api_key)
        base_url = sdk.resolve_base_url(options.base_url)
        backend = cls(config, options, base_url)
        sdk.wait_reachable(base_url, options.connect_timeout_s, options.connect_attempts)
        return backend

    def policy(self) -> TinkerPolicy:
        return self._policy

    def _session(self) -> Any:
        """The SDK's service client (one per backend)."""
        if self._service is None:
            self._service = sdk.service_client(self.base_url, self.opts.api_key)
        return self._service

    async def _start(self) -> None:
        """Create the LoRA training client and the first sampler (once)."""
        if self._training is not None:
            return
        async with self._lock:
            if self._training is not None:
                return
            o = self.opts
            training = await sdk.training_client(
                self._session(),
                self._timeout,
                base_model=o.base_model,
                rank=o.lora_rank,
                seed=self.config.seed,
                train_mlp=o.train_mlp,
                train_attn=o.train_attn,
                train_unembed=o.train_unembed,
            )
            sampler = await sdk.snapshot_sampler(training, self._timeout)
            self._policy.publish(self._policy.latest, sampler)
            self._training = training

    async def forward_backward(
        self, groups: list[TrajectoryGroup], loss: LossConfig
    ) -> dict[str, float]:
        """Submit one micro-batch's forward/backward, then wait for the one submitted before it."""
        check_loss(loss)
        await self._start()
        batch = examples(groups)
        if batch:
            self._normalizer.weigh(groups, batch)
            data = [sdk.datum(e.inputs, e.targets, e.logprobs, e.sent_advantages()) for e in batch]
            future = sdk.forward_backward(
                self._training, data, LOSS_FNS[loss.name], loss_fn_config(loss)
            )
            self._pending.append((future, batch, loss))
        await self._drain(keep=1 if self.opts.pipeline_requests else 0)
        return {}

    async def optim_step(self) -> dict[str, float]:
        """Submit the step with our LR, wait for every pending micro-batch and the step itself.

        Without server snapshots, sampling is frozen from here to the next `on_policy_updated`.
        """
        await self._start()
        optim = self.config.optim
        lr = learning_rate(optim, self._step, self.config.train.total_steps)
        params = sdk.adam_params(lr, optim.betas, optim.weight_decay, optim.grad_clip)
        await self._policy.freeze()
        try:
            future = sdk.optim_step(self._training, params)
            await self._drain(keep=0)
            response = await sdk.call("optim_step", future, self._timeout)
        except BaseException:
            self._policy.thaw()
            raise
        self._step += 1
        metrics = {"optim/lr": lr, **self._stats.metrics(), **self._normalizer.close_step()}
        metrics.update({f"tinker/{k}": v for k, v in sdk.optim_metrics(response).items()})
        self._stats = LossStats()
        return metrics

    async def _drain(self, keep: int) -> None:
        """Wait for all but the newest `keep` pending forward/backward results."""
        while len(self._pending) > keep:
            future, batch, loss = self._pending.pop(0)
            output = await sdk.call("forward_backward", future, self._timeout)
            self._stats.merge(loss_stats(batch, sdk.output_logprobs(output), loss))

    async def on_policy_updated(self, version: int) -> None:
        """Snapshot the trained weights into a new sampler for `version`."""
        await self._start()
        self._policy.publish(version, await sdk.snapshot_sampler(self._training, self._timeout))

    async def save(self, path: Path) -> None:
        """Save weights + optimizer state on the server; `path` records where, for `load`."""
        await self._start()
        run = re.sub(r"[^A-Za-z0-9_-]", "-", self.config.name)[:64]
        name = f"{run}-step{self._step}-{uuid.uuid4().hex[:8]}"
        state = await sdk.save_state(self._training, name, self._timeout)
        record = {
            "state_path": state,
            "step": self._step,
            "base_model": self.opts.base_model,
            "lora_rank": self.opts.lora_rank,
            "normalizer": self._normalizer.per_group,
        }
        path.mkdir(parents=True, exist_ok=True)
        (path / CHECKPOINT_FILE).write_text(json.dumps(record, indent=2) + "\n")

    async def load(self, path: Path) -> None:
        """Continue from a `save`d checkpoint: a training client restored with its optimizer state."""
        file = path / CHECKPOINT_FILE
        if not file.is_file():
            raise ConfigError(f"{path} is not a Tinker checkpoint: it has no {CHECKPOINT_FILE}")
        record = json.loads(file.read_text())
        for key in ("base_model", "lora_rank"):
            if record[key] != getattr(self.opts, key):
                raise ConfigError(
                    f"checkpoint {path} was trained with backend.{key}={record[key]!r}, but this "
                    f"run has {getattr(self.opts, key)!r}: use the same {key} to resume"
                )
        async with self._lock:
            self._pending.clear()
            self._training = await sdk.training_client_from_state(
                self._session(), record["state_path"], self._timeout
            )
        sampler = await sdk.snapshot_sampler(self._training, self._timeout)
        self._policy.publish(self._policy.latest, sampler)
        self._step = int(record["step"])
        per_group = record.get("normalizer")
        self._normalizer.per_group = (
            (float(per_group[0]), float(per_group[1])) if per_group else None
        )

    async def close(self) -> None:
        """Drop pending results and end the session."""
        self._pending.clear()
        self._policy.thaw()
        if self._service is not None:
            await sdk.close(self._service, min(self._timeout, 30.0))
        self._service = self._training = None
