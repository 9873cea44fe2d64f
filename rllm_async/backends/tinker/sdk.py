"""The one place that speaks to the `tinker` SDK: the same calls for SDK 0.24.x and >= 0.38.

What differs: from 0.38, `create_lora_training_client`, `create_training_client_from_state_*`,
`save_weights_and_get_sampling_client` and `sample` return awaitable futures at once; before,
the creators block (their `*_async` twins are coroutines) and `sample` returns a
`concurrent.futures.Future`. `forward_backward`, `optim_step` and `save_state` return an
`APIFuture` in both. Every wait here is bounded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import os
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import tinker
from tinker import types

from rllm_async.config import ConfigError

TINKER_CLOUD_URL = "https://tinker.thinkingmachines.dev/services/tinker-prod"  # the SDK's default


def sdk_version(version: str = tinker.__version__) -> tuple[int, ...]:
    """The SDK's version as integers, e.g. (0, 24, 1)."""
    return tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())


FUTURES_API = sdk_version() >= (0, 38)


class TinkerBackendError(RuntimeError):
    """A Tinker call that failed, was rejected or timed out; the message names the call."""


def resolve_base_url(base_url: str | None) -> str:
    """The option, else $TINKER_BASE_URL, else the Tinker service."""
    return (base_url or os.environ.get("TINKER_BASE_URL") or TINKER_CLOUD_URL).rstrip("/")


def require_credentials(api_key: str | None) -> None:
    """Refuse to start without any credential the SDK could use."""
    if api_key or os.environ.get("TINKER_API_KEY") or os.environ.get("TINKER_CREDENTIAL_CMD"):
        return
    if FUTURES_API and (Path.home() / ".tinker" / "credentials.json").is_file():
        return
    raise ConfigError(
        "no Tinker API key: export TINKER_API_KEY=tml-... (or set backend.api_key, or "
        "TINKER_CREDENTIAL_CMD; with tinker >= 0.38, `tinker auth login` also works)"
    )


def wait_reachable(base_url: str, timeout_s: float, attempts: int) -> None:
    """Open a TCP connection to the server, retrying with backoff; a clear error when it fails."""
    parts = urlsplit(base_url)
    if not parts.hostname:
        raise ConfigError(f"backend.base_url '{base_url}' is not a URL like http://host:port")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    delay = 0.5
    for attempt in range(1, attempts + 1):
        try:
            socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
            return
        except OSError as e:
            if attempt == attempts:
                raise TinkerBackendError(
                    f"cannot reach the Tinker server at {base_url} ({e}) after {attempts} "
                    "attempts: is it running? check backend.base_url or $TINKER_BASE_URL"
                ) from None
            time.sleep(delay)
            delay *= 2


async def call(op: str, pending: Any, timeout_s: float) -> Any:
    """Await an SDK result (future, coroutine or value) within `timeout_s`, naming `op` on error."""
    try:
        if isinstance(pending, concurrent.futures.Future) and not inspect.isawaitable(pending):
            pending = asyncio.wrap_future(pending)
        if inspect.isawaitable(pending):
            return await asyncio.wait_for(_await(pending), timeout_s)
        return pending
    except TimeoutError:
        raise TinkerBackendError(
            f"Tinker {op} did not finish within {timeout_s:.0f}s (backend.request_timeout_s)"
        ) from None
    except tinker.APIStatusError as e:
        raise TinkerBackendError(f"Tinker rejected {op} (HTTP {e.status_code}): {e.message}") from e
    except (tinker.TinkerError, ValueError) as e:
        raise TinkerBackendError(f"Tinker {op} failed: {e}") from e


async def _await(pending: Any) -> Any:
    return await pending


def service_client(base_url: str, api_key: str | None) -> Any:
    """A `tinker.ServiceClient` for `base_url`."""
    return tinker.ServiceClient(base_url=base_url, api_key=api_key)


async def training_client(service: Any, timeout_s: float, **lora: Any) -> Any:
    """A LoRA training client (`base_model`, `rank`, `seed`, `train_mlp`, ... as keywords)."""
    if FUTURES_API:
        pending = service.create_lora_training_client(**lora)
    else:
        pending = service.create_lora_training_client_async(**lora)
    return await call("create_lora_training_client", pending, timeout_s)


async def snapshot_sampler(training: Any, timeout_s: float) -> Any:
    """Save the current weights and return a sampling client pinned to that snapshot."""
    op = "save_weights_and_get_sampling_client"
    if FUTURES_API:
        return await call(op, training.save_weights_and_get_sampling_client(), timeout_s)
    # SDK < 0.38 blocks inside this call (also in its `_async` twin): keep it off our loop.
    return await call(
        op, asyncio.to_thread(training.save_weights_and_get_sampling_client), timeout_s
    )


def datum(
    inputs: list[int], targets: list[int], logprobs: list[float], advantages: list[float]
) -> Any:
    """One training example for the RL losses: next-token targets, sampler logprobs, advantages."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(inputs),
        loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.asarray(targets, dtype=np.int64)),
            "logprobs": types.TensorData.from_numpy(np.asarray(logprobs, dtype=np.float32)),
            "advantages": types.TensorData.from_numpy(np.asarray(advantages, dtype=np.float32)),
        },
    )


def forward_backward(
    training: Any, data: list[Any], loss_fn: str, config: dict[str, float] | None
) -> Any:
    """Submit a forward/backward pass at once; returns the SDK's future of its output."""
    return training.forward_backward(data, loss_fn, config)


def output_logprobs(output: Any) -> list[list[float]]:
    """The learner's logprobs of each datum's targets, from a forward/backward output."""
    return [_to_list(o["logprobs"]) for o in output.loss_fn_outputs]


def adam_params(
    lr: float, betas: tuple[float, float], weight_decay: float, grad_clip: float | None
) -> Any:
    """The SDK's AdamParams; a grad_clip of None means no clipping (0.0)."""
    return types.AdamParams(
        learning_rate=lr,
        beta1=betas[0],
        beta2=betas[1],
        weight_decay=weight_decay,
        grad_clip_norm=grad_clip or 0.0,
    )


def optim_step(training: Any, params: Any) -> Any:
    """Submit an optimizer step at once; returns the SDK's future of its response."""
    return training.optim_step(params)


def optim_metrics(response: Any) -> dict[str, float]:
    """The server's optimizer metrics (grad norm, ...), when it reports any."""
    return {k: float(v) for k, v in (getattr(response, "metrics", None) or {}).items()}


def sampling_params(
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
    stop: list[int] | list[str],
) -> Any:
    """The SDK's SamplingParams; `stop` is all token ids or all strings."""
    return types.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop
    )


async def sample(
    sampler: Any, prompt_ids: list[int], params: Any, timeout_s: float
) -> tuple[list[int], list[float], str]:
    """One completion: its tokens, their logprobs and the stop reason ("stop" or "length")."""
    pending = sampler.sample(
        prompt=types.ModelInput.from_ints(prompt_ids), num_samples=1, sampling_params=params
    )
    response = await call("sample", pending, timeout_s)
    seq = response.sequences[0]
    logprobs = [float(x) for x in (seq.logprobs or [])]
    if len(logprobs) != len(seq.tokens):
        raise TinkerBackendError("Tinker sample returned no logprob for some sampled tokens")
    return list(seq.tokens), logprobs, str(seq.stop_reason)


async def save_state(training: Any, name: str, timeout_s: float) -> str:
    """Save weights and optimizer state under `name`; returns the tinker:// path."""
    response = await call("save_state", training.save_state(name), timeout_s)
    return str(response.path)


async def training_client_from_state(service: Any, path: str, timeout_s: float) -> Any:
    """A training client restored from a `save_state` path, weights and optimizer state."""
    op = "create_training_client_from_state_with_optimizer"
    if FUTURES_API:
        pending = service.create_training_client_from_state_with_optimizer(path)
    else:
        pending = service.create_training_client_from_state_with_optimizer_async(path)
    return await call(op, pending, timeout_s)


async def close(service: Any, timeout_s: float) -> None:
    """End the session where the SDK can (>= 0.38); older SDKs just stop heartbeating on exit."""
    if FUTURES_API and hasattr(service, "close"):
        await call("close", service.close("success"), timeout_s)


def _to_list(tensor: Any) -> list[float]:
    return [float(x) for x in (tensor.tolist() if hasattr(tensor, "tolist") else tensor)]
