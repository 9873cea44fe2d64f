"""VerlBackend: training on verl's FSDP workers in a Ray worker group, sampling in this process."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import ray
import torch
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

from rllm_async.algorithms.losses import LossStats
from rllm_async.algorithms.schedule import learning_rate
from rllm_async.backends.local.backend import DTYPES, LocalPolicy
from rllm_async.backends.local.hf import load_checkpoint
from rllm_async.backends.local.model import ModelConfig, load_model
from rllm_async.backends.local.sampler import Sampler
from rllm_async.backends.local.snapshots import WeightStore
from rllm_async.backends.verl import batch as verl_batch
from rllm_async.backends.verl.loss import LOSS_KEY
from rllm_async.backends.verl.options import VerlOptions, check_config
from rllm_async.backends.verl.verl_config import actor_config
from rllm_async.backends.verl.worker import VerlWorker
from rllm_async.config import Config, ConfigError, LossConfig
from rllm_async.types import TrajectoryGroup

T = TypeVar("T")
CHECKPOINT_FILE = "verl_backend.json"


class VerlBackend:
    """verl 0.9's split-step actor workers (FSDP) on Ray, fed one micro-batch per call.

    Rollout runs on the local backend's dynamic-batching sampler in this process; after every
    update, the trained weights are exported from the workers and published as the new version.
    """

    options: ClassVar[type[VerlOptions]] = VerlOptions
    virtual_clock: ClassVar[bool] = False

    def __init__(self, config: Config, opts: VerlOptions) -> None:
        self.config = config
        self.opts = opts
        self.temperature = config.rollout.temperature or 1.0
        ckpt = load_checkpoint(Path(opts.model_path).expanduser())
        self.model_cfg: ModelConfig = ckpt.config
        self.sampler_device = torch.device(opts.sampler_device)
        self.sampler_dtype = DTYPES[opts.sampler_dtype]
        self.store = WeightStore(0, self._snapshot(ckpt.state))
        self.sampler = Sampler(
            self.store,
            ckpt.tokenizer,
            ckpt.stop_ids,
            max_batch=opts.max_batch,
            max_seq_len=opts.max_seq_len,
            device=self.sampler_device,
            dtype=self.sampler_dtype,
            threads=opts.sampler_threads,
            seed=config.seed if opts.seed is None else opts.seed,
        )
        self._policy = LocalPolicy(self.sampler, self.store)
        self._filler = ckpt.tokenizer.eos_token_id
        self._calls = concurrent.futures.ThreadPoolExecutor(1, "rllm-verl")
        self._started_ray = _start_ray(opts)
        try:
            self.workers = _worker_group(config, opts)
        except BaseException:
            self._shutdown_ray()
            raise
        self._stats = LossStats()
        self._step = 0
        self.export_s = 0.0  # seconds the last weight export took (gather, transfer, load)
        self._closed = False

    @classmethod
    def from_config(cls, config: Config) -> VerlBackend:
        """Validate options, refuse what cannot run, start Ray and the training workers."""
        opts = check_config(config)
        try:
            return cls(config, opts)
        except ConfigError:
            raise
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"backend verl: {e}") from e

    def policy(self) -> LocalPolicy:
        return self._policy

    async def forward_backward(
        self, groups: list[TrajectoryGroup], loss: LossConfig
    ) -> dict[str, float]:
        """Send the groups' sequences to the workers; gradients accumulate until `optim_step`."""
        rows = verl_batch.rows(groups)
        if not rows:
            return {}
        world = self.opts.world_size
        padded = rows + [verl_batch.filler_row(self._filler)] * (-len(rows) % world)
        data = verl_batch.to_tensordict(
            padded, temperature=self.temperature, extra={LOSS_KEY: loss.model_dump()}
        )
        output = await self._call(lambda: self.workers.forward_backward(data).get())
        logprobs = verl_batch.response_logprobs(output["log_probs"], padded)[: len(rows)]
        self._stats.merge(verl_batch.loss_stats(rows, logprobs, loss))
        return {}

    async def optim_step(self) -> dict[str, float]:
        """Divide the step's summed gradients by its loss tokens, clip, and step with our LR."""
        lr = learning_rate(self.config.optim, self._step, self.config.train.total_steps)
        tokens = self._stats.tokens
        grad_norm = 0.0
        if tokens > 0:
            results = await self._call(
                self.workers.optimizer_step_scaled, 1.0 / tokens, {"lr": float(lr)}
            )
            grad_norm = float(results[0].get("grad_norm", 0.0))
        else:
            await self._call(self.workers.optimizer_zero_grad)
        metrics = {
            "optim/lr": lr,
            "optim/grad_norm": grad_norm,
            "optim/num_tokens": tokens,
            **self._stats.metrics(),
        }
        self._stats = LossStats()
        self._step += 1
        return metrics

    async def on_policy_updated(self, version: int) -> None:
        """Export the trained weights from the workers and publish them to the sampler."""
        start = time.perf_counter()
        state = await self._call(lambda: self.workers.export_weights()[0])
        self.store.publish(version, self._snapshot(state))
        self.export_s = time.perf_counter() - start

    async def save(self, path: Path) -> None:
        """verl's FSDP checkpoint (weights, optimizer) under `path`/verl, and our step and version."""
        if self._stats.tokens > 0:
            raise RuntimeError(
                "cannot checkpoint with gradients not yet applied: call optim_step()"
            )
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        await self._call(
            self.workers.save_checkpoint, str((path / "verl").resolve()), None, self._step
        )
        record = {"step": self._step, "version": self.store.latest}
        (path / CHECKPOINT_FILE).write_text(json.dumps(record) + "\n")

    async def load(self, path: Path) -> None:
        """Restore what `save` wrote and publish the restored weights to the sampler."""
        file = Path(path) / CHECKPOINT_FILE
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: is {path} a verl-backend checkpoint?")
        record = json.loads(file.read_text())
        await self._call(self.workers.load_checkpoint, str((Path(path) / "verl").resolve()))
        self._step = int(record["step"])
        self._stats = LossStats()
        await self.on_policy_updated(int(record["version"]))

    async def close(self) -> None:
        """Stop the sampler, the workers and (when this backend started it) Ray; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.sampler.close()
        for worker in self.workers.workers:
            ray.kill(worker)
        for group in self.workers.resource_pool.get_placement_groups():
            ray.util.remove_placement_group(group)
        self._calls.shutdown(wait=True)
        self._shutdown_ray()

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking worker-group call off the event loop, one at a time, in order."""
        if self._closed:
            raise RuntimeError("the verl backend is closed")
        return await asyncio.get_running_loop().run_in_executor(self._calls, fn, *args)

    def _snapshot(self, state: dict[str, torch.Tensor]) -> Any:
        """A frozen sampler model from Hugging Face-named weights."""
        tensors = {name.removeprefix("model."): t for name, t in state.items()}
        model = load_model(self.model_cfg, tensors, self.sampler_device, self.sampler_dtype)
        return model.eval().requires_grad_(False)

    def _shutdown_ray(self) -> None:
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


def _start_ray(opts: VerlOptions) -> bool:
    """Connect to `ray_address`, or start Ray here; check it has the devices; True if started."""
    started = False
    if not ray.is_initialized():
        num_cpus = None
        if opts.ray_address is None:
            num_cpus = opts.ray_num_cpus or max(os.cpu_count() or 1, opts.world_size + 1)
        ray.init(address=opts.ray_address, num_cpus=num_cpus, include_dashboard=False)
        started = True
    kind = "GPU" if opts.device == "cuda" else "CPU"
    have = ray.cluster_resources().get(kind, 0)
    if have < opts.world_size:
        if started:
            ray.shutdown()
        raise ConfigError(
            f"backend verl needs {opts.world_size} {kind}s (nodes {opts.nodes} x gpus_per_node "
            f"{opts.gpus_per_node}), but the Ray cluster has {have:g}: lower nodes/gpus_per_node, "
            "or connect to a larger cluster with backend.ray_address"
        )
    return started


def _worker_group(config: Config, opts: VerlOptions) -> RayWorkerGroup:
    """The actor workers, one per device, with verl's FSDP engine built and our loss set."""
    cpu = opts.device == "cpu"
    env: dict[str, str] = {}
    if cpu:
        from rllm_async.backends.verl.cpu import worker_env

        env = worker_env()
    pool = RayResourcePool(
        process_on_nodes=[opts.gpus_per_node] * opts.nodes, use_gpu=not cpu, max_colocate_count=1
    )
    init = RayClassWithInitArgs(
        cls=ray.remote(VerlWorker), config=actor_config(config, opts), role="actor"
    )
    group = RayWorkerGroup(
        resource_pool=pool, ray_cls_with_init=init, worker_env=env, device_name=opts.device
    )
    group.init_model()
    return group
