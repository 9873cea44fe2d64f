"""The `backend:` options of `name: verl`, and the refusal of layouts and configs it cannot run.

Nothing here imports verl, so a bad config is refused before Ray or verl start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rllm_async.config import Config, ConfigError, validate_options
from rllm_async.engines.vllm.engine import VLLMOptions, eval_problem
from rllm_async.engines.vllm.server import REPO_VENV_PYTHON

VERL_SERVERS = {"verl-vllm": "vllm", "verl-sglang": "sglang"}  # our rollout name: verl's


class FSDPOptions(BaseModel):
    """How verl's FSDP engine shards and stores the trained model."""

    model_config = ConfigDict(extra="forbid")

    strategy: Literal["fsdp", "fsdp2"] = "fsdp2"
    fsdp_size: int = Field(default=-1, ge=-1)  # -1: shard over all training workers
    param_offload: bool = False
    optimizer_offload: bool = False
    reshard_after_forward: bool = True
    # Compute dtype of forward/backward; the master weights and Adam moments stay float32.
    # null: bfloat16 on cuda, float32 on cpu.
    param_dtype: Literal["float32", "bfloat16"] | None = None
    gradient_checkpointing: bool = False


class VerlOptions(BaseModel):
    """Options of `backend.name: verl`."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_path: str  # a local Hugging Face checkpoint directory (weights, config, tokenizer)
    device: Literal["cuda", "cpu"] = "cuda"  # cpu: the training workers run on CPU (gloo)
    nodes: int = Field(default=1, ge=1)
    gpus_per_node: int = Field(default=1, ge=1)  # with device: cpu, training processes per node
    # Who samples: the local sampler in this process, the project's vLLM engine (`vllm:`, as with
    # `backend.name: local`), or verl's own vLLM/SGLang server replicas.
    rollout: Literal["local", "vllm", "verl-vllm", "verl-sglang"] = "local"
    vllm: VLLMOptions = Field(default_factory=VLLMOptions)
    tensor_parallel_size: int = Field(default=1, ge=1)  # of each verl-vllm/verl-sglang server
    # 0: the rollout servers share the training GPUs (colocated); n: n nodes of their own.
    rollout_nodes: int = Field(default=0, ge=0)
    rollout_gpus_per_node: int | None = Field(default=None, ge=1)  # null: gpus_per_node
    # verl's weight transfer to servers on their own GPUs (colocated servers load in-process).
    checkpoint_engine: str = "nccl"
    fsdp: FSDPOptions = Field(default_factory=FSDPOptions)
    attn_implementation: str | None = None  # null: sdpa on cpu, flash_attention_2 on cuda
    # Pack each micro-batch's sequences without padding; null: only with flash_attention_2.
    use_remove_padding: bool | None = None
    max_token_len_per_gpu: int = Field(default=16384, ge=1)  # tokens per training micro-batch
    overrides: list[str] = Field(default_factory=list)  # extra Hydra overrides of verl's config
    ray_address: str | None = None  # null: start Ray on this machine
    ray_num_cpus: int | None = Field(default=None, ge=1)  # CPUs of a locally started Ray
    # The local sampler (rollout: local) runs in this process, as in `backend.name: local`.
    sampler_device: str = "cpu"
    sampler_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_batch: int = Field(default=32, ge=1)
    max_seq_len: int = Field(default=256, ge=2)
    sampler_threads: int = Field(default=1, ge=1)
    seed: int | None = None  # unseeded sampling; None: the config's seed

    @field_validator("rollout", mode="before")
    @classmethod
    def _renamed(cls, value: Any) -> Any:
        """`sglang` named verl's SGLang servers before `vllm` came to mean the shared engine."""
        if value == "sglang":
            raise ValueError(
                "sglang is now verl-sglang (verl's SGLang servers; verl-vllm are verl's vLLM "
                "servers, and vllm is the project's vLLM engine)"
            )
        return value

    @property
    def verl_server(self) -> str | None:
        """verl's name of the rollout servers verl starts (`vllm`, `sglang`); None for ours."""
        return VERL_SERVERS.get(self.rollout)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def colocated(self) -> bool:
        """Whether the rollout servers run on the training GPUs (sleeping while they train)."""
        return self.rollout_nodes == 0

    @property
    def rollout_gpus(self) -> int:
        """GPUs the rollout servers need besides the training ones (0 when colocated)."""
        return self.rollout_nodes * self.server_gpus_per_node

    @property
    def server_gpus_per_node(self) -> int:
        """GPUs per node that one node's rollout servers divide among themselves."""
        if self.colocated:
            return self.gpus_per_node
        return self.rollout_gpus_per_node or self.gpus_per_node

    @property
    def shares_device(self) -> bool | None:
        """Whether generation and training share devices (`rllm-async plan`): colocated verl
        servers do, servers on nodes of their own do not, and the local sampler does where it runs
        on the workers' kind of device; the project's vLLM servers' devices, and the device that
        `auto` picks, are not in these options (None: unknown)."""
        if self.verl_server is not None:
            return self.colocated
        sampler = self.sampler_device.split(":")[0]
        if self.rollout == "local" and sampler != "auto":
            return sampler == self.device
        return None

    @property
    def decode_slots(self) -> int | None:
        """The most sequences decoded together (`rllm-async plan`): the local sampler's
        `max_batch`, what the vLLM engine's options say, or None for verl's servers, whose
        batch is verl's own setting."""
        if self.rollout == "local":
            return self.max_batch
        if self.rollout == "vllm":
            return self.vllm.decode_slots
        return None

    @property
    def attention(self) -> str:
        """The Hugging Face attention implementation the workers use."""
        default = "sdpa" if self.device == "cpu" else "flash_attention_2"
        return self.attn_implementation or default

    @property
    def remove_padding(self) -> bool:
        if self.use_remove_padding is None:
            return self.attention == "flash_attention_2"
        return self.use_remove_padding


def check_config(config: Config) -> VerlOptions:
    """Validate the options and refuse every layout or option this backend cannot run."""
    opts = validate_options(VerlOptions, config.backend.options, "backend")
    problems = layout_problems(opts)
    if config.algorithm.loss.kl_coef > 0:
        problems.append(
            f"algorithm.loss.kl_coef is {config.algorithm.loss.kl_coef}, but the verl backend builds "
            "no reference model: set it to 0, or use backend.name: local"
        )
    if config.algorithm.loss.behaviour_logprobs != "sampler":
        problems.append(
            "algorithm.loss.behaviour_logprobs is "
            f"{config.algorithm.loss.behaviour_logprobs}, but the verl backend trains through "
            "verl's engine with the sampler's logprobs as the old ones and does not run its "
            "old-logprob pass: set it to sampler, or use backend.name: local"
        )
    co = config.coordinator
    if opts.rollout != "local" and co.weight_update == "pin" and co.pipeline_depth != 0:
        problems.append(
            f"backend.rollout: {opts.rollout} servers hold one weight version at a time, so an "
            "episode cannot stay on the version it started with (coordinator.weight_update: pin) "
            f"while rollouts overlap training (coordinator.pipeline_depth {co.pipeline_depth}): "
            "set coordinator.weight_update: latest (every token keeps the version that sampled "
            "it), or pipeline_depth: 0 (mode: sync)"
        )
    if opts.rollout != "local" and co.weight_update == "pin" and config.train.mini_batches > 1:
        problems.append(
            f"backend.rollout: {opts.rollout} servers hold one weight version at a time, so an "
            "episode cannot stay on the version it started with (coordinator.weight_update: pin) "
            f"while train.mini_batches ({config.train.mini_batches}) steps the optimizer before "
            "the batch's rollouts end: set coordinator.weight_update: latest, or mini_batches: 1"
        )
    if opts.rollout == "vllm" and (problem := eval_problem(config.eval.every_steps)):
        problems.append(problem)
    if opts.verl_server is not None and opts.colocated and co.sync_every > 1:
        problems.append(
            "colocated rollout servers (rollout_nodes: 0) sleep while the workers train and wake "
            f"only with a weight sync, so coordinator.sync_every ({co.sync_every}) > 1 would leave "
            "them asleep: set sync_every: 1, or give the servers their own nodes (rollout_nodes)"
        )
    if config.rollout.max_tokens >= opts.max_seq_len:
        problems.append(
            f"rollout.max_tokens ({config.rollout.max_tokens}) leaves no room for a prompt in "
            f"backend.max_seq_len ({opts.max_seq_len}): raise max_seq_len or lower max_tokens"
        )
    if problems:
        raise ConfigError("backend verl cannot run this config:\n  " + "\n  ".join(problems))
    return opts


def layout_problems(opts: VerlOptions) -> list[str]:
    """What is impossible about the requested nodes, devices, sharding and rollout servers."""
    problems = []
    world = opts.world_size
    fsdp = opts.fsdp
    if fsdp.fsdp_size != -1 and (fsdp.fsdp_size == 0 or world % fsdp.fsdp_size):
        problems.append(
            f"backend.fsdp.fsdp_size ({fsdp.fsdp_size}) must divide the {world} training workers "
            f"(nodes {opts.nodes} x gpus_per_node {opts.gpus_per_node}), or be -1 (all of them)"
        )
    problems.extend(_rollout_problems(opts))
    if opts.device == "cpu" and (fsdp.param_offload or fsdp.optimizer_offload):
        problems.append(
            "backend.fsdp.param_offload/optimizer_offload mean nothing on cpu: remove them"
        )
    if opts.remove_padding and opts.attention != "flash_attention_2":
        problems.append(
            f"backend.use_remove_padding packs sequences into one row, which only verl's patched "
            f"flash_attention_2 keeps apart; {opts.attention} would attend across them: set "
            "use_remove_padding: false, or attn_implementation: flash_attention_2"
        )
    if opts.ray_address is None and opts.nodes > 1:
        problems.append(
            f"backend.nodes is {opts.nodes}, but a Ray started here has one node: start a cluster "
            "(`ray start --head` on one node, `ray start --address=...` on the others) and give "
            "its address as backend.ray_address"
        )
    if opts.ray_address is not None and opts.ray_num_cpus is not None:
        problems.append(
            "backend.ray_num_cpus sizes a Ray started here; with backend.ray_address the cluster "
            "has its own resources: remove ray_num_cpus"
        )
    return problems


def _rollout_problems(opts: VerlOptions) -> list[str]:
    """What is impossible about the rollout: the local sampler, the vLLM engine, or verl's servers."""
    problems = []
    if "vllm" in opts.model_fields_set and opts.rollout != "vllm":
        problems.append(
            f"backend.vllm configures the vLLM engine of rollout: vllm, but rollout is "
            f"{opts.rollout}: remove backend.vllm, or set rollout: vllm"
        )
    if opts.verl_server is None:
        extra = [
            ("tensor_parallel_size", opts.tensor_parallel_size != 1),
            ("rollout_nodes", opts.rollout_nodes != 0),
            ("rollout_gpus_per_node", opts.rollout_gpus_per_node is not None),
            ("checkpoint_engine", "checkpoint_engine" in opts.model_fields_set),
        ]
        problems += [
            f"backend.{key} applies to verl's rollout servers (rollout: verl-vllm|verl-sglang), "
            f"not to rollout: {opts.rollout}: remove it"
            for key, set_ in extra
            if set_
        ]
        if opts.rollout == "vllm":
            problems += _engine_problems(opts.vllm)
        return problems
    name, tp, gpus = opts.verl_server, opts.tensor_parallel_size, opts.server_gpus_per_node
    where = "backend.gpus_per_node" if opts.colocated else "the rollout GPUs per node"
    if tp > gpus:
        problems.append(
            f"backend.tensor_parallel_size ({tp}) exceeds {where} ({gpus}): a rollout server "
            "cannot span nodes"
        )
    elif gpus % tp:
        problems.append(f"backend.tensor_parallel_size ({tp}) must divide {where} ({gpus})")
    if opts.device != "cuda":
        problems.append(
            f"backend.rollout: {opts.rollout} runs verl's {name} servers on GPUs, but "
            f"backend.device is {opts.device}: use device: cuda, or rollout: vllm (the project's "
            "vLLM engine, which runs on the CPU) or local"
        )
    if opts.colocated and opts.rollout_gpus_per_node is not None:
        problems.append(
            "backend.rollout_gpus_per_node sizes rollout nodes of their own, but rollout_nodes is "
            "0 (servers share the training GPUs): set rollout_nodes, or remove rollout_gpus_per_node"
        )
    if not opts.colocated and opts.checkpoint_engine == "naive":
        problems.append(
            "backend.checkpoint_engine: naive loads weights in the training process, which only "
            "colocated servers share: use nccl (or another verl engine) with rollout_nodes > 0"
        )
    return problems


def _engine_problems(vllm: VLLMOptions) -> list[str]:
    """What stops the vLLM engine from starting servers, found before Ray and verl start."""
    python = Path(vllm.python) if vllm.python else REPO_VENV_PYTHON
    if vllm.urls or python.is_file():
        return []
    return [
        f"backend.rollout: vllm starts vLLM servers with {python}, which does not exist: run "
        "`python scripts/vllm_env.py setup`, set backend.vllm.python to an interpreter with "
        "vLLM, or give running servers as backend.vllm.urls"
    ]
