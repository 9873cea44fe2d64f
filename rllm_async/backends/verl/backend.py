"""VerlBackend: verl's FSDP training workers in a Ray worker group, with the local sampler, the
project's vLLM engine, or verl's own rollout servers."""

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
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

from rllm_async.algorithms.losses import LossStats
from rllm_async.algorithms.schedule import learning_rate
from rllm_async.backends.hf_tokenizer import load_tokenizer
from rllm_async.backends.local.hf import load_checkpoint
from rllm_async.backends.verl import batch as verl_batch
from rllm_async.backends.verl.local_rollout import LocalRollout
from rllm_async.backends.verl.loss import LOSS_KEY
from rllm_async.backends.verl.options import VerlOptions, check_config
from rllm_async.backends.verl.server_rollout import ServerRollout, check_server_installed
from rllm_async.backends.verl.verl_config import verl_config
from rllm_async.backends.verl.vllm_rollout import VLLMRollout
from rllm_async.backends.verl.worker import VerlWorker
from rllm_async.config import Config, ConfigError, LossConfig
from rllm_async.engines.vllm.engine import vllm_metrics
from rllm_async.protocols import PolicyClient
from rllm_async.types import TrajectoryGroup

T = TypeVar("T")
CHECKPOINT_FILE = "verl_backend.json"


class VerlBackend:
    """verl 0.9's split-step actor workers (FSDP) on Ray, fed one micro-batch per call.

    Rollout is `LocalRollout` (the local sampler in this process, fed with weights exported from
    the workers), `VLLMRollout` (the project's vLLM engine, fed with the same export) or
    `ServerRollout` (verl's vLLM/SGLang servers, fed by its checkpoint engines).
    """

    options: ClassVar[type[VerlOptions]] = VerlOptions
    virtual_clock: ClassVar[bool] = False

    @classmethod
    def shares_device(cls, options: dict[str, Any]) -> bool | None:
        """Whether generation and training share devices under these `backend:` options."""
        return VerlOptions.model_validate(options).shares_device

    @classmethod
    def decode_slots(cls, options: dict[str, Any]) -> int | None:
        """The most sequences decoded together under these `backend:` options."""
        return VerlOptions.model_validate(options).decode_slots

    def __init__(self, config: Config, opts: VerlOptions) -> None:
        self.config = config
        self.opts = opts
        self.temperature = config.rollout.temperature or 1.0
        path = Path(opts.model_path).expanduser()
        if opts.rollout == "local":
            ckpt = load_checkpoint(path)  # before Ray: a model the sampler cannot run stops here
            tokenizer: Any = ckpt.tokenizer
        else:
            if opts.verl_server is not None:
                check_server_installed(opts.verl_server)
            tokenizer = load_tokenizer(
                path, setting="backend.model_path", require_chat_template=True
            )
        self._filler = tokenizer.eos_token_id
        self._calls = concurrent.futures.ThreadPoolExecutor(1, "rllm-verl")
        cfg = verl_config(config, opts)
        self._started_ray = _start_ray(opts)
        try:
            self.workers = _worker_group(cfg.actor_rollout_ref, opts)
        except BaseException:
            self._shutdown_ray()
            raise
        try:
            self.rollout: LocalRollout | VLLMRollout | ServerRollout
            if opts.rollout == "local":
                seed = config.seed if opts.seed is None else opts.seed
                self.rollout = LocalRollout(ckpt, self.workers, opts, seed)
            elif opts.rollout == "vllm":  # the engine stops its servers if one fails to start
                self.rollout = VLLMRollout(config, opts, self.workers, tokenizer)
            else:
                self.rollout = ServerRollout(cfg, self.workers, opts, tokenizer)
                self.rollout.sync(0)  # the servers start without the trained weights
        except BaseException:
            self._stop_workers()
            self._shutdown_ray()
            raise
        self._stats = LossStats()
        # Micro-batches held until `optim_step` while colocated servers still sample.
        self._deferred: list[tuple[list[TrajectoryGroup], LossConfig]] = []
        self._step = 0
        self._version = 0
        self.export_s = 0.0  # seconds the last weight sync took (gather, transfer, load)
        self._vllm_pause_s = 0.0  # of that, the vLLM servers' pause to resume
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

    def policy(self) -> PolicyClient:
        return self.rollout.policy

    async def forward_backward(
        self, groups: list[TrajectoryGroup], loss: LossConfig
    ) -> dict[str, float]:
        """Send the groups' sequences to the workers; gradients accumulate until `optim_step`.

        With colocated servers the sequences wait for `optim_step`: the servers keep sampling the
        step's remaining groups, and the workers train once the servers sleep (as in verl).
        """
        if self.rollout.colocated:
            self._deferred.append((groups, loss))
        else:
            await self._forward_backward(groups, loss)
        return {}

    async def _forward_backward(self, groups: list[TrajectoryGroup], loss: LossConfig) -> None:
        rows = verl_batch.rows(groups)
        if not rows:
            return
        world = self.opts.world_size
        padded = rows + [verl_batch.filler_row(self._filler)] * (-len(rows) % world)
        data = verl_batch.to_tensordict(
            padded, temperature=self.temperature, extra={LOSS_KEY: loss.model_dump()}
        )
        output = await self._call(lambda: self.workers.forward_backward(data).get())
        logprobs = verl_batch.response_logprobs(output["log_probs"], padded)[: len(rows)]
        self._stats.merge(verl_batch.loss_stats(rows, logprobs, loss))

    async def optim_step(self) -> dict[str, float]:
        """Divide the step's summed gradients by its loss tokens, clip, and step with our LR."""
        if self._deferred:
            await self._call(self.rollout.pause)
            deferred, self._deferred = self._deferred, []
            for groups, loss in deferred:
                await self._forward_backward(groups, loss)
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
        if isinstance(self.rollout, VLLMRollout):
            metrics.update(vllm_metrics(self.rollout.engine, self._vllm_pause_s))
        self._stats = LossStats()
        self._step += 1
        return metrics

    async def on_policy_updated(self, version: int) -> None:
        """Move the trained weights to the rollout (sampler or servers) as `version`."""
        start = time.perf_counter()
        if isinstance(self.rollout, VLLMRollout):
            # Gathered and written on the call thread; loaded from the loop the client lives on.
            path = await self._call(self.rollout.export)
            self._vllm_pause_s = await self.rollout.load(path, version)
        else:
            await self._call(self.rollout.sync, version)
        self._version = version
        self.export_s = time.perf_counter() - start

    async def save(self, path: Path) -> None:
        """verl's FSDP checkpoint (weights, optimizer) under `path`/verl, and our step and version."""
        if self._stats.tokens > 0 or self._deferred:
            raise RuntimeError(
                "cannot checkpoint with gradients not yet applied: call optim_step()"
            )
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        await self._call(
            self.workers.save_checkpoint, str((path / "verl").resolve()), None, self._step
        )
        record = {"step": self._step, "version": self._version}
        (path / CHECKPOINT_FILE).write_text(json.dumps(record) + "\n")

    async def load(self, path: Path) -> None:
        """Restore what `save` wrote and move the restored weights to the rollout."""
        file = Path(path) / CHECKPOINT_FILE
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: is {path} a verl-backend checkpoint?")
        record = json.loads(file.read_text())
        await self._call(self.workers.load_checkpoint, str((Path(path) / "verl").resolve()))
        self._step = int(record["step"])
        self._stats = LossStats()
        self._deferred = []
        await self.on_policy_updated(int(record["version"]))

    async def close(self) -> None:
        """Stop the rollout, the workers and (when this backend started it) Ray; idempotent."""
        if self._closed:
            return
        self._closed = True
        await self.rollout.close()
        self._stop_workers()
        self._calls.shutdown(wait=True)
        self._shutdown_ray()

    def _stop_workers(self) -> None:
        for worker in self.workers.workers:
            ray.kill(worker)
        for group in self.workers.resource_pool.get_placement_groups():
            ray.util.remove_placement_group(group)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking worker-group call off the event loop, one at a time, in order."""
        if self._closed:
            raise RuntimeError("the verl backend is closed")
        return await asyncio.get_running_loop().run_in_executor(self._calls, fn, *args)

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
    need = opts.world_size + opts.rollout_gpus
    if have < need:
        if started:
            ray.shutdown()
        rollout = f" + rollout {opts.rollout_gpus}" if opts.rollout_gpus else ""
        raise ConfigError(
            f"backend verl needs {need} {kind}s (nodes {opts.nodes} x gpus_per_node "
            f"{opts.gpus_per_node}{rollout}), but the Ray cluster has {have:g}: lower "
            "nodes/gpus_per_node/rollout_nodes, or connect to a larger cluster with "
            "backend.ray_address"
        )
    return started


def _worker_group(actor_rollout_ref: Any, opts: VerlOptions) -> RayWorkerGroup:
    """The actor workers, one per device, with verl's FSDP engine built and our loss set.

    With colocated servers the workers also hold verl's rollout adapters (role `actor_rollout`),
    through which verl's hybrid replicas run on the same devices and load weights in-process.
    """
    cpu = opts.device == "cpu"
    env: dict[str, str] = {}
    if cpu:
        from rllm_async.backends.verl.cpu import worker_env

        env = worker_env()
    pool = RayResourcePool(
        process_on_nodes=[opts.gpus_per_node] * opts.nodes, use_gpu=not cpu, max_colocate_count=1
    )
    role = "actor_rollout" if opts.verl_server is not None and opts.colocated else "actor"
    init = RayClassWithInitArgs(cls=ray.remote(VerlWorker), config=actor_rollout_ref, role=role)
    group = RayWorkerGroup(
        resource_pool=pool, ray_cls_with_init=init, worker_env=env, device_name=opts.device
    )
    group.init_model()
    return group
