"""`rollout: verl-vllm|verl-sglang`: verl's own rollout servers, weight sync through its
checkpoint engines.

Requests go token-in/token-out through verl's `LLMServerManager` client, whose router keeps every
request of one session on one server (sticky, for prefix caching). The session is the calling
asyncio task: the trainer runs each rollout in a task of its own, so every turn of an episode goes
to the same server.

A server holds one weight version at a time. Each answer carries the version it was served with
(verl's `global_steps`, which verl's server adapters set on every weight update); that version is
recorded for each of its tokens. A weight sync first aborts the requests in flight; a request cut
short is sent again with its prompt plus the tokens it already has, so one completion can carry
two versions, each on the tokens it sampled.

verl is imported inside the functions, so importing this module needs neither verl nor Ray.
"""

from __future__ import annotations

import contextvars
import uuid
from typing import Any

from rllm_async.backends.verl.options import VerlOptions
from rllm_async.config import ConfigError
from rllm_async.protocols import Completion, SamplingParams, Tokenizer

ABORTED = frozenset(("aborted", "abort"))  # vLLM's and SGLang's words for a request cut short
VERL_VERSION = "0.9.1"

_session: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "rllm_verl_session", default=None
)


def session_id() -> str:
    """The sticky-routing key of the calling asyncio task, made on its first request."""
    key = _session.get()
    if key is None:
        key = uuid.uuid4().hex
        _session.set(key)
    return key


def check_server_installed(name: str) -> None:
    """Refuse verl's `name` servers (vllm, sglang) when verl cannot load their replica class."""
    from verl.workers.rollout.replica import get_rollout_replica_class

    try:
        get_rollout_replica_class(name)
    except (ImportError, ValueError) as e:  # verl's vllm loader raises ValueError when it is absent
        raise ConfigError(
            f"backend.rollout: verl-{name} needs the {name} package in this environment and on "
            f"every node ({e}): pip install 'verl[{name}]=={VERL_VERSION}', or use rollout: vllm "
            "(the project's vLLM engine, in an environment of its own) or local"
        ) from e


class ServerPolicy:
    """The `PolicyClient` of `rollout: verl-vllm|verl-sglang`, over verl's `LLMServerClient`.

    `acquire` gives the version the servers hold; a `version` passed to `generate` must be it
    (a server cannot sample with weights it no longer has).
    """

    def __init__(
        self, client: Any, tokenizer: Tokenizer, *, server: str, max_context_tokens: int
    ) -> None:
        self._client = client
        self._tokenizer = tokenizer
        self._seed_key = "sampling_seed" if server == "sglang" else "seed"
        self.max_context_tokens = max_context_tokens
        self.version = 0  # what the servers hold; `ServerRollout.sync` moves it

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def acquire(self) -> int:
        return self.version

    def release(self, version: int) -> None:
        """Nothing to free: the servers keep no older versions."""

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, version: int | None = None
    ) -> Completion:
        """Sample on the session's server; resume on it when a weight sync cuts the request."""
        if version is not None and version != self.version:
            raise RuntimeError(_pin_error(version, self.version))
        request_id = session_id()
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            out = await self._client.generate(
                request_id,
                prompt_ids=[*prompt_ids, *ids],
                sampling_params=self._sampling(params, params.max_tokens - len(ids)),
            )
            served = out.extra_fields.get("global_steps")
            if served is None:
                raise RuntimeError("the rollout server reported no weight version (global_steps)")
            if version is not None and served != version:
                raise RuntimeError(_pin_error(version, served))
            if len(out.log_probs or ()) != len(out.token_ids):
                raise RuntimeError("the rollout server returned no logprob for some tokens")
            ids.extend(out.token_ids)
            logprobs.extend(out.log_probs or ())
            versions.extend([int(served)] * len(out.token_ids))
            if out.stop_reason not in ABORTED or len(ids) >= params.max_tokens:
                break
        limit = min(params.max_tokens, self.max_context_tokens - len(prompt_ids))
        stopped = out.stop_reason == "stop" or len(ids) < limit
        return Completion(ids, logprobs, versions, "stop" if stopped else "length")

    def _sampling(self, params: SamplingParams, max_tokens: int) -> dict[str, Any]:
        """verl's sampling params; vLLM and SGLang servers both read `max_tokens`."""
        out: dict[str, Any] = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": max_tokens,
            "logprobs": True,
        }
        if params.stop:
            out["stop"] = list(params.stop)
        if params.seed is not None:
            out[self._seed_key] = params.seed
        return out


def _pin_error(wanted: int, served: int) -> str:
    return (
        f"version {wanted} was asked for, but the rollout servers hold version {served}: a server "
        "keeps one version, so rollouts cannot stay pinned across a weight sync "
        "(set coordinator.weight_update: latest)"
    )


class ServerRollout:
    """verl's rollout replicas, their router and their weight sync, built from the actor workers.

    Colocated (`rollout_nodes: 0`), the servers run on the training GPUs inside the workers' own
    processes (verl's hybrid replicas); they are aborted and put to sleep before training (`pause`)
    and woken by the sync with verl's in-process `naive` engine, as verl's PPO trainer does. On GPUs
    of their own (verl's standalone replicas), `CheckpointEngineManager.update_weights` aborts,
    transfers through the configured engine (e.g. NCCL) and resumes them; they never sleep.
    The methods block: the backend runs them off its event loop.
    """

    def __init__(self, cfg: Any, workers: Any, opts: VerlOptions, tokenizer: Tokenizer) -> None:
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.rollout.llm_server import LLMServerManager

        self.colocated = opts.colocated
        self.manager = LLMServerManager.create(
            config=cfg, worker_group=workers if opts.colocated else None
        )
        self.checkpoints = CheckpointEngineManager(
            config=omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine),
            actor_wg=workers,
            replicas=self.manager.get_replicas(),
        )
        self.policy = ServerPolicy(
            self.manager.get_client(),
            tokenizer,
            server=cfg.actor_rollout_ref.rollout.name,
            max_context_tokens=opts.max_seq_len,
        )
        self._awake = True  # replicas start serving (the first sync loads the trained weights)

    def pause(self) -> None:
        """Colocated: abort what is in flight (it waits at the servers' gate) and sleep."""
        if self.colocated and self._awake:
            self.checkpoints.abort_replicas()
            self.checkpoints.sleep_replicas()
            self._awake = False

    def sync(self, version: int) -> None:
        """Load the workers' weights into every server as `version`, then serve again."""
        if self.colocated:
            self.pause()
            # verl's naive engine: the workers wake the weights, load them, then wake the cache.
            self.checkpoints.update_weights(global_steps=version)
            self.checkpoints.resume_generation_replicas()
            self._awake = True
        else:
            self.checkpoints.update_weights(global_steps=version)
        self.policy.version = version

    async def close(self) -> None:
        """Stop the servers and the router; standalone replicas also free their own GPUs."""
        import ray

        for replica in self.manager.get_replicas():
            for actor in replica.servers:
                ray.kill(actor)
            if not self.colocated:  # colocated replicas' workers are the training workers
                for worker in replica.workers:
                    ray.kill(worker)
                for group in replica.resource_pool.get_placement_groups():
                    ray.util.remove_placement_group(group)
        ray.kill(self.manager.global_load_balancer)
