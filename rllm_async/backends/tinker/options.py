"""The `backend:` options of the Tinker backend, and the refusal of what Tinker cannot compute."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rllm_async.config import Config, ConfigError, LossConfig, validate_options

# Our loss names -> the SDK's built-in `loss_fn` names.
LOSS_FNS = {"ppo_clip": "ppo", "importance_sampling": "importance_sampling", "cispo": "cispo"}


class TinkerOptions(BaseModel):
    """Options of `backend.name: tinker`; the API key is better left to $TINKER_API_KEY."""

    model_config = ConfigDict(extra="forbid")

    base_model: str
    base_url: str | None = None  # null: $TINKER_BASE_URL, else the Tinker service
    api_key: str | None = None  # null: $TINKER_API_KEY (or the SDK's other credential sources)
    lora_rank: int = Field(default=32, ge=1)
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    tokenizer: str | None = None  # a local directory or hub name; null: base_model
    # How the server reduces the per-token loss of a step: the Tinker service sums over tokens and
    # sequences; SkyRL's open-source server averages over each sequence, then over the sequences.
    server_loss_reduction: Literal["sum", "sequence_mean"] = "sum"
    # Whether a sampler keeps the weights it was created with. SkyRL's server loads a sampler's
    # weights into the training adapter instead: there, only the newest weights can be sampled
    # (mode: sync, or async with coordinator.weight_update: latest), and sampling pauses around
    # each optimizer step.
    server_snapshots: bool = True
    # Submit each forward_backward before awaiting the previous one (one request always queued
    # behind the running one); false awaits each before the next is sent (for comparison).
    pipeline_requests: bool = True
    request_timeout_s: float = Field(default=600.0, gt=0.0)
    connect_timeout_s: float = Field(default=5.0, gt=0.0)
    connect_attempts: int = Field(default=3, ge=1)


def loss_problems(loss: LossConfig) -> list[str]:
    """What in `loss` Tinker's built-in losses cannot compute, each with what to use instead."""
    problems = []
    if loss.kl_coef > 0:
        problems.append(
            f"algorithm.loss.kl_coef is {loss.kl_coef}, but Tinker's built-in losses have no KL "
            "penalty against a reference model: set it to 0, or use backend.name: local"
        )
    if loss.importance_sampling != "none":
        problems.append(
            f"algorithm.loss.importance_sampling is {loss.importance_sampling}, but Tinker's losses "
            "take the ratio to the sampler's logprobs directly, with no separate truncation or "
            "mask: set it to none (clip_low/clip_high bound the ratio with ppo_clip and cispo), "
            "or use backend.name: local"
        )
    if loss.opsm_kl_threshold is not None:
        problems.append(
            "algorithm.loss.opsm_kl_threshold is set, but Tinker has no off-policy sequence mask: "
            "set it to null, or use backend.name: local"
        )
    if loss.behaviour_logprobs != "sampler":
        problems.append(
            f"algorithm.loss.behaviour_logprobs is {loss.behaviour_logprobs}, but Tinker's losses "
            "take the ratio to the sampler's logprobs and cannot recompute old ones: set it to "
            "sampler, or use backend.name: local"
        )
    return problems


def check_loss(loss: LossConfig) -> None:
    """Raise a ConfigError naming every loss option Tinker cannot honour."""
    _refuse(loss_problems(loss))


def loss_fn_config(loss: LossConfig) -> dict[str, float] | None:
    """The SDK's `loss_fn_config`: ratio thresholds 1 - clip_low and 1 + clip_high."""
    if loss.name == "importance_sampling":
        return None
    return {"clip_low_threshold": 1.0 - loss.clip_low, "clip_high_threshold": 1.0 + loss.clip_high}


def check_config(config: Config) -> TinkerOptions:
    """Validate the backend options and refuse every option Tinker cannot honour."""
    options = validate_options(TinkerOptions, config.backend.options, "backend")
    problems = loss_problems(config.algorithm.loss)
    co = config.coordinator
    if not options.server_snapshots and co.pipeline_depth != 0 and co.weight_update == "pin":
        problems.append(
            "backend.server_snapshots is false (the server's samplers share the training weights), "
            f"but coordinator.pipeline_depth is {co.pipeline_depth} with weight_update: pin, which "
            "keeps sampling a version after newer weights exist and would overwrite them: set "
            "coordinator.weight_update: latest (every call samples the newest weights), or "
            "mode: sync, or use a server whose samplers are snapshots (the Tinker service)"
        )
    if not options.server_snapshots and co.sync_every > 1:
        problems.append(
            "backend.server_snapshots is false (the server's samplers share the training weights), "
            f"so sampling sees every optimizer step and cannot lag by coordinator.sync_every "
            f"({co.sync_every}) steps: set sync_every: 1, or use a server whose samplers are "
            "snapshots (the Tinker service)"
        )
    _refuse(problems)
    return options


def _refuse(problems: list[str]) -> None:
    if problems:
        raise ConfigError("backend tinker cannot run this config:\n  " + "\n  ".join(problems))
