"""A CPU stand-in for verl's vLLM rollout server, registered under verl's name `vllm`.

This is the only fake in the server-rollout tests. vLLM cannot run here (no GPU), so importing this
module makes verl's registries resolve `vllm` to the classes below, in every process that imports
it: the test process, and the training workers (through `model.external_lib=server_stub`, which
verl imports when it builds a model config). Everything around them is verl's own:
`LLMServerManager`, its router and client, the hybrid replica layout, `CheckpointEngineManager`
with the `naive` engine, and the workers' `update_weights`.

- `StubServer` is a Ray actor with the token-in/token-out surface verl's vLLM server offers
  (`generate` -> `TokenOutput` with `global_steps`, abort/resume gate, sleep/wake, weight version).
  It samples with the local backend's `Sampler`, one token per call so that an abort returns the
  tokens so far, as vLLM does, and it refuses to generate while asleep or load weights it was not
  woken for, so a wrong order of calls fails the tests.
- `StubServerAdapter` is the worker-side rollout (verl's `ServerAdapter` role): it receives the
  weights verl's `update_weights(mode="naive")` gathers and hands them to its replica's server.
- `StubReplica` is the `RolloutReplica` that starts one `StubServer` per replica.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import ray
import torch
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

from rllm_async.backends.local.hf import load_checkpoint
from rllm_async.backends.local.model import load_model
from rllm_async.backends.local.sampler import Sampler
from rllm_async.backends.local.snapshots import WeightStore
from rllm_async.protocols import SamplingParams

NAME = "vllm"


def server_name(replica_rank: int) -> str:
    return f"rllm_stub_server_{replica_rank}"


class StubServer:
    """One replica's server: the local sampler behind verl's vLLM-server calls."""

    def __init__(self, model_path: str, max_model_len: int, dummy: bool) -> None:
        ckpt = load_checkpoint(Path(model_path))
        self.cfg = ckpt.config
        self.tokenizer = ckpt.tokenizer
        state = ckpt.state
        if dummy:  # verl's load_format: dummy, random weights until the first sync
            gen = torch.Generator().manual_seed(1)
            state = {k: torch.randn(v.shape, generator=gen) * 0.5 for k, v in state.items()}
        self.store = WeightStore(-1, self._model(state))
        self.sampler = Sampler(
            self.store,
            ckpt.tokenizer,
            ckpt.stop_ids,
            max_batch=32,
            max_seq_len=max_model_len,
            device=torch.device("cpu"),
            dtype=torch.float32,
            threads=1,
            seed=0,
        )
        self.max_model_len = max_model_len
        self.global_steps: int | None = None
        self.asleep: set[str] = set()
        self.token_delay_s = 0.0
        self._gate = asyncio.Event()
        self._gate.set()
        self._epoch = 0  # bumped by every abort; a request started in an older epoch stops
        self._inflight = 0
        self.log: list[dict[str, Any]] = []  # every generate call, for the tests

    def _model(self, state: dict[str, torch.Tensor]) -> Any:
        tensors = {name.removeprefix("model."): t.float() for name, t in state.items()}
        return load_model(self.cfg, tensors, torch.device("cpu"), torch.float32).eval()

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        **_: Any,
    ) -> TokenOutput:
        while not self._gate.is_set():  # parked until resume_generation, as vLLM's gate does
            await self._gate.wait()
        if self.asleep:
            raise RuntimeError(f"generate on a sleeping server ({sorted(self.asleep)} released)")
        epoch, self._inflight = self._epoch, self._inflight + 1
        try:
            return await self._generate(list(prompt_ids), dict(sampling_params), epoch)
        finally:
            self._inflight -= 1

    async def _generate(self, prompt: list[int], sp: dict[str, Any], epoch: int) -> TokenOutput:
        max_tokens = min(sp["max_tokens"], self.max_model_len - len(prompt))
        seed = sp.get("seed")
        stops = sp.get("stop") or []
        entry = {"prompt": prompt, "ids": [], "version": self.global_steps, "aborted": False}
        self.log.append(entry)
        ids: list[int] = entry["ids"]
        logprobs: list[float] = []
        reason = "completed"
        while len(ids) < max_tokens:
            if epoch != self._epoch:
                reason, entry["aborted"] = "aborted", True
                break
            params = SamplingParams(
                sp.get("temperature", 1.0),
                sp.get("top_p", 1.0),
                max_tokens=1,
                seed=None if seed is None else seed * 1_000_003 + len(ids),
            )
            out = await self.sampler.generate(prompt + ids, params)
            ids.extend(out.ids)
            logprobs.extend(out.logprobs)
            if out.finish_reason == "stop" or any(s in self.tokenizer.decode(ids) for s in stops):
                break
            await asyncio.sleep(self.token_delay_s)
        return TokenOutput(
            token_ids=ids,
            log_probs=logprobs if sp.get("logprobs") else None,
            stop_reason=reason,
            extra_fields={"global_steps": self.global_steps},
        )

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        self._gate.clear()
        self._epoch += 1
        while self._inflight:
            await asyncio.sleep(0.01)
        return {"aborted_count": 0}

    async def resume_generation(self) -> None:
        self._gate.set()

    async def sleep(self) -> None:
        if self._inflight:
            raise RuntimeError("sleep with requests in flight: abort them first")
        self.asleep = {"weights", "kv_cache"}

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.asleep -= set(tags or ("weights", "kv_cache"))

    async def load_weights(self, state: dict[str, torch.Tensor], global_steps: int | None) -> None:
        if "weights" in self.asleep:
            raise RuntimeError("weights loaded into a server whose weights are asleep")
        self.store.publish(global_steps if global_steps is not None else -1, self._model(state))

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def set_token_delay(self, seconds: float) -> None:
        self.token_delay_s = seconds

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **_: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    async def state(self) -> dict[str, Any]:
        return {
            "log": self.log,
            "global_steps": self.global_steps,
            "asleep": sorted(self.asleep),
            "inflight": self._inflight,
        }


class StubReplica(RolloutReplica):
    """verl's replica interface; hybrid mode only: the server runs beside the replica's workers."""

    async def launch_servers(self) -> None:
        server = (
            ray.remote(StubServer)
            .options(name=server_name(self.replica_rank), num_cpus=0, max_concurrency=1000)
            .remote(
                self.model_config.path,
                self.config.max_model_len,
                self.config.load_format == "dummy",
            )
        )
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"stub-{self.replica_rank}"


class StubServerAdapter(BaseRollout):
    """The rollout inside a training worker: forwards wake/sleep and the weights to its server."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, **_: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        tp = self.config.tensor_model_parallel_size
        rank = int(os.environ["RANK"])
        self.replica_rank = rank // tp
        self.is_leader_rank = rank % tp == 0
        self.sleep_level = 2

    def _server(self) -> Any:
        return ray.get_actor(server_name(self.replica_rank))

    async def resume(self, tags: list[str]) -> None:
        if self.is_leader_rank:
            await self._server().wake_up.remote(tags=tags)

    async def release(self) -> None:
        if self.is_leader_rank:
            await self._server().sleep.remote()

    async def update_weights(self, weights: Any, global_steps: int | None = None, **_: Any) -> None:
        # Every rank walks the generator: gathering each FSDP shard is a collective.
        state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
        if self.is_leader_rank:
            server = self._server()
            await server.load_weights.remote(state, global_steps)
            if global_steps is not None:
                await server.set_global_steps.remote(global_steps)


RolloutReplicaRegistry.register(NAME, lambda: StubReplica)
rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.StubServerAdapter"
