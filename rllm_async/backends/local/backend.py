"""`LocalBackend`: the sampler on a thread of this process; the learner on a thread of it too, or on
a process of its own (`learner: process`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import torch
from pydantic import BaseModel

from rllm_async.backends.local.hf import checkpoint_dir, read_config
from rllm_async.backends.local.learner import Learner
from rllm_async.backends.local.learner_process import LearnerProcess, LearnerSpec
from rllm_async.backends.local.model import (
    Transformer,
    build_model,
    hf_state_dict,
    load_model,
    preset_config,
)
from rllm_async.backends.local.options import (
    LocalOptions,
    check_fallback,
    check_vllm,
    device_of,
    dtype_of,
    model_impl,
)
from rllm_async.backends.local.policy import LocalPolicy
from rllm_async.backends.local.snapshots import WeightStore
from rllm_async.backends.local.transformers_model import (
    Decoder,
    inference_copy,
    load_transformers_model,
    max_positions,
)
from rllm_async.backends.local.warm_start import warm_start
from rllm_async.backends.toy_tokenizers import CharTokenizer
from rllm_async.config import Config, ConfigError, LossConfig, validate_options
from rllm_async.engines.vllm import VLLMPolicy
from rllm_async.engines.vllm.engine import VLLMEngine, vllm_metrics
from rllm_async.protocols import Tokenizer
from rllm_async.types import TrajectoryGroup

log = logging.getLogger(__name__)
T = TypeVar("T")
CHECKPOINT_FILE = "local_backend.pt"


class LocalBackend:
    """Plain PyTorch on CPU or one GPU: a dynamic-batching sampler thread, and a training thread
    or process."""

    options: ClassVar[type[BaseModel]] = LocalOptions
    virtual_clock: ClassVar[bool] = False

    @classmethod
    def shares_device(cls, options: dict[str, Any]) -> bool | None:
        """Whether generation and training share one device under these `backend:` options: the
        sampler thread and the learner run on `device` (the CPU, or one GPU); where vLLM servers
        sample, their devices are not in the options (None: unknown)."""
        opts = LocalOptions.model_validate(options)
        return True if opts.rollout == "local" else None

    @classmethod
    def decode_slots(cls, options: dict[str, Any]) -> int | None:
        """The most sequences decoded together under these `backend:` options: the sampler's
        `max_batch`, or what the vLLM servers' options say (`VLLMOptions.decode_slots`)."""
        opts = LocalOptions.model_validate(options)
        return opts.max_batch if opts.rollout == "local" else opts.vllm.decode_slots

    def __init__(self, config: Config, opts: LocalOptions) -> None:
        self.opts = opts
        self.device = device_of(opts.device)
        self.dtype = dtype_of(opts.dtype, self.device)
        if opts.dtype == "auto":
            log.info("local backend: dtype auto is %s on %s", self.dtype, self.device)
        if config.rollout.max_tokens >= opts.max_seq_len:
            raise ConfigError(
                f"rollout.max_tokens ({config.rollout.max_tokens}) leaves no room for a prompt in "
                f"backend.max_seq_len ({opts.max_seq_len}): raise max_seq_len or lower max_tokens"
            )
        if opts.rollout == "vllm":
            check_vllm(config, opts)
        impl, why = model_impl(opts)
        runs = "native decoder" if impl == "native" else "transformers fallback"
        # A warning for the fallback: it samples many times slower, which a run should not hide.
        level = logging.INFO if impl == "native" else logging.WARNING
        log.log(
            level, "local backend: %s runs on the %s: %s", opts.model_path or opts.model, runs, why
        )
        if impl == "transformers":
            check_fallback(opts)
        seed = config.seed if opts.seed is None else opts.seed
        model, tokenizer, stop_ids = _build(opts, impl, self.device, seed)
        if opts.warm_start is not None:
            identity = {"preset": opts.model, "path": opts.model_path}
            warm_start(model, tokenizer, opts.warm_start, identity=identity, seed=seed)
        spec = LearnerSpec(
            with_ref=config.algorithm.loss.kl_coef > 0,
            optim=config.optim,
            total_steps=config.train.total_steps,
            temperature=config.rollout.temperature or 1.0,
            train_batch=opts.train_batch,
            compute_dtype=self.dtype,
            device=str(self.device),
            threads=opts.threads,
            lora=opts.lora,
            seed=seed,
            updates_per_batch=config.train.updates_per_batch,
            tokenizer=tokenizer,
            stop_ids=tuple(stop_ids),
        )
        # The learner's model, or in `process` mode this process's copy of its weights (adapters
        # merged), which each snapshot refreshes first.
        self._model: Decoder = model
        self.version = 0
        self.vllm: VLLMEngine | None = None
        self._vllm_pause_s = 0.0  # the last weight sync's pause of the servers, to resume
        self._policy: LocalPolicy | VLLMPolicy
        if opts.rollout == "vllm":
            assert opts.model_path is not None  # check_vllm
            assert isinstance(model, Transformer)  # check_fallback
            self.vllm = VLLMEngine(
                opts.vllm,
                checkpoint=checkpoint_dir(Path(opts.model_path).expanduser()),
                state=hf_state_dict(model),
                tokenizer=tokenizer,
                max_seq_len=opts.max_seq_len,
                run_dir=config.run_path,
                mode="wait"
                if config.coordinator.weight_update == "pin"
                else opts.vllm.partial_rollouts,
            )
            self._policy = self.vllm.policy
        else:
            self.store = WeightStore(0, inference_copy(model, self.device, self.dtype))
            policy = LocalPolicy.start(
                self.store,
                tokenizer,
                stop_ids,
                opts,
                self.device,
                self.dtype,
                seed,
                constrains_decoding=True,  # our learner replays the masks (learner.py)
            )
            self.sampler, self._policy = policy.sampler, policy
        self._train = concurrent.futures.ThreadPoolExecutor(
            1, "rllm-local-train", initializer=torch.set_num_threads, initargs=(opts.threads,)
        )
        # Last, so that no later failure can leave the learner's process behind.
        self.learner: Learner | LearnerProcess
        try:
            if opts.learner == "process":
                assert isinstance(model, Transformer)  # check_fallback
                self.learner = LearnerProcess(spec, model)
            else:
                self.learner = spec.build(model)
        except BaseException:
            self._close_rollout()
            raise
        self._closed = False

    @classmethod
    def from_config(cls, config: Config) -> LocalBackend:
        """Validate `backend:` options and build the models; refuse what cannot run here."""
        opts = validate_options(LocalOptions, config.backend.options, "backend")
        try:
            return cls(config, opts)
        except ConfigError:
            raise
        except (ValueError, ImportError) as e:
            raise ConfigError(f"backend local: {e}") from e

    @staticmethod
    def export(config: Config, backend_dir: Path, out: Path) -> None:
        """Write the checkpoint saved in `backend_dir` as a Hugging Face model directory `out`."""
        from rllm_async.backends.local.export import export_model, export_transformers_model

        opts = validate_options(LocalOptions, config.backend.options, "backend")
        file = backend_dir / CHECKPOINT_FILE
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} not found: is {backend_dir} a local-backend checkpoint?"
            )
        state = torch.load(file, map_location="cpu", weights_only=True)
        if model_impl(opts)[0] == "transformers":
            assert opts.model_path is not None  # model_impl: presets are native
            export_transformers_model(
                state["model"], out, model_path=opts.model_path, rollout=config.rollout
            )
            return
        if (opts.lora is not None) != ("lora" in state):
            raise ValueError(f"{file} and the run's backend.lora disagree on LoRA adapters")
        export_model(
            state["model"],
            out,
            preset=opts.model,
            model_path=opts.model_path,
            max_seq_len=opts.max_seq_len,
            rollout=config.rollout,
            lora=None if opts.lora is None else (opts.lora, state["lora"]),
            base_changed=opts.warm_start is not None,
        )

    def policy(self) -> LocalPolicy | VLLMPolicy:
        return self._policy

    async def forward_backward(
        self, groups: list[TrajectoryGroup], loss: LossConfig
    ) -> dict[str, float]:
        return await self._on_train_thread(self.learner.forward_backward, groups, loss)

    async def optim_step(self) -> dict[str, float]:
        metrics = await self._on_train_thread(self.learner.optim_step)
        if self.vllm is not None:
            metrics.update(vllm_metrics(self.vllm, self._vllm_pause_s))
        return metrics

    async def recompute_logprobs(self, groups: list[TrajectoryGroup]) -> None:
        """Record the current policy's logprobs of `groups` as their old logprobs (no grad)."""
        await self._on_train_thread(self.learner.record_old_logprobs, groups)

    async def on_policy_updated(self, version: int) -> None:
        """Publish the learner's weights as `version`: to the sampler, where pinned older versions
        stay until released, or into the vLLM servers."""
        if self.vllm is not None:
            path = await self._on_train_thread(self._write_for_vllm)
            self._vllm_pause_s = await self.vllm.load(path, version)
        else:
            self.store.publish(version, await self._on_train_thread(self._snapshot))
        self.version = version

    async def save(self, path: Path) -> None:
        """Write weights, optimizer state, schedule position and policy version to `path`/."""
        await self._on_train_thread(self._save, Path(path))

    async def load(self, path: Path) -> None:
        """Restore what `save` wrote and publish the restored weights to the sampler."""
        version = await self._on_train_thread(self._load, Path(path))
        await self.on_policy_updated(version)

    async def close(self) -> None:
        """Stop the decode thread and the training thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.vllm is not None:
            await self.vllm.policy.close()
        self._close_rollout()
        self._train.shutdown(wait=True)
        if isinstance(self.learner, LearnerProcess):
            self.learner.close()

    def _close_rollout(self) -> None:
        """Stop the sampler thread, or the vLLM servers this backend started."""
        if self.vllm is not None:
            self.vllm.stop()
        else:
            self.sampler.close()

    async def _on_train_thread(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise RuntimeError("the local backend is closed")
        return await asyncio.get_running_loop().run_in_executor(self._train, fn, *args)

    def _current(self) -> Decoder:
        """A model holding the learner's current weights, LoRA adapters merged."""
        if isinstance(self.learner, LearnerProcess):
            assert isinstance(self._model, Transformer)  # check_fallback
            self.learner.copy_weights_to(self._model)
            return self._model
        return self.learner.merged_model()

    def _snapshot(self) -> Decoder:
        return inference_copy(self._current(), self.device, self.dtype)

    def _write_for_vllm(self) -> Path:
        assert self.vllm is not None
        model = self._current()
        assert isinstance(model, Transformer)  # check_fallback
        return self.vllm.write(hf_state_dict(model))

    def _save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        state = compact_optimizer(self.learner.state_dict(), self.opts.checkpoint_optimizer)
        torch.save({**state, "version": self.version}, path / CHECKPOINT_FILE)

    def _load(self, path: Path) -> int:
        file = path / CHECKPOINT_FILE
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: is {path} a local-backend checkpoint?")
        state = torch.load(file, map_location=self.device, weights_only=True)
        if "optimizer" not in state:
            log.warning(
                "%s holds weights only (backend.checkpoint_optimizer: none): AdamW's moments "
                "start from zero",
                path,
            )
        self.learner.load_state_dict(state)
        return int(state["version"])


def compact_optimizer(
    state: dict[str, Any], kind: Literal["float32", "bfloat16", "none"]
) -> dict[str, Any]:
    """A learner's state with its optimizer's moments as `kind` asks: kept, rounded to bfloat16
    (which `load_state_dict` casts back to the parameters' float32), or left out."""
    if kind == "float32":
        return state
    if kind == "none":
        return {key: value for key, value in state.items() if key != "optimizer"}
    optimizer = state["optimizer"]
    moments = {
        index: {
            key: value.to(torch.bfloat16) if key != "step" and value.is_floating_point() else value
            for key, value in per_param.items()
        }
        for index, per_param in optimizer["state"].items()
    }
    return {**state, "optimizer": {**optimizer, "state": moments}}


def _build(
    opts: LocalOptions, impl: Literal["native", "transformers"], device: torch.device, seed: int
) -> tuple[Decoder, Tokenizer, tuple[int, ...]]:
    """The trainable model (our decoder's or transformers'), its tokenizer and the token ids that
    end a completion."""
    if opts.model_path is None:
        tokenizer = CharTokenizer()
        model = build_model(preset_config(opts.model, tokenizer.vocab_size), seed).to(device)
        return model, tokenizer, tokenizer.eos_token_ids
    from rllm_async.backends.local.hf import load_chat_tokenizer, load_checkpoint

    if impl == "transformers":
        path = checkpoint_dir(Path(opts.model_path).expanduser())
        _check_max_seq_len(opts, max_positions(read_config(path)))
        hf_tokenizer, stop_ids = load_chat_tokenizer(path)
        return load_transformers_model(path, device), hf_tokenizer, stop_ids
    ckpt = load_checkpoint(Path(opts.model_path).expanduser())
    _check_max_seq_len(opts, min(ckpt.max_positions, ckpt.sliding_window or ckpt.max_positions))
    model = load_model(ckpt.config, ckpt.state, device, torch.float32)
    return model, ckpt.tokenizer, ckpt.stop_ids


def _check_max_seq_len(opts: LocalOptions, limit: int) -> None:
    if opts.max_seq_len > limit:
        raise ValueError(
            f"backend.max_seq_len ({opts.max_seq_len}) exceeds what {opts.model_path} supports "
            f"({limit}): lower max_seq_len"
        )
