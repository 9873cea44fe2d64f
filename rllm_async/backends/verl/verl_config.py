"""verl's own config for the workers and rollout servers: verl's Hydra defaults plus our options."""

from __future__ import annotations

import math
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rllm_async.backends.verl.options import VerlOptions
from rllm_async.config import Config, ConfigError

DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def actor_config(config: Config, opts: VerlOptions) -> DictConfig:
    """`actor_rollout_ref` of `verl_config`: what the training workers are built from."""
    return verl_config(config, opts).actor_rollout_ref


def verl_config(config: Config, opts: VerlOptions) -> DictConfig:
    """verl's whole `ppo_trainer` config, set up for our split-step training and rollout servers.

    Rollout servers and their managers read `actor_rollout_ref.rollout` from the whole config.
    """
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    overrides = [f"actor_rollout_ref.{o}" for o in opts.overrides]
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose("ppo_trainer", overrides=overrides)
    except HydraException as e:
        raise ConfigError(f"backend.overrides {opts.overrides}: {e}") from e
    settings = _settings(config, opts)
    if opts.verl_server is not None:
        settings.update(_server_settings(config, opts))
    for key, value in settings.items():
        OmegaConf.update(cfg, f"actor_rollout_ref.{key}", value, force_add=True)
    return cfg


def _server_settings(config: Config, opts: VerlOptions) -> dict[str, Any]:
    """verl's rollout section for its vllm/sglang servers: layout, lengths and weight transfer."""
    return {
        "rollout.name": opts.verl_server,
        "rollout.tensor_model_parallel_size": opts.tensor_parallel_size,
        "rollout.nnodes": opts.rollout_nodes,
        "rollout.n_gpus_per_node": opts.server_gpus_per_node,
        "rollout.max_model_len": opts.max_seq_len,
        "rollout.prompt_length": opts.max_seq_len - config.rollout.max_tokens,
        "rollout.response_length": config.rollout.max_tokens,
        "rollout.calculate_log_probs": True,
        "rollout.skip_tokenizer_init": False,  # stop strings are matched on the decoded text
        "rollout.checkpoint_engine.backend": "naive" if opts.colocated else opts.checkpoint_engine,
    }


def _settings(config: Config, opts: VerlOptions) -> dict[str, Any]:
    cpu = opts.device == "cpu"
    fsdp, optim = opts.fsdp, config.optim
    dtype = DTYPES[fsdp.param_dtype or ("float32" if cpu else "bfloat16")]
    clip = optim.grad_clip if optim.grad_clip is not None else math.inf
    return {
        "model.path": os.path.abspath(os.path.expanduser(opts.model_path)),
        "model.use_remove_padding": opts.remove_padding,
        "model.enable_gradient_checkpointing": fsdp.gradient_checkpointing,
        "model.override_config.attn_implementation": opts.attention,
        "actor.strategy": fsdp.strategy,
        "actor.use_dynamic_bsz": True,
        "actor.ppo_max_token_len_per_gpu": opts.max_token_len_per_gpu,
        "rollout.log_prob_use_dynamic_bsz": True,
        "rollout.log_prob_max_token_len_per_gpu": opts.max_token_len_per_gpu,
        "actor.use_torch_compile": not cpu,
        "actor.fsdp_config.use_torch_compile": not cpu,
        "actor.fsdp_config.fsdp_size": fsdp.fsdp_size,
        "actor.fsdp_config.param_offload": fsdp.param_offload,
        "actor.fsdp_config.optimizer_offload": fsdp.optimizer_offload,
        "actor.fsdp_config.reshard_after_forward": fsdp.reshard_after_forward,
        "actor.fsdp_config.model_dtype": "fp32",
        "actor.fsdp_config.seed": config.seed,
        "actor.fsdp_config.mixed_precision": {
            "param_dtype": dtype,
            "reduce_dtype": "fp32",
            "buffer_dtype": "fp32",
        },
        "actor.optim.lr": optim.lr,
        "actor.optim.betas": list(optim.betas),
        "actor.optim.weight_decay": optim.weight_decay,
        "actor.optim.clip_grad": clip,
        "actor.optim.total_training_steps": config.train.total_steps,
    }
